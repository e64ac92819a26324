#!/usr/bin/env python3
"""Writes MoE checkpoints with the reference writers (the `safetensors` and
`gguf` Python packages, with numpy) plus the exact values they store, so the
C++ side can check that ep_moe reads them identically.

usage: reference_writers.py OUT_DIR [SEED]
Exit code 77 (ctest's "skipped") when the packages are not importable.
"""
import json
import os
import struct
import sys

try:
    import numpy as np
    import safetensors.numpy
    import gguf
    import gguf.quants
except ImportError as e:  # pragma: no cover
    print(f"skipped: the reference writers are not installed ({e})")
    sys.exit(77)

out = sys.argv[1]
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
rng = np.random.default_rng(seed)
E, H, I, K, L = 4, 64, 32, 2, 1
os.makedirs(f"{out}/hf", exist_ok=True)


def normal(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


gate = normal(E, I, H, scale=H ** -0.5)
up = normal(E, I, H, scale=H ** -0.5)
down = normal(E, H, I, scale=I ** -0.5)
router = normal(E, H, scale=H ** -0.5)


def raw(path, arrays):
    """The stored values as little-endian f32, concatenated in order."""
    with open(path, "wb") as f:
        for a in arrays:
            f.write(np.ascontiguousarray(a, dtype="<f4").tobytes())


# --- safetensors, HF per-expert names, F16 ---------------------------------
tensors = {f"model.layers.{L}.mlp.gate.weight": router.astype(np.float16)}
for e in range(E):
    p = f"model.layers.{L}.mlp.experts.{e}."
    tensors[p + "gate_proj.weight"] = gate[e].astype(np.float16)
    tensors[p + "up_proj.weight"] = up[e].astype(np.float16)
    tensors[p + "down_proj.weight"] = down[e].astype(np.float16)
tensors["model.embed_tokens.weight"] = normal(10, H).astype(np.float16)
safetensors.numpy.save_file(tensors, f"{out}/hf/model.safetensors", metadata={"format": "pt"})
with open(f"{out}/hf/config.json", "w") as f:
    json.dump({"model_type": "qwen3_moe", "hidden_size": H, "moe_intermediate_size": I, "num_experts": E, "num_experts_per_tok": K,
               "norm_topk_prob": True, "num_hidden_layers": L + 1, "hidden_act": "silu"}, f)
f16 = lambda a: a.astype(np.float16).astype(np.float32)
raw(f"{out}/hf.raw", [f16(router)] + [f16(x[e]) for e in range(E) for x in (gate, up, down)])

# --- GGUF: F32 gate/up, Q8_0 down -------------------------------------------
w = gguf.GGUFWriter(f"{out}/model.gguf", "qwen3moe")
w.add_block_count(L + 1)
w.add_embedding_length(H)
w.add_expert_count(E)
w.add_expert_used_count(K)
w.add_expert_feed_forward_length(I)
w.add_tensor(f"blk.{L}.ffn_gate_inp.weight", router)
w.add_tensor(f"blk.{L}.ffn_gate_exps.weight", gate)
w.add_tensor(f"blk.{L}.ffn_up_exps.weight", up)
qt = gguf.GGMLQuantizationType.Q8_0
qdown = gguf.quants.quantize(down, qt)
w.add_tensor(f"blk.{L}.ffn_down_exps.weight", qdown, raw_shape=qdown.shape, raw_dtype=qt)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
down_q = gguf.quants.dequantize(qdown, qt).reshape(E, H, I)
raw(f"{out}/gguf.raw", [router] + [x[e] for e in range(E) for x in (gate, up, down_q)])
qdown.tofile(f"{out}/gguf_down.q8_0")  # the blocks, which layers keep as they are

with open(f"{out}/ready", "w") as f:
    f.write(f"{E} {H} {I} {K} {L}\n")
print(f"wrote reference checkpoints to {out}")
