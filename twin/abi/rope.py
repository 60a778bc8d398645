"""RoPE inverse frequencies (kernel-math.md §3.2): the one formula, read by the lowering's default
tables and by golden's kernels.

Ratio 0 layers use `rope_theta` with no interpolation; compressed layers (ratio 4 or 128) use
`compress_rope_theta` with YaRN frequency interpolation (no mscale).  float32 is pypto-lib's table
(`utils.precompute_freqs_cos_sin`): each operation rounded to f32 as torch does it, the power taken
in float64 and rounded once (f32 pow is correctly rounded there for every preset, and this form is
so on any libm).  float64 is exact mode's.
"""
from __future__ import annotations

import math

import numpy as np


def yarn_range(rope_dims: int, base: float, orig: int, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    def dim(rot):
        return rope_dims * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(dim(beta_fast)), 0)
    high = min(math.ceil(dim(beta_slow)), rope_dims - 1)
    return low, high


def inv_freq(model, compressed: bool, dtype=np.float64) -> np.ndarray:
    """[R/2] inverse frequencies 1 / base^(2i/R), every step in `dtype`."""
    R = model.qk_rope_head_dim
    t = np.dtype(dtype).type
    base = model.compress_rope_theta if compressed else model.rope_theta
    x = np.arange(0, R, 2, dtype=dtype) / t(R)
    f = t(1) / (np.float64(base) ** x.astype(np.float64)).astype(dtype)
    if compressed and model.original_max_position_embeddings > 0:
        low, high = yarn_range(R, base, model.original_max_position_embeddings, model.beta_fast, model.beta_slow)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(R // 2, dtype=dtype) - t(low)) / t(high - low), t(0), t(1))
        smooth = t(1) - ramp
        f = f / t(model.rope_factor) * (t(1) - smooth) + f * smooth
    return f
