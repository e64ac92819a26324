// Loading one rank's part of a checkpoint layer: only the byte ranges of the
// experts this rank holds, the router, the bias, the shared expert's gate and
// this rank's shard of the shared expert.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "common/quant.hpp"
#include "layer/layer.hpp"

namespace ep_moe {

namespace {

using io::Elem;

// A window of a slice read into memory, ready to be packed.
struct Loaded {
  std::vector<uint8_t> buf;
  ep_moe_dtype_t dtype = EP_MOE_DTYPE_F32;
  int64_t cols = 0;  // row length of buf (or, transposed, of the stored rows)
  bool transposed = false;
};

// The dtype a tensor is read in: its own (block formats kept as they are).
ep_moe_dtype_t dtype_of(const io::TensorInfo& t, const io::Checkpoint& ck) {
  const int dt = io::elem_dtype(t.elem);
  if (dt < 0)
    fail(EP_MOE_ERR_UNSUPPORTED,
         "%s: tensor '%s' is %s; only F32, F16, BF16, F8_E4M3 with its weight_scale_inv (and in GGUF the "
         "block formats of docs/quantization.md) can be loaded",
         ck.file(t.file).name().c_str(), t.name.c_str(), t.type_name.c_str());
  return static_cast<ep_moe_dtype_t>(dt);
}

// GPT-OSS's fused gate_up ([2I, ...] logical rows alternating gate and up)
// reordered to gate rows then up rows, as EP_MOE_WEIGHT_EXPERT_GATE_UP
// takes them. Logical rows are stored columns when `transposed`; a bias row
// ([1, 2I]) is the transposed case with one stored row.
void deinterleave(Loaded& ld, int64_t logical_rows, bool as_columns) {
  if (dtype_is_quant(ld.dtype) && as_columns)
    fail(EP_MOE_ERR_UNSUPPORTED, "an interleaved gate_up stored transposed in a block format cannot be reordered");
  const size_t es = dtype_size(ld.dtype);
  std::vector<uint8_t> out(ld.buf.size());
  const int64_t half = logical_rows / 2;
  if (!as_columns) {  // whole rows of ld.cols elements
    const size_t rb = dtype_is_quant(ld.dtype) ? quant_row_bytes(ld.dtype, ld.cols) : static_cast<size_t>(ld.cols) * es;
    for (int64_t r = 0; r < logical_rows; ++r) {
      const int64_t to = r % 2 == 0 ? r / 2 : half + r / 2;
      std::memcpy(out.data() + static_cast<size_t>(to) * rb, ld.buf.data() + static_cast<size_t>(r) * rb, rb);
    }
  } else {  // every stored row holds one element of each logical row
    const int64_t stored_rows = static_cast<int64_t>(ld.buf.size() / es) / logical_rows;
    for (int64_t i = 0; i < stored_rows; ++i) {
      const uint8_t* src = ld.buf.data() + static_cast<size_t>(i * logical_rows) * es;
      uint8_t* dst = out.data() + static_cast<size_t>(i * logical_rows) * es;
      for (int64_t r = 0; r < logical_rows; ++r) {
        const int64_t to = r % 2 == 0 ? r / 2 : half + r / 2;
        std::memcpy(dst + static_cast<size_t>(to) * es, src + static_cast<size_t>(r) * es, es);
      }
    }
  }
  ld.buf.swap(out);
}

class Reader {
 public:
  explicit Reader(const io::Checkpoint& ck) : ck_(ck) {}
  uint64_t bytes() const { return bytes_; }

  // Rows [r0, r0 + nr) and columns [c0, c0 + nc) of a slice.
  Loaded read(const io::Slice& s, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
    if (s.fp8) return read_fp8(s, r0, nr, c0, nc);
    if (s.scales) return read_mxfp4(s, r0, nr, c0, nc);
    const io::TensorInfo& t = *s.tensor;
    const ep_moe_dtype_t dt = dtype_of(t, ck_);
    const io::ByteSource& f = ck_.file(t.file);
    Loaded out;
    out.dtype = dt;
    if (s.transposed) {  // stored [cols, rows]: whole slices only
      if (r0 != 0 || nr != s.rows || c0 != 0 || nc != s.cols)
        fail(EP_MOE_ERR_INTERNAL, "windows of transposed tensors are not supported");
      if (dtype_is_quant(dt))
        fail(EP_MOE_ERR_UNSUPPORTED, "tensor '%s' is %s stored transposed: block formats are read row by row",
             t.name.c_str(), t.type_name.c_str());
      out.transposed = true;
      out.cols = s.rows;  // the stored row length
      fetch(f, t, s.offset, s.rows * s.cols, &out.buf);
      return out;
    }
    // Whole rows are contiguous; a column window of a plain type, or of a
    // block format on whole blocks, is read row by row. Blocks cannot be
    // split: another window of a block format (a shared expert's down shard)
    // reads whole rows and dequantizes the window.
    const bool quant = dtype_is_quant(dt);
    const int64_t qk = quant ? quant_block_elems(dt) : 1;
    const bool whole_rows = nc == s.cols || (quant && (c0 % qk != 0 || nc % qk != 0));
    const int64_t row_elems = s.cols;
    const uint64_t row_bytes = t.bytes_of(static_cast<uint64_t>(row_elems));
    if (whole_rows) {
      fetch(f, t, s.offset + static_cast<uint64_t>(r0) * row_bytes, nr * row_elems, &out.buf);
      out.cols = row_elems;
      if (nc != s.cols) {
        std::vector<uint8_t> narrow(static_cast<size_t>(nr * nc) * sizeof(float));
        const Source rows{out.buf.data(), dt, row_elems, 0, c0};
        for (int64_t r = 0; r < nr; ++r) source_row_f32(rows, r, nc, reinterpret_cast<float*>(narrow.data()) + r * nc);
        out.buf.swap(narrow);
        out.dtype = EP_MOE_DTYPE_F32;
        out.cols = nc;
      }
      return out;
    }
    // The window's bytes in each row (a block format's: its whole blocks).
    const uint64_t skip = t.bytes_of(static_cast<uint64_t>(c0)), take = t.bytes_of(static_cast<uint64_t>(nc));
    out.buf.resize(static_cast<size_t>(static_cast<uint64_t>(nr) * take));
    for (int64_t r = 0; r < nr; ++r) {
      const uint64_t off = s.offset + static_cast<uint64_t>(r0 + r) * row_bytes + skip;
      f.read(off, out.buf.data() + static_cast<size_t>(static_cast<uint64_t>(r) * take), static_cast<size_t>(take));
      bytes_ += take;
    }
    out.cols = nc;
    return out;
  }

 private:
  // The same window of an MXFP4 blocks + scales pair (io::Slice), as GGUF
  // MXFP4 blocks: each block's exponent byte, then its 16 code bytes with
  // elements j and j + 16 in byte j (low and high nibble), where the pair
  // holds elements 2j and 2j + 1 in byte j. A window on whole blocks reads
  // only its blocks; another (not met in GPT-OSS, which has no shared
  // expert) reads whole rows and dequantizes the window.
  Loaded read_mxfp4(const io::Slice& s, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
    const bool whole_blocks = c0 % 32 == 0 && nc % 32 == 0;
    const int64_t groups = s.cols / 32, g0 = whole_blocks ? c0 / 32 : 0, ng = whole_blocks ? nc / 32 : groups;
    std::vector<uint8_t> codes(static_cast<size_t>(nr * ng) * 16), exps(static_cast<size_t>(nr * ng));
    // Rows r .. r + n of the window (whole rows: all in one read each).
    const auto fetch_rows = [&](int64_t r, int64_t n) {
      const auto first = static_cast<uint64_t>((r0 + r) * groups + g0);
      read_bytes(*s.tensor, s.offset + first * 16, static_cast<size_t>(n * ng) * 16,
                 codes.data() + static_cast<size_t>(r * ng) * 16);
      read_bytes(*s.scales, s.scales_offset + first, static_cast<size_t>(n * ng),
                 exps.data() + static_cast<size_t>(r * ng));
    };
    if (ng == groups) fetch_rows(0, nr);
    else
      for (int64_t r = 0; r < nr; ++r) fetch_rows(r, 1);
    Loaded out;
    out.dtype = EP_MOE_DTYPE_MXFP4;
    out.cols = ng * 32;
    out.buf.resize(exps.size() * 17);
    for (size_t b = 0; b < exps.size(); ++b) {
      const uint8_t* in = codes.data() + b * 16;
      uint8_t* blk = out.buf.data() + b * 17;
      blk[0] = exps[b];
      const auto code = [&](int i) { return static_cast<uint8_t>(i % 2 ? in[i / 2] >> 4 : in[i / 2] & 0x0F); };
      for (int j = 0; j < 16; ++j) blk[1 + j] = static_cast<uint8_t>(code(j) | code(j + 16) << 4);
    }
    if (!whole_blocks) {
      std::vector<uint8_t> narrow(static_cast<size_t>(nr * nc) * sizeof(float));
      const Source rows{out.buf.data(), out.dtype, out.cols, 0, c0};
      for (int64_t r = 0; r < nr; ++r) source_row_f32(rows, r, nc, reinterpret_cast<float*>(narrow.data()) + r * nc);
      out.buf.swap(narrow);
      out.dtype = EP_MOE_DTYPE_F32;
      out.cols = nc;
    }
    return out;
  }

  // The same window of an F8_E4M3 weight and its weight_scale_inv
  // (io::Slice::fp8) as FP8_E4M3 blocks: per 128 columns of a row the
  // scale of its block of rows, then the 128 codes. Only the window's rows
  // and the scales of their blocks of rows are read; a window on whole
  // blocks of columns reads only those, another (a shared expert's shard
  // not on 128 columns) whole rows, dequantized to the window. A
  // non-finite scale or an E4M3 NaN code is refused, named.
  Loaded read_fp8(const io::Slice& s, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
    const io::TensorInfo& t = *s.tensor;
    const io::TensorInfo& st = *s.scales;
    const bool whole_blocks = c0 % 128 == 0 && nc % 128 == 0;
    const int64_t nb = s.cols / 128, b0 = whole_blocks ? c0 / 128 : 0, wb = whole_blocks ? nc / 128 : nb;
    const int64_t R = s.fp8_block_rows;
    std::vector<uint8_t> codes(static_cast<size_t>(nr * wb) * 128);
    for (int64_t r = 0; r < nr; ++r)
      read_bytes(t, s.offset + static_cast<uint64_t>((r0 + r) * s.cols + 128 * b0), static_cast<size_t>(wb) * 128,
                 codes.data() + static_cast<size_t>(r * wb) * 128);
    const int64_t sr0 = r0 / R, srn = nr > 0 ? (r0 + nr - 1) / R - sr0 + 1 : 0;
    const auto es = static_cast<size_t>(st.block_bytes);
    std::vector<uint8_t> sraw(static_cast<size_t>(srn * nb) * es);
    read_bytes(st, s.scales_offset + static_cast<uint64_t>(sr0 * nb) * es, sraw.size(), sraw.data());
    const ep_moe_dtype_t sdt = st.type_name == "F32"    ? EP_MOE_DTYPE_F32
                               : st.type_name == "BF16" ? EP_MOE_DTYPE_BF16
                                                        : EP_MOE_DTYPE_F16;
    std::vector<float> scales(static_cast<size_t>(srn * nb));
    source_row_f32(Source{sraw.data(), sdt, srn * nb}, 0, srn * nb, scales.data());
    Loaded out;
    out.dtype = EP_MOE_DTYPE_FP8_E4M3;
    out.cols = wb * 128;
    out.buf.resize(static_cast<size_t>(nr * wb) * 132);
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t b = 0; b < wb; ++b) {
        const float sc = scales[static_cast<size_t>(((r0 + r) / R - sr0) * nb + b0 + b)];
        if (!std::isfinite(sc))
          fail(EP_MOE_ERR_FORMAT, "%s: '%s' [%lld, %lld] is %g: scales must be finite",
               ck_.file(st.file).name().c_str(), st.name.c_str(), static_cast<long long>((r0 + r) / R),
               static_cast<long long>(b0 + b), static_cast<double>(sc));
        const uint8_t* in = codes.data() + static_cast<size_t>(r * wb + b) * 128;
        for (int i = 0; i < 128; ++i)
          if (e4m3_nan(in[i]))
            fail(EP_MOE_ERR_FORMAT, "%s: '%s' [%lld, %lld] is an E4M3 NaN code (0x%02x)",
                 ck_.file(t.file).name().c_str(), t.name.c_str(), static_cast<long long>(r0 + r),
                 static_cast<long long>(128 * (b0 + b) + i), in[i]);
        uint8_t* blk = out.buf.data() + static_cast<size_t>(r * wb + b) * 132;
        std::memcpy(blk, &sc, 4);
        std::memcpy(blk + 4, in, 128);
      }
    if (!whole_blocks) {
      std::vector<uint8_t> narrow(static_cast<size_t>(nr * nc) * sizeof(float));
      const Source rows{out.buf.data(), out.dtype, out.cols, 0, c0};
      for (int64_t r = 0; r < nr; ++r) source_row_f32(rows, r, nc, reinterpret_cast<float*>(narrow.data()) + r * nc);
      out.buf.swap(narrow);
      out.dtype = EP_MOE_DTYPE_F32;
      out.cols = nc;
    }
    return out;
  }

  // n bytes of tensor t at an absolute file offset inside it.
  void read_bytes(const io::TensorInfo& t, uint64_t offset, size_t n, uint8_t* dst) {
    if (offset < t.offset || offset + n > t.offset + t.bytes)
      fail(EP_MOE_ERR_INTERNAL, "read outside tensor '%s'", t.name.c_str());
    ck_.file(t.file).read(offset, dst, n);
    bytes_ += n;
  }

  void fetch(const io::ByteSource& f, const io::TensorInfo& t, uint64_t offset, int64_t count,
             std::vector<uint8_t>* dst) {
    const uint64_t n = t.bytes_of(static_cast<uint64_t>(count));
    if (offset < t.offset || offset + n > t.offset + t.bytes)
      fail(EP_MOE_ERR_INTERNAL, "read outside tensor '%s'", t.name.c_str());
    dst->resize(static_cast<size_t>(n));
    f.read(offset, dst->data(), dst->size());
    bytes_ += n;
  }

  const io::Checkpoint& ck_;
  uint64_t bytes_ = 0;
};

// The bytes of the experts' weight tensors in `experts` of layer L (a fused
// gate_up counted once), for the progress lines.
uint64_t expert_bytes(const io::Checkpoint& ck, int32_t L, const std::vector<int32_t>& experts) {
  uint64_t total = 0;
  for (int32_t e : experts) {
    bool fused = false;
    for (ep_moe_weight_t w : {EP_MOE_WEIGHT_EXPERT_GATE_UP, EP_MOE_WEIGHT_EXPERT_GATE, EP_MOE_WEIGHT_EXPERT_UP,
                              EP_MOE_WEIGHT_EXPERT_DOWN}) {
      if (fused && (w == EP_MOE_WEIGHT_EXPERT_GATE || w == EP_MOE_WEIGHT_EXPERT_UP)) continue;  // read as gate_up
      io::Slice sl;
      if (!ck.locate(L, w, e, &sl)) continue;
      total += sl.bytes();
      fused = fused || w == EP_MOE_WEIGHT_EXPERT_GATE_UP;
    }
  }
  return total;
}

}  // namespace

uint64_t Layer::load(const io::Checkpoint& ck, int32_t L) { return load_parts(ck, L, LoadParts{}); }

uint64_t Layer::load_parts(const io::Checkpoint& ck, int32_t L, const LoadParts& parts) {
  const io::LayerShape s = ck.layer_shape(L);
  const char* fname = ck.file(0).name().c_str();
  auto mismatch = [&](const char* what, int64_t have, int64_t want) {
    fail(EP_MOE_ERR_INVALID_ARGUMENT, "%s layer %d has %s %lld, but the layer was configured with %lld", fname, L, what,
         static_cast<long long>(have), static_cast<long long>(want));
  };
  if (s.hidden != cfg_.hidden_size) mismatch("hidden size", s.hidden, cfg_.hidden_size);
  if (s.inter != cfg_.intermediate_size) mismatch("expert intermediate size", s.inter, cfg_.intermediate_size);
  if (s.experts != cfg_.num_experts) mismatch("experts", s.experts, cfg_.num_experts);
  if (cfg_.shared_intermediate_size > 0 && s.shared_inter != cfg_.shared_intermediate_size)
    mismatch("shared-expert intermediate size", s.shared_inter, cfg_.shared_intermediate_size);

  Reader rd(ck);
  // Progress (at INFO): what this rank will read of its experts, then at
  // most a line every kProgressSeconds.
  constexpr double kProgressSeconds = 0.5;
  std::vector<int32_t> todo;
  for (int32_t e = 0; e < cfg_.num_experts; ++e)
    if (wants(EP_MOE_WEIGHT_EXPERT_DOWN, e) && (parts.experts.empty() || parts.experts[static_cast<size_t>(e)]))
      todo.push_back(e);
  const uint64_t expert_total = log_enabled(EP_MOE_LOG_INFO) ? expert_bytes(ck, L, todo) : 0;
  if (!todo.empty())
    log(EP_MOE_LOG_INFO, "[EP rank %d/%d] loading layer %d from %s: %zu experts, %llu bytes of expert weights",
        map_.ep_rank(), map_.ep_size(), L, fname, todo.size(), static_cast<unsigned long long>(expert_total));
  auto last_report = std::chrono::steady_clock::now();
  auto need = [&](ep_moe_weight_t which, int32_t e, io::Slice* sl) {
    if (!ck.locate(L, which, e, sl))
      fail(EP_MOE_ERR_NOT_FOUND, "%s layer %d has no %s%s", fname, L, weight_name(which),
           e >= 0 ? format(" for expert %d", e).c_str() : "");
  };
  auto put = [&](ep_moe_weight_t which, int32_t e, const Loaded& ld, bool shard_relative) {
    Source src{ld.buf.data(), ld.dtype, ld.cols};
    src.transposed = ld.transposed;
    store(which, e, src, shard_relative);
  };

  // Routed experts: only those with a slot on this rank.
  for (size_t done = 0; done < todo.size(); ++done) {
    const int32_t e = todo[done];
    const auto now = std::chrono::steady_clock::now();
    if (done > 0 && std::chrono::duration<double>(now - last_report).count() >= kProgressSeconds &&
        log_enabled(EP_MOE_LOG_INFO)) {
      log(EP_MOE_LOG_INFO, "[EP rank %d/%d] layer %d: %zu of %zu experts, %llu of %llu bytes", map_.ep_rank(),
          map_.ep_size(), L, done, todo.size(), static_cast<unsigned long long>(rd.bytes()),
          static_cast<unsigned long long>(expert_total));
      last_report = now;
    }
    io::Slice sl;
    if (ck.locate(L, EP_MOE_WEIGHT_EXPERT_GATE_UP, e, &sl)) {
      Loaded ld = rd.read(sl, 0, sl.rows, 0, sl.cols);
      if (s.gate_up_interleaved) deinterleave(ld, sl.rows, ld.transposed);
      put(EP_MOE_WEIGHT_EXPERT_GATE_UP, e, ld, false);
    } else {
      for (ep_moe_weight_t w : {EP_MOE_WEIGHT_EXPERT_GATE, EP_MOE_WEIGHT_EXPERT_UP}) {
        need(w, e, &sl);
        put(w, e, rd.read(sl, 0, sl.rows, 0, sl.cols), false);
      }
    }
    need(EP_MOE_WEIGHT_EXPERT_DOWN, e, &sl);
    put(EP_MOE_WEIGHT_EXPERT_DOWN, e, rd.read(sl, 0, sl.rows, 0, sl.cols), false);
    if (s.expert_bias) {
      if (ck.locate(L, EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS, e, &sl)) {
        Loaded ld = rd.read(sl, 0, 1, 0, sl.cols);
        if (s.gate_up_interleaved) deinterleave(ld, sl.cols, true);
        put(EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS, e, ld, false);
      } else {
        for (ep_moe_weight_t w : {EP_MOE_WEIGHT_EXPERT_GATE_BIAS, EP_MOE_WEIGHT_EXPERT_UP_BIAS}) {
          need(w, e, &sl);
          put(w, e, rd.read(sl, 0, 1, 0, sl.cols), false);
        }
      }
      need(EP_MOE_WEIGHT_EXPERT_DOWN_BIAS, e, &sl);
      put(EP_MOE_WEIGHT_EXPERT_DOWN_BIAS, e, rd.read(sl, 0, 1, 0, sl.cols), false);
    }
  }

  io::Slice sl;
  if (parts.others && ck.locate(L, EP_MOE_WEIGHT_ROUTER, -1, &sl))
    put(EP_MOE_WEIGHT_ROUTER, -1, rd.read(sl, 0, sl.rows, 0, sl.cols), false);
  if (parts.others && ck.locate(L, EP_MOE_WEIGHT_ROUTER_BIAS, -1, &sl))
    put(EP_MOE_WEIGHT_ROUTER_BIAS, -1, rd.read(sl, 0, 1, 0, sl.cols), false);
  if (parts.others && cfg_.use_score_bias) {
    need(EP_MOE_WEIGHT_SCORE_BIAS, -1, &sl);
    put(EP_MOE_WEIGHT_SCORE_BIAS, -1, rd.read(sl, 0, 1, 0, sl.cols), false);
  }
  if (parts.shared && cfg_.shared_intermediate_size > 0) {
    // Only this rank's shard: gate/up rows and down columns.
    for (ep_moe_weight_t w : {EP_MOE_WEIGHT_SHARED_GATE, EP_MOE_WEIGHT_SHARED_UP, EP_MOE_WEIGHT_SHARED_DOWN}) {
      need(w, -1, &sl);
      if (shared_count_ == 0) continue;
      const bool down = w == EP_MOE_WEIGHT_SHARED_DOWN;
      const Loaded ld = down ? rd.read(sl, 0, sl.rows, shared_begin_, shared_count_)
                             : rd.read(sl, shared_begin_, shared_count_, 0, sl.cols);
      put(w, -1, ld, true);
    }
  }
  if (parts.others && cfg_.shared_intermediate_size > 0) {
    if (cfg_.shared_expert_gate) {
      need(EP_MOE_WEIGHT_SHARED_EXPERT_GATE, -1, &sl);
      put(EP_MOE_WEIGHT_SHARED_EXPERT_GATE, -1, rd.read(sl, 0, 1, 0, sl.cols), false);
    }
  }
  bytes_loaded_ += rd.bytes();
  log(EP_MOE_LOG_INFO, "[EP rank %d/%d] loaded layer %d from %s: %llu bytes", map_.ep_rank(), map_.ep_size(), L, fname,
      static_cast<unsigned long long>(rd.bytes()));
  return rd.bytes();
}

}  // namespace ep_moe
