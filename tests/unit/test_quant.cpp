// The GGUF block formats (common/quant.hpp) and their kernels at every ISA
// level this CPU has: quantize -> dequantize within each format's step, the
// activation rows as their definition says (the vector quantizer's bytes
// the same as the scalar one's), and every kernel against a double-precision
// product of the dequantized weights and the dequantized activation rows.
// (Bit-exactness of the dequantization against gguf.quants is checked by
// io.quant_blocks, which needs Python.)
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/dtype.hpp"
#include "common/quant.hpp"
#include "cpu/isa.hpp"
#include "cpu/kernels.hpp"
#include "cpu/pack.hpp"
#include "cpu/qdecoded.hpp"
#include "isas_here.hpp"

using namespace ep_moe;

namespace {

// Every block format, in dtype order.
std::vector<ep_moe_dtype_t> all_types() {
  std::vector<ep_moe_dtype_t> v;
  for (int i = kQuantFirst; i <= kQuantLast; ++i) v.push_back(static_cast<ep_moe_dtype_t>(i));
  return v;
}
const std::vector<ep_moe_dtype_t> kTypes = all_types();

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
  // ggml's block sizes (ggml-common.h's block_* structs), written out here
  // independently of the traits table they check.
  // FP8_E4M3 last: ep_moe's own block of an f32 scale and 128 codes.
  const int elems[] = {32, 32, 256, 256, 256, 256, 32,  256, 256, 32, 32,
                       32, 32, 256, 256, 256, 256, 256, 256, 256, 128};
  const int bytes[] = {34, 18, 144, 176, 210, 136, 17, 84, 110, 20, 22, 24, 18, 66, 74, 82, 98, 110, 50, 56, 132};
  const int gguf[] = {8, 2, 12, 13, 14, 23, 39, 10, 11, 3, 6, 7, 20, 16, 17, 22, 18, 21, 19, 29, -1};
  REQUIRE(kTypes.size() == sizeof elems / sizeof elems[0]);
  for (int i = 0; i < kQuantTypes; ++i) {
    const ep_moe_dtype_t t = kTypes[static_cast<size_t>(i)];
    CAPTURE(dtype_name(t));
    CHECK(quant_index(t) == i);
    CHECK(quant_traits(t)->dtype == t);
    CHECK(quant_block_elems(t) == elems[i]);
    CHECK(quant_block_bytes(t) == bytes[i]);
    CHECK(quant_row_bytes(t, 512) == static_cast<size_t>(512 / elems[i] * bytes[i]));
    if (gguf[i] >= 0) CHECK(quant_dtype_of_gguf(gguf[i]) == t);
    CHECK(act_quant_of(t) == (elems[i] == 256 ? ActQuant::Q8_K : ActQuant::Q8_0));
  }
  CHECK_FALSE(dtype_is_quant(EP_MOE_DTYPE_BF16));
  CHECK_FALSE(dtype_is_quant(EP_MOE_DTYPE_U8));
  CHECK_FALSE(dtype_is_quant(static_cast<ep_moe_dtype_t>(kQuantLast + 1)));
  CHECK(quant_traits(EP_MOE_DTYPE_F32) == nullptr);
  CHECK(quant_dtype_of_gguf(15) == -1);  // Q8_K: GGUF's activation format, not a weight format here
  CHECK(quant_dtype_of_gguf(-1) == -1);
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
    // (a half step, plus the scales' own rounding); 3-bit Q3_K about 1/4 and
    // 2-bit Q2_K 1/3 (a half step of a range up to twice the largest
    // magnitude). The grid formats round 8 (4) values at once onto a sparse
    // grid, so one element can land far off: for them the bound on each
    // element is loose (IQ1 above 1, as a ternary point may flip an element
    // to gain on the other seven) and the block's RMS error is bounded too.
    struct Bound {
      double each, rms;
    };
    const bool grid = t >= EP_MOE_DTYPE_IQ2_XXS && t != EP_MOE_DTYPE_IQ4_NL;
    const Bound bound = t == EP_MOE_DTYPE_Q8_0       ? Bound{0.01, 1}
                        : t == EP_MOE_DTYPE_Q6_K     ? Bound{0.04, 1}
                        : t == EP_MOE_DTYPE_FP8_E4M3 ? Bound{0.07, 1}  // 3 mantissa bits: half a step is 1/16
                        : t == EP_MOE_DTYPE_Q5_K || t == EP_MOE_DTYPE_Q5_0 || t == EP_MOE_DTYPE_Q5_1 ? Bound{0.07, 1}
                        : t == EP_MOE_DTYPE_MXFP4                                                    ? Bound{0.26, 1}
                        : t == EP_MOE_DTYPE_Q3_K                                                     ? Bound{0.3, 1}
                        : t == EP_MOE_DTYPE_Q2_K                                                     ? Bound{0.4, 1}
                        : t == EP_MOE_DTYPE_IQ1_S || t == EP_MOE_DTYPE_IQ1_M                         ? Bound{1.6, 0.3}
                        : grid                                                                       ? Bound{1.1, 0.2}
                                                                                                     : Bound{0.14, 1};
    const double frac = bound.each;
    const int qk = quant_block_elems(t);
    for (int64_t b = 0; b < n / qk; ++b) {
      double amax = 0;
      for (int i = 0; i < qk; ++i) amax = std::max(amax, std::fabs(double(x[static_cast<size_t>(b * qk + i)])));
      double sq = 0;
      for (int i = 0; i < qk; ++i) {
        const auto at = static_cast<size_t>(b * qk + i);
        INFO("element " << at);
        const double e = std::fabs(double(y[at]) - double(x[at]));
        sq += e * e;
        CHECK(e <= frac * amax + 1e-7);
        CHECK(dequantize_at(t, q.data(), static_cast<int64_t>(at)) == y[at]);
      }
      CHECK(std::sqrt(sq / qk) <= bound.rms * amax + 1e-7);
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

namespace {
// Format t's qgemm `fn` (rows interleaved as il says, panels of nr rows)
// against a double product of the dequantized values: k elements, a
// second, partly empty panel, activation rows quantized by `quantize`.
void check_qgemm(cpu::QGemmFn fn, void (*quantize)(const float*, int64_t, ActQuant, void*), ep_moe_dtype_t t, int k,
                 int nr, int il, std::mt19937& rng) {
  const int n = nr + 3;
  std::vector<float> wf = normal(static_cast<size_t>(n) * k, rng, 0.05f);
  // Rows of the weight in the format, packed into panels.
  std::vector<uint8_t> wq(quant_row_bytes(t, k) * static_cast<size_t>(n));
  for (int r = 0; r < n; ++r)
    quantize_row(t, wf.data() + static_cast<size_t>(r) * k, wq.data() + quant_row_bytes(t, k) * r, k);
  cpu::PackedWeight w;
  cpu::pack(w, Source{wq.data(), t, k}, n, k, nr, t, il);
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
      quantize(x.data(), k, act_quant_of(t), rows[static_cast<size_t>(i)].data());
      a[static_cast<size_t>(i)] = rows[static_cast<size_t>(i)].data();
      av[static_cast<size_t>(i)] = act_values(a[static_cast<size_t>(i)], k);
    }
    for (int p = 0; p < w.panels(); ++p) {
      std::vector<float> c(static_cast<size_t>(m) * nr, NAN);
      fn(m, a.data(), k, w.panel(p), nr, c.data(), nr, nullptr);
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
}  // namespace

TEST_CASE("block-format kernels match a double product of the dequantized values, every ISA and type",
          "[unit][quant][kernels]") {
  std::mt19937 rng(Catch::rngSeed() + 13);
  for (cpu::Isa isa : isas_here()) {
    const cpu::Kernels& kern = cpu::kernels_for(isa);
    for (ep_moe_dtype_t t : kTypes)
      // 32 and 96: rows of one and of an odd number of blocks (formats of 32).
      for (int k : {32, 96, 256, 512, 2048}) {
        if (k % quant_block_elems(t) != 0) continue;
        CAPTURE(cpu::isa_name(isa), dtype_name(t), k);
        check_qgemm(kern.qgemm[quant_index(t)], kern.quantize_act, t, k, kern.nr, kern.il_of(t),
                    rng);  // in the layout the table reads
      }
  }
}

namespace {
// The f16 scale (and min or dmin) of a block of a decoded format set to
// d and m, its other bytes kept: every bit pattern of those is valid.
void set_scales(ep_moe_dtype_t t, uint8_t* b, uint16_t d, uint16_t m) {
  const auto put16 = [b](size_t at, uint16_t v) { std::memcpy(b + at, &v, 2); };
  if (t == EP_MOE_DTYPE_IQ1_M) {  // its f16 scale in the top nibbles of 4 u16 words
    for (int w = 0; w < 4; ++w) {
      uint16_t v;
      std::memcpy(&v, b + 48 + 2 * w, 2);
      put16(48 + 2 * static_cast<size_t>(w), static_cast<uint16_t>((v & 0x0FFF) | (((d >> (4 * w)) & 0xF) << 12)));
    }
    return;
  }
  const size_t at = t == EP_MOE_DTYPE_Q2_K ? 80 : t == EP_MOE_DTYPE_Q3_K ? 108 : 0;
  put16(at, d);
  if (t == EP_MOE_DTYPE_Q2_K || t == EP_MOE_DTYPE_Q4_1 || t == EP_MOE_DTYPE_Q5_1) put16(at + 2, m);  // dmin, m
}

// One block of format t whose values all sit at the format's largest
// magnitude (variant 0) or its other end (variant 1), with unit scales:
// the blocks that drive the kernels' integer sums to their bounds
// (qgroups_avx2.cpp's i16 sums of maddubs pairs, for one).
std::vector<uint8_t> extreme_block(ep_moe_dtype_t t, int variant) {
  std::vector<uint8_t> b(static_cast<size_t>(quant_block_bytes(t)), 0);
  const auto put16 = [&b](size_t at, uint16_t v) { std::memcpy(b.data() + at, &v, 2); };
  const uint16_t one = 0x3C00;  // f16 1.0
  switch (t) {
    case EP_MOE_DTYPE_Q8_0:
      put16(0, one);
      std::memset(b.data() + 2, variant ? 0x80 : 0x7F, 32);  // -128 or 127
      break;
    case EP_MOE_DTYPE_Q4_0:
      put16(0, one);
      std::memset(b.data() + 2, variant ? 0x00 : 0xFF, 16);  // -8 or 7 (stored 0 or 15)
      break;
    case EP_MOE_DTYPE_MXFP4:
      b[0] = 127;                                            // 2^-1: its values times 0.5
      std::memset(b.data() + 1, variant ? 0xFF : 0x77, 16);  // -6 or 6
      break;
    case EP_MOE_DTYPE_Q4_K:
    case EP_MOE_DTYPE_Q5_K: {
      put16(0, one);
      put16(2, one);
      std::memset(b.data() + 4, variant ? 0x00 : 0xFF, 12);  // scales and mins 63 (or 0: none)
      if (variant) std::memset(b.data() + 4, 0x3F, 4);       // scales 63, mins 0
      const size_t qs = t == EP_MOE_DTYPE_Q5_K ? 48 : 16;
      if (t == EP_MOE_DTYPE_Q5_K) std::memset(b.data() + 16, 0xFF, 32);
      std::memset(b.data() + qs, 0xFF, 128);  // 15 (31)
      break;
    }
    case EP_MOE_DTYPE_Q6_K:
      std::memset(b.data(), 0xFF, 192);                        // 63: 31 after the offset
      if (variant) std::memset(b.data(), 0x00, 192);           // 0: -32
      std::memset(b.data() + 192, variant ? 0x80 : 0x7F, 16);  // scales -128 or 127
      put16(208, one);
      break;
    case EP_MOE_DTYPE_IQ4_XS:
      put16(0, one);
      put16(2, variant ? 0 : 0xFFFF);                         // scales_h
      std::memset(b.data() + 4, variant ? 0 : 0xFF, 4);       // l 63 (31 after the offset) or 0 (-32)
      std::memset(b.data() + 8, variant ? 0xFF : 0x00, 128);  // 113 or -127
      break;
    case EP_MOE_DTYPE_FP8_E4M3: {
      const float one_f = 1.0f;
      std::memcpy(b.data(), &one_f, 4);
      std::memset(b.data() + 4, variant ? 0xFE : 0x7E, 128);  // -448 or 448: the largest magnitudes
      break;
    }
    default: {
      // The decoded formats: every bit set (variant 0: Q5_0 15, Q2_K 3
      // with scale and min 15, Q3_K 3 with scale 31, IQ4_NL 113, the grids'
      // last entries with every sign negative) or none (Q5_0 -16, Q3_K -4
      // with scale -32, IQ4_NL -127, the grids' first entries), with the
      // f16 scales 1.
      std::memset(b.data(), variant ? 0x00 : 0xFF, b.size());
      set_scales(t, b.data(), one, one);
      break;
    }
  }
  return b;
}
}  // namespace

namespace {
// Format t's qgemm `fn` on panels of nr rows (interleaved il) whose every
// block is an extreme_block, against every activation at +-127.
void check_extremes(cpu::QGemmFn fn, void (*quantize)(const float*, int64_t, ActQuant, void*), ep_moe_dtype_t t, int nr,
                    int il) {
  const int k = 512;
  for (int variant : {0, 1})
    for (float sign : {1.0f, -1.0f}) {
      CAPTURE(variant, sign);
      const std::vector<uint8_t> blk = extreme_block(t, variant);
      const size_t rb = quant_row_bytes(t, k);
      std::vector<uint8_t> wq(rb * static_cast<size_t>(nr));
      for (size_t off = 0; off < wq.size(); off += blk.size()) std::memcpy(wq.data() + off, blk.data(), blk.size());
      cpu::PackedWeight w;
      cpu::pack(w, Source{wq.data(), t, k}, nr, k, nr, t, il);
      std::vector<float> row(static_cast<size_t>(k));
      dequantize_row(t, wq.data(), row.data(), k);
      // Every activation the same: each quantizes to +-127.
      const std::vector<float> x(static_cast<size_t>(k), sign);
      std::vector<uint8_t> act(act_row_bytes(k));
      quantize(x.data(), k, act_quant_of(t), act.data());
      const std::vector<double> av = act_values(act.data(), k);
      double want = 0, mag = 0;
      for (int q = 0; q < k; ++q) {
        want += row[static_cast<size_t>(q)] * av[static_cast<size_t>(q)];
        mag += std::fabs(row[static_cast<size_t>(q)] * av[static_cast<size_t>(q)]);
      }
      const void* a = act.data();
      for (int m : {1, 4}) {
        std::vector<const void*> as(static_cast<size_t>(m), a);
        std::vector<float> c(static_cast<size_t>(m) * nr, NAN);
        fn(m, as.data(), k, w.panel(0), nr, c.data(), nr, nullptr);
        int wrong = 0;
        for (float v : c) wrong += !(std::fabs(double(v) - want) <= 2e-6 * mag + 1e-30);
        CHECK(wrong == 0);
        if (wrong) FAIL_CHECK("m " << m << ": got " << c[0] << ", want " << want);
      }
    }
}
}  // namespace

TEST_CASE("block-format kernels at the bounds of their integer sums: every value at its largest",
          "[unit][quant][kernels]") {
  for (cpu::Isa isa : isas_here()) {
    const cpu::Kernels& kern = cpu::kernels_for(isa);
    for (ep_moe_dtype_t t : kTypes) {
      CAPTURE(cpu::isa_name(isa), dtype_name(t));
      check_extremes(kern.qgemm[quant_index(t)], kern.quantize_act, t, kern.nr, kern.il_of(t));
    }
  }
}

namespace {
// A table's int8 tiles as a QGemmFn: each panel unpacked (qunpack), then
// its rows through qtile, so that check_qgemm and check_extremes hold the
// tiles to what they hold the block kernels to.
const cpu::Kernels* g_tiles = nullptr;
ep_moe_dtype_t g_tile_type = EP_MOE_DTYPE_F32;
void unpacked_then_tiled(int m, const void* const* a, int k, const void* panel, int nr, float* c, int ldc,
                         const void* next) {
  const int i = quant_index(g_tile_type);
  std::vector<uint8_t> buf(cpu::qtile_panel_bytes(g_tile_type, k, nr) + 64);
  void* out = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
  g_tiles->qunpack[i](panel, k, out);
  g_tiles->qtile[i](m, a, k, out, c, ldc, next);
}
}  // namespace

TEST_CASE("int8 tiles on unpacked panels match a double product of the dequantized values, every table with them",
          "[unit][quant][kernels]") {
  // Where a table has tiles for a format (Kernels::qtile: AVX512-VNNI's
  // for every format, AVX2's maddubs ones for some), at every tile height
  // and at the bounds of the integer sums; formats without are reported.
  std::mt19937 rng(Catch::rngSeed() + 17);
  for (cpu::Isa isa : isas_here()) {
    const cpu::Kernels& kern = cpu::kernels_for(isa);
    for (ep_moe_dtype_t t : kTypes) {
      if (!cpu::groups_rows(t)) continue;  // the decoded formats decode a row once for every row of the call
      if (!kern.qtile[quant_index(t)]) {
        WARN("skipped: " << cpu::isa_name(isa) << " (" << kern.qname << ") has no int8 tiles for " << dtype_name(t));
        continue;
      }
      REQUIRE(kern.qunpack[quant_index(t)] != nullptr);
      g_tiles = &kern;
      g_tile_type = t;
      CAPTURE(cpu::isa_name(isa), dtype_name(t));
      for (int k : {32, 96, 256, 768, 2048})
        if (k % quant_block_elems(t) == 0) {
          CAPTURE(k);
          check_qgemm(unpacked_then_tiled, kern.quantize_act, t, k, kern.nr, kern.il_of(t), rng);
        }
      check_extremes(unpacked_then_tiled, kern.quantize_act, t, kern.nr, kern.il_of(t));
    }
  }
}

#if defined(__x86_64__)  // the x86 kernels are built
TEST_CASE("the 8-row interleaved kernels of every multiply-add, on 16- and 32-row panels", "[unit][quant][kernels]") {
  // The tables take one of them per CPU (AVX-VNNI's where it has it,
  // the AVX-512 tables the 16-row kernels where it has AVX512_VNNI), so
  // each is run here on its own: maddubs (on 32-row panels, an AVX-512
  // table without AVX512_VNNI), AVX-VNNI's vpdpbusd, and the same
  // arithmetic through AVX512_VNNI's 256-bit vpdpbusd.
  if (cpu::detect_isa() < cpu::Isa::Avx2) {
    WARN("skipped: no AVX2 (or EP_MOE_CPU_ISA below it)");
    return;
  }
  struct Policy {
    const char* name;
    void (*set)(cpu::QGemmFn*);
    bool here;
  };
  const Policy policies[] = {{"maddubs", cpu::qgroups_avx2, true},
                             {"avx-vnni", cpu::qgroups_avxvnni, cpu::has_avx_vnni()},
                             {"avx512-vnni 256-bit", cpu::qgroups8_vnni_evex, cpu::has_avx512_vnni()}};
  std::mt19937 rng(Catch::rngSeed() + 16);
  for (const Policy& pol : policies) {
    if (!pol.here) {
      WARN("skipped: the 8-row kernels through " << pol.name << " (this CPU lacks it)");
      continue;
    }
    cpu::QGemmFn fns[kQuantTypes] = {};
    pol.set(fns);
    for (int nr : {16, 32})
      for (ep_moe_dtype_t t : kTypes) {
        if (!cpu::groups_rows(t)) continue;  // the decoded formats have no group kernels
        CAPTURE(pol.name, nr, dtype_name(t));
        for (int k : {32, 256, 2048})
          if (k % quant_block_elems(t) == 0)
            check_qgemm(fns[quant_index(t)], cpu::quantize_act_avx2, t, k, nr, cpu::kGroupRows8, rng);
        check_extremes(fns[quant_index(t)], cpu::quantize_act_avx2, t, nr, cpu::kGroupRows8);
      }
  }
}
#endif

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

#if defined(__x86_64__)
TEST_CASE("the AVX2 row decoders give the portable decode's values, every decoded format", "[unit][quant][kernels]") {
  if (cpu::detect_isa() < cpu::Isa::Avx2) {
    WARN("skipped: no AVX2 (or EP_MOE_CPU_ISA below it)");
    return;
  }
  std::mt19937 rng(Catch::rngSeed() + 18);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> mag(-3.0f, 3.0f);
  for (ep_moe_dtype_t t : kTypes) {
    const QuantTraits& q = *quant_traits(t);
    if (!q.decode) continue;
    const cpu::RowDecodeFn fast = cpu::row_decoder_avx2(t);
    REQUIRE(fast != nullptr);
    CAPTURE(dtype_name(t));
    for (int k : {256, 768, 2048}) {
      const int blocks = k / q.block_elems;
      std::vector<uint8_t> row(static_cast<size_t>(blocks * q.block_bytes));
      for (auto& x : row) x = static_cast<uint8_t>(byte(rng));
      for (int b = 0; b < blocks; ++b)  // finite scales of either sign and many magnitudes
        set_scales(t, row.data() + b * q.block_bytes, f32_to_f16(std::ldexp(mag(rng), -(byte(rng) % 12))),
                   f32_to_f16(mag(rng)));
      std::vector<int8_t> v(static_cast<size_t>(k));
      std::vector<float> sc(static_cast<size_t>(k / 16)), mn(static_cast<size_t>(k / 16), 0.0f);
      fast(row.data(), k, v.data(), sc.data(), mn.data());
      int wrong = 0;
      for (int b = 0; b < blocks; ++b) {
        DecodedBlock db;
        q.decode(row.data() + b * q.block_bytes, &db);
        for (int i = 0; i < q.block_elems; ++i) {
          const int at = b * q.block_elems + i;
          wrong += v[static_cast<size_t>(at)] != db.v[i];
          wrong += std::memcmp(&sc[static_cast<size_t>(at / 16)], &db.sc[i / 16], 4) != 0;
          if (q.has_min) wrong += std::memcmp(&mn[static_cast<size_t>(at / 16)], &db.mn[i / 16], 4) != 0;
        }
      }
      CHECK(wrong == 0);
    }
  }
}
#endif

TEST_CASE("FP8 E4M3FN: every code's value, and the nearest code of a float", "[unit][quant]") {
  CHECK(e4m3_value(0x38) == 1.0f);
  CHECK(e4m3_value(0x7E) == 448.0f);
  CHECK(e4m3_value(0xFE) == -448.0f);
  CHECK(e4m3_value(0x01) == std::ldexp(1.0f, -9));  // the smallest subnormal
  CHECK(e4m3_value(0x08) == std::ldexp(1.0f, -6));  // the smallest normal
  CHECK(std::isnan(e4m3_value(0x7F)));
  CHECK(std::isnan(e4m3_value(0xFF)));
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    if (e4m3_nan(code)) continue;
    CAPTURE(c);
    CHECK(e4m3_code(e4m3_value(code)) == code);  // every value round-trips (-0 keeps its sign)
  }
  // Halfway between 1 and 1.125: ties to even (1.0, mantissa 0); between
  // 1.125 and 1.25: to 1.25 (mantissa 2); past 448: saturated.
  CHECK(e4m3_code(1.0625f) == 0x38);
  CHECK(e4m3_code(1.1875f) == 0x3A);
  CHECK(e4m3_code(1000.0f) == 0x7E);
  CHECK(e4m3_code(-1000.0f) == 0xFE);
  CHECK(e4m3_code(std::ldexp(1.0f, -11)) == 0x00);  // a quarter of the smallest subnormal
  CHECK(e4m3_code(std::ldexp(3.0f, -10)) == 0x02);  // 1.5 subnormal steps: ties to even
}

#if defined(__x86_64__)
TEST_CASE(
    "IQ2_XXS, IQ2_XS, IQ3_XXS and IQ3_S decoded in registers (AVX512_VBMI) and through their decoded rows agree with "
    "the double product",
    "[unit][quant][kernels]") {
  if (!cpu::has_avx512_vbmi()) {
    WARN("skipped: no AVX512_VBMI");
    return;
  }
  // The AVX-512 VNNI table's entries as a CPU without VBMI has them (the
  // decoded rows), then with the register decodes installed over them.
  std::vector<cpu::QGemmFn> fns(static_cast<size_t>(kQuantTypes), nullptr);
  cpu::qdecoded_avx512vnni(fns.data());
  const std::vector<cpu::QGemmFn> decoded = fns;
  cpu::qfused_avx512vbmi(fns.data());
  const cpu::Kernels& kern = cpu::kernels_for(cpu::Isa::Avx512);
  std::mt19937 rng(Catch::rngSeed() + 23);
  for (ep_moe_dtype_t t : {EP_MOE_DTYPE_IQ2_XXS, EP_MOE_DTYPE_IQ2_XS, EP_MOE_DTYPE_IQ3_XXS, EP_MOE_DTYPE_IQ3_S}) {
    CAPTURE(dtype_name(t));
    const auto i = static_cast<size_t>(quant_index(t));
    REQUIRE(fns[i] != decoded[i]);
    CHECK(kern.qgemm[i] == fns[i]);
    for (cpu::QGemmFn fn : {decoded[i], fns[i]})
      for (int k : {256, 2048}) check_qgemm(fn, kern.quantize_act, t, k, kern.nr, 0, rng);
  }
  const char* before = std::getenv("EP_MOE_CPU_ISA");
  const std::string saved = before ? before : "";
  setenv("EP_MOE_CPU_ISA", "avx512bf16,-vbmi", 1);
  CHECK_FALSE(cpu::has_avx512_vbmi());
  CHECK(cpu::has_avx512_vnni());
  if (before) setenv("EP_MOE_CPU_ISA", saved.c_str(), 1);
  else unsetenv("EP_MOE_CPU_ISA");
}

TEST_CASE("EP_MOE_CPU_ISA leaves features out one at a time: the AVX-512 tables without AVX512_VNNI",
          "[unit][quant][kernels]") {
  // On a CPU with AVX512_VNNI, "avx512,-vnni" gives the AVX-512 tables of a
  // CPU without it (the 8-row maddubs block kernels, no int8 tiles), so one
  // machine checks both; every format's kernels against the double product.
  if (!cpu::has_avx512_vnni()) {
    WARN("skipped: no AVX512_VNNI to leave out");
    return;
  }
  const char* before = std::getenv("EP_MOE_CPU_ISA");
  const std::string saved = before ? before : "";
  setenv("EP_MOE_CPU_ISA", "avx512bf16,-vnni", 1);
  CHECK_FALSE(cpu::has_avx512_vnni());
  std::mt19937 rng(Catch::rngSeed() + 19);
  for (cpu::Isa isa : {cpu::Isa::Avx512, cpu::Isa::Avx512Bf16}) {
    if (cpu::detect_isa() < isa) continue;
    const cpu::Kernels& kern = cpu::kernels_for(isa);
    INFO(cpu::isa_name(isa) << ": " << kern.qname);
    CHECK(kern.il_of(EP_MOE_DTYPE_Q4_K) == cpu::kGroupRows8);
    CHECK(kern.qtile[quant_index(EP_MOE_DTYPE_Q4_K)] == nullptr);
    for (ep_moe_dtype_t t : kTypes)
      for (int k : {256, 2048})
        if (k % quant_block_elems(t) == 0) {
          CAPTURE(dtype_name(t), k);
          check_qgemm(kern.qgemm[quant_index(t)], kern.quantize_act, t, k, kern.nr, kern.il_of(t), rng);
        }
  }
  if (before) setenv("EP_MOE_CPU_ISA", saved.c_str(), 1);
  else unsetenv("EP_MOE_CPU_ISA");
  CHECK(cpu::has_avx512_vnni());
  CHECK(cpu::kernels_for(cpu::Isa::Avx512).il_of(EP_MOE_DTYPE_Q4_K) == cpu::kGroupRows);
}
#endif
