"""TP-sharded output projection (2 of 8 o_proj groups per rank) and the vocab-sharded LM head.

o_proj (K12): rank r of a group receives, for every row of the group, the heads of its o_proj
groups (an all-to-all of the attention output), computes their int32-GEMM contributions and the
group sums them.  `reduction`:
  "ordered"       the contributions are folded in global group order, as one rank would: bitwise
                  equal to the single-rank projection (the exact-mode check);
  "partial_sums"  each rank scales and sums its own groups, the f32 partials are summed in rank order
                  (the device's reduce-scatter); equal within the K12 tolerance.
LM head (K18): rank r computes the logits of vocab shard r % tp for every row of its group; the
all-to-all returns each owner its rows' four shards, concatenated in shard (= vocab) order.
"""
from __future__ import annotations

import numpy as np

from twin.abi.errors import AbiError

REDUCTIONS = ("ordered", "partial_sums")


def group_contributions(o_packed, wo_a, wo_b, *, nm):
    """o_packed [n, T, GI] of n o_proj groups -> n contributions [T, D] (before wo_b_scale).

    The per-group terms of golden.kernels.o_proj.o_proj_partial, written with the same operations
    so that the ordered reduction reproduces it bit for bit (a test pins the equality)."""
    o_a = nm.asf(o_packed) @ nm.asf(wo_a).transpose(0, 2, 1)             # f32, not rounded
    o_i8, dq = nm.q8(o_a)
    return [nm.int_mm(o_i8[g], wo_b[g].T) * dq[g] for g in range(o_packed.shape[0])]


def o_proj_tp(o_packed, wo_a, wo_b, wo_b_scale, layout, *, nm, reduction: str = "ordered"):
    """o_packed [G, T, GI] of one TP group's rows -> attn_out [T, D] (bf16 values)."""
    if reduction not in REDUCTIONS:
        raise AbiError("reduction", reduction, f"one of {REDUCTIONS}", where="o_proj_tp")
    if o_packed.shape[0] != layout.cfg.o_groups:
        raise AbiError("o_packed", tuple(o_packed.shape), f"[{layout.cfg.o_groups}, T, GI]", where="o_proj_tp")
    per_rank = []
    for r in range(layout.tp):                      # the ranks of one group: local index r
        gs = np.asarray(layout.o_groups_of(r))
        per_rank.append(group_contributions(o_packed[gs], wo_a[gs], wo_b[gs], nm=nm))
    return fold(per_rank, wo_b_scale, nm=nm, reduction=reduction)


def fold(per_rank, wo_b_scale, *, nm, reduction: str = "ordered"):
    """per_rank[r]: the contributions of a group's local rank r (`group_contributions`) -> attn_out
    [T, D] (bf16 values), reduced as `reduction` says (module docstring)."""
    scale = nm.asf(wo_b_scale)
    out = 0.0
    if reduction == "ordered":
        for contribs in per_rank:
            for c in contribs:
                out = out + c
        return nm.bf16(out * scale)
    for contribs in per_rank:
        part = 0.0
        for c in contribs:
            part = part + c
        out = out + part * scale
    return nm.bf16(out)


def lm_head_tp(h, lm_head_weight, layout, *, nm):
    """h [T, D] (one group's rows, all-gathered) -> full logits [T, V] via 4 vocab shards."""
    shards = [nm.asf(h) @ nm.asf(lm_head_weight[np.asarray(layout.vocab_of(r))]).T for r in range(layout.tp)]
    return nm.xp.concatenate(shards, axis=-1)
