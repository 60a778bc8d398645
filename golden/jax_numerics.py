"""FP32 numerics for the JAX path: the device contract's accumulator instead of NumPy's float64.

kernel-math.md §0 defines a "bf16 in, fp32 acc" matmul as an fp32 GEMM of the widened values and
§8 sets the lockstep tolerances "for fp32 accumulation in any order".  `Fp32Numerics` keeps every
rounding point of `golden.numerics.Numerics` (BF16 storage, W8A8 per-row INT8, FP32 outputs) and
only changes what carries the sums between them: float32, in XLA's order.

INT8 GEMMs stay exact integers, as on the device (int32 accumulator): integers |v| <= 127 are
BF16 values, so they run as BF16 GEMMs with f32 sums over K slices of at most EXACT_F32_K
(|sum| < 2^24, so each slice is exact), the slices added in int32, and the int32 sum converted to
f32 once (kernel-math §3.1: y = f32(acc) * dq * w_s); against an int8 weight (the routed experts,
which `JaxGolden` keeps int8) one int8 x int8 -> int32 dot, the same integer.

BF16 GEMMs: a product of two BF16 values is exact in f32, so a "bf16 in, fp32 acc" GEMM may take
its operands as bf16 (`preferred_element_type=f32`: XLA CPU's BF16 kernels run 2-4x its f32 ones)
with nothing changed but the f32 summation order.  Float GEMMs take that path only inside
`bf16_operands()`, which the JAX kernels open around the kernels whose every `mm` multiplies BF16
values (a rounded activation by a BF16 weight or pool); hc mixes, hc_post and the gate multiply
FP32 values and stay FP32 GEMMs.  `verify_bf16=True` makes each BF16 GEMM also check (traced) that
its operands are BF16 values; `JaxGolden` reports the result (a test runs it).  XLA CPU keeps a
BF16 dot BF16 only when no transpose sits between the dot and an operand (it falls back to f32
otherwise): `JaxGolden` stores the matrices the kernels read as w.T transposed, and the JAX
kernels write their own dots as dot_generals on the untransposed operands.

Exact mode ignores all of this (float64, as `Numerics`).  The NumPy path stays the reference: its
float64 carry makes a token's bits independent of batching; this one is as batching-dependent as
the device (see golden/README.md, "JAX path").
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from .numerics import EXACT_F32_K, Numerics, _record


@dataclass(frozen=True)
class Fp32Numerics(Numerics):
    # pool -> the last rows read from it while tracing (see set_rows); cleared per traced step
    reads: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    verify_bf16: bool = False
    # [depth of open bf16_operands() contexts, traced "operands were BF16 values" checks]: run state
    # of the trace, mutable in a frozen dataclass as `reads` is
    bf16_state: list = field(default_factory=lambda: [0, []], compare=False, hash=False, repr=False)

    @contextmanager
    def bf16_operands(self):
        """Float GEMMs inside take their operands as BF16 (the caller vouches that they are BF16
        values; verify_bf16 checks it).  No effect outside device mode or on NumPy."""
        self.bf16_state[0] += 1
        try:
            yield
        finally:
            self.bf16_state[0] -= 1

    @property
    def bf16_active(self) -> bool:
        """Inside bf16_operands() in device mode on JAX: float GEMMs take BF16 operands."""
        return self.bf16_state[0] > 0 and self.mode == "device" and not self.is_numpy

    def as_bf16(self, *vs):
        """GEMM operands that hold BF16 values, as bf16 arrays (verify_bf16: each checked)."""
        xp = self.xp
        vs = [xp.asarray(v) for v in vs]
        if self.verify_bf16:
            self.bf16_state[1].extend(xp.all(v == v.astype(xp.bfloat16).astype(v.dtype)) for v in vs)
        return [v.astype(xp.bfloat16) for v in vs]

    def mm(self, a, b):
        if self.bf16_active:
            _record("f", a, b)
            return self.xp.matmul(*self.as_bf16(a, b), preferred_element_type=self.xp.float32)
        return super().mm(a, b)

    @property
    def f(self):
        return self.xp.float64 if self.exact else self.xp.float32

    def int_mm(self, a, b):
        if self.mode != "device":
            return super().int_mm(a, b)
        _record("i", a, b)
        xp = self.xp
        if xp.asarray(b).dtype == xp.int8:
            # an int8 weight (JaxGolden keeps the routed experts so, in the layout the dot reads):
            # int8 x int8 -> int32, the device's accumulator, exact like the f32 slices below and
            # ~2x faster on XLA CPU; against a transposed operand or into XLA's generic dot
            # (the other GEMMs' shapes) it is slower, so only where the caller chose it
            return xp.matmul(xp.asarray(a).astype(xp.int8), b, preferred_element_type=xp.int32).astype(xp.float32)
        # integers |v| <= 127 are BF16 values: BF16 dots with f32 sums, exact on K slices
        a16, b16 = self.as_bf16(a, b)
        dot = lambda x, y: xp.matmul(x, y, preferred_element_type=xp.float32)
        K = a16.shape[-1]
        if K <= EXACT_F32_K:
            return dot(a16, b16)
        acc = 0
        for k0 in range(0, K, EXACT_F32_K):
            acc = acc + dot(a16[..., k0:k0 + EXACT_F32_K], b16[k0:k0 + EXACT_F32_K]).astype(xp.int32)
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
