"""K11 sparse attention (SWA / CSA / HCA) with the attention sink, MQA over 512-wide KV rows.

Candidates: the window rows (tile 0, `W` columns, valid where k < lens and the slot >= 0), then
the compressed rows in their column order, in tiles of 128.  Per tile: max m, e = exp(s - m)
(0 for invalid), l = sum e, o = sum bf16(e) k (the device rounds P to BF16 before PV); tiles
merge by exp(m_t - M); the sink adds exp(sink - M) to the denominator; no candidate -> 0.
Inverse RoPE at the query position (each output BF16), BF16 out.
"""
from __future__ import annotations

import torch

from .numerics import bf16
from .paged import get_rows
from .rope import rope_tail

TILE = 128
NEG_INF_ATTN = -1e20


def _tiles(n: int) -> int:
    return -(-n // TILE) * TILE


def sparse_attention(q, kv_flat, win_slots, win_valid, sink, cos, sin, *, scale: float, rope_dims: int,
                     cmp_flat=None, cmp_slots=None):
    """q [T, H, HD]; win_slots / win_valid [T, W]; cmp_slots [T, n] (-1 invalid) -> [T, H, HD].
    Only rows with a candidate are computed: a row without one is 0 (and so is its inverse RoPE)."""
    live = win_valid.any(dim=1)
    if cmp_slots is not None and cmp_slots.shape[1]:
        live = live | (cmp_slots >= 0).any(dim=1)
    out = torch.zeros_like(q)
    rows = torch.nonzero(live).reshape(-1)
    if rows.numel():
        out[rows] = _attend(q[rows], kv_flat, win_slots[rows], win_valid[rows], sink, cos[rows], sin[rows],
                            scale=scale, rope_dims=rope_dims, cmp_flat=cmp_flat,
                            cmp_slots=None if cmp_slots is None else cmp_slots[rows])
    return out


def _attend(q, kv_flat, win_slots, win_valid, sink, cos, sin, *, scale, rope_dims, cmp_flat, cmp_slots):
    T, H, HD = q.shape
    W = win_slots.shape[1]
    K = get_rows(kv_flat, torch.where(win_valid, win_slots.long(), -1)).reshape(T, W, HD)
    valid = win_valid
    pad = _tiles(W) - W
    if pad:
        K = torch.cat([K, K.new_zeros(T, pad, HD)], 1)
        valid = torch.cat([valid, valid.new_zeros(T, pad)], 1)
    if cmp_slots is not None and cmp_slots.shape[1]:
        n = cmp_slots.shape[1]
        Kc = get_rows(cmp_flat, cmp_slots).reshape(T, n, HD)
        vc = cmp_slots >= 0
        pad = _tiles(n) - n
        if pad:
            Kc = torch.cat([Kc, Kc.new_zeros(T, pad, HD)], 1)
            vc = torch.cat([vc, vc.new_zeros(T, pad)], 1)
        K = torch.cat([K, Kc], 1)
        valid = torch.cat([valid, vc], 1)
    nt = K.shape[1] // TILE
    s = torch.einsum("thd,tnd->thn", q, K) * scale
    v = valid[:, None, :].reshape(T, 1, nt, TILE)
    s = torch.where(v, s.reshape(T, H, nt, TILE), torch.tensor(NEG_INF_ATTN, device=q.device))
    m = s.amax(dim=-1)                                                  # [T, H, nt]
    e = torch.where(v, torch.exp(s - m[..., None]), torch.zeros((), device=q.device))
    l_t = e.sum(dim=-1)
    o_t = torch.einsum("thkn,tknd->thkd", bf16(e), K.reshape(T, nt, TILE, HD))
    any_t = v.any(dim=-1)                                               # [T, 1, nt]
    has = any_t.any(dim=-1)                                             # [T, 1]
    M = torch.where(any_t, m, torch.tensor(float("-inf"), device=q.device)).amax(dim=-1)
    M = torch.where(has, M, torch.zeros((), device=q.device))
    a = torch.where(any_t, torch.exp(m - M[..., None]), torch.zeros((), device=q.device))
    o = (a[..., None] * o_t).sum(dim=2)
    den = (a * l_t).sum(dim=2) + torch.exp(sink[None, :] - M)
    o = torch.where(has[..., None], o / den[..., None], torch.zeros((), device=q.device))
    return bf16(rope_tail(o, cos[:, None, :], sin[:, None, :], rope_dims, inverse=True))
