"""FP32 numerics for the JAX path: the device contract's accumulator instead of NumPy's float64.

kernel-math.md §0 defines a "bf16 in, fp32 acc" matmul as an fp32 GEMM of the widened values and
§8 sets the lockstep tolerances "for fp32 accumulation in any order".  `Fp32Numerics` keeps every
rounding point of `golden.numerics.Numerics` (BF16 storage, W8A8 per-row INT8, FP32 outputs) and
only changes what carries the sums between them: float32, in XLA's order.

INT8 GEMMs stay exact integers, as on the device (int32 accumulator): f32 GEMMs over K slices of at
most EXACT_F32_K (|sum| < 2^24, so each slice is exact), the slices added in int32, and the int32
sum converted to f32 once (kernel-math §3.1: y = f32(acc) * dq * w_s).

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
        a32, b32 = xp.asarray(a).astype(xp.float32), xp.asarray(b).astype(xp.float32)
        K = a32.shape[-1]
        if K <= EXACT_F32_K:
            return a32 @ b32
        acc = 0
        for k0 in range(0, K, EXACT_F32_K):
            acc = acc + (a32[..., k0:k0 + EXACT_F32_K] @ b32[k0:k0 + EXACT_F32_K]).astype(xp.int32)
        return acc.astype(xp.float32)

    def get_rows(self, pool, slots):
        """As Numerics.get_rows; a BF16 pool is gathered as its uint16 bits (XLA's CPU gather on
        bf16 widens the whole pool to f32 first: a 5632 x 128 pool per layer to read 2k rows)."""
        if _is_bf16(self, pool):
            from jax import lax
            rows = lax.bitcast_convert_type(super().get_rows(lax.bitcast_convert_type(pool, self.xp.uint16), slots),
                                            self.xp.bfloat16)
        else:
            rows = super().get_rows(pool, slots)
        if not self.is_numpy:
            self.reads[id(pool)] = (pool, rows)
        return rows

    def set_rows(self, pool, slots, rows):
        """As Numerics.set_rows.  A write to a pool this step read before (the compressors pool
        old state rows, then commit the new ones) is made data-dependent on that read: XLA then
        orders the two and updates the pool in place instead of copying it (twice) per layer.
        BF16 pools are scattered as their uint16 bits (XLA's CPU scatter on bf16 widens the whole
        pool to f32 and narrows it back)."""
        xp = self.xp
        if self.is_numpy:
            return super().set_rows(pool, slots, rows)
        read = self.reads.pop(id(pool), None)
        if read is not None and read[0] is pool and read[1].size:
            z = read[1].reshape(-1)[0].astype(xp.float32)
            never = (z != z) & (z == z)              # always False, opaque to XLA's simplifier
            rows = xp.asarray(rows)
            rows = xp.where(never, xp.zeros_like(rows), rows)
        if not _is_bf16(self, pool):
            return super().set_rows(pool, slots, rows)
        from jax import lax        # BF16 pools are scattered as their uint16 bits, like get_rows
        bits = lambda a: lax.bitcast_convert_type(a, xp.uint16)
        return lax.bitcast_convert_type(super().set_rows(bits(pool), slots, bits(xp.asarray(rows).astype(xp.bfloat16))),
                                        xp.bfloat16)


def _is_bf16(nm, pool) -> bool:
    return not nm.is_numpy and nm.xp.dtype(pool.dtype) == nm.xp.dtype(nm.xp.bfloat16)
