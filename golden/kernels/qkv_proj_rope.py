"""K6 qkv_proj_rope: low-rank query (W8A8 up-projection), single-head KV, interleaved RoPE.

The same kernel serves the SWA profile (theta 1e4) and the compress profile (theta 160000 + YaRN):
the profile is only in the cos/sin rows the caller passes.
"""
from __future__ import annotations

import numpy as np

from .rmsnorm import rmsnorm_f
from .rope import compressed_rows, rope_tail_bf16

CHUNK_BYTES = 4 << 20     # f64 query rows per NumPy chunk of _query_heads


def qkv_proj_rope(x, wq_a, wq_b, wq_b_scale, wkv, gamma_cq, gamma_ckv, rope_cos, rope_sin, *, cfg, nm,
                  proj=None, q_head_norm=True):
    """x [T, D] (attn-normed, bf16 values) -> q [T, H, HD], kv [T, HD] (bf16 values),
    qr [T, QL] (int8 values), qr_scale [T, 1] (the shared low-rank query, reused by the indexer).
    proj: the (act(x) @ wq_a, act(x) @ wkv) products when the caller already has them (the JAX
    path's one fused projection GEMM).  q_head_norm False: no per-head RMS renormalization of q
    (the official V4.1 drafter attention has none; every target layer and the device drafter do)."""
    eps = cfg.rms_norm_eps
    if proj is None:
        a = nm.act(x)
        proj = nm.mm(a, nm.asf(wq_a)), nm.mm(a, nm.asf(wkv))
    qr_f = rmsnorm_f(proj[0], gamma_cq, nm, eps)                                # f32, not rounded
    qr, qr_scale = nm.q8(qr_f)
    q = _query_heads(nm.int_mm(qr, wq_b), qr_scale, nm.asf(wq_b_scale), rope_cos, rope_sin, cfg=cfg, nm=nm,
                     q_head_norm=q_head_norm)
    kv = compressed_rows(proj[1], gamma_ckv, rope_cos, rope_sin, cfg=cfg, nm=nm)   # official: FP8 nope part (§7 #7)
    return q, kv, qr, qr_scale


def _query_heads(qi, qr_scale, wq_b_scale, cos, sin, *, cfg, nm, q_head_norm):
    """The up-projection's exact integer product qi [T, H*HD] -> q [T, H, HD] (bf16 values):
    dequantized, per-head RMS renormalized, RoPE tail.  Every step is per row, so NumPy runs it over
    chunks of rows (about CHUNK_BYTES: FLASH's 32768-wide rows would otherwise pass through memory
    several times); each row's arithmetic is the same in any chunk."""
    T = qi.shape[0]
    H, HD = cfg.num_attention_heads, cfg.head_dim

    def rows(lo, hi):
        q = (qi[lo:hi] * qr_scale[lo:hi] * wq_b_scale).reshape(hi - lo, H, HD)
        if q_head_norm:
            q = rmsnorm_f(q, None, nm, cfg.rms_norm_eps)                       # per-head, unweighted
        return rope_tail_bf16(q, cos[lo:hi, None, :], sin[lo:hi, None, :], nm)

    chunk = max(1, CHUNK_BYTES // (8 * H * HD))
    if not nm.is_numpy or T <= chunk:
        return rows(0, T)
    out = np.empty((T, H, HD), nm.f)
    for lo in range(0, T, chunk):
        out[lo:lo + chunk] = rows(lo, min(lo + chunk, T))
    return out
