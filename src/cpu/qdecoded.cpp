// The decoded formats' row decoding and portable row dot (qdecoded.hpp).
#include "cpu/qdecoded.hpp"

#include <cstring>
#include <vector>

namespace ep_moe {
namespace cpu {

DecodedRow decode_row(const QuantTraits& q, const uint8_t* row, int k, RowDecodeFn fast) {
  thread_local std::vector<int8_t> v;
  thread_local std::vector<float> scx, mn;
  const auto ku = static_cast<size_t>(k);
  if (v.size() < ku) {
    v.resize(ku);
    scx.resize(ku / 4);
    mn.resize(ku / 16);
  }
  if (fast) {
    fast(row, k, v.data(), scx.data(), mn.data());
    return DecodedRow{v.data(), scx.data(), mn.data()};
  }
  DecodedBlock db;
  const int e = q.block_elems, groups = e / 16;
  for (int b = 0; b < k / e; ++b) {
    q.decode(row + static_cast<size_t>(b) * static_cast<size_t>(q.block_bytes), &db);
    std::memcpy(v.data() + b * e, db.v, static_cast<size_t>(e));
    for (int g = 0; g < groups; ++g) {
      const auto at = static_cast<size_t>(b * groups + g);
      float* s = scx.data() + 4 * at;
      s[0] = s[1] = s[2] = s[3] = db.sc[g];
      mn[at] = q.has_min ? db.mn[g] : 0.0f;
    }
  }
  return DecodedRow{v.data(), scx.data(), mn.data()};
}

namespace {
struct RowDotGeneric {
  static RowDecodeFn decoder(ep_moe_dtype_t) { return nullptr; }
  static float dot(const DecodedRow& w, const void* arow, int k, bool has_min) {
    const int8_t* q = act_q(arow);
    const float* d = act_d(arow, k);
    const int16_t* s = act_s(arow, k);
    float acc = 0;
    for (int g = 0; g < k / 16; ++g) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += w.v[16 * g + i] * q[16 * g + i];
      float part = w.scx[4 * g] * static_cast<float>(sum);
      if (has_min) part += w.mn[g] * static_cast<float>(s[g]);
      acc += d[g / 2] * part;
    }
    return acc;
  }
};
}  // namespace

void qdecoded_generic(QGemmFn* gemm) { set_decoded<RowDotGeneric>(gemm); }

}  // namespace cpu
}  // namespace ep_moe
