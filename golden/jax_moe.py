"""The MoE sub-layer on JAX: golden.compose.moe_sublayer with the router's top-k as a selection
(`golden.jax_select.top_k_desc`, the same ids as the kernel's stable argsort), the routed experts
in expert blocks (`golden.jax_kernels.moe_blocked`) and hc_post as stream multiply-adds."""
from __future__ import annotations

import jax.numpy as jnp

from .compose import SHARED_NAMES
from .jax_kernels import hc_post_streams, moe_blocked
from .jax_select import top_k_desc
from .kernels.hyper_connections import hc_pre
from .kernels.moe import _softplus, gate
from .kernels.rmsnorm import rms_scale


def gate_topk(x_mixed, norm_w, gate_w, gate_bias, tid2eid, input_ids, *, layer, cfg, nm):
    """golden.kernels.moe.gate, same values and rounding points; hash layers are the kernel's."""
    if layer < cfg.num_hash_layers:
        return gate(x_mixed, norm_w, gate_w, gate_bias, tid2eid, input_ids, layer=layer, cfg=cfg, nm=nm)
    x = nm.asf(x_mixed)
    inv_rms = rms_scale(x, nm, cfg.rms_norm_eps)
    xg = x * nm.asf(norm_w)
    if nm.mode == "official":         # official routes the bf16 ffn_norm output (kernel-math §7 #8)
        xn = nm.bf16(xg * inv_rms)
        logits = nm.mm(xn, nm.asf(gate_w).T)
        x_i8, x_scale = nm.q8(xn)
    else:
        logits = inv_rms * nm.mm(xg, nm.asf(gate_w).T)
        x_i8, dq = nm.q8(xg)
        x_scale = dq * inv_rms
    x_scale = nm.r32(x_scale)
    scores = nm.r32(jnp.sqrt(_softplus(nm.r32(logits), jnp)))
    idx = top_k_desc(scores + nm.asf(gate_bias), cfg.num_experts_per_tok)
    sel = jnp.take_along_axis(scores, idx, axis=-1)
    weights = nm.r32(sel / jnp.sum(sel, axis=-1, keepdims=True) * cfg.routed_scaling_factor)
    return x_i8, x_scale, idx, weights


def moe_sublayer(x_hc, layer, w, experts, input_ids, *, cfg, nm, taps=None):
    """golden.compose.moe_sublayer; experts: the layer's stacked routed weights as [E, in, out]."""
    x_mixed, post, comb = hc_pre(x_hc, w["hc_ffn_fn"], w["hc_ffn_scale"], w["hc_ffn_base"], cfg=cfg, nm=nm)
    x_i8, x_scale, idx, wts = gate_topk(x_mixed, w["norm_w"], w["gate_w"], w.get("gate_bias"), w.get("tid2eid"),
                                        input_ids, layer=layer, cfg=cfg, nm=nm)
    ffn_out = moe_blocked(x_i8, x_scale, idx, wts, experts, {k: w[k] for k in SHARED_NAMES}, cfg=cfg, nm=nm,
                          transposed=True)
    if taps is not None:
        for stage, v in (("ffn_x_mixed", x_mixed), ("moe_indices", idx), ("moe_weights", wts), ("ffn_out", ffn_out)):
            taps.put(layer, stage, v)
    x_hc = hc_post_streams(ffn_out, x_hc, post, comb, cfg=cfg, nm=nm)
    if taps is not None:
        taps.put(layer, "x_hc", x_hc)
    return x_hc
