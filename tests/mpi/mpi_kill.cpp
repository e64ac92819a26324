// Run under mpirun: every rank loops forward steps; rank 1 kills itself
// (SIGKILL) before its 4th step. The survivors must not hang: mpirun ends
// the job, and ep_moe's timeout (5 s) is the backstop. Never exits 0.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <signal.h>

#include <cstdio>
#include <vector>

#include "ep_moe/ep_moe.h"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm w = MPI_COMM_WORLD;
  ep_moe_comm_config_t cc;
  ep_moe_comm_config_init(&cc);
  cc.timeout_ms = 5000;
  ep_moe_comm_t* comm = nullptr;
  if (ep_moe_comm_create_mpi(&comm, &w, sizeof w, &cc) != EP_MOE_OK) return 2;
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.ep_size = size;
  mc.ep_rank = rank;
  mc.global_num_experts = 8;
  ep_moe_expert_map_t* map = nullptr;
  ep_moe_expert_map_create(&map, &mc);
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  lc.hidden_size = 32;
  lc.intermediate_size = 16;
  lc.num_experts = 8;
  lc.top_k = 2;
  lc.max_tokens = 4;
  lc.num_threads = 1;
  ep_moe_layer_t* layer = nullptr;
  if (ep_moe_layer_create(&layer, &lc, map, comm, nullptr) != EP_MOE_OK) return 2;
  std::vector<float> wgt(32 * 16, 0.01f);
  for (int e = 0; e < 8; ++e) {
    ep_moe_layer_set_weight(nullptr, layer, EP_MOE_WEIGHT_EXPERT_GATE, e, wgt.data(), EP_MOE_DTYPE_F32, 16, 32);
    ep_moe_layer_set_weight(nullptr, layer, EP_MOE_WEIGHT_EXPERT_UP, e, wgt.data(), EP_MOE_DTYPE_F32, 16, 32);
    ep_moe_layer_set_weight(nullptr, layer, EP_MOE_WEIGHT_EXPERT_DOWN, e, wgt.data(), EP_MOE_DTYPE_F32, 32, 16);
  }
  std::vector<float> x(4 * 32, 0.5f), logits(4 * 8, 0.0f), out(4 * 32);
  for (int i = 0; i < 4 * 8; ++i) logits[static_cast<size_t>(i)] = static_cast<float>(i % 8);
  ep_moe_forward_args_t a;
  ep_moe_forward_args_init(&a);
  a.num_tokens = 4;
  a.hidden = x.data();
  a.router_logits = logits.data();
  a.out = out.data();
  for (int step = 0; step < 1000; ++step) {
    if (rank == 1 && step == 3) raise(SIGKILL);
    const ep_moe_status_t s = ep_moe_layer_forward(layer, &a);
    if (s != EP_MOE_OK) {
      std::fprintf(stderr, "[rank %d] step %d: %s: %s\n", rank, step, ep_moe_status_string(s),
                   ep_moe_layer_last_error(layer));
      return 3;  // no MPI_Finalize: a peer is gone
    }
  }
  MPI_Finalize();
  return 4;  // unreachable in a passing run: rank 1 never finishes
}
