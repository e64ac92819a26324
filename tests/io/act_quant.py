"""The int8 activation quantization the kernels state (docs/quantization.md),
in numpy, for the reference writers (quant_writers.py, fp8_writers.py)."""
import numpy as np


def act_quant(x, bs):
    """x as the kernels quantize an activation row: per block of bs, f32 amax,
    q = rint(x * (127 / amax)) in f32 (ties to even), values q * (amax / 127).
    Also each element's step where it lies within 1e-3 steps of a rounding
    boundary (the kernels' f32 value may round the other way there), else 0."""
    x = np.asarray(x, dtype=np.float32)
    y = np.zeros(x.shape, dtype=np.float64)
    near = np.zeros(x.shape, dtype=np.float64)
    for b0 in range(0, x.size, bs):
        blk = x[b0:b0 + bs]
        amax = np.float32(np.max(np.abs(blk)))
        if amax == 0:
            continue
        idd = np.float32(127.0) / amax
        v = blk * idd
        step = np.float64(amax / np.float32(127.0))
        y[b0:b0 + bs] = np.rint(v).astype(np.float64) * step
        near[b0:b0 + bs] = np.where(np.abs(np.abs(v - np.floor(v)) - 0.5) < 1e-3, step, 0.0)
    return y, near
