"""K3 hc_pre (Sinkhorn mix), K4 hc_post, K5 hc_head: the four hyper-connection streams."""
from __future__ import annotations

import torch

from .numerics import bf16, mm


def _mixes(x_hc, fn, eps):
    """r * (fn . x_flat): the linear before the rms factor (FP32)."""
    flat = x_hc.reshape(x_hc.shape[0], -1)
    r = torch.rsqrt(torch.mean(flat * flat, dim=-1, keepdim=True) + eps)
    return r * mm(flat, fn.T)


def _collapse(x_hc, pre):
    """sum_h pre_h x_h in the device's association ((x0 + x1) + (x2 + x3)), -> BF16 values."""
    t = pre[..., None] * x_hc
    if t.shape[1] == 4:
        return bf16((t[:, 0] + t[:, 1]) + (t[:, 2] + t[:, 3]))
    return bf16(t.sum(dim=1))


def sinkhorn(c, iters: int, eps: float):
    """Row softmax + eps, column normalise, then (iters - 1) x {rows, columns}; c [T, in, out]."""
    c = torch.softmax(c, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def hc_pre(x_hc, fn, scale, base, *, hc: int, rms_eps: float, hc_eps: float, iters: int):
    """-> (x_mixed [T, D] bf16 values, post [T, HC], comb [T, HC, HC] indexed [in, out])."""
    mix = (2 + hc) * hc
    m = _mixes(x_hc, fn[:mix], rms_eps)
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (m[:, 2 * hc:] * scale[2] + base[2 * hc:mix]).reshape(-1, hc, hc)
    return _collapse(x_hc, pre), post, sinkhorn(comb, iters, hc_eps)


def hc_post(x, residual, post, comb):
    """y[t, j] = post[t, j] x[t] + sum_i comb[t, i, j] residual[t, i] (FP32 residual stream)."""
    return post[..., None] * x[:, None, :] + torch.einsum("tij,tid->tjd", comb, residual)


def hc_head(x_hc, fn, scale, base, *, rms_eps: float, hc_eps: float):
    m = _mixes(x_hc, fn, rms_eps)
    pre = torch.sigmoid(m * scale[0] + base) + hc_eps
    return _collapse(x_hc, pre)
