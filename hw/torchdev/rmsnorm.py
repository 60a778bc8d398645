"""K2 rms_norm: one BF16 rounding at the end."""
from __future__ import annotations

from .numerics import bf16, rmsnorm


def rms_norm(x, w, eps: float):
    return bf16(rmsnorm(x, w, eps))
