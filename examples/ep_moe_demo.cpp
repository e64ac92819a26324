// ep_moe_demo: runs one MoE layer of a real model's shape on random weights
// (or one layer of a real checkpoint) across in-process expert-parallel
// ranks, checks the result against the same layer on a single rank, and
// reports tokens/s. Public API only.
//
//   ep_moe_demo [--model NAME] [--ep N] [--tokens T] [--dtype f32|bf16|f16|q4_k|...]
//               [--shared I] [--iters N] [--placement linear|round_robin]
//               [--checkpoint PATH [--layer L]] [--plan] [--list]
#include <algorithm>
#include <climits>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "cli.hpp"
#include "ep_moe/ep_moe.h"
#include "presets.hpp"

#if defined(EP_MOE_DEMO_MPI)
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string model = "qwen3-30b-a3b";
  int ep = 4, tokens = 64, iters = 3, shared = -1, redundant = 0;
  int hidden = 0, inter = 0, experts = 0, top_k = 0;  // overrides of the model's sizes
  int placement = EP_MOE_PLACEMENT_LINEAR;
  ep_moe_dtype_t dtype = EP_MOE_DTYPE_BF16;    // activations
  ep_moe_dtype_t weights = EP_MOE_DTYPE_BF16;  // weights (a block format: quantized by ep_moe)
  int down = -1;                               // the routed experts' down in another block format (-1: as the weights)
  bool plan = false;
  bool mpi = false;  // one rank per MPI process (run under mpirun)
  // --checkpoint: the layer's configuration and weights come from it, and
  // its router computes the logits when it has one.
  std::string checkpoint;
  int layer = -1;  // -1: the first MoE layer
  const presets::CheckpointLayer* ck = nullptr;
};

bool ok(ep_moe_status_t s, const char* what, const char* detail = nullptr) {
  if (s == EP_MOE_OK) return true;
  std::fprintf(stderr, "%s failed: %s: %s\n", what, ep_moe_status_string(s), detail ? detail : ep_moe_last_error());
  return false;
}

void log_to_stderr(ep_moe_log_level_t level, const char* msg, void*) {
  static const char* names[] = {"error", "warn", "info", "debug"};
  std::fprintf(stderr, "[ep_moe %s] %s\n", names[level], msg);
}

ep_moe_expert_map_t* make_map(const presets::Model& m, const Options& o, int ep, int rank) {
  ep_moe_expert_map_config_t c;
  ep_moe_expert_map_config_init(&c);
  c.ep_size = ep;
  c.ep_rank = rank;
  c.global_num_experts = m.experts;
  c.placement = o.placement;
  c.num_expert_group = m.groups;
  c.num_redundant_experts = o.redundant;
  ep_moe_expert_map_t* map = nullptr;
  return ok(ep_moe_expert_map_create(&map, &c), "ep_moe_expert_map_create") ? map : nullptr;
}

int print_plan(const presets::Model& m, const Options& o) {
  std::printf("%-5s %-8s %s\n", "rank", "experts", "local->global");
  for (int r = 0; r < o.ep; ++r) {
    ep_moe_expert_map_t* map = make_map(m, o, o.ep, r);
    if (!map) return 1;
    int32_t n = 0;
    ep_moe_expert_map_get_attr(&n, map, EP_MOE_MAP_ATTR_NUM_LOCAL_ROUTED);
    size_t need = 0;
    ep_moe_expert_map_describe(nullptr, 0, &need, map);
    std::string text(need + 1, '\0');
    ep_moe_expert_map_describe(&text[0], text.size(), nullptr, map);
    text.resize(need);
    if (text.size() > 90) text = text.substr(0, 87) + "...";
    std::printf("%-5d %-8d %s\n", r, n, text.c_str());
    ep_moe_expert_map_destroy(map);
  }
  return 0;
}

struct Run {
  std::vector<std::vector<uint8_t>> outs;  // per rank
  double seconds = 0;                      // median forward time
  double load_seconds = 0;
  std::string error;
};

// One rank: load its experts, then `iters` timed forward calls (after one
// warm-up) on the same tokens, each started together (barrier).
std::string rank_body(const presets::Model& m, const Options& o, ep_moe_comm_t* comm, int ep, int r, int shared,
                      const std::vector<uint8_t>& hidden, const std::vector<float>& logits, std::vector<uint8_t>* out,
                      std::vector<double>* times, double* load_seconds) {
  const auto t_load = Clock::now();
  std::string err;
  ep_moe_expert_map_t* map = make_map(m, o, ep, r);
  if (!map) {
    ep_moe_comm_abort(comm);
    return "map";
  }
  ep_moe_layer_config_t lc = presets::layer_config(m, shared, o.weights, o.dtype, o.tokens, 0);
  if (o.ck) {
    lc = o.ck->config;
    lc.act_dtype = o.dtype;
    lc.max_tokens = o.tokens;
  }
  ep_moe_layer_t* layer = nullptr;
  if (ep_moe_layer_create(&layer, &lc, map, comm, nullptr) != EP_MOE_OK) err = ep_moe_last_error();
  else if (o.ck && ep_moe_layer_load(layer, o.ck->ck, o.ck->layer) != EP_MOE_OK) err = ep_moe_layer_last_error(layer);
  else if (!o.ck) err = presets::load_random_weights(layer, map, m, shared, 2026, o.down);
  ep_moe_expert_map_destroy(map);
  if (!err.empty()) {
    ep_moe_comm_abort(comm);  // the others must not wait for us
    ep_moe_layer_destroy(layer);
    return err;
  }
  *load_seconds = std::chrono::duration<double>(Clock::now() - t_load).count();
  out->assign(hidden.size(), 0);
  ep_moe_forward_args_t a;
  ep_moe_forward_args_init(&a);
  a.num_tokens = o.tokens;
  a.hidden = hidden.data();
  a.router_logits = o.ck && o.ck->router ? nullptr : logits.data();  // the checkpoint's router computes them
  a.out = out->data();
  for (int it = 0; it <= o.iters; ++it) {
    if (ep_moe_comm_barrier(comm) != EP_MOE_OK) {
      err = ep_moe_comm_last_error(comm);
      break;
    }
    const auto t0 = Clock::now();
    if (ep_moe_layer_forward(layer, &a) != EP_MOE_OK) {
      err = ep_moe_layer_last_error(layer);
      break;
    }
    if (it > 0) times->push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  ep_moe_layer_destroy(layer);
  return err;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The layer on `ep` in-process ranks, one thread each.
Run run(const presets::Model& m, const Options& o, int ep, int shared, const std::vector<uint8_t>& hidden,
        const std::vector<float>& logits) {
  Run res;
  std::vector<ep_moe_comm_t*> comms(static_cast<size_t>(ep));
  if (!ok(ep_moe_comm_create_local(comms.data(), ep, nullptr), "ep_moe_comm_create_local")) {
    res.error = "comm";
    return res;
  }
  res.outs.resize(static_cast<size_t>(ep));
  std::vector<std::string> errors(static_cast<size_t>(ep));
  std::vector<std::vector<double>> times(static_cast<size_t>(ep));
  std::vector<double> load(static_cast<size_t>(ep), 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < ep; ++r)
    threads.emplace_back([&, r] {
      errors[static_cast<size_t>(r)] =
          rank_body(m, o, comms[static_cast<size_t>(r)], ep, r, shared, hidden, logits,
                    &res.outs[static_cast<size_t>(r)], &times[static_cast<size_t>(r)], &load[static_cast<size_t>(r)]);
    });
  for (auto& t : threads) t.join();
  for (auto* c : comms) ep_moe_comm_destroy(c);
  for (int r = 0; r < ep; ++r)
    if (!errors[static_cast<size_t>(r)].empty()) {
      res.error = "rank " + std::to_string(r) + ": " + errors[static_cast<size_t>(r)];
      return res;
    }
  res.seconds = median(times[0]);
  res.load_seconds = *std::max_element(load.begin(), load.end());
  return res;
}

double max_rel_error(const std::vector<uint8_t>& got_b, const std::vector<uint8_t>& want_b, ep_moe_dtype_t dt) {
  const std::vector<float> got = presets::decode(got_b, dt), want = presets::decode(want_b, dt);
  double scale = 1e-30, worst = 0;
  for (float v : want) scale = std::max(scale, static_cast<double>(std::fabs(v)));
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, static_cast<double>(std::fabs(got[i] - want[i])) / scale);
  return worst;
}

double tolerance(ep_moe_dtype_t dt) { return dt == EP_MOE_DTYPE_F32 ? 1e-4 : dt == EP_MOE_DTYPE_F16 ? 5e-3 : 1e-2; }

void report(const Options& o, const char* label, double seconds, double load_seconds, const Run& one, double worst,
            double tol) {
  std::printf("\n%-22s %12s %12s %14s\n", "", "forward ms", "tokens/s", "weights load s");
  std::printf("%-22s %12.2f %12.1f %14.2f\n", label, seconds * 1e3, o.tokens / seconds, load_seconds);
  std::printf("%-22s %12.2f %12.1f %14.2f\n", "single rank", one.seconds * 1e3, o.tokens / one.seconds,
              one.load_seconds);
  std::printf("\nmax |EP - single rank| / max |single rank| = %.3g (tolerance %.0e): %s\n", worst, tol,
              worst <= tol ? "PASS" : "FAIL");
  std::printf("(this machine has %u hardware threads; the ranks share them)\n", std::thread::hardware_concurrency());
}

#if defined(EP_MOE_DEMO_MPI)
// Each MPI process is one rank; rank 0 also runs the single-rank reference.
int run_mpi(const presets::Model& m, const Options& o, int shared, const std::vector<uint8_t>& hidden,
            const std::vector<float>& logits) {
  int rank = 0, size = 1;  // MPI_Init ran in main
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm world = MPI_COMM_WORLD;
  ep_moe_comm_t* comm = nullptr;
  if (!ok(ep_moe_comm_create_mpi(&comm, &world, sizeof world, nullptr), "ep_moe_comm_create_mpi")) {
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  if (rank == 0) std::printf("\nrunning on %d MPI ranks...\n", size);
  std::vector<uint8_t> out;
  std::vector<double> times;
  double load = 0;
  const std::string err = rank_body(m, o, comm, size, rank, shared, hidden, logits, &out, &times, &load);
  int bad = err.empty() ? 0 : 1, any_bad = 0;
  if (bad) std::fprintf(stderr, "rank %d failed: %s\n", rank, err.c_str());
  MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  int rc = any_bad ? 1 : 0;
  if (!any_bad) {
    // Every rank's output equals rank 0's; rank 0's equals the single rank's.
    std::vector<uint8_t> first = out;
    MPI_Bcast(first.data(), static_cast<int>(first.size()), MPI_BYTE, 0, MPI_COMM_WORLD);
    const int differs = first == out ? 0 : 1;
    int n_differ = 0;
    MPI_Reduce(&differs, &n_differ, 1, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      std::printf("running the same layer on a single rank for reference...\n");
      const Run one = run(m, o, 1, shared, hidden, logits);
      if (!one.error.empty()) {
        std::fprintf(stderr, "single-rank run failed: %s\n", one.error.c_str());
        rc = 1;
      } else {
        const double worst = max_rel_error(out, one.outs[0], o.dtype), tol = tolerance(o.dtype);
        report(o, ("EP=" + std::to_string(size) + " MPI ranks").c_str(), median(times), load, one, worst, tol);
        if (n_differ) std::printf("%d rank(s) hold an output different from rank 0's: FAIL\n", n_differ);
        rc = worst <= tol && n_differ == 0 ? 0 : 1;
      }
    }
    MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
  }
  ep_moe_comm_destroy(comm);
  MPI_Finalize();
  return rc;
}
#endif

}  // namespace

// Reads the command line into `o`; -1 to go on, else the exit code (0 after
// --help or --list, 2 for a bad argument).
int parse_options(int argc, char** argv, Options* op) {
  Options& o = *op;
  bool list = false;
  cli::Parser args("ep_moe_demo [options]",
                   "Runs one MoE layer on in-process EP ranks (or MPI processes), checks it against one rank, and "
                   "reports tokens/s.");
  args.option("--model", &o.model, "model shape (--list shows them; default qwen3-30b-a3b)", "NAME")
      .option("--ep", &o.ep, "in-process expert-parallel ranks (default 4)", 1, 4096)
      .option("--tokens", &o.tokens, "tokens per forward (default 64)", 1, 1 << 20)
      .custom("--dtype", "D",
              "weights and activations: f32, bf16 (default) or f16; or weights in a block format (q8_0, "
              "q4_k, q2_k, iq2_xxs, ..., fp8: ep_moe_dtype_name's names) with bf16 activations; or two, "
              "gate/up+down (iq2_xxs+q3_k: DeepSeek-R1 UD-IQ2_XXS's layout)",
              [&o](const std::string& v, std::string* err) {
                if (!presets::parse_layout(v, &o.weights, &o.down)) {
                  *err = "takes " + presets::dtype_list(true) + ", or two block formats as gate_up+down";
                  return false;
                }
                o.dtype = o.weights <= EP_MOE_DTYPE_F16 ? o.weights : EP_MOE_DTYPE_BF16;
                return true;
              })
      .option("--shared", &o.shared, "shared-expert intermediate size (0 = none; default: the model's)", 0, 1 << 18)
      .option("--hidden", &o.hidden, "override the model's hidden size (0: the model's)", 0, 1 << 16)
      .option("--inter", &o.inter, "override the model's expert intermediate size (0: the model's)", 0, 1 << 18)
      .option("--experts", &o.experts, "override the model's number of experts (0: the model's)", 0, 1 << 20)
      .option("--topk", &o.top_k, "override the model's top-k (0: the model's)", 0, 1 << 20)
      .option("--redundant", &o.redundant, "redundant expert slots (replicas) in the map", 0, 1 << 20)
      .option("--iters", &o.iters, "timed forward calls (default 3)", 1, 1 << 20)
      .custom("--placement", "P", "linear (default) or round_robin",
              [&o](const std::string& v, std::string* err) {
                if (v == "linear") o.placement = EP_MOE_PLACEMENT_LINEAR;
                else if (v == "round_robin") o.placement = EP_MOE_PLACEMENT_ROUND_ROBIN;
                else *err = "unknown placement " + v;
                return err->empty();
              })
      .option("--checkpoint", &o.checkpoint, "a safetensors or GGUF checkpoint: its layer's shape, routing and weights",
              "PATH")
      .option("--layer", &o.layer, "with --checkpoint: the MoE layer (default: the first)", 0, INT_MAX)
      .flag("--plan", &o.plan, "only print which experts each rank owns")
      .flag("--mpi", &o.mpi, "one rank per MPI process: mpirun -np 4 ep_moe_demo --mpi")
      .flag("--list", &list, "list the model shapes");
  if (const int rc = args.parse(argc, argv); rc != cli::Parser::kRun) return rc;
  if (list) {
    for (const auto& m : presets::models()) std::printf("%-16s %s\n", m.name, m.note);
    return 0;
  }
#if !defined(EP_MOE_DEMO_MPI)
  if (o.mpi) {
    std::fprintf(stderr, "--mpi: this demo was built without MPI (install libopenmpi-dev and rebuild)\n");
    return 2;
  }
#endif
  return -1;
}

int main(int argc, char** argv) {
  Options o;
  if (const int rc = parse_options(argc, argv, &o); rc >= 0) return rc;
  const presets::Model* base = presets::find(o.model);
  if (!base) {
    std::fprintf(stderr, "unknown model %s (try --list)\n", o.model.c_str());
    return 2;
  }
  presets::Model custom = *base;
  presets::CheckpointLayer ckl;
  if (!o.checkpoint.empty()) {
    if (!presets::open_checkpoint_layer(o.checkpoint, o.layer, &ckl)) return 1;
    o.ck = &ckl;
    ckl.note = o.checkpoint + " layer " + std::to_string(ckl.layer) + " (" + ckl.arch +
               (ckl.router ? ", its router)" : ", random logits)");
    custom = ckl.model;
    custom.note = ckl.note.c_str();
    o.shared = custom.shared_intermediate;
  }
  if (o.hidden > 0) custom.hidden = o.hidden;
  if (o.inter > 0) custom.intermediate = o.inter;
  if (o.experts > 0) custom.experts = o.experts;
  if (o.top_k > 0) custom.top_k = o.top_k;
  if (custom.groups > 0 && custom.experts % custom.groups != 0) custom.groups = custom.topk_group = 0;
  const presets::Model* m = &custom;
  ep_moe_set_log_callback(log_to_stderr, EP_MOE_LOG_WARN, nullptr);
  const int shared = o.shared >= 0 ? o.shared : m->shared_intermediate;
  bool quiet = false;  // MPI ranks other than 0 print nothing
#if defined(EP_MOE_DEMO_MPI)
  if (o.mpi) {
    MPI_Init(&argc, &argv);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &o.ep);
    quiet = rank != 0;
  }
#endif
  if (!quiet) {
    std::printf("ep_moe %s demo: %s\n", ep_moe_version_string(), m->note);
    std::string wname = o.ck ? "the checkpoint's" : presets::dtype_name(o.weights);
    if (!o.ck && o.down >= 0)
      wname += std::string(" (down ") + presets::dtype_name(static_cast<ep_moe_dtype_t>(o.down)) + ")";
    std::printf("layer: H=%d I=%d E=%d top-%d, shared expert %d, %s weights, %s activations, EP=%d, %d tokens\n\n",
                m->hidden, m->intermediate, m->experts, m->top_k, shared, wname.c_str(), presets::dtype_name(o.dtype),
                o.ep, o.tokens);
    if (o.plan && !o.mpi) return print_plan(*m, o);
    print_plan(*m, o);
  }

  // Random tokens and router logits.
  std::vector<float> hid(static_cast<size_t>(o.tokens) * m->hidden), logits(static_cast<size_t>(o.tokens) * m->experts);
  presets::fill(hid, hid.size(), 7, 1, 1.0f);
  presets::fill(logits, logits.size(), 7, 2, 3.0f);
  const std::vector<uint8_t> hidden = presets::encode(hid, o.dtype);

#if defined(EP_MOE_DEMO_MPI)
  if (o.mpi) return run_mpi(*m, o, shared, hidden, logits);
#endif
  std::printf("\nrunning on %d in-process ranks...\n", o.ep);
  const Run ep_run = run(*m, o, o.ep, shared, hidden, logits);
  if (!ep_run.error.empty()) {
    std::fprintf(stderr, "EP run failed: %s\n", ep_run.error.c_str());
    return 1;
  }
  std::printf("running the same layer on a single rank for reference...\n");
  const Run one = run(*m, o, 1, shared, hidden, logits);
  if (!one.error.empty()) {
    std::fprintf(stderr, "single-rank run failed: %s\n", one.error.c_str());
    return 1;
  }
  // Every EP rank must hold the same output, equal to the single-rank one.
  double worst = 0;
  for (const auto& out : ep_run.outs) worst = std::max(worst, max_rel_error(out, one.outs[0], o.dtype));
  const double tol = tolerance(o.dtype);
  const bool pass = worst <= tol;
  report(o, ("EP=" + std::to_string(o.ep) + " in-process").c_str(), ep_run.seconds, ep_run.load_seconds, one, worst,
         tol);
  return pass ? 0 : 1;
}
