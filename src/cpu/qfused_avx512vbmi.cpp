// IQ2_XXS, IQ2_XS, IQ3_XXS and IQ3_S on rows one after another on the AVX-512
// tables of a CPU with AVX512_VNNI and AVX512_VBMI (vpermb, vpermt2b,
// vpmultishiftqb), the block decoded in registers for calls of up to
// kMaxRows activation rows (qfused_rows.inc); larger calls keep the
// decoded-row kernel this replaces, which decodes each row once for all.
//
// A block is decoded with no scalar or gathered load of its grid (either
// bound the kernel at half this speed or less): its grid indices are
// looked up 32 at a time in the grid's 256 or 512 16-bit level codes held
// in vectors (vpermt2w over 64 entries each, blended by the index's high
// bits); vpmultishiftqb spreads an entry's 2- or 3-bit codes over its
// bytes and vpermb turns them into the format's magnitudes. The 7-bit sign
// codes take their parity bit from a 128-byte table (vpermt2b) (IQ3_S
// stores whole sign bytes) and become,
// spread by vpermb and vptestmb, the masks that negate the activations,
// so that the magnitudes stay u8 for vpdpbusd. Each dword lane belongs to
// one group in every vector (element_of says how), so the block's four
// vpdpbusd add up in one accumulator (two where a group has two scales,
// IQ2_XS), which meets the groups' 2 s + 1 once (vpmulld; every sum exact
// in int32) and then the block's d times d_a in float.
// GCC 12 warns falsely inside its own AVX-512 intrinsics (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/quant_grids.hpp"
#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {

namespace {

#include "cpu/qfused_rows.inc"

// Vector v (0..3) of a block holds elements 32 g + 8 v .. + 7 in its u64 g
// (g = 0..7, the groups of 32 that share a scale and whose sign code v
// covers those 8): every dword lane of every vector then belongs to one
// group (lanes 2 g and 2 g + 1 to group g), so that the four vectors' dot
// products add up in one accumulator and meet the groups' scales once a
// block. The activations are permuted to that order once a call.
inline int element_of(int v, int g) { return 32 * g + 8 * v; }

// What the formats' decodes share: the grid (kEntries 16-bit level codes),
// the sign codes' parity table, the spreading of sign bytes.
template <int kEntries>
struct Common {
  static constexpr int kVectors = kEntries / 32;
  __m512i grid[kVectors];  // the level codes, 32 a vector
  __m512i magnitude;       // byte i: the magnitude of level code i & (levels - 1)
  __m512i parity[2];       // byte c (0..127): c, with bit 7 making its bit count even
  __m512i sign_spread[4];  // vector v: byte 8 g + i <- byte 8 g + v (group g's sign byte v)
  __m512i bit;             // byte i: 1 << i % 8
  // Vector v: each u64's level codes of its elements into its bytes. 2-bit
  // codes (8 elements an entry): word v of the u64 (entry v of the group);
  // 3-bit codes (4 an entry): words 2 (v % 2) and 2 (v % 2) + 1 (entries 2 v
  // and 2 v + 1, from the lookup of half v / 2).
  __m512i level_fields[4];
  Common(const uint16_t* codes, const int* levels, int nlevels) {
    for (int v = 0; v < kVectors; ++v) grid[v] = _mm512_loadu_si512(codes + 32 * v);
    alignas(64) uint8_t b[128];
    for (int i = 0; i < 64; ++i) b[i] = static_cast<uint8_t>(levels[i & (nlevels - 1)]);
    magnitude = _mm512_load_si512(b);
    for (int c = 0; c < 128; ++c)
      b[c] = static_cast<uint8_t>(c | (__builtin_popcount(static_cast<unsigned>(c)) & 1) << 7);
    parity[0] = _mm512_load_si512(b);
    parity[1] = _mm512_load_si512(b + 64);
    for (int i = 0; i < 64; ++i) b[i] = static_cast<uint8_t>(1u << (i % 8));
    bit = _mm512_load_si512(b);
    for (int v = 0; v < 4; ++v) {
      for (int i = 0; i < 64; ++i) b[i] = static_cast<uint8_t>(8 * (i / 8) + v);
      sign_spread[v] = _mm512_load_si512(b);
      for (int i = 0; i < 64; ++i)
        b[i] =
            static_cast<uint8_t>(nlevels == 4 ? 16 * v + 2 * (i % 8) : 32 * (v % 2) + 16 * (i % 8 / 4) + 3 * (i % 4));
      level_fields[v] = _mm512_load_si512(b);
    }
  }
  // The magnitudes (u8) of vector v from the level codes of its entries.
  __m512i magnitudes(int v, __m512i codes) const {
    return _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(level_fields[v], codes), magnitude);
  }
  // The level codes of the 32 grid indices in idx's 16-bit lanes: vpermt2w
  // over each 64 entries (index bits 0-5), then blends by bits 6, 7, ....
  __m512i lookup(__m512i idx) const {
    __m512i r[kVectors / 2];
    for (int k = 0; k < kVectors / 2; ++k) r[k] = _mm512_permutex2var_epi16(grid[2 * k], idx, grid[2 * k + 1]);
    int n = kVectors / 2;
    for (int bitpos = 6; n > 1; ++bitpos, n /= 2) {
      const __mmask32 hi = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(static_cast<int16_t>(1 << bitpos)));
      for (int k = 0; k < n / 2; ++k) r[k] = _mm512_mask_blend_epi16(hi, r[2 * k], r[2 * k + 1]);
    }
    return r[0];
  }
  // Sign codes (7 bits, in bytes 8 g + v; bit 7 ignored) into the masks of
  // the four vectors' negative elements.
  void negatives(__m512i codes7, __mmask64* neg) const {
    sign_masks(_mm512_permutex2var_epi8(parity[0], codes7, parity[1]), neg);
  }
  // Full sign bytes (in bytes 8 g + v) into the same masks.
  void sign_masks(__m512i signs, __mmask64* neg) const {
    for (int v = 0; v < 4; ++v) neg[v] = _mm512_test_epi8_mask(_mm512_permutexvar_epi8(sign_spread[v], signs), bit);
  }
};

// A block as the rows below take it: the magnitudes (u8) of vector v, the
// masks of its negative elements, the groups' odd scale factors in dword
// lanes 2 g and 2 g + 1, and the float factor of the block.
// odd[1] is used by the formats with two scales a group (kTwoScales: one
// for vectors 0-1, the other for 2-3).
struct Decoded {
  __m512i mag[4];
  __mmask64 neg[4];
  __m512i odd[2];
  float scale;
};

// The groups' 4-bit scales s at bits 60..63 of u64 g of x as 2 s + 1 in
// dword lanes 2 g and 2 g + 1.
inline __m512i odd_scales(__m512i x, int shift) {
  const __m512i s4 = _mm512_and_si512(_mm512_srli_epi64(x, shift), _mm512_set1_epi64(15));
  return _mm512_or_si512(_mm512_or_si512(_mm512_slli_epi64(s4, 1), _mm512_slli_epi64(s4, 33)), _mm512_set1_epi32(1));
}

// IQ2_XXS (66 bytes: d, then per group g 8 bytes: 4 grid indices, each 8
// elements, and a u32 of four 7-bit sign codes and the 4-bit scale): the
// elements d (2 s + 1) / 8 x sign x magnitude (8, 25, 43).
struct IQ2XXS {
  static constexpr ep_moe_dtype_t kType = EP_MOE_DTYPE_IQ2_XXS;
  static constexpr size_t kBytes = 66;
  static constexpr bool kTwoScales = false;
  struct Consts : Common<256> {
    __m512i index_words;  // 16-bit lane 4 g + v: grid index v of group g (zero-extended)
    __m512i sign_fields;  // per u64 g of qs: its four 7-bit sign codes into bytes 0-3
    Consts() : Common<256>(grids::kIq2xxsCodes, kLevels, 4) {
      alignas(64) uint8_t b[64];
      for (int w = 0; w < 32; ++w) {
        b[2 * w] = static_cast<uint8_t>(8 * (w / 4) + w % 4);
        b[2 * w + 1] = 0;  // masked to zero
      }
      index_words = _mm512_load_si512(b);
      for (int i = 0; i < 64; ++i) b[i] = static_cast<uint8_t>(32 + 7 * (i % 4));
      sign_fields = _mm512_load_si512(b);
    }
  };
  static constexpr int kLevels[4] = {8, 25, 43, 0};
  static void decode(const uint8_t* blk, const Consts& k, Decoded* o) {
    const __m512i x = _mm512_loadu_si512(blk + 2);  // qs
    const __m512i codes = k.lookup(_mm512_maskz_permutexvar_epi8(0x5555555555555555ull, k.index_words, x));
    k.negatives(_mm512_multishift_epi64_epi8(k.sign_fields, x), o->neg);
    o->odd[0] = odd_scales(x, 60);
    for (int v = 0; v < 4; ++v) o->mag[v] = k.magnitudes(v, codes);
    o->scale = 0.125f * f16at(blk);
  }
};
constexpr int IQ2XXS::kLevels[4];

// IQ3_XXS (98 bytes: d, 64 grid indices of 4 elements each, 8 in a group,
// then per group a u32 of four 7-bit sign codes and the 4-bit scale): the
// elements d (2 s + 1) / 4 x sign x magnitude (4, 12, ..., 52, 62).
struct IQ3XXS {
  static constexpr ep_moe_dtype_t kType = EP_MOE_DTYPE_IQ3_XXS;
  static constexpr size_t kBytes = 98;
  static constexpr bool kTwoScales = false;
  struct Consts : Common<256> {
    __m512i index_words[2];  // half h, lane 4 g + m: grid index 4 h + m of group g
    __m512i sign_fields;     // per u64 g (its u32 zero-extended): the sign codes into bytes 0-3
    Consts() : Common<256>(grids::kIq3xxsCodes, kLevels, 8) {
      alignas(64) uint8_t b[64];
      for (int h = 0; h < 2; ++h) {
        for (int w = 0; w < 32; ++w) {
          b[2 * w] = static_cast<uint8_t>(8 * (w / 4) + 4 * h + w % 4);
          b[2 * w + 1] = 0;
        }
        index_words[h] = _mm512_load_si512(b);
      }
      for (int i = 0; i < 64; ++i) b[i] = static_cast<uint8_t>(7 * (i % 4));
      sign_fields = _mm512_load_si512(b);
    }
  };
  static constexpr int kLevels[8] = {4, 12, 20, 28, 36, 44, 52, 62};
  static void decode(const uint8_t* blk, const Consts& k, Decoded* o) {
    const __m512i x = _mm512_loadu_si512(blk + 2);  // the grid indices
    const __m512i codes[2] = {k.lookup(_mm512_maskz_permutexvar_epi8(0x5555555555555555ull, k.index_words[0], x)),
                              k.lookup(_mm512_maskz_permutexvar_epi8(0x5555555555555555ull, k.index_words[1], x))};
    const __m512i sas =
        _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 66)));  // u64 g: group g's u32
    k.negatives(_mm512_multishift_epi64_epi8(k.sign_fields, sas), o->neg);
    o->odd[0] = odd_scales(sas, 28);
    for (int v = 0; v < 4; ++v) o->mag[v] = k.magnitudes(v, codes[v / 2]);
    o->scale = 0.25f * f16at(blk);
  }
};
constexpr int IQ3XXS::kLevels[8];

// IQ2_XS (74 bytes: d, 32 u16 of a 9-bit grid index and a 7-bit sign code,
// each 8 elements, 4 a group, then a byte of two 4-bit scales per group:
// the low one for its first 16 elements, the high one for the rest): the
// elements d (2 s + 1) / 8 x sign x magnitude (8, 25, 43). The u16 of
// entry v of group g is word 4 g + v of qs: the vectors' order as it is.
struct IQ2XS {
  static constexpr ep_moe_dtype_t kType = EP_MOE_DTYPE_IQ2_XS;
  static constexpr size_t kBytes = 74;
  static constexpr bool kTwoScales = true;
  struct Consts : Common<512> {
    __m512i sign_pick;  // byte 8 g + v (v < 4): the high byte of word 4 g + v
    Consts() : Common<512>(grids::kIq2xsCodes, IQ2XXS::kLevels, 4) {
      alignas(64) uint8_t b[64];
      for (int i = 0; i < 64; ++i) b[i] = static_cast<uint8_t>(8 * (i / 8) + 2 * (i % 4) + 1);
      sign_pick = _mm512_load_si512(b);
    }
  };
  static void decode(const uint8_t* blk, const Consts& k, Decoded* o) {
    const __m512i x = _mm512_loadu_si512(blk + 2);  // qs
    const __m512i codes = k.lookup(_mm512_and_si512(x, _mm512_set1_epi16(511)));
    // The sign codes: bits 9-15 of each word, its high byte >> 1.
    k.negatives(_mm512_srli_epi16(_mm512_permutexvar_epi8(k.sign_pick, x), 1), o->neg);
    const __m512i sc = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 66)));
    o->odd[0] = odd_scales(sc, 0);
    o->odd[1] = odd_scales(sc, 4);
    for (int v = 0; v < 4; ++v) o->mag[v] = k.magnitudes(v, codes);
    o->scale = 0.125f * f16at(blk);
  }
};

// IQ3_S (110 bytes: d, 64 low bytes of 9-bit grid indices of 4 elements
// each, 8 a group; qh[8], bit m of byte g the high bit of group g's index
// m; 32 sign bytes, one per 8 elements; 4 bytes of two 4-bit scales, group
// g's in nibble g % 2 of byte g / 2): the elements d (2 s + 1) x sign x
// magnitude (1, 3, ..., 15).
struct IQ3S {
  static constexpr ep_moe_dtype_t kType = EP_MOE_DTYPE_IQ3_S;
  static constexpr size_t kBytes = 110;
  static constexpr bool kTwoScales = false;
  static constexpr int kLevels[8] = {1, 3, 5, 7, 9, 11, 13, 15};
  struct Consts : Common<512> {
    __m512i index_words[2];  // half h, lane 4 g + j: the low byte of index 4 h + j of group g
    __m512i qh_words;        // lane 4 g + j: qh[g] in the high byte
    __m512i qh_bit[2];       // half h, lane 4 g + j: 1 << (8 + 4 h + j)
    __m512i sign_arrange;    // byte 8 g + v (v < 4): sign byte 4 g + v
    Consts() : Common<512>(grids::kIq3sCodes, kLevels, 8) {
      alignas(64) uint8_t b[64];
      alignas(64) uint16_t w[32];
      for (int h = 0; h < 2; ++h) {
        for (int l = 0; l < 32; ++l) {
          b[2 * l] = static_cast<uint8_t>(8 * (l / 4) + 4 * h + l % 4);
          b[2 * l + 1] = 0;
          w[l] = static_cast<uint16_t>(1u << (8 + 4 * h + l % 4));
        }
        index_words[h] = _mm512_load_si512(b);
        qh_bit[h] = _mm512_load_si512(w);
      }
      for (int l = 0; l < 32; ++l) {
        b[2 * l] = 0;  // masked to zero
        b[2 * l + 1] = static_cast<uint8_t>(l / 4);
      }
      qh_words = _mm512_load_si512(b);
      for (int i = 0; i < 64; ++i) b[i] = static_cast<uint8_t>(4 * (i / 8) + i % 4);
      sign_arrange = _mm512_load_si512(b);
    }
  };
  static void decode(const uint8_t* blk, const Consts& k, Decoded* o) {
    const __m512i x = _mm512_loadu_si512(blk + 2);  // the low bytes of the indices
    const __m512i qh = _mm512_maskz_permutexvar_epi8(
        0xAAAAAAAAAAAAAAAAull, k.qh_words,
        _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 66))));
    __m512i codes[2];
    for (int h = 0; h < 2; ++h) {
      const __m512i lo = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, k.index_words[h], x);
      const __mmask32 high = _mm512_test_epi16_mask(qh, k.qh_bit[h]);
      codes[h] = k.lookup(_mm512_mask_add_epi16(lo, high, lo, _mm512_set1_epi16(256)));
    }
    const __m512i signs = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 74)));
    k.sign_masks(_mm512_permutexvar_epi8(k.sign_arrange, signs), o->neg);
    // Group g's scale: nibble g % 2 of byte g / 2, into u64 g.
    uint32_t sc4;
    std::memcpy(&sc4, blk + 106, 4);
    const __m512i sc = _mm512_srlv_epi64(
        _mm512_cvtepu8_epi64(_mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(sc4)),
                                              _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0))),
        _mm512_setr_epi64(0, 4, 0, 4, 0, 4, 0, 4));
    o->odd[0] = odd_scales(sc, 0);
    for (int v = 0; v < 4; ++v) o->mag[v] = k.magnitudes(v, codes[v / 2]);
    o->scale = f16at(blk);
  }
};
constexpr int IQ3S::kLevels[8];

// Activation row q (k values) in the vectors' order.
void permute_row(const int8_t* q, int k, int8_t* out) {
  for (int blk = 0; blk < k; blk += 256)
    for (int v = 0; v < 4; ++v)
      for (int g = 0; g < 8; ++g) std::memcpy(out + blk + 64 * v + 8 * g, q + blk + element_of(v, g), 8);
}

// Format F on M activation rows (a compile-time count, so that each row's
// accumulators stay in registers across the blocks).
template <class F>
struct GridRows {
  static constexpr ep_moe_dtype_t kType = F::kType;
  template <int M>
  static void rows(const void* const* a, int k, const void* panel, int nr, float* c, int ldc) {
    static const typename F::Consts kc;
    thread_local std::vector<int8_t> perm;
    if (perm.size() < static_cast<size_t>(M) * static_cast<size_t>(k))
      perm.resize(static_cast<size_t>(M) * static_cast<size_t>(k));
    const int8_t* q[M];
    const float* da[M];
    for (int i = 0; i < M; ++i) {
      int8_t* p = perm.data() + static_cast<size_t>(i) * static_cast<size_t>(k);
      permute_row(act_q(a[i]), k, p);
      q[i] = p;
      da[i] = act_d(a[i], k);
    }
    const size_t rb = static_cast<size_t>(k / 256) * F::kBytes;
    const __m512i zero = _mm512_setzero_si512();
    for (int j = 0; j < nr; ++j) {
      const uint8_t* row = static_cast<const uint8_t*>(panel) + static_cast<size_t>(j) * rb;
      __m512 acc[M];
      for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_ps();
      for (int b = 0; b < k / 256; ++b) {
        const uint8_t* blk = row + F::kBytes * static_cast<size_t>(b);
        _mm_prefetch(reinterpret_cast<const char*>(blk) + 1024, _MM_HINT_T0);
        Decoded w;
        F::decode(blk, kc, &w);
        constexpr int kSums = F::kTwoScales ? 2 : 1;  // vectors 0-1 and 2-3 apart where their scales differ
        __m512i isum[M][kSums];
        for (int i = 0; i < M; ++i)
          for (int h = 0; h < kSums; ++h) isum[i][h] = _mm512_setzero_si512();
        for (int v = 0; v < 4; ++v)
          for (int i = 0; i < M; ++i) {
            const __m512i qv = _mm512_loadu_si512(q[i] + 256 * b + 64 * v);
            __m512i& sum = isum[i][kSums == 2 ? v / 2 : 0];
            sum = _mm512_dpbusd_epi32(sum, w.mag[v], _mm512_mask_sub_epi8(qv, w.neg[v], zero, qv));
          }
        for (int i = 0; i < M; ++i) {
          __m512i scaled = _mm512_mullo_epi32(isum[i][0], w.odd[0]);
          if (kSums == 2) scaled = _mm512_add_epi32(scaled, _mm512_mullo_epi32(isum[i][kSums - 1], w.odd[1]));
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(scaled), _mm512_set1_ps(w.scale * da[i][8 * b]), acc[i]);
        }
      }
      for (int i = 0; i < M; ++i) c[i * ldc + j] = hsum(acc[i]);
    }
  }
};

}  // namespace

void qfused_avx512vbmi(QGemmFn* gemm) {
  install<GridRows<IQ2XXS>>(gemm);
  install<GridRows<IQ2XS>>(gemm);
  install<GridRows<IQ3XXS>>(gemm);
  install<GridRows<IQ3S>>(gemm);
}

}  // namespace cpu
}  // namespace ep_moe
