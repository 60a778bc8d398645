"""K14 gate (FFN norm folded in), K15 shared expert, K16 routed experts, K17 dispatch / combine.

Gate: inv_rms = rsqrt(mean(x^2) + eps); xg = x * norm_w (f32); Q8(xg) with the rms factor riding
on the dequant scale; logits = inv_rms * (xg . gate_w^T); scores = sqrt(softplus(logits)).  Hash
layers route by tid2eid[input_ids]; the others by a stable descending sort of scores + bias.
weights = scores[idx] / sum * routed_scaling (unbiased scores).
Experts: SwiGLU with gate clamped to <= limit and up to [-limit, limit]; W8A8 on all three
matmuls; the routing weight rides on the w2 dequant scale; combine adds routes in k order.
"""
from __future__ import annotations

from .rmsnorm import rms_scale


def _softplus(x, xp):
    return xp.maximum(x, 0.0) + xp.log1p(xp.exp(-xp.abs(x)))


def gate(x_mixed, norm_w, gate_w, gate_bias, tid2eid, input_ids, *, layer, cfg, nm, num_tokens=None, top_k=None):
    """-> x_norm_i8 [T, D], x_norm_scale [T, 1], indices [T, K] int32, weights [T, K].
    top_k(biased_scores, k): the k best experts per row, best first, ties to the lower id (the
    default is a stable descending argsort; the JAX path passes a sort-free equivalent)."""
    xp = nm.xp
    x = nm.asf(x_mixed)
    inv_rms = rms_scale(x, nm, cfg.rms_norm_eps)
    xg = x * nm.asf(norm_w)
    if nm.mode == "official":         # official routes the bf16 ffn_norm output (§7 #8)
        xn = nm.bf16(xg * inv_rms)
        logits = nm.mm(xn, nm.asf(gate_w).T)
        x_i8, x_scale = nm.q8(xn)
    else:
        logits = inv_rms * nm.mm(xg, nm.asf(gate_w).T)
        x_i8, dq = nm.q8(xg)
        x_scale = dq * inv_rms
    x_scale = nm.r32(x_scale)
    scores = nm.r32(xp.sqrt(_softplus(nm.r32(logits), xp)))
    K = cfg.num_experts_per_tok
    if layer < cfg.num_hash_layers:
        idx = xp.asarray(tid2eid)[xp.asarray(input_ids)].astype(xp.int32)
    elif top_k is None:
        idx = xp.argsort(-(scores + nm.asf(gate_bias)), axis=-1, stable=True)[:, :K].astype(xp.int32)
    else:
        idx = top_k(scores + nm.asf(gate_bias), K)
    sel = xp.take_along_axis(scores, idx, axis=-1)
    weights = nm.r32(sel / xp.sum(sel, axis=-1, keepdims=True) * cfg.routed_scaling_factor)
    if num_tokens is not None:        # rows >= num_tokens: scale 0, expert 0, weight 0
        live = (xp.arange(x.shape[0]) < num_tokens)[:, None]
        x_scale, idx, weights = xp.where(live, x_scale, 0.0), xp.where(live, idx, 0), xp.where(live, weights, 0.0)
    return x_i8, x_scale, idx, weights


def swiglu_expert(x_i8, x_scale, w1, w1_scale, w3, w3_scale, w2, w2_scale, *, cfg, nm, route_weight=None):
    """One expert on rows [n, D] -> y [n, D] (bf16 values); route_weight [n] scales the w2 dequant."""
    h_i8, h_dq = swiglu_hidden(nm.int_mm(x_i8, w1.T), nm.int_mm(x_i8, w3.T), x_scale, nm.asf(w1_scale),
                               nm.asf(w3_scale), cfg=cfg, nm=nm)
    if route_weight is not None:
        h_dq = h_dq * route_weight[:, None]
    return swiglu_out(nm.int_mm(h_i8, w2.T), h_dq, nm.asf(w2_scale), nm=nm)


def swiglu_hidden(g, u, x_scale, w1_scale, w3_scale, *, cfg, nm):
    """SwiGLU between the gate / up GEMMs and the down GEMM: g, u are the GEMMs' exact integer
    products; dequantized (x_scale [n, 1], w*_scale per output channel, [I] or per row [n, I]),
    rounded to f32, gate clamped to <= limit and up to [-limit, limit], silu(g) * u, Q8 ->
    (h_i8, h_dq)."""
    xp = nm.xp
    lim = cfg.swiglu_limit
    g = xp.minimum(nm.r32(g * x_scale * w1_scale), lim)
    u = xp.clip(nm.r32(u * x_scale * w3_scale), -lim, lim)
    return nm.q8(g / (1.0 + xp.exp(-g)) * u)


def swiglu_out(y, h_dq, w2_scale, *, nm):
    """The down GEMM's exact integer product y -> the expert's output (bf16 values); h_dq carries
    the route weight where there is one."""
    return nm.bf16(y * h_dq * w2_scale)


def shared_expert(x_i8, x_scale, shared, *, cfg, nm):
    return swiglu_expert(x_i8, x_scale, shared["shared_w1"], shared["shared_w1_scale"], shared["shared_w3"],
                         shared["shared_w3_scale"], shared["shared_w2"], shared["shared_w2_scale"], cfg=cfg, nm=nm)


def routed_expert(x_i8, x_scale, ew, route_weight, *, cfg, nm):
    return swiglu_expert(x_i8, x_scale, ew["routed_w1"], ew["routed_w1_scale"], ew["routed_w3"],
                         ew["routed_w3_scale"], ew["routed_w2"], ew["routed_w2_scale"], cfg=cfg, nm=nm,
                         route_weight=route_weight)


def moe_experts(x_i8, x_scale, indices, weights, expert, shared, *, cfg, nm):
    """Grouped dispatch: each expert runs once on all its routes.  expert(e) -> routed weights of e.

    Returns ffn_out [T, D] (bf16 values) = bf16(sh + sum_k routed[t, k]) with routes added in k order.
    NumPy numerics only (hw.real's TorchNumerics included): the JAX path runs its expert blocks
    (golden.jax_moe) and shares only moe_combine."""
    import numpy as np
    T, K = indices.shape
    flat = np.asarray(indices).reshape(-1)
    order = np.argsort(flat, kind="stable")            # routes grouped by expert, one sort
    bounds = np.searchsorted(flat[order], np.arange(cfg.n_routed_experts + 1))
    wts = np.asarray(weights).reshape(-1)
    routed = _routed_grouped(x_i8, x_scale, order, bounds, wts, expert, K, cfg=cfg, nm=nm)
    return moe_combine(routed.reshape(T, K, -1), x_i8, x_scale, shared, cfg=cfg, nm=nm)


def moe_combine(routed, x_i8, x_scale, shared, *, cfg, nm):
    """K17 combine: the shared expert plus each token's K routed rows [T, K, D], added in k order,
    rounded to BF16 once -> ffn_out [T, D].  Shared by moe_experts and the JAX path's expert blocks."""
    out = nm.asf(shared_expert(x_i8, x_scale, shared, cfg=cfg, nm=nm))
    for k in range(routed.shape[1]):
        out = out + routed[:, k]
    return nm.bf16(out)


ROUTE_CHUNK_BYTES = 4 << 20     # f64 [routes, D] rows per chunk of _routed_grouped: in cache, on the heap


def _routed_grouped(x_i8, x_scale, order, bounds, wts, expert, K, *, cfg, nm):
    """routed [T*K, D]: swiglu_expert's arithmetic with only the GEMMs per expert.  Every other
    step (swiglu_hidden, swiglu_out) is per row (or per row and column), so it runs once over a
    chunk of consecutive experts' routes (about ROUTE_CHUNK_BYTES of f64 rows: on SMALL every
    route, on FLASH a few experts' worth, so that the temporaries stay in cache instead of
    faulting in fresh pages), each row with its expert's scales: the same values as one
    swiglu_expert call per expert, in far fewer calls.  The rows are bf16 values outside exact
    mode, so they are kept as f32 (exactly)."""
    import numpy as np
    E = cfg.n_routed_experts
    T, D = x_i8.shape
    routes = order[bounds[0]:bounds[E]]
    # the GEMM operands, made once (int8 values as f32 in device mode, as int_mm reads them)
    op = (lambda a: np.asarray(a, np.float32)) if nm.mode == "device" else nm.asf
    x_op, xsc = op(x_i8), nm.asf(x_scale)
    routed = np.zeros((T * K, D), np.float64 if nm.exact else np.float32)
    used = [e for e in range(E) if bounds[e + 1] > bounds[e]]
    per = max(1, ROUTE_CHUNK_BYTES // (8 * D))
    chunk, n = [], 0
    for i, e in enumerate(used):
        chunk.append(e)
        n += bounds[e + 1] - bounds[e]
        if n >= per or i == len(used) - 1:
            _routed_chunk(chunk, x_op, xsc, routes, bounds, wts, expert, K, routed, op, cfg=cfg, nm=nm)
            chunk, n = [], 0
    return routed


def _routed_chunk(used, x_op, xsc, routes, bounds, wts, expert, K, routed, op, *, cfg, nm):
    """_routed_grouped over the routes of experts `used` (consecutive in route order): their rows
    of `routed` written."""
    import numpy as np
    base = bounds[0]
    lo0, hi0 = bounds[used[0]] - base, bounds[used[-1] + 1] - base
    r = routes[lo0:hi0]
    rows = r // K
    xs = x_op[rows]
    ws = {e: expert(e) for e in used}
    span = [(bounds[e] - base - lo0, bounds[e + 1] - base - lo0) for e in used]
    n, D = rows.size, x_op.shape[1]
    I = ws[used[0]]["routed_w1"].shape[0]
    g, u = np.empty((n, I)), np.empty((n, I))
    for e, (lo, hi) in zip(used, span):
        ew = ws[e]
        g[lo:hi] = nm.int_mm(xs[lo:hi], ew["routed_w1"].T)
        u[lo:hi] = nm.int_mm(xs[lo:hi], ew["routed_w3"].T)
    # each route's row of its expert's scales (widened to f64, as assigning into f64 rows did)
    count = [hi - lo for lo, hi in span]
    s1, s3, s2 = (np.repeat(np.asarray([ws[e][name] for e in used], np.float64).reshape(len(used), -1), count, axis=0)
                  for name in ("routed_w1_scale", "routed_w3_scale", "routed_w2_scale"))
    h_i8, h_dq = swiglu_hidden(g, u, xsc[rows], s1, s3, cfg=cfg, nm=nm)
    h_dq = h_dq * wts[r][:, None]
    h32 = op(h_i8)
    y = np.empty((n, D))
    for e, (lo, hi) in zip(used, span):
        y[lo:hi] = nm.int_mm(h32[lo:hi], ws[e]["routed_w2"].T)
    routed[r] = swiglu_out(y, h_dq, s2, nm=nm)
