"""K11 sparse attention (SWA / CSA / HCA) with the attention sink.

MQA: keys = values = the 512-wide KV rows.  Candidates per query: the window rows (physical ori
slots, oldest first) and, for CSA / HCA, compressed rows (logical rows read through the request's
compressed block table).  Tiled online softmax over tiles of 128 candidates (the window is tile 0);
the probabilities are rounded to bf16 before the PV product (device); the sink adds exp(sink - m)
to the denominator; no valid candidate gives 0.  Inverse RoPE at the query position, bf16 out.
"""
from __future__ import annotations

import numpy as np

from ..numerics import BF16, NEG_INF_ATTN
from .rope import rope_tail_bf16

TILE = 128
CHUNK_BYTES = 4 << 20      # widened candidates per NumPy chunk (see sparse_attention)


def candidate_buffers(T, W, n, cmp_kv, hd, *, nm, tile=TILE):
    """NumPy buffers K [T, N, HD], valid [T, N] for gather_candidates, pad columns filled: zeros
    after the window, compressed row 0 after the compressed rows (never valid: probability 0)."""
    Wp = -(-W // tile) * tile
    K = np.empty((T, Wp + (-(-n // tile) * tile), hd), nm.f)
    K[:, W:Wp] = 0.0
    if n:
        K[:, Wp + n:] = cmp_kv.reshape(-1, hd)[0]
    return K, np.zeros(K.shape[:2], bool)


def candidate_slots(swa_indices, swa_lens, *, cmp_kv=None, cmp_rows=None, cmp_block_table=None, req=None, nm):
    """Where each query's candidates are read: (window slots [T, W], window valid [T, W],
    compressed slots [T, n], compressed ok [T, n]; the last two None without compressed rows).
    A slot is -1 where nothing is read (get_rows reads row 0 there; the flags mask it)."""
    xp = nm.xp
    W = swa_indices.shape[1]
    valid = (xp.arange(W)[None, :] < swa_lens[:, None]) & (swa_indices >= 0)
    wslots = xp.where(valid, swa_indices, -1)
    if cmp_rows is None or not cmp_rows.shape[1]:
        return wslots, valid, None, None
    rpp, width = cmp_kv.shape[1], cmp_block_table.shape[1]
    pg = xp.where(cmp_rows >= 0, cmp_rows, 0) // rpp
    ent = cmp_block_table[req[:, None], xp.minimum(pg, width - 1)]
    ok = (cmp_rows >= 0) & (pg < width) & (ent >= 0)
    return wslots, valid, xp.where(ok, ent * rpp + cmp_rows % rpp, -1), ok


def gather_candidates(kv_cache, slots, *, cmp_kv=None, nm, tile=TILE, buffers=None):
    """K [T, N, HD] and valid [T, N], N padded to a multiple of `tile`, read at `slots` (these
    queries' candidate_slots).

    Pad columns: zeros after the window, compressed row 0 after the compressed rows (never valid,
    so never read: their probability is 0)."""
    xp = nm.xp
    wslots, valid, cslots, ok = slots
    T, W = wslots.shape
    win = nm.get_rows(kv_cache, wslots)
    Wp = -(-W // tile) * tile
    n = 0 if cslots is None else cslots.shape[1]
    if n:
        cmp = nm.get_rows(cmp_kv, cslots)
    np_ = Wp + (-(-n // tile) * tile)
    if nm.is_numpy:
        # one f64 buffer, each part widened as it is copied in (no widened copies concatenated);
        # `buffers` (from candidate_buffers) already hold the pad columns: only rows are written
        K, v = buffers if buffers is not None else candidate_buffers(T, W, n, cmp_kv, win.shape[-1], nm=nm)
        K, v = K[:T], v[:T]
        K[:, :W] = win
        v[:, :W] = valid
        if n:
            K[:, Wp:Wp + n] = cmp
            v[:, Wp:Wp + n] = ok
        return K, v
    K = nm.asf(win)
    if Wp > W:
        K = xp.concatenate([K, xp.zeros((T, Wp - W, K.shape[-1]), K.dtype)], axis=1)
        valid = xp.concatenate([valid, xp.zeros((T, Wp - W), bool)], axis=1)
    if n:
        Kc = nm.asf(cmp)
        if np_ - Wp > n:
            row0 = nm.asf(cmp_kv.reshape(-1, Kc.shape[-1])[0])
            Kc = xp.concatenate([Kc, xp.broadcast_to(row0, (T, np_ - Wp - n, Kc.shape[-1]))], axis=1)
            ok = xp.concatenate([ok, xp.zeros((T, np_ - Wp - n), bool)], axis=1)
        K = xp.concatenate([K, Kc], axis=1)
        valid = xp.concatenate([valid, ok], axis=1)
    return K, valid


def attend(q, K, valid, attn_sink, *, cfg, nm, tile=TILE):
    """Tiled softmax with sink: q [T, H, HD], K [T, N, HD], valid [T, N] -> [T, H, HD] (f32)."""
    xp = nm.xp
    T, N, HD = K.shape
    nt = N // tile
    if nm.exact:
        s = nm.mm(nm.asf(q), K.transpose(0, 2, 1))
    else:
        # as (K q^T)^T: ~2.5x faster in OpenBLAS than an 8-row GEMM against a transposed K.  The
        # products of bf16 values are exact in f64 and a sum of 128 of them is exact unless they
        # span ~37 binades (and far below the FP32 rounding after it otherwise), so the
        # orientation does not show; exact mode keeps q K^T (its products round, and OpenBLAS's
        # kernels for the two orientations add them differently)
        s = nm.mm(K, nm.contiguous(nm.asf(q).transpose(0, 2, 1))).transpose(0, 2, 1)
    v = valid.reshape(T, 1, nt, tile)
    if nm.is_numpy:     # the same steps in place on one C-order buffer (fewer passes over [T, H, N])
        e = np.multiply(s, cfg.softmax_scale, order="C").reshape(T, -1, nt, tile)
        m = np.max(e, axis=-1, where=v, initial=NEG_INF_ATTN)     # = max(where(v, s, NEG))
        np.subtract(e, m[..., None], out=e)
        np.exp(e, out=e, where=v)         # valid only: NumPy's SIMD exp takes ~7x longer on the
        np.copyto(e, 0.0, where=~v)       # masked (underflowing) arguments; those are 0
    else:
        s = xp.where(v, (s * cfg.softmax_scale).reshape(T, -1, nt, tile), NEG_INF_ATTN)
        m = xp.max(s, axis=-1)
        e = xp.where(v, xp.exp(s - m[..., None]), 0.0)
    l_t = xp.sum(e, axis=-1)
    if nm.is_numpy and nm.mode == "device":
        # P rounded to bf16 and widened straight into the PV GEMM's [T, nt, H, tile] operand (a
        # plain layout is faster for OpenBLAS; bf16 products are exact, as in `s` above)
        pt = np.empty((T, nt, e.shape[1], tile))
        np.copyto(pt.transpose(0, 2, 1, 3), e.astype(np.float32).astype(BF16))
    else:
        pt = (e if nm.mode == "official" else nm.bf16(e)).transpose(0, 2, 1, 3)   # the device rounds P to bf16
    o_raw = nm.mm(pt, K.reshape(T, nt, tile, HD))            # [T, nt, H, HD]
    any_t = xp.any(v, axis=-1)                               # [T, 1, nt]
    if nm.is_numpy:
        return _combine_tiles_np(m, l_t, o_raw, any_t, nm.asf(attn_sink))
    o_t = o_raw.transpose(0, 2, 1, 3)
    has = xp.any(any_t, axis=-1)                             # [T, 1]
    M = xp.max(xp.where(any_t, m, -xp.inf), axis=-1)
    M = xp.where(has, M, 0.0)
    a = xp.where(any_t, xp.exp(m - M[..., None]), 0.0)
    o = xp.sum(a[..., None] * o_t, axis=2)
    den = xp.sum(a * l_t, axis=2) + xp.exp(nm.asf(attn_sink)[None, :] - M)
    return xp.where(has[..., None], o / den[..., None], 0.0)


def _combine_tiles_np(m, l_t, o_raw, any_t, sink):
    """attend's tile combination on NumPy, with the generic code's bits and no [T, H, nt, HD]
    temporary: its sum over the tile axis (not the innermost one) adds tile by tile in order from
    0.0 (so a -0 term sums to +0), as the loop here does.  One tile: its weight exp(m - M) is
    exactly 1 (M = m), or the row is masked to 0 either way.  Where every tile of every row has a
    valid candidate, the masks select everything and are skipped."""
    every = bool(np.all(any_t))                              # every tile of every row has a candidate
    has = np.any(any_t, axis=-1)                             # [T, 1]
    nt = m.shape[-1]
    if nt == 1:
        M = np.where(has, m[..., 0], 0.0)
        o = o_raw[:, 0] + 0.0
        den = l_t[..., 0] + np.exp(sink[None, :] - M)
    else:
        if every:       # (the usual case) the masks change nothing: left out
            M = np.max(m, axis=-1)
            a = np.exp(m - M[..., None])                        # [T, H, nt]
        else:
            M = np.max(np.where(any_t, m, -np.inf), axis=-1)
            M = np.where(has, M, 0.0)
            a = np.where(any_t, np.exp(m - M[..., None]), 0.0)  # [T, H, nt]
        o = a[..., 0, None] * o_raw[:, 0]
        o += 0.0
        tmp = np.empty_like(o)
        for j in range(1, nt):
            o += np.multiply(a[..., j, None], o_raw[:, j], out=tmp)
        den = np.sum(a * l_t, axis=2) + np.exp(sink[None, :] - M)
    o /= den[..., None]
    if not every:
        o[~has[:, 0]] = 0.0
    return o


def sparse_attention(q, kv_cache, swa_indices, swa_lens, attn_sink, rope_cos, rope_sin, *, cmp_kv=None,
                     cmp_rows=None, cmp_block_table=None, req=None, cfg, nm, chunk=None):
    """-> o [T, H, HD] (bf16 values), inverse-RoPE'd at each query's position.

    NumPy runs the tokens in chunks of `chunk` (default: as many as keep the widened candidates
    near CHUNK_BYTES, so that the gather, both GEMMs and the softmax between them work in cache:
    ~2x faster than 64-token chunks on SMALL; every token's arithmetic is the same in any chunk),
    and the inverse RoPE over ~CHUNK_BYTES of output rows at a time."""
    T = q.shape[0]
    if chunk is None:
        n = -(-swa_indices.shape[1] // TILE) + (0 if cmp_rows is None else -(-cmp_rows.shape[1] // TILE))
        chunk = max(1, CHUNK_BYTES // (n * TILE * q.shape[-1] * 8))

    # NumPy: one candidate buffer serves every chunk (its pad columns written once, and in cache)
    n_cmp = 0 if cmp_rows is None else cmp_rows.shape[1]
    buffers = (candidate_buffers(min(chunk, T), swa_indices.shape[1], n_cmp, cmp_kv, q.shape[-1], nm=nm)
               if nm.is_numpy else None)

    # every query's candidate addresses at once (a few calls per layer, not per chunk)
    slots = candidate_slots(swa_indices, swa_lens, cmp_kv=cmp_kv, cmp_rows=cmp_rows,
                            cmp_block_table=cmp_block_table, req=req, nm=nm)

    def run(lo, hi):
        K, valid = gather_candidates(kv_cache, tuple(None if a is None else a[lo:hi] for a in slots), cmp_kv=cmp_kv,
                                     nm=nm, buffers=buffers)
        return attend(q[lo:hi], K, valid, attn_sink, cfg=cfg, nm=nm)

    def tail(o, lo, hi):
        return rope_tail_bf16(o, rope_cos[lo:hi, None, :], rope_sin[lo:hi, None, :], nm, inverse=True)

    if not (nm.is_numpy and T > chunk):
        return tail(run(0, T), 0, T)
    # the inverse RoPE tail (per row) once per ~CHUNK_BYTES of output rows, while they are in cache
    out = np.empty(q.shape, nm.f)
    group = max(chunk, CHUNK_BYTES // (8 * q.shape[1] * q.shape[2]))
    for g0 in range(0, T, group):
        g1 = min(g0 + group, T)
        for lo in range(g0, g1, chunk):
            out[lo:min(lo + chunk, g1)] = run(lo, min(lo + chunk, g1))
        out[g0:g1] = tail(out[g0:g1], g0, g1)
    return out


def hca_rows(positions, req, kv_seq_lens, *, ratio=128, cap=8192, nm, n_max=None):
    """Logical compressed rows 0 .. n_c-1, n_c = min((p+1)//ratio, kv_seq_lens//ratio, cap)."""
    xp = nm.xp
    n_c = xp.minimum(xp.minimum((positions + 1) // ratio, kv_seq_lens[req] // ratio), cap)
    if n_max is None:
        n_max = int(n_c.max()) if positions.shape[0] else 0
    j = xp.arange(n_max)
    return xp.where(j[None, :] < n_c[:, None], j[None, :], -1).astype(xp.int32)


def csa_rows(topk_idxs, positions, *, ratio=4, nm):
    """Indexer top-k kept iff 0 <= c < (p+1)//4 (causal); the rest -1."""
    xp = nm.xp
    ok = (topk_idxs >= 0) & (topk_idxs < ((positions + 1) // ratio)[:, None])
    return xp.where(ok, topk_idxs, -1)
