"""K12 grouped output projection: per-group low-rank wo_a (f32, unrounded), Q8 per (group, token),
W8A8 wo_b summed over groups in group order."""
from __future__ import annotations


def pack_groups(o, *, cfg):
    """o [T, H, HD] -> o_packed [G, T, HPG*HD] (group g = heads g*HPG .. g*HPG+HPG-1)."""
    T = o.shape[0]
    G = cfg.o_groups
    return o.reshape(T, G, cfg.o_group_in).transpose(1, 0, 2)


def o_proj(o_packed, wo_a, wo_b, wo_b_scale, *, cfg, nm):
    """o_packed [G, T, GI]; wo_a [G, OL, GI]; wo_b [G, D, OL] int8; wo_b_scale [D] -> [T, D] bf16 values.

    A TP rank passes its local groups and gets its f32 partial back with `partial=True` semantics
    by calling `o_proj_partial`; the full projection is the sum of partials, then rounded."""
    return nm.bf16(o_proj_partial(o_packed, wo_a, wo_b, wo_b_scale, cfg=cfg, nm=nm))


def o_proj_partial(o_packed, wo_a, wo_b, wo_b_scale, *, cfg, nm):
    o_a = _low_rank(o_packed, wo_a, nm)                                       # f32, not rounded
    o_i8, dq = nm.q8(o_a)
    out = 0.0
    for g in range(o_packed.shape[0]):                                     # groups summed in order
        out = out + nm.int_mm(o_i8[g], wo_b[g].T) * dq[g]
    return out * nm.asf(wo_b_scale)


def _low_rank(o_packed, wo_a, nm):
    """o_packed [G, T, GI] @ wo_a[g]^T per group -> [G, T, OL].  NumPy widens one group's weight at a
    time into one reused buffer (FLASH: 32 MB instead of the whole 256 MB f64 weight, written fresh
    on every call) and runs the group's GEMM on the same transposed view the batched product
    reads, so each group's BLAS call, and its bits, are those of the batched one.  A Numerics with
    its own GEMM (hw.real's torch one) keeps the batched call."""
    import numpy as np

    from ..numerics import Numerics
    if not nm.is_numpy or type(nm).mm is not Numerics.mm or o_packed.shape[0] < 2:
        return nm.mm(nm.asf(o_packed), nm.asf(wo_a).transpose(0, 2, 1))
    a = nm.asf(o_packed)
    G, T, _ = a.shape
    buf = np.empty(wo_a.shape[1:], nm.f)
    out = np.empty((G, T, wo_a.shape[1]), nm.f)
    for g in range(G):
        np.copyto(buf, wo_a[g])
        out[g] = nm.mm(a[g], buf.T)
    return out
