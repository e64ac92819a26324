// ep_moe_bench's forwards: batches of tokens cycled through a layer, one
// timed forward, and two layers alternated in rounds so that the
// machine's drift cancels in their ratio.
#pragma once

#include <cstdint>
#include <vector>

#include "ep_moe/ep_moe.h"
#include "presets.hpp"
#include "report.hpp"

namespace bench_feed {

// Several different batches of T tokens, cycled, so that decode rows touch
// different experts each call and the cache cannot keep the same weights hot.
struct Batches {
  std::vector<std::vector<uint8_t>> hidden;
  std::vector<std::vector<float>> logits;
};
Batches make_batches(const presets::Model& m, int T, ep_moe_dtype_t dt);

// A token count's batches with an output buffer and the forward's
// arguments for them (a.hidden and a.router_logits set per forward).
struct Feed {
  Batches batches;
  std::vector<uint8_t> out;
  ep_moe_forward_args_t a;
  Feed(const presets::Model& m, int T, ep_moe_dtype_t dt)
      : batches(make_batches(m, T, dt)), out(batches.hidden[0].size()) {
    ep_moe_forward_args_init(&a);
    a.num_tokens = T;
    a.out = out.data();
  }
  Feed(const Feed&) = delete;  // a.out points into out
  Feed& operator=(const Feed&) = delete;
};

// One forward of batch it % sets into `a` (a.out set by the caller); its
// wall seconds and the layer's expert nanoseconds. False: the forward
// failed (the layer's error printed).
bool forward_batch(ep_moe_layer_t* layer, ep_moe_forward_args_t& a, const Batches& b, int it, double* wall_s,
                   int64_t* expert_ns, int64_t* local_pairs = nullptr);

// `rounds` rounds of a block of forwards of layers[0] and of
// layers[1] in turn, at least block_s seconds each, who goes first
// alternating; each layer cycles its feed's batches from where it left off
// (the two may share one feed). Per round, the ratio of layers[num]'s mean
// expert (and forward) time to the other's: the same moments for both, so
// the machine's drift cancels. A round in which the other layer had no
// local pair (a large EP at a few tokens) has no ratio and is left out.
// False: a forward failed.
bool alternate(double block_s, int rounds, ep_moe_layer_t* const (&layers)[2], Feed* const (&feeds)[2], int num,
               bench_report::Alternated* q);

}  // namespace bench_feed
