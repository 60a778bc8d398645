"""K6 qkv_proj_rope: low-rank Q through W8A8, single-head KV, RoPE on the last R dims."""
from __future__ import annotations

import torch

from .numerics import bf16, int8_gemm, mm, q8, rmsnorm
from .rope import rope_tail


def qkv_proj_rope(x_n, w, cos, sin, *, heads: int, head_dim: int, rope_dims: int, eps: float):
    """x_n [T, D] bf16 values; w: wq_a [D, QL], wq_b [QL, H*HD] i8, wq_b_scale, wkv [D, HD],
    gamma_cq, gamma_ckv.  -> q [T, H, HD], kv [T, HD] (bf16 values), qr (int values), qr_scale."""
    qr_f = rmsnorm(mm(x_n, w["wq_a"]), w["gamma_cq"], eps)
    qr, qr_scale = q8(qr_f)
    q = int8_gemm(qr, qr_scale, w["wq_b"], w["wq_b_scale"]).reshape(-1, heads, head_dim)
    q = q * torch.rsqrt(torch.mean(q * q, dim=-1, keepdim=True) + eps)
    q = bf16(rope_tail(q, cos[:, None, :], sin[:, None, :], rope_dims))
    kv = bf16(rope_tail(rmsnorm(mm(x_n, w["wkv"]), w["gamma_ckv"], eps), cos, sin, rope_dims))
    return q, kv, qr, qr_scale
