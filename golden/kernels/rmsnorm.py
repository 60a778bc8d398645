"""K2 rms_norm: y = x * rsqrt(mean(x^2) + eps) * w, one bf16 rounding at the end."""
from __future__ import annotations


def rms_scale(x, nm, eps: float):
    """rsqrt(mean(x^2) + eps) over the last axis, keepdims."""
    xp = nm.xp
    return 1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps)


def rmsnorm_f(x, w, nm, eps: float):
    """Weighted RMSNorm in the compute dtype, not rounded (w=None: unweighted)."""
    x = nm.asf(x)
    y = x * rms_scale(x, nm, eps)
    return y if w is None else y * nm.asf(w)


def rms_norm(x, norm_w, *, cfg, nm):
    """x [T, D] (bf16 values), norm_w [D] -> x_normed [T, D] (bf16 values)."""
    return nm.bf16(rmsnorm_f(x, norm_w, nm, cfg.rms_norm_eps))
