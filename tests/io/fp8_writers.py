#!/usr/bin/env python3
"""Block-scaled FP8 references for tests/io/fp8_ref_test.cpp: E4M3 values from
ml_dtypes.float8_e4m3fn (not from ep_moe), safetensors files written byte by
byte as the format defines them, outputs in float64.

  codes.u8 / scales.f32 / deq.f32   [rows, cols] E4M3 codes (every non-NaN
                                    code), their [ceil(rows/128), cols/128]
                                    scales and code x scale in f32 (numpy's
                                    product of ml_dtypes' value and the scale);
  <name>/                           a qwen3_moe checkpoint whose experts are
                                    F8_E4M3 with F32 weight_scale_inv, config
                                    quantization_config fp8 e4m3 [R, 128];
  <name>.x / .out                   tokens and the layer's output in float64:
                                    the experts' values as ml_dtypes gives
                                    them times the scales, applied in double,
                                    the activations quantized as the kernels
                                    state (blocks of 32, docs/quantization.md);
  models.txt                        name E H I K L T expected (ok, or the
                                    status the C++ side must see and a word
                                    of its message).

usage: fp8_writers.py OUT_DIR [SEED]; exit 77 ("skipped") without the packages.
"""
import json
import os
import struct
import sys

try:
    import numpy as np
    from act_quant import act_quant
    import ml_dtypes
except ImportError as e:  # pragma: no cover
    print(f"skipped: the FP8 reference packages are not installed ({e})")
    sys.exit(77)

out = sys.argv[1]
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
rng = np.random.default_rng(seed)
os.makedirs(out, exist_ok=True)
E4M3 = ml_dtypes.float8_e4m3fn
VALID = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], dtype=np.uint8)  # every non-NaN code


def value(codes):
    """The E4M3 codes' values (float64), by ml_dtypes."""
    return codes.view(E4M3).astype(np.float64)


def random_codes(rows, cols, scale):
    """Codes whose values times `scale`-sized block scales are about 1 / sqrt(cols)."""
    return rng.choice(VALID[(VALID & 0x78) <= 0x48], size=(rows, cols)).astype(np.uint8)  # |value| < 4


def write_safetensors(path, tensors):
    """tensors: list of (name, dtype string, shape, bytes), in file order."""
    header, off = {}, 0
    for name, dt, shape, data in tensors:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for _, _, _, data in tensors:
            f.write(data)


# --- 1. codes and scales, dequantized -----------------------------------------
rows, cols = 200, 256  # a last partial block of rows
codes = rng.choice(VALID, size=(rows, cols)).astype(np.uint8)
scales = (np.exp(rng.uniform(-8, 2, size=((rows + 127) // 128, cols // 128)))).astype(np.float32)
codes.tofile(f"{out}/codes.u8")
scales.tofile(f"{out}/scales.f32")
full = np.repeat(np.repeat(scales, 128, axis=0)[:rows], 128, axis=1)
(codes.view(E4M3).astype(np.float32) * full).astype("<f4").tofile(f"{out}/deq.f32")


# --- 2. MoE layers with FP8 experts -------------------------------------------
def model(name, E, H, I, K, L, T, block_rows=128, fault=None, Is=0):
    d = f"{out}/{name}"
    os.makedirs(d, exist_ok=True)
    router = (rng.standard_normal((E, H)) * H ** -0.5).astype(np.float32)
    tensors = [(f"model.layers.{L}.mlp.gate.weight", "F32", (E, H), router.tobytes())]
    weights = []  # per expert: gate, up, down values (float64); the shared expert last
    for e in range(E + (1 if Is else 0)):
        vals = []
        shared = e == E
        for proj, r, c in (("gate_proj", Is if shared else I, H), ("up_proj", Is if shared else I, H),
                           ("down_proj", H, Is if shared else I)):
            w = random_codes(r, c, 1.0)
            s = (np.exp(rng.uniform(-1, 1, size=((r + block_rows - 1) // block_rows, c // 128))) / 4 *
                 c ** -0.5).astype(np.float32)
            base = f"model.layers.{L}.mlp.shared_expert.{proj}." if shared else f"model.layers.{L}.mlp.experts.{e}.{proj}."
            if fault == "nan_code" and e == 1 and proj == "up_proj":
                w[3, 7] = 0x7F
            if fault == "nan_scale" and e == 2 and proj == "down_proj":
                s[0, 0] = np.nan
            if fault == "inf_scale" and e == 0 and proj == "gate_proj":
                s[-1, -1] = np.inf
            sshape = s.shape
            if fault == "bad_scale_shape" and e == 0 and proj == "down_proj":
                s = s.reshape(-1)[: s.size - 1]
                sshape = (s.size,)
            tensors.append((base + "weight", "F8_E4M3", (r, c), w.tobytes()))
            if not (fault == "no_scale" and e == 0 and proj == "gate_proj"):
                tensors.append((base + "weight_scale_inv", "F32", sshape, s.tobytes()))
            full = np.repeat(np.repeat(s.reshape(sshape if len(sshape) == 2 else (1, -1)), block_rows, axis=0)[:r],
                             128, axis=1) if fault != "bad_scale_shape" else None
            vals.append(None if full is None else value(w) * full.astype(np.float64))
        weights.append(vals)
    sgate = (rng.standard_normal((1, H)) * H ** -0.5).astype(np.float32)
    if Is:  # Qwen2-MoE's shared expert under a sigmoid gate (kept in F32)
        tensors.append((f"model.layers.{L}.mlp.shared_expert_gate.weight", "F32", (1, H), sgate.tobytes()))
    write_safetensors(f"{d}/model.safetensors", tensors)
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": [block_rows, 64 if fault == "block_cols" else 128]}
    cfg = {"model_type": "qwen2_moe" if Is else "qwen3_moe", "hidden_size": H, "moe_intermediate_size": I,
           "num_experts": E, "num_experts_per_tok": K, "norm_topk_prob": True, "num_hidden_layers": L + 1,
           "hidden_act": "silu", "quantization_config": qc}
    if Is:
        cfg["shared_expert_intermediate_size"] = Is
    with open(f"{d}/config.json", "w") as f:
        json.dump(cfg, f)
    if fault:
        return
    xs, ys, slacks = [], [], []
    while len(xs) < T:
        x = rng.standard_normal(H).astype(np.float32)
        logits = router.astype(np.float64) @ x.astype(np.float64)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        if p[order[K - 1]] - p[order[K]] < 1e-3:  # a near-tie: f32 and double may choose differently
            continue
        ids = order[:K]
        wts = p[ids] / p[ids].sum()
        xq = act_quant(x, 32)[0]
        y, slack = np.zeros(H), np.zeros(H)
        for e, wt in zip(ids, wts):
            g, u, dn = weights[e]
            a = g @ xq
            b = u @ xq
            h = a / (1 + np.exp(-a)) * b
            hq, near = act_quant(h, 32)
            y += wt * (dn @ hq)
            slack += wt * (np.abs(dn) @ near)
        if Is:  # its input and its h quantized as the routed experts' (its shards fall on blocks of 32)
            g, u, dn = weights[E]
            a = g @ xq
            b = u @ xq
            hq, near = act_quant(a / (1 + np.exp(-a)) * b, 32)
            gate = 1 / (1 + np.exp(-(sgate[0].astype(np.float64) @ x.astype(np.float64))))
            y += gate * (dn @ hq)
            slack += gate * (np.abs(dn) @ near)
        xs.append(x)
        ys.append(y)
        slacks.append(slack)
    np.stack(xs).astype("<f4").tofile(f"{d}.x")
    np.stack(ys).astype("<f8").tofile(f"{d}.out")
    np.stack(slacks).astype("<f8").tofile(f"{d}.slack")


lines = []
for name, E, H, I, K, block_rows, fault, expect, Is in (
        ("fp8", 8, 256, 256, 2, 128, None, "ok", 0),
        # an FP8 shared expert: whole blocks of it at EP 1 and 2 (shards of 128)
        ("fp8_shared", 8, 256, 256, 2, 128, None, "ok12", 256),
        ("fp8_rows64", 6, 256, 128, 2, 64, None, "ok", 0),  # weight_block_size [64, 128]
        ("fp8_nan_code", 4, 128, 128, 2, 128, "nan_code", "FORMAT NaN", 0),
        ("fp8_nan_scale", 4, 128, 128, 2, 128, "nan_scale", "FORMAT finite", 0),
        ("fp8_inf_scale", 4, 128, 128, 2, 128, "inf_scale", "FORMAT finite", 0),
        ("fp8_bad_scale_shape", 4, 128, 128, 2, 128, "bad_scale_shape", "FORMAT weight_scale_inv", 0),
        ("fp8_no_scale", 4, 128, 128, 2, 128, "no_scale", "UNSUPPORTED weight_scale_inv", 0),
        ("fp8_block_cols", 4, 128, 128, 2, 128, "block_cols", "UNSUPPORTED weight_block_size", 0)):
    model(name, E, H, I, K, 1, 5, block_rows, fault, Is)
    lines.append(f"{name} {E} {H} {I} {K} 1 5 {expect}")
with open(f"{out}/models.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
print(f"wrote FP8 references to {out}")
