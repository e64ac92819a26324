// The in-process communicator through the C API: every collective and
// dtype against values computed here, split groups, and the failure paths
// (mismatched or bad arguments, timeouts, abort) that must never hang.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../common/reference_moe.hpp"
#include "../common/seed.hpp"
#include "ep_moe/ep_moe.h"

namespace {

using Clock = std::chrono::steady_clock;

void run_ranks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r) ts.emplace_back(fn, r);
  for (auto& t : ts) t.join();
}

struct Group {
  std::vector<ep_moe_comm_t*> h;
  explicit Group(int n, int timeout_ms = 10000) : h(static_cast<size_t>(n), nullptr) {
    ep_moe_comm_config_t c;
    REQUIRE(ep_moe_comm_config_init(&c) == EP_MOE_OK);
    c.timeout_ms = timeout_ms;
    REQUIRE(ep_moe_comm_create_local(h.data(), n, &c) == EP_MOE_OK);
  }
  ~Group() {
    for (auto* x : h) ep_moe_comm_destroy(x);
  }
  ep_moe_comm_t* operator[](int r) const { return h[static_cast<size_t>(r)]; }
};

size_t esize(ep_moe_dtype_t t) {
  return t == EP_MOE_DTYPE_F32 || t == EP_MOE_DTYPE_I32 ? 4 : t == EP_MOE_DTYPE_I64 ? 8 : t == EP_MOE_DTYPE_U8 ? 1 : 2;
}

// Rank r's input element i, as a double representable in every dtype.
double value(int r, size_t i, ep_moe_dtype_t t) {
  const double v = static_cast<double>((static_cast<int>(i * 7 + static_cast<size_t>(r) * 13) % 41) - 20);
  if (t == EP_MOE_DTYPE_U8) return static_cast<double>((i * 31 + static_cast<size_t>(r) * 97) % 256);
  return t == EP_MOE_DTYPE_I32 || t == EP_MOE_DTYPE_I64 ? v * 1000003.0 : v / 8.0 + 0.125 * r;
}

std::vector<uint8_t> make_buf(int r, size_t n, ep_moe_dtype_t t, size_t first = 0) {
  std::vector<uint8_t> b(n * esize(t));
  for (size_t i = 0; i < n; ++i) {
    const double v = value(r, first + i, t);
    switch (t) {
      case EP_MOE_DTYPE_F32: {
        const float f = static_cast<float>(v);
        std::memcpy(&b[i * 4], &f, 4);
        break;
      }
      case EP_MOE_DTYPE_BF16: {
        const uint16_t h = ref::to_bf16(static_cast<float>(v));
        std::memcpy(&b[i * 2], &h, 2);
        break;
      }
      case EP_MOE_DTYPE_F16: {
        const uint16_t h = ref::to_f16(static_cast<float>(v));
        std::memcpy(&b[i * 2], &h, 2);
        break;
      }
      case EP_MOE_DTYPE_I32: {
        const int32_t x = static_cast<int32_t>(v);
        std::memcpy(&b[i * 4], &x, 4);
        break;
      }
      case EP_MOE_DTYPE_I64: {
        const int64_t x = static_cast<int64_t>(v) * 1000000007LL;
        std::memcpy(&b[i * 8], &x, 8);
        break;
      }
      case EP_MOE_DTYPE_U8: b[i] = static_cast<uint8_t>(v); break;
      default: break;
    }
  }
  return b;
}

// The sum over ranks 0..n-1 of element i, encoded like the library must
// produce it (f32 accumulation in rank order, one rounding).
std::vector<uint8_t> expected_sum(int n, size_t count, ep_moe_dtype_t t, size_t first = 0) {
  std::vector<std::vector<uint8_t>> ins;
  for (int r = 0; r < n; ++r) ins.push_back(make_buf(r, count, t, first));
  std::vector<uint8_t> out(count * esize(t));
  for (size_t i = 0; i < count; ++i) {
    if (t == EP_MOE_DTYPE_U8) {
      unsigned sum = 0;
      for (int r = 0; r < n; ++r) sum += ins[static_cast<size_t>(r)][i];
      out[i] = static_cast<uint8_t>(sum & 0xff);
      continue;
    }
    if (t == EP_MOE_DTYPE_I32 || t == EP_MOE_DTYPE_I64) {
      int64_t s = 0;
      for (int r = 0; r < n; ++r) {
        int64_t x = 0;
        if (t == EP_MOE_DTYPE_I32) {
          int32_t y;
          std::memcpy(&y, &ins[static_cast<size_t>(r)][i * 4], 4);
          x = y;
        } else {
          std::memcpy(&x, &ins[static_cast<size_t>(r)][i * 8], 8);
        }
        s += x;
      }
      if (t == EP_MOE_DTYPE_I32) {
        const int32_t y = static_cast<int32_t>(s);
        std::memcpy(&out[i * 4], &y, 4);
      } else {
        std::memcpy(&out[i * 8], &s, 8);
      }
      continue;
    }
    float acc = 0.0f;
    for (int r = 0; r < n; ++r)
      acc += ref::decode(&ins[static_cast<size_t>(r)][i * esize(t)], 1, static_cast<int>(t))[0];
    const auto enc = ref::encode({acc}, static_cast<int>(t));
    std::memcpy(&out[i * esize(t)], enc.data(), enc.size());
  }
  return out;
}

const ep_moe_dtype_t kAll[] = {EP_MOE_DTYPE_F32, EP_MOE_DTYPE_BF16, EP_MOE_DTYPE_F16,
                               EP_MOE_DTYPE_I32, EP_MOE_DTYPE_I64,  EP_MOE_DTYPE_U8};

}  // namespace

TEST_CASE("all_reduce: every dtype, sizes, in and out of place, identical on all ranks", "[comm]") {
  for (int n : {1, 2, 3, 5}) {
    Group g(n);
    for (ep_moe_dtype_t t : kAll) {
      for (size_t count : {size_t(0), size_t(1), size_t(7), size_t(1000), size_t(5003)}) {
        for (bool in_place : {false, true}) {
          INFO("ranks=" << n << " dtype=" << t << " count=" << count << " in_place=" << in_place);
          const auto expect = expected_sum(n, count, t);
          std::vector<std::vector<uint8_t>> outs(static_cast<size_t>(n));
          std::vector<ep_moe_status_t> st(static_cast<size_t>(n));
          run_ranks(n, [&](int r) {
            auto in = make_buf(r, count, t);
            auto& out = outs[static_cast<size_t>(r)];
            out.assign(in.size(), 0xEE);
            if (in_place) {
              st[static_cast<size_t>(r)] = ep_moe_comm_all_reduce(in.data(), in.data(), count, t, g[r], nullptr);
              out = in;
            } else {
              st[static_cast<size_t>(r)] = ep_moe_comm_all_reduce(out.data(), in.data(), count, t, g[r], nullptr);
            }
          });
          for (int r = 0; r < n; ++r) {
            REQUIRE(st[static_cast<size_t>(r)] == EP_MOE_OK);
            CHECK(outs[static_cast<size_t>(r)] == expect);
          }
        }
      }
    }
  }
}

TEST_CASE("reduce_scatter, all_gather, all_gather_v, all_to_all_v and barrier", "[comm]") {
  std::mt19937 rng(test_seed() + 3);
  for (int n : {1, 2, 4, 5}) {
    Group g(n);
    for (ep_moe_dtype_t t : kAll) {
      INFO("ranks=" << n << " dtype=" << t);
      const size_t es = esize(t);
      // reduce_scatter: rank r gets block r of the sum.
      const size_t count = 37;
      const auto total = expected_sum(n, count * static_cast<size_t>(n), t);
      std::vector<std::vector<uint8_t>> rs(static_cast<size_t>(n));
      run_ranks(n, [&](int r) {
        auto in = make_buf(r, count * static_cast<size_t>(n), t);
        rs[static_cast<size_t>(r)].assign(count * es, 0);
        if (ep_moe_comm_reduce_scatter(rs[static_cast<size_t>(r)].data(), in.data(), count, t, g[r], nullptr) !=
            EP_MOE_OK)
          rs[static_cast<size_t>(r)].clear();
      });
      for (int r = 0; r < n; ++r)
        CHECK(rs[static_cast<size_t>(r)] ==
              std::vector<uint8_t>(total.begin() + static_cast<long>(static_cast<size_t>(r) * count * es),
                                   total.begin() + static_cast<long>(static_cast<size_t>(r + 1) * count * es)));

      // all_gather and all_gather_v (uneven, with zeros).
      std::vector<size_t> counts(static_cast<size_t>(n));
      for (auto& c : counts) c = rng() % 4 == 0 ? 0 : rng() % 9;
      std::vector<uint8_t> expect_g, expect_v;
      for (int r = 0; r < n; ++r) {
        const auto b = make_buf(r, 11, t);
        expect_g.insert(expect_g.end(), b.begin(), b.end());
        const auto v = make_buf(r, counts[static_cast<size_t>(r)], t);
        expect_v.insert(expect_v.end(), v.begin(), v.end());
      }
      std::vector<std::vector<uint8_t>> ga(static_cast<size_t>(n)), gv(static_cast<size_t>(n));
      run_ranks(n, [&](int r) {
        const auto in = make_buf(r, 11, t);
        ga[static_cast<size_t>(r)].assign(11 * es * static_cast<size_t>(n), 0);
        if (ep_moe_comm_all_gather(ga[static_cast<size_t>(r)].data(), in.data(), 11, t, g[r], nullptr) != EP_MOE_OK)
          ga[static_cast<size_t>(r)].clear();
        const auto inv = make_buf(r, counts[static_cast<size_t>(r)], t);
        gv[static_cast<size_t>(r)].assign(expect_v.size(), 0);
        if (ep_moe_comm_all_gather_v(gv[static_cast<size_t>(r)].data(), inv.data(), counts.data(), t, g[r], nullptr) !=
            EP_MOE_OK)
          gv[static_cast<size_t>(r)].clear();
      });
      for (int r = 0; r < n; ++r) {
        CHECK(ga[static_cast<size_t>(r)] == expect_g);
        CHECK(gv[static_cast<size_t>(r)] == expect_v);
      }

      // all_to_all_v: send[p][q] elements from p to q, values tagged by (p, q).
      std::vector<std::vector<size_t>> send(static_cast<size_t>(n), std::vector<size_t>(static_cast<size_t>(n)));
      for (auto& row : send)
        for (auto& x : row) x = rng() % 3 == 0 ? 0 : rng() % 6;
      std::vector<int> ok(static_cast<size_t>(n), 0);
      run_ranks(n, [&](int r) {
        std::vector<uint8_t> in;
        for (int q = 0; q < n; ++q) {
          const auto b =
              make_buf(r, send[static_cast<size_t>(r)][static_cast<size_t>(q)], t, static_cast<size_t>(q) * 100);
          in.insert(in.end(), b.begin(), b.end());
        }
        std::vector<size_t> recv_counts(static_cast<size_t>(n));
        std::vector<uint8_t> expect;
        for (int p = 0; p < n; ++p) {
          recv_counts[static_cast<size_t>(p)] = send[static_cast<size_t>(p)][static_cast<size_t>(r)];
          const auto b = make_buf(p, recv_counts[static_cast<size_t>(p)], t, static_cast<size_t>(r) * 100);
          expect.insert(expect.end(), b.begin(), b.end());
        }
        std::vector<uint8_t> out(expect.size(), 0);
        const auto s = ep_moe_comm_all_to_all_v(out.data(), recv_counts.data(), in.data(),
                                                send[static_cast<size_t>(r)].data(), t, g[r], nullptr);
        ok[static_cast<size_t>(r)] = s == EP_MOE_OK && out == expect;
        if (ep_moe_comm_barrier(g[r]) != EP_MOE_OK) ok[static_cast<size_t>(r)] = 0;
      });
      CHECK(ok == std::vector<int>(static_cast<size_t>(n), 1));
    }
  }
}

TEST_CASE("ranks that disagree get INVALID_ARGUMENT everywhere, and the group stays usable", "[comm][errors]") {
  Group g(3);
  std::vector<ep_moe_status_t> st(3);
  std::vector<std::string> msg(3);
  run_ranks(3, [&](int r) {
    std::vector<float> buf(10, 1.0f);
    st[static_cast<size_t>(r)] =
        ep_moe_comm_all_reduce(buf.data(), buf.data(), r == 1 ? 9 : 10, EP_MOE_DTYPE_F32, g[r], nullptr);
    msg[static_cast<size_t>(r)] = ep_moe_comm_last_error(g[r]);
  });
  for (int r = 0; r < 3; ++r) {
    CHECK(st[static_cast<size_t>(r)] == EP_MOE_ERR_INVALID_ARGUMENT);
    CHECK(msg[static_cast<size_t>(r)].find("disagree on count") != std::string::npos);
  }
  // Different collectives on different ranks.
  run_ranks(3, [&](int r) {
    std::vector<float> buf(4, 1.0f);
    st[static_cast<size_t>(r)] =
        r == 0 ? ep_moe_comm_barrier(g[r])
               : ep_moe_comm_all_reduce(buf.data(), buf.data(), 4, EP_MOE_DTYPE_F32, g[r], nullptr);
  });
  for (auto s : st) CHECK(s == EP_MOE_ERR_INVALID_ARGUMENT);
  // One rank passes NULL: it gets INVALID_ARGUMENT, the others REMOTE, nobody waits.
  const auto t0 = Clock::now();
  run_ranks(3, [&](int r) {
    std::vector<float> buf(4, 1.0f);
    st[static_cast<size_t>(r)] =
        ep_moe_comm_all_reduce(r == 2 ? nullptr : buf.data(), buf.data(), 4, EP_MOE_DTYPE_F32, g[r], nullptr);
    msg[static_cast<size_t>(r)] = ep_moe_last_error();
  });
  CHECK(Clock::now() - t0 < std::chrono::seconds(2));
  CHECK(st[2] == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(msg[2].find("out is NULL") != std::string::npos);
  CHECK(st[0] == EP_MOE_ERR_REMOTE);
  CHECK(msg[0].find("rank 2") != std::string::npos);
  // The group still works.
  run_ranks(3, [&](int r) {
    int32_t v = r + 1;
    st[static_cast<size_t>(r)] = ep_moe_comm_all_reduce(&v, &v, 1, EP_MOE_DTYPE_I32, g[r], nullptr);
    if (v != 6) st[static_cast<size_t>(r)] = EP_MOE_ERR_INTERNAL;
  });
  for (auto s : st) CHECK(s == EP_MOE_OK);
}

TEST_CASE("a missing peer makes the others time out, then the group is broken", "[comm][timeout]") {
  Group g(3, 300);
  std::vector<ep_moe_status_t> st(3, EP_MOE_OK);
  std::vector<std::string> msg(3);
  const auto t0 = Clock::now();
  run_ranks(3, [&](int r) {
    if (r == 1) return;  // never joins
    st[static_cast<size_t>(r)] = ep_moe_comm_barrier(g[r]);
    msg[static_cast<size_t>(r)] = ep_moe_last_error();
  });
  const auto took = Clock::now() - t0;
  CHECK(took < std::chrono::milliseconds(300 + 1000));
  // The first to time out reports TIMEOUT; a rank woken by the broken group REMOTE.
  for (int r : {0, 2}) {
    INFO(msg[static_cast<size_t>(r)]);
    CHECK((st[static_cast<size_t>(r)] == EP_MOE_ERR_TIMEOUT || st[static_cast<size_t>(r)] == EP_MOE_ERR_REMOTE));
    CHECK(msg[static_cast<size_t>(r)].find("rank(s) 1") != std::string::npos);
  }
  CHECK((st[0] == EP_MOE_ERR_TIMEOUT || st[2] == EP_MOE_ERR_TIMEOUT));
  // The late rank finds the group broken at once.
  const auto t1 = Clock::now();
  CHECK(ep_moe_comm_barrier(g[1]) == EP_MOE_ERR_REMOTE);
  CHECK(Clock::now() - t1 < std::chrono::milliseconds(100));
}

TEST_CASE("abort wakes blocked ranks; abort twice and destroy after abort are fine", "[comm][abort]") {
  Group g(3, 20000);
  std::vector<ep_moe_status_t> st(3, EP_MOE_OK);
  const auto t0 = Clock::now();
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    CHECK(ep_moe_comm_abort(g[2]) == EP_MOE_OK);
    CHECK(ep_moe_comm_abort(g[2]) == EP_MOE_OK);
  });
  run_ranks(2, [&](int r) { st[static_cast<size_t>(r)] = ep_moe_comm_barrier(g[r]); });
  aborter.join();
  CHECK(Clock::now() - t0 < std::chrono::seconds(2));
  CHECK(st[0] == EP_MOE_ERR_ABORTED);
  CHECK(st[1] == EP_MOE_ERR_ABORTED);
  CHECK(ep_moe_comm_barrier(g[2]) == EP_MOE_ERR_ABORTED);
  ep_moe_comm_destroy(g.h[0]);
  g.h[0] = nullptr;
}

TEST_CASE("split forms sub-groups by color and key; abort reaches them", "[comm][split]") {
  Group g(6);
  std::vector<int32_t> sub_rank(6, -1), sub_size(6, -1), sum(6, -1);
  std::vector<ep_moe_comm_t*> subs(6, nullptr);
  run_ranks(6, [&](int r) {
    ep_moe_comm_t* s = nullptr;
    // Colors: ranks 0,2,4 -> 0 (reverse order by key); 1,3 -> 1; 5 -> none.
    const int color = r == 5 ? -1 : r % 2;
    if (ep_moe_comm_split(&s, g[r], color, -r) != EP_MOE_OK) return;
    subs[static_cast<size_t>(r)] = s;
    if (!s) return;
    ep_moe_comm_get_rank(&sub_rank[static_cast<size_t>(r)], s);
    ep_moe_comm_get_size(&sub_size[static_cast<size_t>(r)], s);
    int32_t v = r;
    if (ep_moe_comm_all_reduce(&v, &v, 1, EP_MOE_DTYPE_I32, s, nullptr) == EP_MOE_OK) sum[static_cast<size_t>(r)] = v;
  });
  CHECK(subs[5] == nullptr);
  CHECK(sub_size == std::vector<int32_t>({3, 2, 3, 2, 3, -1}));
  CHECK(sub_rank == std::vector<int32_t>({2, 1, 1, 0, 0, -1}));
  CHECK(sum == std::vector<int32_t>({6, 4, 6, 4, 6, -1}));
  // Aborting the parent aborts the sub-groups.
  REQUIRE(ep_moe_comm_abort(g[5]) == EP_MOE_OK);
  CHECK(ep_moe_comm_barrier(subs[0]) == EP_MOE_ERR_ABORTED);
  for (auto* s : subs) ep_moe_comm_destroy(s);
}

TEST_CASE("communicator argument checks", "[comm][errors]") {
  ep_moe_comm_t* h[2] = {nullptr, nullptr};
  CHECK(ep_moe_comm_create_local(h, 0, nullptr) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_comm_create_local(h, 5000, nullptr) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_comm_create_local(nullptr, 2, nullptr) == EP_MOE_ERR_INVALID_ARGUMENT);
  ep_moe_comm_config_t c;
  REQUIRE(ep_moe_comm_config_init(&c) == EP_MOE_OK);
  CHECK(c.timeout_ms == 60000);
  c.timeout_ms = 0;
  CHECK(ep_moe_comm_create_local(h, 2, &c) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(std::string(ep_moe_last_error()).find("timeout_ms") != std::string::npos);
  c.struct_size = 3;
  CHECK(ep_moe_comm_create_local(h, 2, &c) == EP_MOE_ERR_STRUCT_SIZE);
  CHECK(h[0] == nullptr);
  CHECK(ep_moe_comm_config_init(nullptr) == EP_MOE_ERR_INVALID_ARGUMENT);

  REQUIRE(ep_moe_comm_create_local(h, 1, nullptr) == EP_MOE_OK);
  int32_t v = 9;
  CHECK(ep_moe_comm_get_rank(&v, h[0]) == EP_MOE_OK);
  CHECK(v == 0);
  CHECK(ep_moe_comm_get_size(&v, h[0]) == EP_MOE_OK);
  CHECK(v == 1);
  CHECK(ep_moe_comm_get_rank(nullptr, h[0]) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_comm_get_size(&v, nullptr) == EP_MOE_ERR_INVALID_HANDLE);
  CHECK(ep_moe_comm_set_timeout(h[0], -5) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_comm_set_timeout(h[0], 1000) == EP_MOE_OK);
  float x = 1.0f;
  CHECK(ep_moe_comm_all_reduce(&x, &x, 1, static_cast<ep_moe_dtype_t>(42), h[0], nullptr) ==
        EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(std::string(ep_moe_comm_last_error(h[0])).find("dtype 42") != std::string::npos);
  CHECK(ep_moe_comm_all_gather_v(&x, &x, nullptr, EP_MOE_DTYPE_F32, h[0], nullptr) == EP_MOE_ERR_INVALID_ARGUMENT);
  const size_t one = 1;
  CHECK(ep_moe_comm_all_to_all_v(&x, &one, nullptr, &one, EP_MOE_DTYPE_F32, h[0], nullptr) ==
        EP_MOE_ERR_INVALID_ARGUMENT);
  // NULL buffers are fine with a zero count.
  CHECK(ep_moe_comm_all_reduce(nullptr, nullptr, 0, EP_MOE_DTYPE_F32, h[0], nullptr) == EP_MOE_OK);
  // Still usable after the failures.
  CHECK(ep_moe_comm_all_reduce(&x, &x, 1, EP_MOE_DTYPE_F32, h[0], nullptr) == EP_MOE_OK);
  CHECK(x == 1.0f);
  ep_moe_comm_t* dead = h[0];
  ep_moe_comm_destroy(h[0]);
  CHECK(ep_moe_comm_barrier(dead) == EP_MOE_ERR_INVALID_HANDLE);
  CHECK(ep_moe_comm_abort(nullptr) == EP_MOE_ERR_INVALID_HANDLE);
  CHECK(std::string(ep_moe_comm_last_error(nullptr)) == "the handle is NULL");
}
