"""K10 lightning indexer: INT8 index queries against the INT8 compressed index cache, top-k.

score[t, c] = sum_h relu(f32(q_i8[t,h] . kv_i8[c]) * q_scale[t,h] * kv_scale[c]) * w[t,h] for
c < visible_t = min(cache_len, (p+1)//4, cap), FP32_NEG_INF elsewhere; the top min(IK, visible)
in descending score order (ties: lower row first), -1 padded.  Offset 0 (compositions).
"""
from __future__ import annotations

import torch

from .numerics import bf16, int8_gemm, mm, q8
from .paged import get_rows, table_slot
from .rope import rope_tail

FP32_NEG_INF = -3.4028234663852886e38


def index_queries(x_n, qr, qr_scale, w, cos, sin, *, heads: int, head_dim: int, rope_dims: int):
    """-> (q_i8 [T, IH, IHD] int values, q_scale [T, IH, 1], weights [T, IH])."""
    q = int8_gemm(qr, qr_scale, w["csa_idx_wq_b"], w["csa_idx_wq_b_scale"]).reshape(-1, heads, head_dim)
    q = bf16(rope_tail(q, cos[:, None, :], sin[:, None, :], rope_dims))
    q_i8, q_scale = q8(mm(q, w["csa_hadamard_idx"]))
    wts = mm(x_n, w["csa_weights_proj"]) * (head_dim ** -0.5 * heads ** -0.5)
    return q_i8, q_scale, wts


def lightning_indexer(x_n, qr, qr_scale, w, cos, sin, idx_flat, scale_flat, idx_tables, pos, cache_len, *,
                      heads: int, head_dim: int, rope_dims: int, topk: int, cap: int):
    """idx_tables [T, width] (each row's request table), cache_len [T] -> (score, topk_idxs [T, IK])."""
    q_i8, q_scale, wts = index_queries(x_n, qr, qr_scale, w, cos, sin, heads=heads, head_dim=head_dim,
                                       rope_dims=rope_dims)
    visible = torch.minimum(torch.minimum(cache_len, (pos + 1) // 4), torch.full_like(pos, cap))
    n = max(int(visible.max()) if visible.numel() else 0, 1)
    c = torch.arange(n, device=pos.device)
    slots = table_slot(idx_tables, c[None, :].expand(pos.shape[0], -1), idx_flat.shape[1])
    kv = get_rows(idx_flat.reshape(-1, idx_flat.shape[-1]), slots)                    # [T, n, IHD]
    ks = get_rows(scale_flat.reshape(-1, 1), slots)[..., 0]                              # [T, n]
    dots = torch.einsum("thd,tnd->thn", q_i8.double(), kv.double()).float()             # exact integer sums
    s = torch.relu(dots * q_scale * ks[:, None, :])
    score = torch.sum(s * wts[..., None], dim=1)
    keep = (c[None, :] < visible[:, None]) & (slots >= 0)
    score = torch.where(keep, score, torch.full_like(score, FP32_NEG_INF))
    order = torch.sort(-score, dim=-1, stable=True).indices[:, :topk].to(torch.int32)
    k = torch.minimum(visible, torch.full_like(visible, topk))
    j = torch.arange(order.shape[1], device=pos.device)[None, :]
    out = torch.where(j < k[:, None], order, torch.full_like(order, -1))
    if out.shape[1] < topk:
        out = torch.cat([out, torch.full((out.shape[0], topk - out.shape[1]), -1, dtype=out.dtype,
                                         device=out.device)], dim=1)
    return score, out

