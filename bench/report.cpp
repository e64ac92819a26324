// ep_moe_bench's parts that stand alone (report.hpp).
#include "report.hpp"

#include <chrono>
#include <cstdio>
#include <thread>

#include "machine_peaks.hpp"

namespace bench_report {

// The all-to-all flow of `model` on `ranks` in-process ranks of one thread
// each, T tokens per rank: each rank's permutation and combine rates from
// the layer's phase attributes (means over the timed forwards), then
// memcpy of the same bytes per rank by `ranks` concurrent threads. The
// experts are shrunk (intermediate 16, no shared expert): neither phase
// depends on them. Returns "" or the error.
std::string run_dispatch(const presets::Model& model, int ranks, int T, ep_moe_dtype_t dt, double min_time,
                         DispatchRow* row) {
  presets::Model m = model;
  m.intermediate = 16;
  m.shared_intermediate = 0;
  std::vector<ep_moe_comm_t*> comms(static_cast<size_t>(ranks), nullptr);
  if (ep_moe_comm_create_local(comms.data(), ranks, nullptr) != EP_MOE_OK) return ep_moe_last_error();
  const int iters = T >= 4096 ? 6 : T <= 64 ? 1000 : 24;  // the same on every rank: forward is collective
  std::vector<std::string> errs(static_cast<size_t>(ranks));
  // Per rank: the bytes of every timed forward (the same input each time),
  // and each forward's permutation, combine and wall times.
  std::vector<double> perm_b(static_cast<size_t>(ranks)), comb_b(perm_b);
  std::vector<std::vector<double>> perm_ns(static_cast<size_t>(ranks)), comb_ns(perm_ns), fwd_ns(perm_ns);
  std::vector<std::thread> ts;
  for (int r = 0; r < ranks; ++r) {
    ts.emplace_back([&, r] {
      std::string& err = errs[static_cast<size_t>(r)];
      ep_moe_comm_t* comm = comms[static_cast<size_t>(r)];
      // A rank that cannot set up aborts the group, so its peers' first
      // collective fails instead of waiting for it.
      auto fail = [&](std::string e) {
        err = std::move(e);
        ep_moe_comm_abort(comm);
      };
      ep_moe_expert_map_t* map = presets::linear_map(ranks, r, m.experts);
      if (!map) return fail(ep_moe_last_error());
      ep_moe_layer_config_t lc = presets::layer_config(m, 0, dt, dt, T, 1);
      lc.dispatch_mode = EP_MOE_DISPATCH_ALLTOALL;
      ep_moe_layer_t* layer = nullptr;
      if (ep_moe_layer_create(&layer, &lc, map, comm, nullptr) != EP_MOE_OK) {
        fail(ep_moe_last_error());
        ep_moe_expert_map_destroy(map);
        return;
      }
      const std::string werr = presets::load_random_weights(layer, map, m, 0, 1);
      ep_moe_expert_map_destroy(map);
      if (!werr.empty()) fail(werr);
      std::vector<float> hid(static_cast<size_t>(T) * m.hidden), lg(static_cast<size_t>(T) * m.experts);
      presets::fill(hid, hid.size(), 21 + static_cast<uint64_t>(r), static_cast<uint64_t>(T), 1.0f);
      presets::fill(lg, lg.size(), 2000 + static_cast<uint64_t>(r), static_cast<uint64_t>(T), 3.0f);
      const std::vector<uint8_t> h = presets::encode(hid, dt);
      std::vector<uint8_t> out(h.size());
      ep_moe_forward_args_t a;
      ep_moe_forward_args_init(&a);
      a.num_tokens = T;
      a.hidden = h.data();
      a.router_logits = lg.data();
      a.out = out.data();
      for (int it = 0; it <= iters && err.empty(); ++it) {  // call 0 warms up
        const auto f0 = std::chrono::steady_clock::now();
        if (ep_moe_layer_forward(layer, &a) != EP_MOE_OK) {
          err = ep_moe_layer_last_error(layer);
          break;
        }
        if (it == 0) continue;
        fwd_ns[static_cast<size_t>(r)].push_back(
            std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - f0).count());
        int64_t v[4] = {0, 0, 0, 0};
        ep_moe_layer_get_attr(&v[0], layer, EP_MOE_LAYER_ATTR_LAST_PERMUTE_NS);
        ep_moe_layer_get_attr(&v[1], layer, EP_MOE_LAYER_ATTR_LAST_PERMUTE_BYTES);
        ep_moe_layer_get_attr(&v[2], layer, EP_MOE_LAYER_ATTR_LAST_COMBINE_NS);
        ep_moe_layer_get_attr(&v[3], layer, EP_MOE_LAYER_ATTR_LAST_COMBINE_BYTES);
        perm_ns[static_cast<size_t>(r)].push_back(static_cast<double>(v[0]));
        perm_b[static_cast<size_t>(r)] = static_cast<double>(v[1]);
        comb_ns[static_cast<size_t>(r)].push_back(static_cast<double>(v[2]));
        comb_b[static_cast<size_t>(r)] = static_cast<double>(v[3]);
      }
      ep_moe_layer_destroy(layer);
    });
  }
  for (auto& t : ts) t.join();
  for (auto* c : comms) ep_moe_comm_destroy(c);
  for (const auto& e : errs)
    if (!e.empty()) return e;
  // Medians over the forwards, then means over the ranks: a mean over
  // forwards lets one preemption of this VM's vCPU (milliseconds) outweigh
  // a thousand sub-microsecond phases.
  double pn = 0, pb = 0, cn = 0, cb = 0, fn = 0;
  for (int r = 0; r < ranks; ++r) {
    const auto ri = static_cast<size_t>(r);
    pn += median_of(perm_ns[ri]);
    cn += median_of(comb_ns[ri]);
    fn += median_of(fwd_ns[ri]);
    pb += perm_b[ri];
    cb += comb_b[ri];
  }
  row->preset = model.name;
  row->ranks = ranks;
  row->tokens = T;
  row->iters = iters;
  row->permute_gbs = pn > 0 ? pb / pn : 0;  // bytes per ns = GB/s
  row->combine_gbs = cn > 0 ? cb / cn : 0;
  row->permute_mb = pb / ranks / 1e6;
  row->combine_mb = cb / ranks / 1e6;
  row->forward_us = fn / ranks / 1e3;
  row->permute_base_gbs = bench::memcpy_gbs_per_thread(ranks, min_time, static_cast<size_t>(pb / ranks));
  row->combine_base_gbs = bench::memcpy_gbs_per_thread(ranks, min_time, static_cast<size_t>(cb / ranks));
  return "";
}

bool write_json(const std::string& path, const std::vector<std::string>& labels, const JsonMachine& m,
                const std::vector<Row>& rows, const std::vector<RatioRow>& ratios,
                const std::vector<DtypeRatio>& dratios, const std::vector<DispatchRow>& drows) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return false;
  std::string dts;
  for (const std::string& l : labels) dts += std::string(dts.empty() ? "\"" : ", \"") + l + "\"";
  std::fprintf(f, "{\n  \"ep_moe_version\": \"%s\",\n  \"dtypes\": [%s],\n", ep_moe_version_string(), dts.c_str());
  std::fprintf(f,
               "  \"machine\": {\"cpu\": \"%s\", \"threads\": %d, \"fma_isa\": \"%s\", \"fma_peak_gflops\": %.3f, "
               "\"bf16_dot_peak_gflops\": %.3f, \"int8_dot_peak_gops\": %.3f, \"int8_maddubs_peak_gops\": %.3f, "
               "\"read_bandwidth_gbs\": %.3f, "
               "\"layer_kernels\": \"%s\"},\n"
               "  \"results\": [\n",
               m.cpu.c_str(), m.threads, m.fma_isa, m.fma_peak, m.dot_peak, m.int8_peak, m.maddubs_peak, m.bw,
               m.layer_kernels);
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::fprintf(f,
                 "    {\"preset\": \"%s\", \"dtype\": \"%s\", \"ep\": %d, \"tokens\": %d, \"strategy\": \"%s\", "
                 "\"threads\": %d, "
                 "\"iters\": %d, \"ms\": %.6f, \"expert_ms\": %.6f, \"tokens_per_s\": %.3f, \"gflops\": %.3f, "
                 "\"gflops_frac_peak\": "
                 "%.5f, \"peak\": \"%s\", \"row_peak_gflops\": %.3f, \"peak_before_gflops\": %.3f, "
                 "\"peak_after_gflops\": %.3f, "
                 "\"weight_gbs\": %.3f, \"row_read_bandwidth_gbs\": %.3f, \"weight_frac_bw\": %.5f, "
                 "\"bw_before_gbs\": %.3f, \"bw_after_gbs\": %.3f, \"bw_steady\": %s, \"attempts\": %d, "
                 "\"bound\": \"%s\", \"roofline_frac\": %.5f, \"local_pairs\": %lld, \"active_experts\": %lld}%s\n",
                 r.preset.c_str(), r.dtype.c_str(), r.ep, r.tokens, r.strategy.c_str(), r.threads, r.iters, r.ms,
                 r.expert_ms, r.tokens_per_s, r.gflops, r.gflops_frac, r.peak_kind.c_str(), r.row_peak, r.peak_before,
                 r.peak_after, r.weight_gbs, r.row_bw, r.weight_frac, r.bw_before, r.bw_after,
                 r.bw_steady ? "true" : "false", r.attempts, r.compute_bound() ? "compute" : "bandwidth",
                 r.roofline_frac(), static_cast<long long>(r.local_pairs), static_cast<long long>(r.active_experts),
                 i + 1 < rows.size() ? "," : "");
  }
  std::fprintf(f, "  ],\n  \"strategy_ratios\": [\n");
  for (size_t i = 0; i < ratios.size(); ++i) {
    const RatioRow& q = ratios[i];
    std::fprintf(f,
                 "    {\"preset\": \"%s\", \"ep\": %d, \"tokens\": %d, \"rows_expert_ratio\": %.4f, "
                 "\"rows_forward_ratio\": %.4f, \"rounds\": %d, \"alternated_expert_ratio\": %.4f, "
                 "\"alternated_expert_ratio_min\": %.4f, \"alternated_expert_ratio_max\": %.4f, "
                 "\"alternated_forward_ratio\": %.4f, \"roofline_work_ratio\": %.4f}%s\n",
                 q.preset.c_str(), q.ep, q.tokens, q.rows_expert, q.rows_forward, q.rounds, q.expert, q.expert_min,
                 q.expert_max, q.forward, q.work, i + 1 < ratios.size() ? "," : "");
  }
  std::fprintf(f, "  ],\n  \"dtype_ratios\": [\n");
  for (size_t i = 0; i < dratios.size(); ++i) {
    const DtypeRatio& q = dratios[i];
    std::fprintf(f,
                 "    {\"preset\": \"%s\", \"tokens\": %d, \"dtype\": \"%s\", \"baseline\": \"%s\", \"rounds\": %d, "
                 "\"alternated_expert_speedup\": %.4f, \"alternated_expert_speedup_min\": %.4f, "
                 "\"alternated_expert_speedup_max\": %.4f, \"alternated_forward_speedup\": %.4f, "
                 "\"weight_bytes_ratio\": %.4f, \"alternated_weight_gbs_ratio\": %.4f}%s\n",
                 q.preset.c_str(), q.tokens, q.dtype.c_str(), q.base.c_str(), q.rounds, q.expert, q.expert_min,
                 q.expert_max, q.forward, q.bytes, q.stream, i + 1 < dratios.size() ? "," : "");
  }
  std::fprintf(f, "  ],\n  \"dispatch\": [\n");
  for (size_t i = 0; i < drows.size(); ++i) {
    const DispatchRow& d = drows[i];
    std::fprintf(f,
                 "    {\"preset\": \"%s\", \"ranks\": %d, \"tokens\": %d, \"iters\": %d, \"permute_mb\": %.4f, "
                 "\"permute_gbs\": %.3f, \"permute_memcpy_gbs\": %.3f, \"combine_mb\": %.4f, \"combine_gbs\": %.3f, "
                 "\"combine_memcpy_gbs\": %.3f, \"memcpy_from_memory_gbs\": %.3f, \"forward_us\": %.3f}%s\n",
                 d.preset.c_str(), d.ranks, d.tokens, d.iters, d.permute_mb, d.permute_gbs, d.permute_base_gbs,
                 d.combine_mb, d.combine_gbs, d.combine_base_gbs, d.memory_gbs, d.forward_us,
                 i + 1 < drows.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
  return std::fclose(f) == 0;
}

}  // namespace bench_report
