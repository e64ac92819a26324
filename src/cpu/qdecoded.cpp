// The decoded formats' row decoding and portable row dot (qdecoded.hpp).
#include "cpu/qdecoded.hpp"

#include <cstring>
#include <vector>

namespace ep_moe {
namespace cpu {

DecodedRow decode_row(const QuantTraits& q, const uint8_t* row, int k, RowDecodeFn fast, int slot) {
  struct Buffers {
    std::vector<int8_t> v;
    std::vector<float> sc, mn;
  };
  thread_local Buffers buf[4];
  std::vector<int8_t>& v = buf[slot].v;
  std::vector<float>& sc = buf[slot].sc;
  std::vector<float>& mn = buf[slot].mn;
  const auto ku = static_cast<size_t>(k);
  if (v.size() < ku) {
    v.resize(ku);
    sc.resize(ku / 16);
    mn.resize(ku / 16);
  }
  if (fast) {
    fast(row, k, v.data(), sc.data(), mn.data());
    return DecodedRow{v.data(), sc.data(), mn.data()};
  }
  DecodedBlock db;
  const int e = q.block_elems, groups = e / 16;
  for (int b = 0; b < k / e; ++b) {
    q.decode(row + static_cast<size_t>(b) * static_cast<size_t>(q.block_bytes), &db);
    std::memcpy(v.data() + b * e, db.v, static_cast<size_t>(e));
    std::memcpy(sc.data() + b * groups, db.sc, static_cast<size_t>(groups) * 4);
    if (q.has_min) std::memcpy(mn.data() + b * groups, db.mn, static_cast<size_t>(groups) * 4);
  }
  return DecodedRow{v.data(), sc.data(), mn.data()};
}

namespace {
struct RowDotGeneric {
  static RowDecodeFn decoder(ep_moe_dtype_t) { return nullptr; }
  static float dot(const DecodedRow& w, const void* arow, int k, bool has_min) {
    return decoded_tail(w, act_q(arow), act_d(arow, k), act_s(arow, k), 0, k / 16, has_min);
  }
  static void dot4(const DecodedRow* w, const void* arow, int k, bool has_min, float* out) {
    for (int r = 0; r < 4; ++r) out[r] = dot(w[r], arow, k, has_min);
  }
};
}  // namespace

void qdecoded_generic(QGemmFn* gemm) { set_decoded<RowDotGeneric>(gemm); }

}  // namespace cpu
}  // namespace ep_moe
