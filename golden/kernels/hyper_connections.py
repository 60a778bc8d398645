"""K3 hc_pre (hc_weights with Sinkhorn, then collapse), K4 hc_post, K5 hc_head: the hyper-connection
residual streams."""
from __future__ import annotations

from .rmsnorm import rms_scale


def _sigmoid(x, xp):
    return 1.0 / (1.0 + xp.exp(-x))


def _mixes(x_hc, fn, nm, eps):
    """m = rsqrt(mean(x_flat^2) + eps) * (fn . x_flat): the linear runs before the rms factor."""
    x = nm.asf(x_hc)
    flat = x.reshape(x.shape[0], -1)
    return rms_scale(flat, nm, eps) * nm.mm(flat, nm.asf(fn).T)


def sinkhorn(logits, iters: int, hc_eps: float, nm):
    """Row softmax (+eps), then alternate column / row normalisation; iters counts the first
    column pass: iters - 1 further (row, column) rounds.  logits [..., HC, HC] indexed [in, out]."""
    xp = nm.xp
    c = xp.exp(logits - xp.max(logits, axis=-1, keepdims=True))
    c = c / xp.sum(c, axis=-1, keepdims=True) + hc_eps
    c = c / (xp.sum(c, axis=-2, keepdims=True) + hc_eps)
    def rounds(_, c):
        c = c / (xp.sum(c, axis=-1, keepdims=True) + hc_eps)
        return c / (xp.sum(c, axis=-2, keepdims=True) + hc_eps)
    if not nm.is_numpy:    # one loop body: unrolled, XLA fuses the chain quadratically (compile time)
        from jax import lax
        return lax.fori_loop(0, iters - 1, rounds, c)
    return _rounds_np(c, iters - 1, hc_eps)


def _rounds_np(c, n, hc_eps):
    """`rounds` n times on NumPy, in place on the [in, out, ...] layout: a 4-term sum over a
    leading axis adds term by term in order, as NumPy's sum over a 4-long axis of [..., HC, HC]
    does, so the bits are the same at a fraction of the calls (~20 rounds per hc_pre)."""
    import numpy as np
    ct = np.ascontiguousarray(np.moveaxis(c, (-2, -1), (0, 1)))
    rs = np.empty((ct.shape[0], 1) + ct.shape[2:])
    cs = np.empty((1,) + ct.shape[1:])
    for _ in range(n):
        np.add.reduce(ct, axis=1, keepdims=True, out=rs)
        rs += hc_eps
        ct /= rs
        np.add.reduce(ct, axis=0, keepdims=True, out=cs)
        cs += hc_eps
        ct /= cs
    return np.ascontiguousarray(np.moveaxis(ct, (0, 1), (-2, -1)))     # C order, as `rounds` gives


def collapse(x_hc, pre, nm):
    """(pre_0 x_0 + pre_1 x_1) + (pre_2 x_2 + pre_3 x_3), in that association order."""
    x = nm.asf(x_hc)
    p = pre[..., None]
    return (p[:, 0] * x[:, 0] + p[:, 1] * x[:, 1]) + (p[:, 2] * x[:, 2] + p[:, 3] * x[:, 3])


def hc_weights(x_hc, hc_fn, hc_scale, hc_base, *, cfg, nm):
    """x_hc [T, HC, D] -> (pre [T, HC], post [T, HC], comb [T, HC*HC] [in, out]): a sub-layer's
    mixing weights from its input streams.

    hc_fn may carry padding rows beyond MIX (the decode ABI pads to 32); they are ignored."""
    xp = nm.xp
    hc, mix = cfg.hc_mult, cfg.mix_hc
    m = _mixes(x_hc, hc_fn[:mix], nm, cfg.rms_norm_eps)
    s, b = nm.asf(hc_scale), nm.asf(hc_base)
    pre = _sigmoid(m[:, :hc] * s[0] + b[:hc], xp) + cfg.hc_eps
    post = 2.0 * _sigmoid(m[:, hc:2 * hc] * s[1] + b[hc:2 * hc], xp)
    comb = (m[:, 2 * hc:] * s[2] + b[2 * hc:]).reshape(-1, hc, hc)
    comb = sinkhorn(comb, cfg.hc_sinkhorn_iters, cfg.hc_eps, nm)
    return pre, nm.r32(post), nm.r32(comb.reshape(-1, hc * hc))


def hc_pre(x_hc, hc_fn, hc_scale, hc_base, *, cfg, nm):
    """x_hc [T, HC, D] -> (x_mixed [T, D] bf16 values, post [T, HC], comb [T, HC*HC] [in, out]):
    the streams collapsed with the sub-layer's own pre-weights (pypto-lib, V4)."""
    pre, post, comb = hc_weights(x_hc, hc_fn, hc_scale, hc_base, cfg=cfg, nm=nm)
    return nm.bf16(collapse(x_hc, pre, nm)), post, comb


def hc_post(x, residual, post, comb, *, cfg, nm, stream_mix=None):
    """y[t, j] = post[t, j] x[t] + sum_i comb[t, i, j] residual[t, i]  -> [T, HC, D] f32.

    pypto keeps the residual in f32; the official reference rounds it to bf16 (§7 #8).
    stream_mix(c [T, in, out], residual [T, in, D]) -> [T, out, D]: the sum over input streams
    (default: one batched GEMM per token; the JAX path passes multiply-adds, see golden.jax_kernels)."""
    hc = cfg.hc_mult
    c = comb.reshape(-1, hc, hc)
    r = nm.asf(residual)
    mix = nm.mm(c.transpose(0, 2, 1), r) if stream_mix is None else stream_mix(c, r)
    y = post[:, :, None] * nm.asf(x)[:, None, :] + mix
    return nm.bf16(y) if nm.mode == "official" else nm.r32(y)


def hc_head(x_hc, hc_head_fn, hc_head_scale, hc_head_base, *, cfg, nm):
    """Collapse the streams to one hidden [T, D] (bf16 values): sigmoid pre-weights, no Sinkhorn."""
    xp = nm.xp
    m = _mixes(x_hc, hc_head_fn, nm, cfg.rms_norm_eps)
    pre = _sigmoid(m * nm.asf(hc_head_scale)[0] + nm.asf(hc_head_base), xp) + cfg.hc_eps
    return nm.bf16(collapse(x_hc, pre, nm))
