"""Where a forward crosses ranks: the grouped output projection, the MoE and the vocab-wide heads.

The drafter and the fused step call these three through a `par` object, so the same composition
runs on one rank (`SINGLE`) and under the 16-rank emulation (`golden.ranks.RankEmulation`), which
splits each one exactly as the device does (2 of 8 o_proj groups per rank, EP dispatch/combine,
vocab/4 LM-head shards).
"""
from __future__ import annotations

from ..compose import forward
from ..kernels.moe import gate, moe_experts
from ..kernels.o_proj import o_proj


class SingleRank:
    name = "single"

    def map_rows(self, fn, owners, *, nm):
        """Row-local work: fn(row indices) -> tuple of arrays with those rows first.  One rank
        owns every row here; the emulation runs fn once per rank and all-gathers rank-major."""
        import numpy as np
        return fn(np.arange(len(owners)))

    def target_forward(self, ckpt, meta, caches, owners, *, cfg, nm, taps=None):
        return forward(ckpt, meta, caches, cfg=cfg, nm=nm, taps=taps)

    def o_proj(self, o_packed, lw, *, cfg, nm, owners=None):
        return o_proj(o_packed, lw["wo_a"], lw["wo_b"], lw["wo_b_scale"], cfg=cfg, nm=nm)

    def moe(self, x_mixed, lw, expert, input_ids, *, layer, cfg, nm, owners=None):
        """K14-K17 on one rank: gate, shared expert, routed experts, combine in k order."""
        x_i8, x_scale, idx, wts = gate(x_mixed, lw["norm_w"], lw["gate_w"], lw["gate_bias"], lw.get("tid2eid"),
                                       input_ids, layer=layer, cfg=cfg, nm=nm)
        return moe_experts(x_i8, x_scale, idx, wts, expert, lw, cfg=cfg, nm=nm)

    def vocab_logits(self, h, lm_head_weight, *, nm, owners=None):
        """f32 logits over the whole vocabulary: h [T, D] (bf16 values) . W^T."""
        return nm.asf(h) @ nm.asf(lm_head_weight).T


SINGLE = SingleRank()
