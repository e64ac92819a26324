#!/usr/bin/env python3
"""Writes one small MoE checkpoint per architecture, the way its own tools
lay it out (tensor names, the fused 3-D expert layout of transformers 5,
config.json with only the keys its config class writes; GGUF through the
`gguf` package's writer), plus the output of that architecture's published
MoE block on random tokens, computed here in float64 numpy. arch_test.cpp
loads each through ep_moe's C API and compares.

The blocks below follow the architectures' code (transformers' modeling
files; llama.cpp's graphs for GGUF): routing (softmax or sigmoid, grouped
top-k, score-correction bias, renormalisation, routed scaling), shared
experts and their gate. Each case also names the mutations of the derived
layer config (another scoring, no renormalisation, ...) that must change
the output, so a test that passes with the wrong semantics fails.

usage: arch_checkpoints.py OUT_DIR [SEED]; exit 77 without numpy/safetensors/gguf.
"""
import json
import os
import sys

try:
    import numpy as np
    import safetensors.numpy
    import gguf
except ImportError as e:  # pragma: no cover
    print(f"skipped: the reference writers are not installed ({e})")
    sys.exit(77)

out = sys.argv[1]
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
rng = np.random.default_rng(seed)
H, I, T, L = 64, 32, 64, 1
os.makedirs(out, exist_ok=True)
cases = []


def normal(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def silu(x):
    return x / (1.0 + np.exp(-x))


def mlp(x, g, u, d):
    """An expert: down(silu(gate x) * up x), float64."""
    return (silu(x @ g.T.astype(np.float64)) * (x @ u.T.astype(np.float64))) @ d.T.astype(np.float64)


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def topk(v, k):
    """Indices of the k largest, and whether the choice has a clear margin
    (the library picks in f32: a near-tie could go either way)."""
    order = np.argsort(-v, kind="stable")
    margin = v[order[k - 1]] - v[order[k]] if k < len(v) else 1.0
    return order[:k], margin > 1e-4 * max(1.0, abs(v[order[k - 1]]))


class Experts:
    def __init__(self, E, inter=I, shared=0):
        self.E = E
        self.gate = normal(E, inter, H, scale=H ** -0.5)
        self.up = normal(E, inter, H, scale=H ** -0.5)
        self.down = normal(E, H, inter, scale=inter ** -0.5)
        self.router = normal(E, H, scale=2 * H ** -0.5)
        if shared:
            self.sg = normal(shared, H, scale=H ** -0.5)
            self.su = normal(shared, H, scale=H ** -0.5)
            self.sd = normal(H, shared, scale=shared ** -0.5)

    def routed(self, x, ids, w):
        return sum(wt * mlp(x, self.gate[e], self.up[e], self.down[e]) for e, wt in zip(ids, w))

    def shared(self, x):
        return mlp(x, self.sg, self.su, self.sd)


# --- the published blocks, one token at a time (x: float64 [H]) ------------
def softmax_topk(logits, K, norm):
    """Qwen2/3-MoE, OLMoE (norm_topk_prob), Mixtral (always): softmax, top-k,
    optionally renormalised."""
    p = softmax(logits)
    ids, ok = topk(p, K)
    w = p[ids]
    if norm:
        w = w / w.sum()
    return ids, w, ok


def deepseek_v2(logits, K, scale, method, n_group=0, topk_group=0):
    """transformers' DeepseekV2Moe: softmax; greedy or group_limited_greedy
    (a group scores its best expert); never renormalised; scaled."""
    p = softmax(logits)
    ok = True
    if method == "group_limited_greedy":
        gs = p.reshape(n_group, -1).max(axis=1)
        gid, ok = topk(gs, topk_group)
        mask = np.zeros(n_group, bool)
        mask[gid] = True
        p_sel = np.where(np.repeat(mask, len(p) // n_group), p, 0.0)
    else:
        p_sel = p
    ids, ok2 = topk(p_sel, K)
    return ids, p[ids] * scale, ok and ok2


def noaux_tc(logits, bias, K, n_group, topk_group, norm, scale):
    """DeepSeek-V3 / GLM-4.5 (transformers' route_tokens_to_experts):
    sigmoid scores, chosen with the bias added, groups scored by their two
    best, the weights the unbiased scores, renormalised (+1e-20), scaled."""
    s = sigmoid(logits)
    sc = s + bias
    ok = True
    if n_group > 1:
        gs = np.sort(sc.reshape(n_group, -1), axis=1)[:, -2:].sum(axis=1)
        gid, ok = topk(gs, topk_group)
        mask = np.zeros(n_group, bool)
        mask[gid] = True
        sc = np.where(np.repeat(mask, len(s) // n_group), sc, 0.0)
    ids, ok2 = topk(sc, K)
    w = s[ids]
    if norm:
        w = w / (w.sum() + 1e-20)
    return ids, w * scale, ok and ok2


def tokens(ex, route, extra=None):
    """T tokens with a clear routing margin, and the block's output."""
    xs, ys = [], []
    while len(xs) < T:
        x = rng.standard_normal(H).astype(np.float32)
        xd = x.astype(np.float64)
        ids, w, ok = route(xd @ ex.router.T.astype(np.float64))
        if not ok:
            continue
        y = ex.routed(xd, ids, w)
        if extra is not None:
            y = y + extra(xd)
        xs.append(x)
        ys.append(y)
    return np.stack(xs), np.stack(ys)


def fused(ex):
    """transformers 5's layout: gate_up_proj [E, 2I, H] (gate rows, then up),
    down_proj [E, H, I]."""
    return np.concatenate([ex.gate, ex.up], axis=1), ex.down


def save_case(name, tensors, config, x, y, arch, mutations, layer=L):
    d = f"{out}/{name}"
    os.makedirs(d, exist_ok=True)
    if tensors is not None:
        tensors["model.embed_tokens.weight"] = normal(8, H)
        safetensors.numpy.save_file(tensors, f"{d}/model.safetensors", metadata={"format": "pt"})
        with open(f"{d}/config.json", "w") as f:
            json.dump(config, f)
    x.astype("<f4").tofile(f"{d}/hidden.f32")
    y.astype("<f8").tofile(f"{d}/expect.f64")
    cases.append(f"{name} ok {name} {layer} {H} {T} {arch} {','.join(mutations) or '-'} -")


def refuse_case(name, tensors, config, needle, layer=L, kind="refuse"):
    d = f"{out}/{name}"
    os.makedirs(d, exist_ok=True)
    safetensors.numpy.save_file(tensors, f"{d}/model.safetensors", metadata={"format": "pt"})
    with open(f"{d}/config.json", "w") as f:
        json.dump(config, f)
    cases.append(f"{name} {kind} {name} {layer} {H} {T} {config.get('model_type', '-')} - {needle}")


def hf_common(E, K, **kw):
    c = {"hidden_size": H, "num_hidden_layers": L + 1, "num_experts_per_tok": K, "hidden_act": "silu"}
    c.update(kw)
    return c


def gguf_case(name, arch, ex, K, meta, extra, x, y, mutations, per_expert=False, split_max_tensors=0, before=None):
    """A GGUF file from the gguf package's writer: the routed experts as
    3-D tensors (`per_expert`: the pre-2024 blk.L.ffn_gate.E.weight names),
    `meta(writer)` for the architecture's keys, `extra` more tensors of
    layer L by name, `before` tensors of layer 0 (written first).
    `split_max_tensors` > 0 splits the file as llama.cpp's gguf-split does
    (name-00001-of-0000N.gguf); the case then names the first split."""
    d = f"{out}/{name}"
    os.makedirs(d, exist_ok=True)
    w = gguf.GGUFWriter(f"{d}/model.gguf", arch, split_max_tensors=split_max_tensors)
    w.add_block_count(L + 1)
    w.add_embedding_length(H)
    w.add_expert_count(ex.E)
    w.add_expert_used_count(K)
    meta(w)
    for n, t in (before or {}).items():
        w.add_tensor(f"blk.0.{n}", t)
    tensors = {"ffn_gate_inp.weight": ex.router}
    if per_expert:
        for e in range(ex.E):
            tensors[f"ffn_gate.{e}.weight"] = ex.gate[e]
            tensors[f"ffn_up.{e}.weight"] = ex.up[e]
            tensors[f"ffn_down.{e}.weight"] = ex.down[e]
    else:
        tensors.update({"ffn_gate_exps.weight": ex.gate, "ffn_up_exps.weight": ex.up, "ffn_down_exps.weight": ex.down})
    tensors.update(extra)
    for n, t in tensors.items():
        w.add_tensor(f"blk.{L}.{n}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    files = sorted(f for f in os.listdir(d) if f.endswith(".gguf"))
    if split_max_tensors and len(files) < 2:
        sys.exit(f"{name}: the writer did not split the file ({files})")
    save_case(name, None, None, x, y, arch, mutations)
    cases[-1] = cases[-1].replace(f" {name} {L} ", f" {name}/{files[0]} {L} ")


p = f"model.layers.{L}.mlp."

# Qwen3-MoE, transformers 5 fused layout, norm_topk_prob true.
E, K = 8, 2
ex = Experts(E)
gu, dn = fused(ex)
x, y = tokens(ex, lambda z: softmax_topk(z, K, True))
save_case("qwen3_moe", {p + "gate.weight": ex.router, p + "experts.gate_up_proj": gu, p + "experts.down_proj": dn},
          hf_common(E, K, model_type="qwen3_moe", num_experts=E, moe_intermediate_size=I, norm_topk_prob=True),
          x, y, "qwen3_moe", ["renormalize"])

# Qwen3-MoE whose config omits norm_topk_prob: Qwen3MoeConfig's default (false).
ex = Experts(E)
gu, dn = fused(ex)
x, y = tokens(ex, lambda z: softmax_topk(z, K, False))
save_case("qwen3_moe_defaults", {p + "gate.weight": ex.router, p + "experts.gate_up_proj": gu, p + "experts.down_proj": dn},
          hf_common(E, K, model_type="qwen3_moe", num_experts=E, moe_intermediate_size=I),
          x, y, "qwen3_moe", ["renormalize"])

# Mixtral, the per-expert w1/w3/w2 layout most checkpoints have; always renormalised.
ex = Experts(E)
x, y = tokens(ex, lambda z: softmax_topk(z, K, True))
t = {f"model.layers.{L}.block_sparse_moe.gate.weight": ex.router}
for e in range(E):
    q = f"model.layers.{L}.block_sparse_moe.experts.{e}."
    t[q + "w1.weight"], t[q + "w3.weight"], t[q + "w2.weight"] = ex.gate[e], ex.up[e], ex.down[e]
save_case("mixtral", t, hf_common(E, K, model_type="mixtral", num_local_experts=E, intermediate_size=I),
          x, y, "mixtral", ["renormalize"])

# Qwen2-MoE: per-expert names, a shared expert under a sigmoid gate, no renormalisation.
Is = 48
ex = Experts(E, shared=Is)
sgate = normal(1, H, scale=H ** -0.5)
x, y = tokens(ex, lambda z: softmax_topk(z, K, False),
              lambda xd: sigmoid(xd @ sgate[0].astype(np.float64)) * ex.shared(xd))
t = {p + "gate.weight": ex.router, p + "shared_expert.gate_proj.weight": ex.sg, p + "shared_expert.up_proj.weight": ex.su,
     p + "shared_expert.down_proj.weight": ex.sd, p + "shared_expert_gate.weight": sgate}
for e in range(E):
    t[p + f"experts.{e}.gate_proj.weight"], t[p + f"experts.{e}.up_proj.weight"] = ex.gate[e], ex.up[e]
    t[p + f"experts.{e}.down_proj.weight"] = ex.down[e]
save_case("qwen2_moe", t, hf_common(E, K, model_type="qwen2_moe", num_experts=E, moe_intermediate_size=I,
                                    shared_expert_intermediate_size=Is, norm_topk_prob=False),
          x, y, "qwen2_moe", ["renormalize"])

# OLMoE: per-expert names; its config class defaults norm_topk_prob to false.
ex = Experts(E)
x, y = tokens(ex, lambda z: softmax_topk(z, K, False))
t = {p + "gate.weight": ex.router}
for e in range(E):
    t[p + f"experts.{e}.gate_proj.weight"], t[p + f"experts.{e}.up_proj.weight"] = ex.gate[e], ex.up[e]
    t[p + f"experts.{e}.down_proj.weight"] = ex.down[e]
save_case("olmoe", t, hf_common(E, K, model_type="olmoe", num_experts=E, intermediate_size=I), x, y, "olmoe",
          ["renormalize"])

# DeepSeek-V2: softmax, group-limited greedy, scaled, never renormalised; two shared experts.
E, K, G, TG, Is = 16, 4, 4, 2, 2 * I
ex = Experts(E, shared=Is)
gu, dn = fused(ex)
x, y = tokens(ex, lambda z: deepseek_v2(z, K, 3.0, "group_limited_greedy", G, TG), ex.shared)
save_case("deepseek_v2", {p + "gate.weight": ex.router, p + "experts.gate_up_proj": gu, p + "experts.down_proj": dn,
                          p + "shared_experts.gate_proj.weight": ex.sg, p + "shared_experts.up_proj.weight": ex.su,
                          p + "shared_experts.down_proj.weight": ex.sd},
          hf_common(E, K, model_type="deepseek_v2", n_routed_experts=E, moe_intermediate_size=I, n_shared_experts=2,
                    topk_method="group_limited_greedy", n_group=G, topk_group=TG, routed_scaling_factor=3.0,
                    norm_topk_prob=False),
          x, y, "deepseek_v2", ["scale", "groups", "renormalize"])

# DeepSeek-V3 as transformers writes its config: no scoring_func, no
# topk_method (the code hard-codes sigmoid + noaux_tc).
Is = I
ex = Experts(E, shared=Is)
bias = (rng.random(E) * 0.2).astype(np.float32)
gu, dn = fused(ex)
x, y = tokens(ex, lambda z: noaux_tc(z, bias.astype(np.float64), K, G, TG, True, 2.5), ex.shared)
v3 = {p + "gate.weight": ex.router, p + "gate.e_score_correction_bias": bias, p + "experts.gate_up_proj": gu,
      p + "experts.down_proj": dn, p + "shared_experts.gate_proj.weight": ex.sg,
      p + "shared_experts.up_proj.weight": ex.su, p + "shared_experts.down_proj.weight": ex.sd}
save_case("deepseek_v3", v3, hf_common(E, K, model_type="deepseek_v3", n_routed_experts=E, moe_intermediate_size=I,
                                       n_shared_experts=1, n_group=G, topk_group=TG, norm_topk_prob=True,
                                       routed_scaling_factor=2.5, first_k_dense_replace=1),
          x, y, "deepseek_v3", ["scoring", "groups", "scale"])

# The same config with only what DeepseekV3Config's defaults do not cover
# (n_group 8, topk_group 4, norm_topk_prob true, routed_scaling_factor 2.5).
E8 = 32
ex = Experts(E8, shared=Is)
bias8 = (rng.random(E8) * 0.2).astype(np.float32)
gu, dn = fused(ex)
x, y = tokens(ex, lambda z: noaux_tc(z, bias8.astype(np.float64), K, 8, 4, True, 2.5), ex.shared)
save_case("deepseek_v3_defaults",
          {p + "gate.weight": ex.router, p + "gate.e_score_correction_bias": bias8, p + "experts.gate_up_proj": gu,
           p + "experts.down_proj": dn, p + "shared_experts.gate_proj.weight": ex.sg,
           p + "shared_experts.up_proj.weight": ex.su, p + "shared_experts.down_proj.weight": ex.sd},
          hf_common(E8, K, model_type="deepseek_v3", n_routed_experts=E8, moe_intermediate_size=I, n_shared_experts=1),
          x, y, "deepseek_v3", ["scoring", "groups", "scale", "renormalize"])

# GLM-4.5 (Glm4Moe): DeepSeek-V3 routing with its own defaults (one group,
# routed_scaling_factor 1), per-expert names.
E, K = 8, 2
ex = Experts(E, shared=I)
bias = (rng.random(E) * 0.2).astype(np.float32)
x, y = tokens(ex, lambda z: noaux_tc(z, bias.astype(np.float64), K, 1, 1, True, 1.0), ex.shared)
t = {p + "gate.weight": ex.router, p + "gate.e_score_correction_bias": bias, p + "shared_experts.gate_proj.weight": ex.sg,
     p + "shared_experts.up_proj.weight": ex.su, p + "shared_experts.down_proj.weight": ex.sd}
for e in range(E):
    t[p + f"experts.{e}.gate_proj.weight"], t[p + f"experts.{e}.up_proj.weight"] = ex.gate[e], ex.up[e]
    t[p + f"experts.{e}.down_proj.weight"] = ex.down[e]
save_case("glm4_moe", t, hf_common(E, K, model_type="glm4_moe", n_routed_experts=E, moe_intermediate_size=I,
                                   n_shared_experts=1), x, y, "glm4_moe", ["scoring"])

# GGUF deepseek2 written as llama.cpp's converter writes DeepSeek-V3:
# sigmoid gating, exp_probs_b, normalised and scaled weights, groups.
E, K = 16, 4
ex = Experts(E, shared=I)
bias = (rng.random(E) * 0.2).astype(np.float32)
x, y = tokens(ex, lambda z: noaux_tc(z, bias.astype(np.float64), K, G, TG, True, 2.5), ex.shared)

def meta_v3(w):
    w.add_expert_feed_forward_length(I)
    w.add_expert_weights_scale(2.5)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_uint32("deepseek2.expert_group_count", G)
    w.add_uint32("deepseek2.expert_group_used_count", TG)


gguf_case("gguf_deepseek2", "deepseek2", ex, K, meta_v3,
          {"exp_probs_b.bias": bias, "ffn_gate_shexp.weight": ex.sg, "ffn_up_shexp.weight": ex.su,
           "ffn_down_shexp.weight": ex.sd}, x, y, ["scoring", "groups", "renormalize"])

# GGUF olmoe without expert_weights_norm: llama.cpp's graph does not renormalise.
E, K = 8, 2
ex = Experts(E)
x, y = tokens(ex, lambda z: softmax_topk(z, K, False))
gguf_case("gguf_olmoe", "olmoe", ex, K, lambda w: None, {}, x, y, ["renormalize"])

# GPT-OSS (transformers' GptOssTopKRouter + GptOssExperts): the router has
# a bias, softmax over the top-k logits; the experts' fused gate_up_proj
# [E, H, 2I] alternates gate and up columns, has a bias, and goes through
# the clamped SwiGLU (up + 1) * gate * sigmoid(1.702 gate) (gate <= 7, up in
# [-7, 7]); down_proj [E, I, H] has a bias. Weights scaled up so that the
# clamp is reached; each part of the block is checked to matter below.
def quantize_acts(v, bs=32):
    """v as the kernels quantize an activation row for block-format weights
    (Q8_0-style for MXFP4): per block of bs, in f32, d = amax / 127 and
    q = x * (127 / amax) rounded to nearest even; returns the values q * d
    and how near (in steps) the nearest x * (127 / amax) lies to a rounding
    boundary, where the kernels' f32 inputs may round the other way."""
    x = np.asarray(v, np.float32).reshape(-1, bs)
    amax = np.abs(x).max(axis=1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    sc = x * inv.astype(np.float32)
    q = np.rint(sc)
    near = np.abs(np.abs(sc - np.floor(sc)) - 0.5).min()
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(-1), near


def gpt_oss_block(x, r_w, r_b, gu, gu_b, dn, dn_b, K, interleaved=True, clamp=True, biases=True, act="oai",
                  quant_acts=False):
    """quant_acts: the activations of gate_up and of down quantized as the
    kernels do for MXFP4 experts (a token near a rounding boundary is not ok)."""
    logits = x @ r_w.T.astype(np.float64) + (r_b if biases else 0)
    ids, ok = topk(logits, K)
    w = softmax(logits[ids])
    y = np.zeros(H)
    xe = x
    if quant_acts:
        xe, near = quantize_acts(x)
        ok = ok and near > 1e-3
    for e, wt in zip(ids, w):
        z = xe @ gu[e].astype(np.float64) + (gu_b[e] if biases else 0)
        g, u = (z[0::2], z[1::2]) if interleaved else (z[:I], z[I:])
        if act == "silu":
            h = silu(g) * u
        else:
            if clamp:
                g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
            h = (u + 1.0) * g * sigmoid(1.702 * g)
        if quant_acts:
            h, near = quantize_acts(h)
            ok = ok and near > 1e-3
        y += wt * (h @ dn[e].astype(np.float64) + (dn_b[e] if biases else 0))
    return y, ok


def gpt_oss_tokens(parts, K, quant_acts=False):
    xs, ys, variants = [], [], {"interleaved": [], "clamp": [], "biases": [], "activation": []}
    while len(xs) < T:
        x = rng.standard_normal(H).astype(np.float32)
        xd = x.astype(np.float64)
        y, ok = gpt_oss_block(xd, *parts, K, quant_acts=quant_acts)
        if not ok:
            continue
        xs.append(x)
        ys.append(y)
        variants["interleaved"].append(gpt_oss_block(xd, *parts, K, interleaved=False, quant_acts=quant_acts)[0])
        variants["clamp"].append(gpt_oss_block(xd, *parts, K, clamp=False, quant_acts=quant_acts)[0])
        variants["biases"].append(gpt_oss_block(xd, *parts, K, biases=False, quant_acts=quant_acts)[0])
        variants["activation"].append(gpt_oss_block(xd, *parts, K, act="silu", quant_acts=quant_acts)[0])
    x, y = np.stack(xs), np.stack(ys)
    # A library that dropped any of these would be off by at least this much.
    for k, v in variants.items():
        rel = np.abs(np.stack(v) - y).max() / np.abs(y).max()
        if rel < 1e-2:
            sys.exit(f"gpt_oss: the case cannot tell '{k}' apart (relative difference {rel:.2e})")
        print(f"gpt_oss reference without the right {k}: relative difference {rel:.3f}")
    return x, y


E, K = 8, 2
r_w, r_b = normal(E, H, scale=2 * H ** -0.5), normal(E, scale=0.5)
gu_t = normal(E, H, 2 * I, scale=4 * H ** -0.5)  # [E, H, 2I], gate columns 0, 2, 4, ...
gu_b, dn, dn_b = normal(E, 2 * I), normal(E, I, H, scale=I ** -0.5), normal(E, H, scale=0.5)
x, y = gpt_oss_tokens((r_w, r_b, gu_t, gu_b, dn, dn_b), K)
save_case("gpt_oss", {p + "router.weight": r_w, p + "router.bias": r_b, p + "experts.gate_up_proj": gu_t,
                      p + "experts.gate_up_proj_bias": gu_b, p + "experts.down_proj": dn,
                      p + "experts.down_proj_bias": dn_b},
          hf_common(E, K, model_type="gpt_oss", num_local_experts=E, intermediate_size=I, swiglu_limit=7.0,
                    experts_per_token=K),
          x, y, "gpt_oss", ["activation"])

# GPT-OSS as OpenAI ships it: the experts in MXFP4, each weight a blocks
# tensor and a scales tensor (mxfp4_pair), gate_up's rows alternating gate
# and up. Their values follow transformers' convert_moe_packed_tensors; the
# reference quantizes the activations as the kernels do, so the tolerance
# is the float one.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_pair(E, rows, cols, scale):
    """Random MXFP4 blocks U8 [E, rows, cols / 32, 16] and scales U8
    [E, rows, cols / 32], and the [E, rows, cols] float64 values they hold:
    byte j of a block holds element 2j (low nibble) and 2j + 1 (high), each
    FP4_VALUES[code] * 2^(scale - 127); exponents around `scale`'s."""
    G = cols // 32
    blocks = rng.integers(0, 256, (E, rows, G, 16), dtype=np.uint8)
    base = 127 + int(np.round(np.log2(scale / 2.0)))
    scales = (base + rng.integers(-1, 2, (E, rows, G))).astype(np.uint8)
    vals = np.empty((E, rows, G, 32))
    vals[..., 0::2] = FP4_VALUES[blocks & 15]
    vals[..., 1::2] = FP4_VALUES[blocks >> 4]
    vals *= np.exp2(scales.astype(np.float64) - 127)[..., None]
    return blocks, scales, vals.reshape(E, rows, cols)


r_w, r_b = normal(E, H, scale=2 * H ** -0.5), normal(E, scale=0.5)
gub, gus, gu_v = mxfp4_pair(E, 2 * I, H, 4 * H ** -0.5)  # rows 0, 2, 4, ... gate
dnb, dns, dn_v = mxfp4_pair(E, H, I, I ** -0.5)
gu_b, dn_b = normal(E, 2 * I), normal(E, H, scale=0.5)
x, y = gpt_oss_tokens((r_w, r_b, gu_v.transpose(0, 2, 1), gu_b, dn_v.transpose(0, 2, 1), dn_b), K, quant_acts=True)
save_case("gpt_oss_mxfp4", {p + "router.weight": r_w, p + "router.bias": r_b, p + "experts.gate_up_proj_blocks": gub,
                            p + "experts.gate_up_proj_scales": gus, p + "experts.gate_up_proj_bias": gu_b,
                            p + "experts.down_proj_blocks": dnb, p + "experts.down_proj_scales": dns,
                            p + "experts.down_proj_bias": dn_b},
          hf_common(E, K, model_type="gpt_oss", num_local_experts=E, intermediate_size=I, swiglu_limit=7.0,
                    experts_per_token=K),
          x, y, "gpt_oss", ["activation"])

# The same block as llama.cpp's converter writes it to GGUF ('gpt-oss'):
# gate and up split apart, every bias a tensor of its own.
r_w, r_b = normal(E, H, scale=2 * H ** -0.5), normal(E, scale=0.5)
gu_t = normal(E, H, 2 * I, scale=4 * H ** -0.5)
gu_b, dn, dn_b = normal(E, 2 * I), normal(E, I, H, scale=I ** -0.5), normal(E, H, scale=0.5)
x, y = gpt_oss_tokens((r_w, r_b, gu_t, gu_b, dn, dn_b), K)
gx = Experts(E)
gx.router = r_w
gx.gate = np.ascontiguousarray(gu_t[:, :, 0::2].transpose(0, 2, 1))  # [E, I, H]
gx.up = np.ascontiguousarray(gu_t[:, :, 1::2].transpose(0, 2, 1))
gx.down = np.ascontiguousarray(dn.transpose(0, 2, 1))  # [E, H, I]
gguf_case("gguf_gpt_oss", "gpt-oss", gx, K, lambda w: w.add_expert_feed_forward_length(I),
          {"ffn_gate_inp.bias": r_b, "ffn_gate_exps.bias": np.ascontiguousarray(gu_b[:, 0::2]),
           "ffn_up_exps.bias": np.ascontiguousarray(gu_b[:, 1::2]), "ffn_down_exps.bias": dn_b}, x, y, ["activation"])

# A split GGUF (how most large MoE GGUFs ship): layer 0 in the first file,
# layer 1 across the next ones; opened from the first split.
E, K = 8, 2
ex = Experts(E)
x, y = tokens(ex, lambda z: softmax_topk(z, K, True))
ex0 = Experts(E)
gguf_case("gguf_split", "qwen3moe", ex, K, lambda w: w.add_expert_feed_forward_length(I), {}, x, y, ["renormalize"],
          split_max_tensors=3, before={"ffn_gate_inp.weight": ex0.router, "ffn_gate_exps.weight": ex0.gate,
                                       "ffn_up_exps.weight": ex0.up, "ffn_down_exps.weight": ex0.down})

# A Mixtral GGUF converted before the 3-D expert tensors: one tensor per
# expert (blk.L.ffn_gate.E.weight), architecture 'llama' (renormalises).
ex = Experts(E)
x, y = tokens(ex, lambda z: softmax_topk(z, K, True))
gguf_case("gguf_mixtral_per_expert", "llama", ex, K, lambda w: None, {}, x, y, ["renormalize"], per_expert=True)

# Refused: GPT-OSS with another clamp ...
refuse_case("gpt_oss_limit", {p + "router.weight": r_w, p + "router.bias": r_b, p + "experts.gate_up_proj": gu_t,
                              p + "experts.gate_up_proj_bias": gu_b, p + "experts.down_proj": dn,
                              p + "experts.down_proj_bias": dn_b},
            hf_common(E, K, model_type="gpt_oss", num_local_experts=E, intermediate_size=I, swiglu_limit=5.0),
            "swiglu_limit")
# ... and MXFP4 pairs that are not whole: down's scales missing, or gate_up's
# scales not one per block of its blocks.
gub, gus, _ = mxfp4_pair(E, 2 * I, H, 0.5)
dnb, dns, _ = mxfp4_pair(E, H, I, I ** -0.5)
mx = {p + "router.weight": r_w, p + "router.bias": r_b, p + "experts.gate_up_proj_blocks": gub,
      p + "experts.gate_up_proj_scales": gus, p + "experts.gate_up_proj_bias": gu_b,
      p + "experts.down_proj_blocks": dnb, p + "experts.down_proj_bias": dn_b}
gpt_oss_cfg = hf_common(E, K, model_type="gpt_oss", num_local_experts=E, intermediate_size=I)
refuse_case("gpt_oss_mxfp4_no_scales", mx, gpt_oss_cfg, "but not its scales")
mx[p + "experts.down_proj_scales"] = dns
mx[p + "experts.gate_up_proj_scales"] = np.ascontiguousarray(gus[:, :, :1])
refuse_case("gpt_oss_mxfp4_bad_scales", mx, gpt_oss_cfg, "one exponent per block")
ex = Experts(E)
# ... a model type ep_moe does not know that leaves out a semantic key ...
refuse_case("unknown_type", {p + "gate.weight": ex.router, p + "experts.gate_up_proj": fused(ex)[0],
                             p + "experts.down_proj": ex.down},
            hf_common(E, K, model_type="newmoe", num_experts=E, moe_intermediate_size=I, norm_topk_prob=True),
            "scoring_func")
# ... DeepSeek-V2 with norm_topk_prob true (its two published blocks disagree) ...
refuse_case("deepseek_v2_norm", {p + "gate.weight": ex.router, p + "experts.gate_up_proj": fused(ex)[0],
                                 p + "experts.down_proj": ex.down},
            hf_common(E, K, model_type="deepseek_v2", n_routed_experts=E, moe_intermediate_size=I,
                      norm_topk_prob=True), "norm_topk_prob")
# ... and DeepSeek-V3 without its score-correction bias.
v3.pop(p + "gate.e_score_correction_bias")
refuse_case("deepseek_v3_no_bias", v3, hf_common(16, 4, model_type="deepseek_v3", n_routed_experts=16,
                                                 moe_intermediate_size=I, n_shared_experts=1, n_group=G,
                                                 topk_group=TG), "score-correction")

with open(f"{out}/cases.txt", "w") as f:
    f.write("\n".join(cases) + "\n")
print(f"wrote {len(cases)} architecture cases to {out}")
