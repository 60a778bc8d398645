"""RoPE tables (plain and YaRN compress profile) and the interleaved rotation (kernel-math.md §3.2).

Tables are in the ABI layout: [rows, R] with the cos (sin) of the R/2 frequencies duplicated,
concat(half, half); the rotation reads the first half.  Pairs are interleaved: (x[2i], x[2i+1])
is rotated by frequency i.
"""
from __future__ import annotations


import numpy as np

from twin.abi.rope import inv_freq as abi_inv_freq

from ..numerics import BF16
from .rmsnorm import rmsnorm_f

SWA_PROFILE, COMPRESS_PROFILE = "swa", "compress"
PROFILES = (SWA_PROFILE, COMPRESS_PROFILE)


def profile_of_ratio(ratio: int) -> str:
    return SWA_PROFILE if ratio == 0 else COMPRESS_PROFILE


def inv_freq(cfg, profile: str, dtype=np.float64) -> np.ndarray:
    """[R/2] inverse frequencies of a profile, every step in `dtype` (twin.abi.rope: float32 is
    pypto-lib's table, float64 exact mode's)."""
    if profile not in PROFILES:
        from twin.abi.errors import AbiError
        raise AbiError("profile", profile, f"one of {PROFILES}", where="rope")
    return abi_inv_freq(cfg, profile == COMPRESS_PROFILE, dtype)


def rope_rows(cfg, profile: str, positions, nm):
    """cos, sin [T, R] at `positions`: exact mode float64 throughout; device and official mode
    pypto-lib's table, f32 inverse frequencies and angles, bf16 values."""
    pos = np.asarray(positions)
    if nm.exact:
        ang = pos.astype(np.float64)[:, None] * inv_freq(cfg, profile)[None, :]
        c, s = np.cos(ang), np.sin(ang)
    else:
        ang = pos.astype(np.float32)[:, None] * inv_freq(cfg, profile, np.float32)[None, :]
        c, s = nm.bf16(np.cos(ang)), nm.bf16(np.sin(ang))
        c, s = np.asarray(c), np.asarray(s)
    return nm.xp.asarray(np.concatenate([c, c], -1)), nm.xp.asarray(np.concatenate([s, s], -1))


def rope_rotate(x, cos, sin, nm, inverse: bool = False, out=None):
    """Rotate the interleaved pairs of x [..., R] with cos/sin broadcastable to [..., R] (ABI layout).

    forward: e' = e c - o s, o' = e s + o c; inverse is the conjugate rotation.  out (NumPy): an
    array [..., R] whose even / odd views receive e' / o', each cast to out's dtype as it is
    written (no stacked copy); returned."""
    xp = nm.xp
    half = x.shape[-1] // 2
    c = nm.asf(cos)[..., :half]
    s = nm.asf(sin)[..., :half]
    if inverse:
        s = -s
    e, o = x[..., 0::2], x[..., 1::2]
    if out is not None:
        np.subtract(e * c, o * s, out=out[..., 0::2])
        np.add(e * s, o * c, out=out[..., 1::2])
        return out
    out = xp.stack([e * c - o * s, e * s + o * c], axis=-1)
    return out.reshape(x.shape)


def rope_tail(x, cos, sin, nm, inverse: bool = False):
    """Rotate the last R dims of x (the RoPE part of a head), leaving the nope part: both in f."""
    xp = nm.xp
    R = cos.shape[-1]
    nope, rot = x[..., :-R], x[..., -R:]
    return xp.concatenate([nope, nm.bf16(rope_rotate(rot, cos, sin, nm, inverse))], axis=-1)


def rope_tail_bf16(x, cos, sin, nm, inverse: bool = False):
    """nm.bf16(rope_tail(x, cos, sin, nm, inverse)) with one rounding pass: rope_tail's own bf16
    rounding of the rotated part is repeated by the outer one (a bf16 value rounds to itself),
    so the whole row is rounded once."""
    R = cos.shape[-1]
    if nm.is_numpy and not nm.exact:
        return _rope_tail_bf16_np(nm.asf(x), cos, sin, nm, inverse)
    rot = rope_rotate(x[..., -R:], cos, sin, nm, inverse)
    return nm.bf16(nm.xp.concatenate([x[..., :-R], rot], axis=-1))


def _rope_tail_bf16_np(x, cos, sin, nm, inverse):
    """rope_tail_bf16 on NumPy outside exact mode: every part is rounded to f32 as it is written
    into one f32 row (f64 arithmetic, then the cast, as nm.bf16's first step), with no stacked or
    concatenated f64 copies; then f32 -> bf16 -> f64 as nm.bf16 does."""
    R = cos.shape[-1]
    y = np.empty(x.shape, np.float32)
    y[..., :-R] = x[..., :-R]
    rope_rotate(x[..., -R:], cos, sin, nm, inverse, out=y[..., -R:])
    return (y.astype(BF16) if nm.rounds_bf16 else y).astype(nm.f)


def compressed_rows(pooled, norm_w, cos, sin, *, cfg, nm):
    """Pooled (the compressors) or projected (qkv_proj_rope's KV) rows -> KV rows (bf16 values):
    RMSNorm, the RoPE tail, and official's FP8 round trip of the non-RoPE part (kernel-math §8 (b),
    §7 #7)."""
    y = rmsnorm_f(pooled, norm_w, nm, cfg.rms_norm_eps)
    if nm.mode != "official":
        return rope_tail_bf16(y, cos, sin, nm)
    y = rope_tail(y, cos, sin, nm)
    R = cfg.qk_rope_head_dim
    y = nm.xp.concatenate([nm.kv_fp8(y[:, :-R]), y[:, -R:]], axis=-1)
    return nm.bf16(y)
