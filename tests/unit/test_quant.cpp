// The GGUF block formats (common/quant.hpp) and their kernels at every ISA
// level this CPU has: quantize -> dequantize within each format's step, the
// activation rows as their definition says (the vector quantizer's bytes
// the same as the scalar one's), and every kernel against a double-precision
// product of the dequantized weights and the dequantized activation rows.
// (Bit-exactness of the dequantization against gguf.quants is checked by
// io.quant_blocks, which needs Python.)
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/dtype.hpp"
#include "common/quant.hpp"
#include "cpu/isa.hpp"
#include "cpu/kernels.hpp"
#include "cpu/pack.hpp"
#include "isas_here.hpp"

using namespace ep_moe;

namespace {

const ep_moe_dtype_t kTypes[] = {EP_MOE_DTYPE_Q8_0, EP_MOE_DTYPE_Q4_0,   EP_MOE_DTYPE_Q4_K, EP_MOE_DTYPE_Q5_K,
                                 EP_MOE_DTYPE_Q6_K, EP_MOE_DTYPE_IQ4_XS, EP_MOE_DTYPE_MXFP4};

std::vector<float> normal(size_t n, std::mt19937& rng, float sd = 1.0f) {
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// The int8 activation row's values, dequantized (q * its block's d).
std::vector<double> act_values(const void* row, int64_t k) {
  std::vector<double> v(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) v[static_cast<size_t>(i)] = double(act_q(row)[i]) * double(act_d(row, k)[i / 32]);
  return v;
}

using ep_moe_test::isas_here;

}  // namespace

TEST_CASE("block formats: sizes as GGUF defines them", "[unit][quant]") {
  const int elems[] = {32, 32, 256, 256, 256, 256, 32};
  const int bytes[] = {34, 18, 144, 176, 210, 136, 17};
  for (int i = 0; i < kQuantTypes; ++i) {
    CHECK(quant_index(kTypes[i]) == i);
    CHECK(quant_block_elems(kTypes[i]) == elems[i]);
    CHECK(quant_block_bytes(kTypes[i]) == bytes[i]);
    CHECK(quant_row_bytes(kTypes[i], 512) == static_cast<size_t>(512 / elems[i] * bytes[i]));
  }
  CHECK_FALSE(dtype_is_quant(EP_MOE_DTYPE_BF16));
  CHECK_FALSE(dtype_is_quant(EP_MOE_DTYPE_U8));
  CHECK_FALSE(dtype_is_quant(static_cast<ep_moe_dtype_t>(13)));
}

TEST_CASE("quantize -> dequantize stays within each format's step", "[unit][quant]") {
  std::mt19937 rng(Catch::rngSeed() + 11);
  const int64_t n = 1024;
  for (ep_moe_dtype_t t : kTypes) {
    CAPTURE(dtype_name(t));
    std::vector<float> x = normal(static_cast<size_t>(n), rng);
    x[5] = 0.0f;
    std::fill(x.begin() + 256, x.begin() + 512, 0.0f);  // an all-zero block
    std::vector<uint8_t> q(quant_row_bytes(t, n));
    quantize_row(t, x.data(), q.data(), n);
    std::vector<float> y(static_cast<size_t>(n));
    dequantize_row(t, q.data(), y.data(), n);
    // Each element within a fraction of its block's largest magnitude:
    // 8-bit 1/127, 6-bit about 1/31, 5-bit 1/15, 4-bit and FP4 about 1/7
    // (a half step, plus the scales' own rounding).
    const double frac = t == EP_MOE_DTYPE_Q8_0    ? 0.01
                        : t == EP_MOE_DTYPE_Q6_K  ? 0.04
                        : t == EP_MOE_DTYPE_Q5_K  ? 0.06
                        : t == EP_MOE_DTYPE_MXFP4 ? 0.26
                                                  : 0.14;
    const int qk = quant_block_elems(t);
    for (int64_t b = 0; b < n / qk; ++b) {
      double amax = 0;
      for (int i = 0; i < qk; ++i) amax = std::max(amax, std::fabs(double(x[static_cast<size_t>(b * qk + i)])));
      for (int i = 0; i < qk; ++i) {
        const auto at = static_cast<size_t>(b * qk + i);
        INFO("element " << at);
        CHECK(std::fabs(double(y[at]) - double(x[at])) <= frac * amax + 1e-7);
        CHECK(dequantize_at(t, q.data(), static_cast<int64_t>(at)) == y[at]);
      }
    }
    for (int i = 256; i < 512; ++i) CHECK(y[static_cast<size_t>(i)] == 0.0f);
  }
}

TEST_CASE("activation rows: d = amax / 127, q rounded to nearest even, sums of 16; vector = scalar bytes",
          "[unit][quant]") {
  std::mt19937 rng(Catch::rngSeed() + 12);
  for (int64_t k : {32, 96, 256, 768, 2048 + 32}) {
    for (ActQuant aq : {ActQuant::Q8_0, ActQuant::Q8_K}) {
      CAPTURE(k, static_cast<int>(aq));
      std::vector<float> x = normal(static_cast<size_t>(k), rng, 3.0f);
      x[0] = 0.5f * 127.0f / 127.0f;
      std::vector<uint8_t> a(act_row_bytes(k));
      quantize_act_row(x.data(), k, aq, a.data());
      const int64_t bs = aq == ActQuant::Q8_K ? 256 : 32, kp = act_row_padded(k);
      for (int64_t b0 = 0; b0 < kp; b0 += bs) {
        float amax = 0;
        for (int64_t i = b0; i < std::min(b0 + bs, k); ++i) amax = std::max(amax, std::fabs(x[static_cast<size_t>(i)]));
        for (int64_t i = b0; i < b0 + bs; ++i) {
          CHECK(act_d(a.data(), k)[i / 32] == amax / 127.0f);
          const int want = i < k ? static_cast<int>(std::nearbyint(x[static_cast<size_t>(i)] * (127.0f / amax))) : 0;
          CHECK(act_q(a.data())[i] == want);
        }
      }
      for (int64_t g = 0; g < kp / 16; ++g) {
        int sum = 0;
        for (int i = 0; i < 16; ++i) sum += act_q(a.data())[16 * g + i];
        CHECK(act_s(a.data(), k)[g] == sum);
      }
      for (cpu::Isa isa : isas_here()) {
        std::vector<uint8_t> b(act_row_bytes(k), 0xAB);
        cpu::kernels_for(isa).quantize_act(x.data(), k, aq, b.data());
        INFO(cpu::isa_name(isa));
        CHECK(std::memcmp(a.data(), b.data(), a.size()) == 0);
      }
    }
  }
}

TEST_CASE("block-format kernels match a double product of the dequantized values, every ISA and type",
          "[unit][quant][kernels]") {
  std::mt19937 rng(Catch::rngSeed() + 13);
  for (cpu::Isa isa : isas_here()) {
    const cpu::Kernels& kern = cpu::kernels_for(isa);
    for (ep_moe_dtype_t t : kTypes) {
      // 32 and 96: rows of one and of an odd number of blocks (formats of 32).
      for (int k : {32, 96, 256, 512, 2048}) {
        if (k % quant_block_elems(t) != 0) continue;
        const int nr = kern.nr, n = nr + 3;  // a second, partly empty panel
        CAPTURE(cpu::isa_name(isa), dtype_name(t), k);
        std::vector<float> wf = normal(static_cast<size_t>(n) * k, rng, 0.05f);
        // Rows of the weight in the format, packed into panels.
        std::vector<uint8_t> wq(quant_row_bytes(t, k) * static_cast<size_t>(n));
        for (int r = 0; r < n; ++r)
          quantize_row(t, wf.data() + static_cast<size_t>(r) * k, wq.data() + quant_row_bytes(t, k) * r, k);
        cpu::PackedWeight w;
        cpu::pack(w, Source{wq.data(), t, k}, n, k, nr, t, kern.il_of(t));  // in the layout the table reads
        REQUIRE(w.quant());
        std::vector<double> wd(static_cast<size_t>(n) * k);
        for (int r = 0; r < n; ++r) {
          std::vector<float> row(static_cast<size_t>(k));
          dequantize_row(t, wq.data() + quant_row_bytes(t, k) * r, row.data(), k);
          for (int c = 0; c < k; ++c) wd[static_cast<size_t>(r) * k + c] = row[static_cast<size_t>(c)];
        }
        for (int m : {1, 2, 3, 4, 5, 6, 7, 8, 9, 17}) {  // every tile height, and tiles after tiles
          CAPTURE(m);
          std::vector<std::vector<uint8_t>> rows(static_cast<size_t>(m));
          std::vector<const void*> a(static_cast<size_t>(m));
          std::vector<std::vector<double>> av(static_cast<size_t>(m));
          for (int i = 0; i < m; ++i) {
            const std::vector<float> x = normal(static_cast<size_t>(k), rng);
            rows[static_cast<size_t>(i)].resize(act_row_bytes(k));
            kern.quantize_act(x.data(), k, act_quant_of(t), rows[static_cast<size_t>(i)].data());
            a[static_cast<size_t>(i)] = rows[static_cast<size_t>(i)].data();
            av[static_cast<size_t>(i)] = act_values(a[static_cast<size_t>(i)], k);
          }
          for (int p = 0; p < w.panels(); ++p) {
            std::vector<float> c(static_cast<size_t>(m) * nr, NAN);
            kern.qgemm[quant_index(t)](m, a.data(), k, w.panel(p), nr, c.data(), nr, nullptr);
            for (int i = 0; i < m; ++i)
              for (int j = 0; j < nr; ++j) {
                const int r = p * nr + j;
                double want = 0, mag = 0;
                if (r < n)
                  for (int q = 0; q < k; ++q) {
                    const double prod =
                        wd[static_cast<size_t>(r) * k + q] * av[static_cast<size_t>(i)][static_cast<size_t>(q)];
                    want += prod;
                    mag += std::fabs(prod);
                  }
                INFO("row " << i << " column " << r);
                CHECK(std::fabs(double(c[static_cast<size_t>(i) * nr + j]) - want) <= 2e-6 * mag + 1e-30);
              }
          }
        }
      }
    }
  }
}

TEST_CASE("int8 tiles: a double product of the dequantized values, and the interleaved-row kernels' bits, every format",
          "[unit][quant][kernels]") {
  const cpu::Kernels& kern = cpu::kernels_for(cpu::Isa::Avx512);
  if (cpu::detect_isa() < cpu::Isa::Avx512 || !kern.qtile[quant_index(EP_MOE_DTYPE_Q8_0)]) {
    WARN("skipped: this CPU has no AVX512_VNNI (or EP_MOE_CPU_ISA is below avx512): no int8 tiles");
    return;
  }
  std::mt19937 rng(Catch::rngSeed() + 31);
  const int nr = kern.nr, n = nr + 3;  // a second, partly empty panel
  REQUIRE(nr == cpu::kQTileCols);
  // Rows from normal floats, with outliers (each format's largest steps),
  // and every fourth row random block bytes under sane scales: every
  // quant value (Q8_0's -128 too), 6-bit scale and min.
  const auto weight_row = [&](ep_moe_dtype_t t, int k, int r, uint8_t* out) {
    if (r % 4 == 3) {
      std::uniform_int_distribution<int> byte(0, 255);
      const int bb = quant_block_bytes(t);
      for (int b = 0; b < k / quant_block_elems(t); ++b) {
        uint8_t* blk = out + static_cast<size_t>(b) * bb;
        for (int i = 0; i < bb; ++i) blk[i] = static_cast<uint8_t>(byte(rng));
        const uint16_t d = f32_to_f16(0.01f * static_cast<float>(1 + byte(rng) % 8));
        if (t == EP_MOE_DTYPE_MXFP4) blk[0] = static_cast<uint8_t>(120 + byte(rng) % 8);
        else std::memcpy(blk + (t == EP_MOE_DTYPE_Q6_K ? 208 : 0), &d, 2);
        if (t == EP_MOE_DTYPE_Q4_K || t == EP_MOE_DTYPE_Q5_K) std::memcpy(blk + 2, &d, 2);  // dmin
      }
      return;
    }
    std::vector<float> x = normal(static_cast<size_t>(k), rng, 0.05f);
    std::uniform_int_distribution<size_t> at(0, x.size() - 1);
    for (size_t i = 0; i < x.size() / 64; ++i) x[at(rng)] *= 40.0f;
    quantize_row(t, x.data(), out, k);
  };
  for (ep_moe_dtype_t t : kTypes) {
    const int qi = quant_index(t);
    if (!kern.qtile[qi]) continue;
    for (int k : {256, 512, 2048}) {
      CAPTURE(dtype_name(t), k);
      const size_t rb = quant_row_bytes(t, k);
      std::vector<uint8_t> wq(rb * static_cast<size_t>(n));
      for (int r = 0; r < n; ++r) weight_row(t, k, r, wq.data() + rb * static_cast<size_t>(r));
      cpu::PackedWeight w;
      cpu::pack(w, Source{wq.data(), t, k}, n, k, nr, t, kern.il_of(t));
      // wd: the values; wp: for Q4_K / Q5_K, their d * scale * q parts
      // alone (dmin zeroed), the values being wp less the mins' parts.
      const bool mins = t == EP_MOE_DTYPE_Q4_K || t == EP_MOE_DTYPE_Q5_K;
      std::vector<double> wd(static_cast<size_t>(n) * k), wp(wd.size());
      std::vector<float> row(static_cast<size_t>(k));
      std::vector<uint8_t> pos(rb);
      for (int r = 0; r < n; ++r) {
        dequantize_row(t, wq.data() + rb * static_cast<size_t>(r), row.data(), k);
        for (int q = 0; q < k; ++q) wd[static_cast<size_t>(r) * k + q] = row[static_cast<size_t>(q)];
        std::memcpy(pos.data(), wq.data() + rb * static_cast<size_t>(r), rb);
        for (size_t b = 0; mins && b < rb; b += static_cast<size_t>(quant_block_bytes(t))) pos[b + 2] = pos[b + 3] = 0;
        dequantize_row(t, pos.data(), row.data(), k);
        for (int q = 0; q < k; ++q) wp[static_cast<size_t>(r) * k + q] = row[static_cast<size_t>(q)];
      }
      std::vector<uint8_t> tiles(cpu::qtile_panel_bytes(t, k));
      for (int m : {1, 2, 3, 4, 5, 6, 7, 9, 13, 17}) {  // every tile height, and tiles after tiles
        CAPTURE(m);
        std::vector<std::vector<uint8_t>> rows(static_cast<size_t>(m));
        std::vector<const void*> a(static_cast<size_t>(m));
        std::vector<std::vector<double>> av(static_cast<size_t>(m));
        for (int i = 0; i < m; ++i) {
          std::vector<float> x = normal(static_cast<size_t>(k), rng);
          if (i % 3 == 1) x[static_cast<size_t>(i) % x.size()] *= 100.0f;  // a block's largest quant at -127 or 127
          rows[static_cast<size_t>(i)].resize(act_row_bytes(k));
          kern.quantize_act(x.data(), k, act_quant_of(t), rows[static_cast<size_t>(i)].data());
          a[static_cast<size_t>(i)] = rows[static_cast<size_t>(i)].data();
          av[static_cast<size_t>(i)] = act_values(a[static_cast<size_t>(i)], k);
        }
        for (int p = 0; p < w.panels(); ++p) {
          std::vector<float> c(static_cast<size_t>(m) * nr, NAN), cb(c.size(), NAN);
          kern.qunpack[qi](w.panel(p), k, tiles.data());
          kern.qtile[qi](m, a.data(), k, tiles.data(), c.data(), nr, w.panel(1 - p));
          kern.qgemm[qi](m, a.data(), k, w.panel(p), nr, cb.data(), nr, nullptr);
          int wrong = 0;
          for (int i = 0; i < m; ++i)
            for (int j = 0; j < nr; ++j) {
              const int r = p * nr + j;
              // mag: the sum of the products' sizes; terms: with mins, of
              // the scaled sums' and the mins' (their difference is the
              // result, so f32 rounds each at its own size).
              double want = 0, mag = 0, terms = 0;
              for (int q = 0; r < n && q < k; ++q) {
                const size_t e = static_cast<size_t>(r) * k + q;
                const double aq = av[static_cast<size_t>(i)][static_cast<size_t>(q)];
                want += wd[e] * aq;
                mag += std::fabs(wd[e] * aq);
                const double parts = std::fabs(wp[e] * aq) + std::fabs((wp[e] - wd[e]) * aq);
                terms += mins ? parts : std::fabs(wd[e] * aq);
              }
              // Exact i32 block sums scaled in f32: within the block
              // kernels' bound of the double product (plus the terms'
              // rounding). The interleaved-row kernel of the same panel
              // forms the same i32 sums and scales them in the same f32
              // steps: the same bits.
              const float got = c[static_cast<size_t>(i) * nr + j], blk = cb[static_cast<size_t>(i) * nr + j];
              const double tol = 2e-6 * mag + 1e-6 * terms + 1e-30;
              REQUIRE(kern.il_of(t) == cpu::kGroupRows);
              const bool ok = std::fabs(double(got) - want) <= tol && std::memcmp(&got, &blk, sizeof got) == 0;
              if (!ok && wrong++ < 3)
                FAIL_CHECK("row " << i << " column " << r << ": tile " << got << ", block kernel " << blk << ", double "
                                  << want << " (magnitude " << mag << ", terms " << terms << ")");
            }
          CHECK(wrong == 0);
        }
      }
    }
  }
}

TEST_CASE("widened block panels: every value as dequantize_row makes it, bit for bit, every ISA and type",
          "[unit][quant][kernels]") {
  std::mt19937 rng(Catch::rngSeed() + 15);
  for (cpu::Isa isa : isas_here()) {
    const cpu::Kernels& kern = cpu::kernels_for(isa);
    for (ep_moe_dtype_t t : kTypes) {
      if (!kern.qdequant[quant_index(t)]) {
        WARN("skipped: " << cpu::isa_name(isa) << " does not widen " << dtype_name(t) << " panels");
        continue;
      }
      for (int k : {32, 256, 288, 2048}) {
        if (k % quant_block_elems(t) != 0) continue;
        const int nr = kern.nr;
        CAPTURE(cpu::isa_name(isa), dtype_name(t), k);
        const size_t rb = quant_row_bytes(t, k);
        std::vector<uint8_t> panel(rb * static_cast<size_t>(nr));
        for (int r = 0; r < nr; ++r) {
          const std::vector<float> x = normal(static_cast<size_t>(k), rng, r % 3 == 0 ? 4.0f : 0.05f);
          quantize_row(t, x.data(), panel.data() + rb * static_cast<size_t>(r), k);
        }
        std::vector<float> wide(static_cast<size_t>(k) * nr, NAN), row(static_cast<size_t>(k));
        kern.qdequant[quant_index(t)](panel.data(), nr, k, wide.data());
        int wrong = 0;
        for (int r = 0; r < nr; ++r) {
          dequantize_row(t, panel.data() + rb * static_cast<size_t>(r), row.data(), k);
          for (int q = 0; q < k; ++q)
            wrong += std::memcmp(&wide[static_cast<size_t>(q) * nr + r], &row[static_cast<size_t>(q)], 4) != 0;
        }
        CHECK(wrong == 0);
      }
    }
  }
}

TEST_CASE("block-format packing: rows copied as they are, quantized from floats, read back whole", "[unit][quant]") {
  std::mt19937 rng(Catch::rngSeed() + 14);
  const int k = 512, inter = 21;
  for (ep_moe_dtype_t t : kTypes) {
    CAPTURE(dtype_name(t));
    const size_t rb = quant_row_bytes(t, k);
    std::vector<float> gf = normal(static_cast<size_t>(inter) * k, rng),
                       uf = normal(static_cast<size_t>(inter) * k, rng);
    std::vector<uint8_t> gq(rb * inter), uq(rb * inter);
    for (int r = 0; r < inter; ++r) {
      quantize_row(t, gf.data() + static_cast<size_t>(r) * k, gq.data() + rb * r, k);
      quantize_row(t, uf.data() + static_cast<size_t>(r) * k, uq.data() + rb * r, k);
    }
    // Rows one after another, and (where the format has the layout) interleaved 8 or 16 at a time.
    for (int il : {0, cpu::kGroupRows8, cpu::kGroupRows}) {
      if (il && !cpu::groups_rows(t)) continue;
      CAPTURE(il);
      cpu::PackedWeight w;
      cpu::init_gate_up(w, inter, k, 32, t, il);
      cpu::pack_gate_up_half(w, Source{gq.data(), t, k}, 0, inter);
      cpu::pack_gate_up_half(w, Source{uf.data(), EP_MOE_DTYPE_F32, k}, 1, inter);  // quantized on the way in
      std::vector<uint8_t> row(rb);
      for (int r = 0; r < inter; ++r) {
        cpu::unpack_gate_up_row(w, 0, r, row.data());
        CHECK(std::memcmp(row.data(), gq.data() + rb * r, rb) == 0);
        cpu::unpack_gate_up_row(w, 1, r, row.data());
        CHECK(std::memcmp(row.data(), uq.data() + rb * r, rb) == 0);
      }
      // And a plain weight's rows (the down projection's), past a panel's end.
      cpu::PackedWeight d;
      cpu::pack(d, Source{gq.data(), t, k}, inter, k, 32, t, il);
      for (int r = 0; r < inter; ++r) {
        cpu::unpack_row(d, r, row.data());
        CHECK(std::memcmp(row.data(), gq.data() + rb * r, rb) == 0);
      }
    }
    // An interleave the kernels do not read is an internal error, not a layout.
    cpu::PackedWeight bad;
    CHECK_THROWS(cpu::pack(bad, Source{gq.data(), t, k}, inter, k, cpu::groups_rows(t) ? 16 : 32, t, 16));
    CHECK_THROWS(cpu::pack(bad, Source{gq.data(), t, k}, inter, k, 32, t, 12));
  }
}
