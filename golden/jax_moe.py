"""The MoE sub-layer on JAX: golden.compose.moe_sublayer with the router's top-k as a selection
(`golden.jax_select.top_k_desc`, the same ids as the kernel's stable argsort), the routed experts
in expert blocks (`golden.jax_kernels.moe_blocked`) and hc_post as stream multiply-adds."""
from __future__ import annotations

from .compose import SHARED_NAMES
from .jax_kernels import hc_post_streams, moe_blocks, moe_combine
from .jax_select import top_k_desc
from .kernels.hyper_connections import hc_pre
from .kernels.moe import gate


def gate_topk(x_mixed, norm_w, gate_w, gate_bias, tid2eid, input_ids, *, layer, cfg, nm):
    """golden.kernels.moe.gate, same values and rounding points, its top-k without a sort."""
    return gate(x_mixed, norm_w, gate_w, gate_bias, tid2eid, input_ids, layer=layer, cfg=cfg, nm=nm, top_k=top_k_desc)


def moe_sublayer(x_hc, layer, w, experts, input_ids, *, cfg, nm, taps=None, scratch=None):
    """golden.compose.moe_sublayer -> (x_hc, the expert-block buffer); experts: the routed weights of
    every layer as [L, E, in, out]; scratch: a block buffer to reuse (moe_blocks)."""
    x_mixed, post, comb = hc_pre(x_hc, w["hc_ffn_fn"], w["hc_ffn_scale"], w["hc_ffn_base"], cfg=cfg, nm=nm)
    x_i8, x_scale, idx, wts = gate_topk(x_mixed, w["norm_w"], w["gate_w"], w.get("gate_bias"), w.get("tid2eid"),
                                        input_ids, layer=layer, cfg=cfg, nm=nm)
    routed, scratch = moe_blocks(x_i8, x_scale, idx, wts, experts, cfg=cfg, nm=nm, transposed=True, layer=layer,
                                 scratch=scratch)
    ffn_out = moe_combine(routed, x_i8, x_scale, {k: w[k] for k in SHARED_NAMES}, cfg=cfg, nm=nm)
    if taps is not None:
        for stage, v in (("ffn_x_mixed", x_mixed), ("moe_indices", idx), ("moe_weights", wts), ("ffn_out", ffn_out)):
            taps.put(layer, stage, v)
    x_hc = hc_post_streams(ffn_out, x_hc, post, comb, cfg=cfg, nm=nm)
    if taps is not None:
        taps.put(layer, "x_hc", x_hc)
    return x_hc, scratch
