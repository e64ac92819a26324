// Kernels of the block formats computed through their decoded form
// (common/quant.hpp's DecodedBlock: Q2_K, Q3_K, Q4_1, Q5_0, Q5_1, IQ4_NL and
// the IQ1/IQ2/IQ3 grid formats): each weight row of a panel (rows one after
// another, il 0) is decoded once into int8 values and per-16 scales, then
// dotted with every activation row of the call (kernels.hpp's QGemmFn), so
// prefill decodes a row once for all its tokens. Per 16 elements the dot
// product of the int8 values is exact; the row is
//   sum_g d_a(g) (sc_g dot_g + mn_g asum_g),
// d_a the activation row's scale of those elements and asum_g the sum of
// its 16 int8 values. Each ISA file supplies the dot of one decoded row
// with one activation row; this header holds the rest.
#pragma once

#include <cstdint>
#include <utility>

#include "common/quant.hpp"
#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {

// One weight row of k elements decoded: v[k], sc[k / 16] (the scale of
// each 16 elements), mn[k / 16] (the formats with offsets; else unused).
struct DecodedRow {
  const int8_t* v;
  const float* sc;
  const float* mn;
};
// A vector decoder of one format: a row of k elements into v[k],
// sc[k / 16] and (the formats with offsets) mn[k / 16], the same values
// as the traits' decode gives.
using RowDecodeFn = void (*)(const uint8_t* row, int k, int8_t* v, float* sc, float* mn);
// Decodes a row of blocks of format q into the calling thread's buffer
// (valid until its next call), through `fast` where given, else the
// traits' decode. Built for baseline x86-64 (qdecoded.cpp): the ISA files
// share no inline code that could be emitted with their instructions.
// Four buffers a thread (slot 0 .. 3), so that four rows can be decoded
// and then read together.
DecodedRow decode_row(const QuantTraits& q, const uint8_t* row, int k, RowDecodeFn fast, int slot = 0);
// The AVX2 decoders (qdecode_avx2.cpp; every decoded format, null for
// the rest), which the x86 tables take.
RowDecodeFn row_decoder_avx2(ep_moe_dtype_t t);

// RowDot: static float dot(const DecodedRow&, const void* act_row, int k,
// bool has_min); static void dot4(const DecodedRow* w, const void*
// act_row, int k, bool has_min, float* out), the dots of four rows with
// one activation row (which it reads once); and static RowDecodeFn
// decoder(ep_moe_dtype_t). Four weight rows at a time are decoded, then
// each activation row of the call is dotted with all four.
template <int I, class RowDot>
void qgemm_decoded(int m, const void* const* a, int k, const void* panel, int nr, float* c, int ldc,
                   const void* /*next*/) {
  const auto t = static_cast<ep_moe_dtype_t>(static_cast<int>(kQuantFirst) + I);
  const QuantTraits& q = *quant_traits(t);
  static const RowDecodeFn fast = RowDot::decoder(t);
  const size_t rb = static_cast<size_t>(k / q.block_elems) * static_cast<size_t>(q.block_bytes);
  const auto* w = static_cast<const uint8_t*>(panel);
  int j = 0;
  for (; j + 4 <= nr; j += 4) {
    DecodedRow rows[4];
    for (int r = 0; r < 4; ++r) rows[r] = decode_row(q, w + static_cast<size_t>(j + r) * rb, k, fast, r);
    for (int i = 0; i < m; ++i) RowDot::dot4(rows, a[i], k, q.has_min, c + i * ldc + j);
  }
  for (; j < nr; ++j) {
    const DecodedRow row = decode_row(q, w + static_cast<size_t>(j) * rb, k, fast);
    for (int i = 0; i < m; ++i) c[i * ldc + j] = RowDot::dot(row, a[i], k, q.has_min);
  }
}

template <class RowDot, int... I>
void set_decoded(QGemmFn* out, std::integer_sequence<int, I...>) {
  ((out[I] = quant_traits(static_cast<ep_moe_dtype_t>(static_cast<int>(kQuantFirst) + I))->decode
                 ? qgemm_decoded<I, RowDot>
                 : out[I]),
   ...);
}
// Sets the entries of every decoded format in a table by quant_index.
template <class RowDot>
void set_decoded(QGemmFn* out) {
  set_decoded<RowDot>(out, std::make_integer_sequence<int, kQuantTypes>{});
}

namespace {
// sum_g d_a(g) (sc_g dot_g + mn_g asum_g) over groups [g0, g1) of a decoded
// row against an activation row, portably: the vector row dots' tail (in
// each file's own copy, built with its flags).
inline float decoded_tail(const DecodedRow& w, const int8_t* q, const float* d, const int16_t* s, int g0, int g1,
                          bool has_min) {
  float acc = 0;
  for (int g = g0; g < g1; ++g) {
    int sum = 0;
    for (int i = 0; i < 16; ++i) sum += w.v[16 * g + i] * q[16 * g + i];
    float part = w.sc[g] * static_cast<float>(sum);
    if (has_min) part += w.mn[g] * static_cast<float>(s[g]);
    acc += d[g / 2] * part;
  }
  return acc;
}
}  // namespace

// The portable table's entries (qdecoded.cpp; the reference of the vector
// ones).
void qdecoded_generic(QGemmFn* gemm);
// The x86 tables' row dots (qdecoded_avx2.cpp, qdecoded_avx512vnni.cpp).
void qdecoded_avx2(QGemmFn* gemm);
void qdecoded_avx512vnni(QGemmFn* gemm);

}  // namespace cpu
}  // namespace ep_moe
