"""K22 dspark_proj, K23 the drafter's context KV, K24 the query block's attention.

dspark_proj: main_x = rms_norm(bf16(main_hidden . main_proj^T)).  Context KV: k = rmsnorm(main_x .
wkv; gamma_ckv) in FP32, RoPE (theta 1e4, no YaRN) on the tail with each half BF16, stored BF16.
Block attention: every row of a request's 7-row block sees the same candidates (the context
window a-127..a and the 7 block rows: no causal mask inside the block); one FP32 softmax over all
of them with the sink in the denominator (no tiles, P not rounded); the inverse RoPE in FP32 and
one BF16 rounding of the head.
"""
from __future__ import annotations

import torch

from .numerics import bf16, mm, rmsnorm
from .rmsnorm import rms_norm
from .rope import rope_tail

NEG_INF_ATTN = -1e20


def dspark_proj(main_hidden, main_proj_weight, main_norm_weight, eps: float):
    return rms_norm(bf16(mm(main_hidden, main_proj_weight.T)), main_norm_weight, eps)


def context_kv(main_x, wkv, gamma_ckv, cos, sin, *, rope_dims: int, eps: float):
    return bf16(rope_tail(rmsnorm(mm(main_x, wkv), gamma_ckv, eps), cos, sin, rope_dims))


def block_attention(q, K, valid, sink, cos, sin, *, scale: float, rope_dims: int):
    """q [B, 7, H, HD]; K [B, N, HD]; valid [B, N]; cos / sin [B, 7, R] -> [B, 7, H, HD] bf16 values."""
    s = torch.einsum("bqhd,bnd->bqhn", q, K) * scale
    v = valid[:, None, None, :]
    s = torch.where(v, s, torch.tensor(NEG_INF_ATTN, device=q.device))
    m = s.amax(dim=-1, keepdim=True)
    e = torch.where(v, torch.exp(s - m), torch.zeros((), device=q.device))
    den = e.sum(dim=-1, keepdim=True) + torch.exp(sink[None, None, :, None] - m)
    o = torch.einsum("bqhn,bnd->bqhd", e, K) / den
    half = rope_dims // 2
    c, s_ = cos[:, :, None, :half], -sin[:, :, None, :half]
    r = o[..., -rope_dims:]
    ev, od = r[..., 0::2], r[..., 1::2]
    rot = torch.stack([ev * c - od * s_, ev * s_ + od * c], dim=-1).reshape(r.shape)
    return bf16(torch.cat([o[..., :-rope_dims], rot], dim=-1))
