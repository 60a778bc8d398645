"""Device numerics in torch: BF16 storage, W8A8 per-row INT8, FP32 accumulation.

The rounding rules of kernel-math.md §3.1 and its notation: `bf16` rounds FP32 to bfloat16
(round to nearest even) and widens back exactly; `q8` is the per-row symmetric INT8 activation
rule (amax floored at 1e-4, scale 127, round half to even) returning integer-valued FP32 and the
dequant scale 1/sq; `int8_gemm` is the exact integer GEMM followed by the two FP32 scales.
"""
from __future__ import annotations

import torch

INT8_MAX = 127.0
AMAX_FLOOR = 1e-4
RMS_EPS = 1e-6
F32 = torch.float32


def bf16(x: torch.Tensor) -> torch.Tensor:
    """FP32 -> bfloat16 (RNE) -> FP32."""
    return x.to(F32).to(torch.bfloat16).to(F32)


def q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row INT8 of the last axis: (integer values as FP32, dq [..., 1] = 1 / (127 / amax))."""
    x = x.to(F32)
    amax = torch.clamp(x.abs().amax(dim=-1, keepdim=True), min=AMAX_FLOOR)
    sq = INT8_MAX / amax
    return torch.round(x * sq), 1.0 / sq


def int_dot(a_i8: torch.Tensor, b_i8: torch.Tensor) -> torch.Tensor:
    """Exact integer products summed exactly (FP64 holds every INT8 GEMM sum of the model), -> FP32."""
    return (a_i8.to(torch.float64) @ b_i8.to(torch.float64)).to(F32)


def int8_gemm(x_i8, dq, w_i8_in_out, w_scale) -> torch.Tensor:
    """y = f32(sum_k x_i8 w_i8) * dq_row * w_scale[out]; weight given as [in, out]."""
    return int_dot(x_i8, w_i8_in_out) * dq * w_scale


def mm(a, b) -> torch.Tensor:
    """FP32 GEMM of FP32-widened operands (bf16 values in, FP32 accumulate)."""
    return a.to(F32) @ b.to(F32)


def rmsnorm(x, w=None, eps: float = RMS_EPS) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w in FP32 over the last axis, not rounded."""
    x = x.to(F32)
    y = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)
    return y if w is None else y * w.to(F32)
