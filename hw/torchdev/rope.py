"""Interleaved RoPE on the last R dims of a head (kernel-math.md §3.2, K29).

Pairs (x[2i], x[2i+1]) rotate by angle i; cos / sin rows are the ABI's [.., R] duplicated-half
tables (the first R/2 columns are read) or half tables [.., R/2].  Forward: e' = e c - o s,
o' = e s + o c; inverse is the conjugate.  Each rotated output is rounded to BF16 (the device's
rounding point); the non-RoPE part stays FP32.
"""
from __future__ import annotations

import torch

from .numerics import bf16


def rotate(r, cos, sin, inverse: bool = False):
    half = r.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    if inverse:
        s = -s
    e, o = r[..., 0::2], r[..., 1::2]
    return torch.stack([bf16(e * c - o * s), bf16(e * s + o * c)], dim=-1).reshape(r.shape)


def rope_tail(x, cos, sin, rope_dims: int, inverse: bool = False):
    """[.., nope | rope]: the rope part rotated (each output BF16), the nope part unchanged."""
    return torch.cat([x[..., :-rope_dims], rotate(x[..., -rope_dims:], cos, sin, inverse)], dim=-1)
