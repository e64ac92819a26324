#!/usr/bin/env python3
"""Block-format references from the `gguf` Python package (its writer,
quantizers and dequantizers) and numpy, for tests/io/quant_ref_test.cpp:

  blocks_<T>.bin / deq_<T>.f32   random valid blocks of each format and what
                                 gguf.quants.dequantize makes of them;
  src_<T>.f32 / gguf_<T>.bin     floats and gguf.quants.quantize's blocks, for
                                 the formats it can quantize (Q8_0, Q4_0, MXFP4);
  model_<name>.gguf              a qwen3moe MoE layer with experts in block
                                 formats, written by gguf.GGUFWriter, with
  model_<name>.x / .out          tokens and their output in float64: the
                                 experts' values as gguf.quants dequantizes
                                 them and the activations quantized as the
                                 kernels state (docs/quantization.md);
  models.txt                     one line per model: name E H I K L T gu down.

usage: quant_writers.py OUT_DIR [SEED]; exit 77 ("skipped") without the packages.
"""
import os
import sys

try:
    import numpy as np
    from act_quant import act_quant
    import gguf
    import gguf.quants
except ImportError as e:  # pragma: no cover
    print(f"skipped: the reference writers are not installed ({e})")
    sys.exit(77)

Q = gguf.GGMLQuantizationType
out = sys.argv[1]
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
rng = np.random.default_rng(seed)
os.makedirs(out, exist_ok=True)

# ep_moe_dtype_t values and the formats' geometry.
TYPES = {"Q8_0": (Q.Q8_0, 6), "Q4_0": (Q.Q4_0, 7), "Q4_K": (Q.Q4_K, 8), "Q5_K": (Q.Q5_K, 9),
         "Q6_K": (Q.Q6_K, 10), "IQ4_XS": (Q.IQ4_XS, 11), "MXFP4": (Q.MXFP4, 12),
         "Q2_K": (Q.Q2_K, 13), "Q3_K": (Q.Q3_K, 14), "Q4_1": (Q.Q4_1, 15), "Q5_0": (Q.Q5_0, 16),
         "Q5_1": (Q.Q5_1, 17), "IQ4_NL": (Q.IQ4_NL, 18), "IQ2_XXS": (Q.IQ2_XXS, 19), "IQ2_XS": (Q.IQ2_XS, 20),
         "IQ2_S": (Q.IQ2_S, 21), "IQ3_XXS": (Q.IQ3_XXS, 22), "IQ3_S": (Q.IQ3_S, 23), "IQ1_S": (Q.IQ1_S, 24),
         "IQ1_M": (Q.IQ1_M, 25)}
# Where each format keeps its f16 scales (byte offsets) and the scale that
# makes its values about 1: every other byte of these formats is valid as
# random bits (grid indices span their grids).
F16_AT = {"Q4_1": ([0, 2], 1 / 8), "Q5_0": ([0], 1 / 16), "Q5_1": ([0, 2], 1 / 16), "IQ4_NL": ([0], 1 / 64),
          "Q2_K": ([80, 82], 1 / 24), "Q3_K": ([108], 1 / 128), "IQ2_XXS": ([0], 1 / 86), "IQ2_XS": ([0], 1 / 86),
          "IQ2_S": ([0], 1 / 86), "IQ3_XXS": ([0], 1 / 250), "IQ3_S": ([0], 1 / 240), "IQ1_S": ([0], 1 / 8)}


def f16_bytes(v):
    return np.asarray(v, dtype=np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(name, rows, cols, scale):
    """Random valid blocks ([rows, cols / elems, bytes] uint8) whose values are about `scale`."""
    qt = TYPES[name][0]
    qk, bb = gguf.constants.GGML_QUANT_SIZES[qt]
    n = rows * (cols // qk)
    b = rng.integers(0, 256, size=(n, bb), dtype=np.uint8)
    s = scale * rng.uniform(0.5, 1.5, size=n)
    if name == "Q8_0":
        b[:, 0:2] = f16_bytes(s / 64)
    elif name == "Q4_0":
        b[:, 0:2] = f16_bytes(s / 4)
    elif name == "MXFP4":
        b[:, 0] = (128 + np.rint(np.log2(s / 3))).astype(np.uint8)
    elif name in ("Q4_K", "Q5_K"):
        b[:, 0:2] = f16_bytes(s / (32 * (16 if name == "Q5_K" else 8)))
        b[:, 2:4] = f16_bytes(s / 32)
    elif name == "Q6_K":
        b[:, 208:210] = f16_bytes(s / (64 * 32))
        b[:, 192:208] = rng.integers(-127, 128, size=(n, 16)).astype(np.int8).view(np.uint8)
    elif name == "IQ4_XS":
        b[:, 0:2] = f16_bytes(s / (16 * 64))
    elif name == "IQ1_M":  # its f16 scale in the top nibbles of 4 u16 words
        bits = np.asarray(s / 8, dtype=np.float16).view(np.uint16).astype(np.uint32)
        words = b[:, 48:56].copy().view(np.uint16).astype(np.uint32)
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
        b[:, 48:56] = words.astype(np.uint16).view(np.uint8)
    else:
        offs, unit = F16_AT[name]
        for o in offs:
            b[:, o:o + 2] = f16_bytes(s * unit)
    return b.reshape(rows, cols // qk * bb)


def dequant(name, blocks, rows, cols):
    return gguf.quants.dequantize(blocks, TYPES[name][0]).reshape(rows, cols).astype(np.float64)


# --- 1. blocks and their dequantization; gguf's quantizers -------------------
for name, (qt, _) in TYPES.items():
    qk, bb = gguf.constants.GGML_QUANT_SIZES[qt]
    b = random_blocks(name, 16, 4 * 256, 1.0)
    b.tofile(f"{out}/blocks_{name}.bin")
    gguf.quants.dequantize(b, qt).astype("<f4").tofile(f"{out}/deq_{name}.f32")
    if name in ("Q8_0", "Q4_0", "MXFP4"):
        src = (rng.standard_normal((16, 1024)) * np.exp(rng.uniform(-3, 3, size=(16, 1)))).astype(np.float32)
        src.tofile(f"{out}/src_{name}.f32")
        gguf.quants.quantize(src, qt).tofile(f"{out}/gguf_{name}.bin")

# --- 2. MoE layers with block-format experts ---------------------------------
E, H, I, K, L, T = 8, 512, 256, 2, 1, 7
MODELS = [("q8_0", "Q8_0", "Q8_0"), ("q4_0", "Q4_0", "Q4_0"), ("q4_k_m", "Q4_K", "Q6_K"), ("q5_k", "Q5_K", "Q5_K"),
          ("iq4_xs", "IQ4_XS", "IQ4_XS"), ("mxfp4", "MXFP4", "MXFP4"), ("q4_k_q8_0", "Q4_K", "Q8_0"),
          # DeepSeek-R1 UD-Q2_K_XL, UD-IQ2_XXS and Qwen3-235B UD-IQ1_S / Q3_K_XL mixes, legacy types
          ("q2_k", "Q2_K", "Q3_K"), ("ud_iq2_xxs", "IQ2_XXS", "Q3_K"), ("iq2_xs", "IQ2_XS", "IQ2_S"),
          ("iq1_s", "IQ1_S", "IQ1_M"), ("iq3_xxs", "IQ3_XXS", "IQ3_S"), ("q3_k", "Q3_K", "Q2_K"),
          ("q4_1", "Q4_1", "Q5_0"), ("q5_1", "Q5_1", "IQ4_NL")]
lines = []
for name, gu_t, down_t in MODELS:
    router = (rng.standard_normal((E, H)) * H ** -0.5).astype(np.float32)
    gb = [random_blocks(gu_t, I, H, H ** -0.5) for _ in range(E)]
    ub = [random_blocks(gu_t, I, H, H ** -0.5) for _ in range(E)]
    db = [random_blocks(down_t, H, I, I ** -0.5) for _ in range(E)]
    w = gguf.GGUFWriter(f"{out}/model_{name}.gguf", "qwen3moe")
    w.add_block_count(L + 1)
    w.add_embedding_length(H)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    w.add_expert_feed_forward_length(I)
    w.add_tensor(f"blk.{L}.ffn_gate_inp.weight", router)
    for t, blocks, rows, cols, qt_name in (("gate", gb, I, H, gu_t), ("up", ub, I, H, gu_t), ("down", db, H, I, down_t)):
        data = np.stack(blocks)
        w.add_tensor(f"blk.{L}.ffn_{t}_exps.weight", data, raw_shape=data.shape, raw_dtype=TYPES[qt_name][0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = [dequant(gu_t, b, I, H) for b in gb]
    u = [dequant(gu_t, b, I, H) for b in ub]
    d = [dequant(down_t, b, H, I) for b in db]
    bs_gu = gguf.constants.GGML_QUANT_SIZES[TYPES[gu_t][0]][0]
    bs_d = gguf.constants.GGML_QUANT_SIZES[TYPES[down_t][0]][0]
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
        wts = p[ids] / p[ids].sum()  # qwen3moe renormalises the top-k
        xq = act_quant(x, bs_gu)[0]
        y, slack = np.zeros(H), np.zeros(H)
        for e, wt in zip(ids, wts):
            a = g[e] @ xq
            b = u[e] @ xq
            h = a / (1 + np.exp(-a)) * b
            hq, near = act_quant(h, bs_d)
            y += wt * (d[e] @ hq)
            slack += wt * (np.abs(d[e]) @ near)  # one step per boundary element, through down
        xs.append(x)
        ys.append(y)
        slacks.append(slack)
    np.stack(xs).astype("<f4").tofile(f"{out}/model_{name}.x")
    np.stack(ys).astype("<f8").tofile(f"{out}/model_{name}.out")
    np.stack(slacks).astype("<f8").tofile(f"{out}/model_{name}.slack")
    lines.append(f"{name} {E} {H} {I} {K} {L} {T} {TYPES[gu_t][1]} {TYPES[down_t][1]}")

with open(f"{out}/models.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
print(f"wrote block-format references to {out}")
