"""FP32 numerics for the JAX path: the device contract's accumulator instead of NumPy's float64.

kernel-math.md §0 defines a "bf16 in, fp32 acc" matmul as an fp32 GEMM of the widened values and
§8 sets the lockstep tolerances "for fp32 accumulation in any order".  `Fp32Numerics` keeps every
rounding point of `golden.numerics.Numerics` (BF16 storage, W8A8 per-row INT8, FP32 outputs) and
only changes what carries the sums between them: float32, in XLA's order.

INT8 GEMMs stay exact integers, as on the device (int32 accumulator): f32 GEMMs over K slices of at
most EXACT_F32_K (|sum| < 2^24, so each slice is exact), the slices added in int32, and the int32
sum converted to f32 once (kernel-math §3.1: y = f32(acc) * dq * w_s); against an int8 weight
(the routed experts, which `JaxGolden` keeps int8) one int8 x int8 -> int32 dot, the same integer.

Exact mode ignores all of this (float64, as `Numerics`).  The NumPy path stays the reference: its
float64 carry makes a token's bits independent of batching; this one is as batching-dependent as
the device (see golden/README.md, "JAX path").
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .numerics import _RECORDERS, EXACT_F32_K, Numerics


@dataclass(frozen=True)
class Fp32Numerics(Numerics):
    # pool -> the last rows read from it while tracing (see set_rows); cleared per traced step
    reads: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def f(self):
        return self.xp.float64 if self.exact else self.xp.float32

    def int_mm(self, a, b):
        if self.mode != "device":
            return super().int_mm(a, b)
        if _RECORDERS:
            _RECORDERS[-1].append(("i", tuple(a.shape), tuple(b.shape)))
        xp = self.xp
        if xp.asarray(b).dtype == xp.int8:
            # an int8 weight (JaxGolden keeps the routed experts so, in the layout the dot reads):
            # int8 x int8 -> int32, the device's accumulator, exact like the f32 slices below and
            # ~2x faster on XLA CPU; against a transposed operand or into XLA's generic dot
            # (the other GEMMs' shapes) it is slower, so only where the caller chose it
            return xp.matmul(xp.asarray(a).astype(xp.int8), b, preferred_element_type=xp.int32).astype(xp.float32)
        a32, b32 = xp.asarray(a).astype(xp.float32), xp.asarray(b).astype(xp.float32)
        K = a32.shape[-1]
        if K <= EXACT_F32_K:
            return a32 @ b32
        acc = 0
        for k0 in range(0, K, EXACT_F32_K):
            acc = acc + (a32[..., k0:k0 + EXACT_F32_K] @ b32[k0:k0 + EXACT_F32_K]).astype(xp.int32)
        return acc.astype(xp.float32)

    def get_rows(self, pool, slots):
        """As Numerics.get_rows.  BF16 pools travel as their uint16 bits (`JaxGolden` keeps them so):
        XLA's CPU gather and scatter on bf16 widen the whole pool to f32 first (a 5632 x 128 pool
        per layer to read 2k rows); a uint16 pool's rows come back as bf16."""
        if self.is_numpy:
            return super().get_rows(pool, slots)
        from jax import lax
        xp = self.xp
        src = lax.bitcast_convert_type(pool, xp.uint16) if _is_bf16(self, pool) else pool
        rows = super().get_rows(src, slots)
        if _is_bits(self, src):
            rows = lax.bitcast_convert_type(rows, xp.bfloat16)
        self.reads[id(pool)] = (pool, rows)
        return rows

    def set_rows(self, pool, slots, rows):
        """As Numerics.set_rows (a uint16 pool holds bf16 bits, see get_rows).  A write to a pool
        this step read before (the compressors pool old state rows, then commit the new ones) is
        made data-dependent on that read: XLA then orders the two and updates the pool in place
        instead of copying it (twice) per layer."""
        xp = self.xp
        if self.is_numpy:
            return super().set_rows(pool, slots, rows)
        from jax import lax
        read = self.reads.pop(id(pool), None)
        if read is not None and read[0] is pool and read[1].size:
            z = read[1].reshape(-1)[0].astype(xp.float32)
            never = (z != z) & (z == z)              # always False, opaque to XLA's simplifier
            rows = xp.asarray(rows)
            rows = xp.where(never, xp.zeros_like(rows), rows)
        if _is_bf16(self, pool):
            return lax.bitcast_convert_type(self.set_rows(lax.bitcast_convert_type(pool, xp.uint16), slots, rows),
                                            xp.bfloat16)
        if _is_bits(self, pool):
            rows = lax.bitcast_convert_type(xp.asarray(rows).astype(xp.bfloat16), xp.uint16)
        return super().set_rows(pool, slots, rows)


def _is_bf16(nm, pool) -> bool:
    return not nm.is_numpy and nm.xp.dtype(pool.dtype) == nm.xp.dtype(nm.xp.bfloat16)


def _is_bits(nm, pool) -> bool:
    """A uint16 pool on the JAX path: BF16 values held as their bits (no ABI pool is uint16)."""
    return not nm.is_numpy and nm.xp.dtype(pool.dtype) == nm.xp.dtype(nm.xp.uint16)
