"""K7 / K8 / K9: the ratio-4 overlapping compressor, the ratio-128 compressor and the indexer's
inner compressor with INT8 quant-on-write.

Every row projects kv and score (score += ape[pos mod ratio]).  A boundary row p ((p+1) mod
ratio == 0) pools a window per channel by a softmax over the rows' scores: ratio 4 takes the front
halves of p-7..p-4 and the back halves of p-3..p; ratio 128 takes p-127..p.  A window row at or
after its request's first position in this call is this call's fresh projection, an earlier one is
read from the OLD state ring; negative positions and unmapped pages are excluded.  State is
committed after pooling (the newer decode kernels' order, which serving's eager publication keeps).
"""
from __future__ import annotations

import torch

from .numerics import bf16, mm, q8, rmsnorm
from .paged import get_rows, ring_slot, set_rows
from .rope import rope_tail


def project(x, wkv, wgate, ape, pos, ratio: int):
    """kv and score projections [T, OUT] in FP32 (weights stored [OUT, D])."""
    return mm(x, wkv.T), mm(x, wgate.T) + ape[pos % ratio]


def pool(kvp, scp, rows, pos, first, state_flat, state_tables, page: int, ratio: int, missing_zero: bool = False):
    """Pooled [n, d] for boundary `rows` of the call.

    pos [T]: each row's position; first [T]: the position of its request's first row in the call;
    state_tables [T, width]: each row's state ring table; the call's rows of one request are
    consecutive, so the fresh row of position q for boundary row i is i - (pos[i] - q).
    missing_zero: an unmapped old row enters with score 0 and kv 0 instead of being excluded (the
    upstream prefill ratio-128 rule, kernel-math §7 #15)."""
    T, out = kvp.shape
    wlen = 2 * ratio if ratio == 4 else ratio
    p = pos[rows]
    q = p[:, None] - (wlen - 1) + torch.arange(wlen, device=pos.device)[None, :]
    fresh = q >= first[rows][:, None]
    fidx = torch.clamp(rows[:, None] - (p[:, None] - q), 0, T - 1)
    slots = ring_slot(state_tables[rows], q, page)
    old = get_rows(state_flat, torch.where(fresh, torch.full_like(slots, -1), slots))
    kv = torch.where(fresh[..., None], kvp[fidx], old[..., :out])
    sc = torch.where(fresh[..., None], scp[fidx], old[..., out:])
    valid = fresh | (slots >= 0)
    if ratio == 4:
        d = out // 2
        kv = torch.cat([kv[:, :ratio, :d], kv[:, ratio:, d:]], dim=1)
        sc = torch.cat([sc[:, :ratio, :d], sc[:, ratio:, d:]], dim=1)
    if missing_zero:
        zero = (q >= 0) & ~fresh & (slots < 0)
        sc = torch.where(zero[..., None], torch.zeros((), device=sc.device), sc)
        valid = valid | zero
    sc = torch.where(valid[..., None], sc, torch.tensor(float("-inf"), device=sc.device))
    kv = torch.where(valid[..., None], kv, torch.zeros((), device=kv.device))
    return torch.sum(torch.softmax(sc, dim=1) * kv, dim=1)


def boundary_rows(pos, ratio: int):
    return torch.nonzero((pos + 1) % ratio == 0).reshape(-1)


def main_compressor(x, pos, first, w, prefix: str, state_flat, state_tables, state_slots, cmp_flat, cmp_slots,
                    cos, sin, *, ratio: int, page: int, rope_dims: int, eps: float, missing_zero: bool = False):
    """CSA (ratio 4) or HCA (ratio 128) KV compressor.  Writes the compressed rows of boundary rows
    at cmp_slots and commits every row's [kv | score] at state_slots, in place.  cos / sin: each
    boundary row's compress-profile row at its window start.  -> (boundary rows, rows written)."""
    kvp, scp = project(x, w[prefix + "wkv"], w[prefix + "wgate"], w[prefix + "ape"], pos, ratio)
    rows = boundary_rows(pos, ratio)
    y = torch.zeros((0, cmp_flat.shape[-1]), device=x.device)
    if rows.numel():
        pooled = pool(kvp, scp, rows, pos, first, state_flat, state_tables, page, ratio, missing_zero)
        y = bf16(rope_tail(rmsnorm(pooled, w[prefix + "norm_w"], eps), cos[rows], sin[rows], rope_dims))
        set_rows(cmp_flat, cmp_slots[rows], y.reshape(-1, *cmp_flat.shape[1:]))
    set_rows(state_flat, state_slots, torch.cat([kvp, scp], dim=-1))
    return rows, y


def indexer_compressor(x, pos, first, w, state_flat, state_tables, state_slots, idx_flat, scale_flat, idx_slots,
                       cos, sin, *, page: int, rope_dims: int, eps: float):
    """K9: ratio-4 pooling at the index head dim, rms, RoPE, BF16, Hadamard, BF16, then INT8 rows
    with their FP32 scale written at idx_slots."""
    kvp, scp = project(x, w["csa_inner_wkv"], w["csa_inner_wgate"], w["csa_inner_ape"], pos, 4)
    rows = boundary_rows(pos, 4)
    if rows.numel():
        pooled = pool(kvp, scp, rows, pos, first, state_flat, state_tables, page, 4)
        y = bf16(rope_tail(rmsnorm(pooled, w["csa_inner_norm_w"], eps), cos[rows], sin[rows], rope_dims))
        y = bf16(mm(y, w["csa_hadamard_idx"]))
        y_i8, dq = q8(y)
        set_rows(idx_flat, idx_slots[rows], y_i8.reshape(-1, *idx_flat.shape[1:]))
        set_rows(scale_flat, idx_slots[rows], dq.reshape(-1, *scale_flat.shape[1:]))
    set_rows(state_flat, state_slots, torch.cat([kvp, scp], dim=-1))
