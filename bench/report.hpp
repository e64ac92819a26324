// ep_moe_bench's rows and the parts of it that stand alone: the
// permutation / combine part (run_dispatch) and the JSON report.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "ep_moe/ep_moe.h"
#include "presets.hpp"

namespace bench_report {

struct Row {
  std::string preset, strategy, dtype;
  int ep = 0, tokens = 0, threads = 0, iters = 0;
  double ms = 0, expert_ms = 0, tokens_per_s = 0, gflops = 0, gflops_frac = 0, weight_gbs = 0, weight_frac = 0;
  double row_bw = 0;                   // the read bandwidth weight_frac is against
  double bw_before = 0, bw_after = 0;  // the probes around a streaming row (0: not probed)
  bool bw_steady = true;               // the two probes within kBwJump of each other
  int attempts = 1;
  std::string peak_kind;
  double row_peak = 0;                     // the GFLOP/s gflops_frac is against
  double peak_before = 0, peak_after = 0;  // the peaks around a compute row (0: not measured)
  // The roofline: the row's time can be no lower than the larger of
  // bytes / row_bw and flops / row_peak, so its fraction of that bound is
  // the larger of weight_frac and gflops_frac, and the larger one names
  // what binds (on AVX2, widened bf16 at 8 rows per expert is bound by
  // arithmetic, not bandwidth).
  bool compute_bound() const { return gflops_frac > weight_frac; }
  double roofline_frac() const { return compute_bound() ? gflops_frac : weight_frac; }
  int64_t local_pairs = 0, active_experts = 0;
  double flops = 0, weight_bytes = 0;  // per forward, means over the batches (the columns' numerators)
  // The row's least time by the roofline at a given bandwidth and peak.
  double roofline_s(double bw_gbs, double peak_gflops) const {
    return std::max(weight_bytes / (bw_gbs * 1e9), flops / (peak_gflops * 1e9));
  }
};

// Two layers alternated: rounds of a block of forwards of each in turn,
// the ratio of each round's mean expert (and forward) times; the median
// over the rounds, with the range (0: not run).
struct Alternated {
  int rounds = 0;
  double expert = 0, expert_min = 0, expert_max = 0, forward = 0;
};

// The weight-0 / skip comparison of one preset and token count: from the
// two rows (run one after the other, seconds to minutes apart on this VM),
// and alternated (weight-0 over skip).
struct RatioRow : Alternated {
  std::string preset;
  int ep = 0, tokens = 0;
  double rows_expert = 0, rows_forward = 0;  // weight-0 row / skip row
  // The ratio the two rows' work gives: the weight-0 row's roofline time
  // over the skip row's, both at the skip row's bandwidth and peak; the
  // expert-time ratio when both rows run at the same fraction of their
  // roofline. Work both strategies do (a shared expert; at decode, the
  // local experts weight-0 streams, not all it routes) keeps it low; a
  // target above it asks the skip row to run its smaller work that much
  // nearer its roofline than the weight-0 row runs its larger work.
  double work = 0;
};

// One dtype against the baseline dtype, alternated (ratios of the
// baseline's time to this dtype's: above 1, this dtype is faster).
struct DtypeRatio : Alternated {
  std::string preset, dtype, base;
  int tokens = 0;
  // Where both dtypes' rows at these tokens are bound by the bandwidth:
  // the dtype's weight bytes per forward over the baseline's (from the
  // rows), and its weight GB/s over the baseline's in the alternated
  // rounds (expert speedup times that bytes ratio), a drift-free measure of
  // how well its kernels stream next to the baseline's. 0: not both bw.
  double bytes = 0, stream = 0;
};

struct DispatchRow {
  std::string preset;
  int ranks = 0, tokens = 0, iters = 0;
  double permute_mb = 0, permute_gbs = 0, permute_base_gbs = 0;  // per rank and forward
  double combine_mb = 0, combine_gbs = 0, combine_base_gbs = 0;
  double memory_gbs = 0;  // memcpy from memory (128 MiB buffers), per thread, same run
  double forward_us = 0;  // wall time of one forward, collectives included (median over forwards, mean over ranks)
};

inline double median_of(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The all-to-all flow of `model` on `ranks` in-process ranks (report.cpp).
std::string run_dispatch(const presets::Model& model, int ranks, int T, ep_moe_dtype_t dt, double min_time,
                         DispatchRow* row);

// What the JSON says of the machine.
struct JsonMachine {
  std::string cpu;
  int threads;
  const char* fma_isa;
  double fma_peak, dot_peak, int8_peak, maddubs_peak, bw;
  const char* layer_kernels;
};

// The results as JSON at `path` (labels: the variants, first the
// baseline); false when it cannot be written.
bool write_json(const std::string& path, const std::vector<std::string>& labels, const JsonMachine& m,
                const std::vector<Row>& rows, const std::vector<RatioRow>& ratios,
                const std::vector<DtypeRatio>& dratios, const std::vector<DispatchRow>& drows);

}  // namespace bench_report
