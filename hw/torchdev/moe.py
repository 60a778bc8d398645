"""K14 gate (FFN norm folded in, hash or biased sqrt-softplus routing), K15 / K16 the W8A8 SwiGLU
experts, K17 expert-parallel dispatch and combine.

Gate: inv_rms = rsqrt(mean(x^2) + eps); xg = x * norm_w (FP32, not rounded); Q8(xg) with inv_rms
riding on the dequant scale; logits = inv_rms * (xg . gate_w^T); scores = sqrt(softplus(logits)).
Hash layers (layer < num_hash_layers) take tid2eid[input_ids]; the others the first K of a stable
descending sort of scores + bias.  weights = scores[idx] / sum * routed_scaling_factor.  Rows at
or past num_tokens get scale 0, expert 0, weight 0 and are not dispatched.
"""
from __future__ import annotations

import torch

from .numerics import bf16, int_dot, mm, q8


def gate(x_mixed, norm_w, gate_w, gate_bias, tid2eid, input_ids, num_tokens: int, *, hash_layer: bool,
         topk: int, scaling: float, eps: float):
    x = x_mixed.to(torch.float32)
    inv_rms = torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)
    xg = x * norm_w
    x_i8, dq = q8(xg)
    x_scale = dq * inv_rms
    logits = inv_rms * mm(xg, gate_w.T)
    scores = torch.sqrt(torch.clamp(logits, min=0) + torch.log1p(torch.exp(-logits.abs())))
    if hash_layer:
        idx = tid2eid[input_ids].long()
    else:
        idx = torch.sort(-(scores + gate_bias), dim=-1, stable=True).indices[:, :topk]
    sel = torch.gather(scores, 1, idx)
    weights = sel / sel.sum(dim=-1, keepdim=True) * scaling
    live = (torch.arange(x.shape[0], device=x.device) < num_tokens)[:, None]
    zero = torch.zeros((), device=x.device)
    return x_i8, torch.where(live, x_scale, zero), torch.where(live, idx, 0), torch.where(live, weights, zero)


def swiglu(x_i8, x_scale, w1, s1, w3, s3, w2, s2, *, limit: float, route_weight=None):
    """One expert on rows [n, D] (INT8 values and their dequant scale) -> [n, D] bf16 values."""
    g = torch.clamp(int_dot(x_i8, w1.T) * x_scale * s1, max=limit)
    u = torch.clamp(int_dot(x_i8, w3.T) * x_scale * s3, -limit, limit)
    h_i8, h_dq = q8(g / (1.0 + torch.exp(-g)) * u)
    if route_weight is not None:
        h_dq = h_dq * route_weight[:, None]
    return bf16(int_dot(h_i8, w2.T) * h_dq * s2)


def moe(ranks, x_i8, x_scale, idx, wts, num_tokens, experts, shared, *, n_local: int, limit: float):
    """EP dispatch / experts / combine over every rank of the deployment.

    x_i8 [T, D], x_scale [T, 1], idx / wts [T, K]: [R] per source rank (`ranks.mine` present);
    num_tokens [R]; experts(dst) -> that rank's routed weights (leading axis: its local experts);
    shared(src) -> the source rank's shared expert.  A route (t, k) with expert e goes to rank
    e // n_local, local expert e % n_local, packed source-rank-major and (t, k) within a source
    (the flattened [R, T, K] order); its row returns to (src, t, k) and ffn_out[t] = bf16(shared[t]
    + sum_k routed[t, k]) in k order.  -> ffn_out [R] per source rank.

    Dispatch is a gather of every source's rows; each process runs the experts of the ranks it
    holds on the same packed rows the one-process form packs, and the combine gathers the routed
    rows back: the same expert batches and the same k-order sums however the ranks are split."""
    x_i8, x_scale, idx, wts = ranks.gather(x_i8, x_scale, idx, wts)
    x_i8, x_scale, idx, wts = (torch.stack(v) for v in (x_i8, x_scale, idx, wts))
    R, T, K = idx.shape
    D = x_i8.shape[-1]
    live = (torch.arange(T, device=idx.device)[None, :] < num_tokens[:, None])[..., None].expand(R, T, K)
    flat = torch.where(live, idx, -1).reshape(-1)
    rows = torch.arange(R * T * K, device=idx.device) // K            # (src, t) of each route
    xs, ss, ws = x_i8.reshape(R * T, D), x_scale.reshape(R * T, 1), wts.reshape(-1)
    done = []
    for e in torch.unique(flat[flat >= 0]).tolist():
        if e // n_local not in ranks.mine:
            continue                                                   # another process's expert
        routes = torch.nonzero(flat == e).reshape(-1)                  # source-rank-major, (t, k) order
        w, loc = experts(e // n_local), e % n_local
        done.append((routes, swiglu(xs[rows[routes]], ss[rows[routes]], w["routed_w1"][loc],
                                    w["routed_w1_scale"][loc], w["routed_w3"][loc], w["routed_w3_scale"][loc],
                                    w["routed_w2"][loc], w["routed_w2_scale"][loc], limit=limit,
                                    route_weight=ws[routes])))
    routed = torch.zeros(R * T * K, D, device=x_i8.device)
    for proc in ranks.share(done):
        for routes, vals in proc:
            routed[routes] = vals.to(routed.device)
    routed = routed.reshape(R, T, K, D)

    def combine(src):
        sw = shared(src)
        acc = swiglu(x_i8[src], x_scale[src], sw["shared_w1"], sw["shared_w1_scale"], sw["shared_w3"],
                     sw["shared_w3_scale"], sw["shared_w2"], sw["shared_w2_scale"], limit=limit)
        for k in range(K):
            acc = acc + routed[src, :, k]
        return bf16(acc)
    return ranks.local(combine)
