"""K10 lightning indexer: per-head INT8 query scores against the INT8 indexer cache, top-k.

score[t, c] = sum_h relu(q_i8[t,h] . k_i8[c] * q_scale[t,h] * k_scale[c]) * w[t,h],
w = (x . weights_proj) * IHD^-0.5 * IH^-0.5.  Candidates c < visible_t = min(cache_len_b,
(p+1) // 4, cap); the rest score FP32_NEG_INF.  top-k: min(IK, visible_t) indices in descending
score order (stable: lower index first on ties), the rest -1, offset 0 (pypto compositions).
"""
from __future__ import annotations

import numpy as np

from ..numerics import FP32_NEG_INF
from .rope import rope_tail_bf16

PREFILL_SCORE_CAP = 2048          # RAW_TOKEN_CAP 8192 / 4
CHUNK_BYTES = 4 << 20             # f64 [tokens, IH, C] head scores per NumPy chunk (lightning_indexer)


def index_query(qr, qr_scale, csa_idx_wq_b, csa_idx_wq_b_scale, csa_hadamard_idx, rope_cos, rope_sin, *, cfg, nm):
    """q_i8 [T, IH, IHD] (int8 values, or rounded floats outside device mode), q_scale [T, IH, 1]."""
    T = qr.shape[0]
    q = nm.int_mm(qr, csa_idx_wq_b) * qr_scale * nm.asf(csa_idx_wq_b_scale)
    q = q.reshape(T, cfg.index_n_heads, cfg.index_head_dim)
    q = rope_tail_bf16(q, rope_cos[:, None, :], rope_sin[:, None, :], nm)
    q = nm.mm(q, nm.rotation(csa_hadamard_idx))
    if nm.mode == "device":
        return nm.q8(q)
    return nm.fp4(q), nm.xp.ones(q.shape[:-1] + (1,), nm.f)


def lightning_indexer(x, qr, qr_scale, csa_idx_wq_b, csa_idx_wq_b_scale, csa_weights_proj, csa_hadamard_idx,
                      rope_cos, rope_sin, idx_kv_cache, idx_kv_scale, idx_block_table, req, positions,
                      cache_lens, *, cfg, nm, cap, n_candidates=None, chunk=None):
    """-> (score [T, C] f32, topk_idxs [T, IK] int32 logical compressed rows, -1 padded).

    NumPy scores the tokens in chunks of `chunk` (default: as many as keep the per-head scores near
    CHUNK_BYTES, in cache and on the heap; every token's arithmetic is the same in any chunk: its
    own GEMM, then elementwise steps and the head sum in head order)."""
    xp = nm.xp
    T = x.shape[0]
    IK = cfg.index_topk
    q_i8, q_scale = index_query(qr, qr_scale, csa_idx_wq_b, csa_idx_wq_b_scale, csa_hadamard_idx,
                                rope_cos, rope_sin, cfg=cfg, nm=nm)
    w = nm.r32(nm.mm(nm.asf(x), nm.asf(csa_weights_proj)) * (cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5))
    visible = xp.minimum(xp.minimum(cache_lens[req], (positions + 1) // 4), cap)
    if n_candidates is None:
        n_candidates = max(int(visible.max()) if T else 1, 1)
    C = n_candidates
    rpp = idx_kv_cache.shape[1]
    width = idx_block_table.shape[1]
    c = xp.arange(C)

    def rows(lo, hi):
        r = req[lo:hi]
        pg = c // rpp
        ent = idx_block_table[r[:, None], xp.minimum(pg, width - 1)[None, :]]
        ok = (pg[None, :] < width) & (ent >= 0)
        slot = xp.where(ok, ent * rpp + c[None, :] % rpp, -1)
        k = nm.asf(nm.get_rows(idx_kv_cache, slot))                      # [t, C, IHD]
        ks = nm.asf(nm.get_rows(idx_kv_scale, slot))[..., 0]             # [t, C]
        d = nm.mm(q_i8[lo:hi], k.transpose(0, 2, 1))                        # exact: |sum| < 2^24
        if nm.is_numpy:     # the same steps in place (the GEMM's result is a fresh array)
            d *= q_scale[lo:hi]
            d *= ks[:, None, :]
            np.maximum(d, 0.0, out=d)
            d *= w[lo:hi, :, None]
            s = np.sum(d, axis=1)
        else:
            s = xp.sum(xp.maximum(d * q_scale[lo:hi] * ks[:, None, :], 0.0) * w[lo:hi, :, None], axis=1)
        keep = ok & (c[None, :] < visible[lo:hi, None])
        return xp.where(keep, nm.r32(s), FP32_NEG_INF)

    if nm.is_numpy:
        chunk = chunk or max(1, CHUNK_BYTES // (8 * cfg.index_n_heads * C))
        score = np.concatenate([rows(lo, min(lo + chunk, T)) for lo in range(0, T, chunk)] or
                               [np.zeros((0, C), nm.f)], axis=0)
    else:
        score = rows(0, T)
    order = xp.argsort(-score, axis=-1, stable=True)[:, :IK].astype(xp.int32)
    k = xp.minimum(visible, IK)
    j = xp.arange(order.shape[1])
    topk = xp.where(j[None, :] < k[:, None], order, -1)
    if order.shape[1] < IK:
        topk = xp.concatenate([topk, xp.full((T, IK - order.shape[1]), -1, xp.int32)], axis=1)
    return score, topk.astype(xp.int32)
