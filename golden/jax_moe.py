"""The MoE sub-layer on JAX: golden.compose.moe_sublayer with the router's top-k as a selection
(`golden.jax_select.top_k_desc`, the same ids as the kernel's stable argsort), the routed experts
in expert blocks (`golden.jax_kernels.moe_blocks`, combined as moe_experts combines them:
`golden.kernels.moe.moe_combine`) and hc_post as stream multiply-adds; optionally with a
reference's routing re-synced at near ties (`golden.jax_resync`)."""
from __future__ import annotations

import jax.numpy as jnp

from .compose import Taps
from .compose import moe_sublayer as compose_moe_sublayer
from .jax_kernels import moe_blocks, stream_sum
from .jax_resync import adopt_routes, route_bounds
from .jax_select import top_k_desc
from .kernels.moe import moe_combine


def moe_sublayer(x_hc, layer, w, experts, input_ids, *, cfg, nm, taps=None, scratch=None, ref=None, expert_layer=None):
    """golden.compose.moe_sublayer -> (x_hc, the expert-block buffer, re-sync masks [3, T] or None);
    experts: the routed weights of the held layers as [L, E, in, out], this layer's at row
    expert_layer (default: layer); scratch: a block buffer to reuse
    (moe_blocks); ref: the reference's (ffn_x_mixed, moe_indices) of this layer, whose routing is
    adopted where it differs within the score bound (jax_resync.adopt_routes; masks: adopted,
    refused, reordered rows)."""
    box, seen = [scratch], _Seen(taps)
    if ref is None:
        top_k = top_k_desc
    else:
        def top_k(biased, k):
            own = top_k_desc(biased, k)
            delta = route_bounds(seen.x_mixed, ref[0], w["norm_w"], w["gate_w"], cfg=cfg, nm=nm)
            idx, *masks = adopt_routes(biased, own, ref[1], delta)
            seen.masks = jnp.stack(masks)
            return idx

    def moe(x_i8, x_scale, idx, wts, _expert, shared, *, cfg, nm):
        routed, box[0] = moe_blocks(x_i8, x_scale, idx, wts, experts, cfg=cfg, nm=nm, transposed=True,
                                    layer=layer if expert_layer is None else expert_layer,
                                    scratch=box[0])
        return moe_combine(routed, x_i8, x_scale, shared, cfg=cfg, nm=nm)
    x_hc = compose_moe_sublayer(x_hc, layer, w, None, input_ids, cfg=cfg, nm=nm, taps=seen, moe=moe,
                                top_k=top_k, stream_mix=stream_sum)
    return x_hc, box[0], seen.masks


class _Seen(Taps):
    """The caller's taps, also keeping the router's input (the re-sync bound reads it)."""

    def __init__(self, taps):
        super().__init__(())
        self.taps, self.x_mixed, self.masks = taps, None, None

    def put(self, layer, stage, value):
        if stage == "ffn_x_mixed":
            self.x_mixed = value
        if self.taps is not None:
            self.taps.put(layer, stage, value)
