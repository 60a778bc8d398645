"""The MoE sub-layer on JAX: golden.compose.moe_sublayer with the router's top-k as a selection
(`golden.jax_select.top_k_desc`, the same ids as the kernel's stable argsort), the routed experts
in expert blocks (`golden.jax_kernels.moe_blocks`, combined as moe_experts combines them:
`golden.kernels.moe.moe_combine`) and hc_post as stream multiply-adds."""
from __future__ import annotations

from .compose import moe_sublayer as compose_moe_sublayer
from .jax_kernels import moe_blocks, stream_sum
from .jax_select import top_k_desc
from .kernels.moe import moe_combine


def moe_sublayer(x_hc, layer, w, experts, input_ids, *, cfg, nm, taps=None, scratch=None):
    """golden.compose.moe_sublayer -> (x_hc, the expert-block buffer); experts: the routed weights of
    every layer as [L, E, in, out]; scratch: a block buffer to reuse (moe_blocks)."""
    box = [scratch]

    def moe(x_i8, x_scale, idx, wts, _expert, shared, *, cfg, nm):
        routed, box[0] = moe_blocks(x_i8, x_scale, idx, wts, experts, cfg=cfg, nm=nm, transposed=True, layer=layer,
                                    scratch=box[0])
        return moe_combine(routed, x_i8, x_scale, shared, cfg=cfg, nm=nm)
    x_hc = compose_moe_sublayer(x_hc, layer, w, None, input_ids, cfg=cfg, nm=nm, taps=taps, moe=moe,
                                top_k=top_k_desc, stream_mix=stream_sum)
    return x_hc, box[0]
