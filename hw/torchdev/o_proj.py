"""K12 grouped o_proj: per group o_a = o_g . wo_a[g]^T (FP32, not rounded), Q8 per (group, row),
INT8 against wo_b, each group's partial dequantized and summed in group order; BF16 once."""
from __future__ import annotations

from .numerics import bf16, int_dot, mm, q8


def o_partial(o_groups, wo_a, wo_b, wo_b_scale):
    """o_groups [G_local, T, GI]; wo_a [G_local, OL, GI]; wo_b [G_local, D, OL] i8 -> FP32 [T, D],
    the groups added in order (one rank's share before the reduce-scatter)."""
    out = None
    for g in range(o_groups.shape[0]):
        a_i8, dq = q8(mm(o_groups[g], wo_a[g].T))
        part = int_dot(a_i8, wo_b[g].T) * dq
        out = part if out is None else out + part
    return out * wo_b_scale


def pack(o, groups: int):
    """[T, H, HD] -> [G, T, HPG * HD] (group g = heads g*HPG .. (g+1)*HPG - 1)."""
    T, H, HD = o.shape
    return o.reshape(T, groups, H // groups * HD).transpose(0, 1)
