"""Numerics modes of the golden model: where values are rounded, and to what.

`device`   BF16 storage (ml_dtypes), per-row INT8 activations (W8A8), FP32 accumulation, with the
           rounding points of kernel-math.md (the PyPTO-Lib kernels' contract).
`exact`    float64 everywhere, no rounding and no quantization: measures what quantization costs
           and is the mode in which independent formulations must agree to ~1e-12.
`official` the official DeepSeek-V4 reference's own round trips: FP8 e4m3 KV (non-RoPE dims,
           compressed rows) and the FP4 e2m1 indexer path always (its quantization-aware-training
           steps), power-of-two (ue8m0) scales; the rest follows the checkpoint's weight dtype
           (`weights`, the config's `dtype`), as the official reference does: block-128 FP8
           linear inputs only for FP8 weights (an FP8 release; a BF16 or FP32 checkpoint's
           `linear` passes its input through), activations and storage in BF16 except for an
           FP32 checkpoint, whose activations stay FP32 (kernel-math.md §7 #7).

Accumulation: the device accumulates in FP32 in its own tile order.  The golden carries every
in-kernel sum in float64 and rounds to FP32 at each kernel's FP32 outputs and storage (a correctly
rounded FP32 accumulator).  In device mode that makes a token's bits independent of batch
composition, padding and BLAS blocking: W8A8 products are integers and BF16 x BF16 products have
16 significant bits, so their float64 sums are exact in any order unless the terms of one sum
span more than ~2^25 in magnitude; where a sum does round (such a span, or FP32 operands), its
error is ~2^-53 relative, and the FP32 rounding after it changes only for a value that close to
an FP32 rounding boundary.  So, but for that rare case, the same token gives the same bits alone,
in a packed prefill or in a decode tile, which is what lets quantization points (a chaotic
amplifier of 1-ulp noise) be compared across prefill, chunked prefill and decode.  Exact mode has
no such guarantee: its float64 operands make products that round, and BLAS (OpenBLAS's remainder
tiles, its thread split) sums a row differently at another row position of the same GEMM, so two
exact-mode formulations that put a row at different GEMM positions agree to ~1e-15 relative, not
bit for bit.

A `Numerics` object carries the mode and the array namespace (`numpy` or `jax.numpy`), so every
kernel is written once and runs on both.  Kernels never branch on the namespace themselves: the
few operations that differ (scatter, integer GEMM) live here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import ml_dtypes
import numpy as np

from twin.abi import constants as C
from twin.abi.errors import AbiError

MODES = ("device", "exact", "official")
_RECORDERS: list = []


class MatmulRecorder(list):
    """Collects ("f" | "i" | "iT", a.shape, b.shape) of every GEMM the kernels run inside the `with`
    (benchmarks replay them alone to measure the overhead around the GEMMs).  operands=True also keeps
    each GEMM's operands (references, not copies), so that `replay` runs the same GEMMs again on the
    same arrays: an INT8 GEMM's weight read from memory and widened as in the step."""

    def __init__(self, operands: bool = False):
        super().__init__()
        self.operands = [] if operands else None

    def replay(self) -> None:
        """Every recorded GEMM again, on its own operands, by the code the kernels called."""
        if self.operands is None:
            raise AbiError("operands", False, "MatmulRecorder(operands=True) to replay", where="MatmulRecorder")
        if not all(isinstance(x, np.ndarray) for ab in self.operands for x in ab):
            raise AbiError("operands", "not NumPy arrays", "a NumPy step's GEMMs (a JAX trace's are tracers)",
                           where="MatmulRecorder")
        for (kind, _, _), (a, b) in zip(self, self.operands):
            if kind == "f":
                a @ b
            else:
                DEVICE.int_mm(a, b)

    def __enter__(self):
        _RECORDERS.append(self)
        return self

    def __exit__(self, *exc):
        _RECORDERS.remove(self)
BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn
FP4 = ml_dtypes.float4_e2m1fn
FP8_MAX, FP4_MAX = 448.0, 6.0
NEG_INF_ATTN = -1e20             # attention masking value (kernel-math.md §1.2)
FP32_NEG_INF = -3.4028e38        # indexer score padding
EXACT_F32_K = 1024               # 1024 * 127 * 127 < 2^24: an int8 dot product this long is exact in f32


def bf16_round(x) -> np.ndarray:
    """Round to bfloat16 (nearest even) and widen back to float32."""
    return np.asarray(x, dtype=np.float32).astype(BF16).astype(np.float32)


def ue8m0(scale, xp=np):
    """Round a positive scale up to a power of two (the ue8m0 scale format)."""
    return xp.exp2(xp.ceil(xp.log2(scale)))


def block_round_trip(x, block: int, fmt, fmt_max: float, xp=np):
    """Quantize the last axis in blocks with a power-of-two scale per block and dequantize."""
    n = x.shape[-1]
    if n % block:
        raise AbiError("block", block, f"a divisor of the last axis ({n})", where="block_round_trip")
    xb = x.reshape(x.shape[:-1] + (n // block, block)).astype(xp.float32)
    amax = xp.maximum(xp.max(xp.abs(xb), axis=-1, keepdims=True), 1e-4)
    s = ue8m0(amax / fmt_max, xp)
    q = xp.clip(xb / s, -fmt_max, fmt_max).astype(fmt).astype(xp.float32)
    return (q * s).reshape(x.shape)


def fit_block(x, block: int) -> int:
    """The official block size, or gcd(block, width) where a small preset's width is not a
    multiple of it (FLASH widths always are: 4096, 448, 128)."""
    import math
    return math.gcd(block, x.shape[-1])


@dataclass(frozen=True)
class Numerics:
    mode: str = "device"
    xp: Any = np
    weights: str = "fp8"           # the checkpoint's linear weight dtype (official mode's rules)

    def __post_init__(self):
        if self.mode not in MODES:
            raise AbiError("mode", self.mode, f"one of {MODES}", where="golden numerics")

    def for_config(self, cfg) -> "Numerics":
        """These numerics for a checkpoint of `cfg`: official mode follows its weight dtype
        (`ModelConfig.dtype`, one of presets.WEIGHT_DTYPES)."""
        return self if cfg.dtype == self.weights else replace(self, weights=cfg.dtype)

    @property
    def fp8_linears(self) -> bool:
        """Official mode rounds linear inputs to FP8 (the weights are FP8)."""
        return self.mode == "official" and self.weights == "fp8"

    @property
    def rounds_bf16(self) -> bool:
        """BF16 rounding points and storage: device mode, and official mode unless the checkpoint is
        FP32 (the official reference then computes in FP32 throughout)."""
        return self.mode == "device" or (self.mode == "official" and self.weights != "fp32")

    # ---- basics --------------------------------------------------------------------------
    @property
    def exact(self) -> bool:
        return self.mode == "exact"

    @property
    def is_numpy(self) -> bool:
        return self.xp is np

    @property
    def f(self):
        """The compute dtype: float64 in every mode (FP32 is a rounding point, see above)."""
        return self.xp.float64

    def asf(self, x):
        """Widen any stored value (bf16, int8, f32) to the compute dtype.

        On NumPy an array already in the compute dtype comes back as it is, not copied: no kernel
        writes into an array in place (set_rows copies the pool it writes)."""
        if self.is_numpy:
            return np.asarray(x, dtype=self.f)
        return self.xp.asarray(x).astype(self.f)

    def r32(self, x):
        """An FP32 rounding point (identity in exact mode)."""
        x = self.asf(x)
        return x if self.exact else x.astype(self.xp.float32).astype(self.f)

    def bf16(self, x):
        """A BF16 rounding point of the device contract (identity in exact mode): the device
        produces the FP32 value first, then rounds it to BF16.  An FP32 point where the mode
        keeps no BF16 (`rounds_bf16`: official mode on an FP32 checkpoint)."""
        x = self.asf(x)
        if self.exact:
            return x
        if not self.rounds_bf16:
            return x.astype(self.xp.float32).astype(self.f)
        return x.astype(self.xp.float32).astype(BF16).astype(self.f)

    def store_bf16(self, x):
        """A value written to a BF16 tensor (pool or output): its storage dtype."""
        return self.asf(x).astype(self.store_dtype)

    @property
    def store_dtype(self):
        """The dtype of the ABI's BF16 tensors: float64 in exact mode, FP32 where the mode keeps no
        BF16 (`rounds_bf16`)."""
        return self.xp.float64 if self.exact else BF16 if self.rounds_bf16 else self.xp.float32

    @property
    def state_dtype(self):
        return self.xp.float64 if self.exact else self.xp.float32

    def contiguous(self, x):
        """x in C order (a GEMM operand: BLAS is fastest on plain layouts); JAX decides its own."""
        return np.ascontiguousarray(x) if self.is_numpy else x

    # ---- W8A8 --------------------------------------------------------------------------
    def q8(self, x):
        """Per-row symmetric INT8 over the last axis: (x_i8 as floats, dq [..., 1]).

        amax floored at 1e-4, scale 127/amax, round half to even (kernel-math.md §3.1).  Exact
        mode does not quantize: it returns (x, 1)."""
        xp = self.xp
        if self.mode != "device":     # official: the FP8 linear's own input round trip
            x = self.asf(x)
            return self.act(x), xp.ones(x.shape[:-1] + (1,), self.f)
        x = xp.asarray(x).astype(xp.float32)          # the device quantizes FP32 values in FP32
        amax = xp.maximum(xp.max(xp.abs(x), axis=-1, keepdims=True), xp.float32(C.INT8_AMAX_EPS))
        sq = xp.float32(C.INT8_SCALE_MAX) / amax
        return self.asf(xp.rint(x * sq)), self.asf(xp.float32(1.0) / sq)

    def mm(self, a, b):
        """A float GEMM in the compute dtype (recorded when a `MatmulRecorder` is active)."""
        _record("f", a, b)
        return a @ b

    def int_mm(self, a, b):
        """A GEMM of integer-valued operands with an exact int32 accumulator, widened to f32.

        (f32 is not exact past 2^24 = 127*127*1040; float64 is exact for every ABI K.)  The
        result is the exact integer (NumPy device mode: as f32 where one K slice covers it, which
        holds it exactly, else float64); the caller's scaling happens in the compute dtype."""
        if self.mode != "device":
            a, b = self.asf(a), self.asf(b)
            _record("f", a, b)          # a float64 GEMM outside device mode
            return a @ b
        # f32 GEMMs are exact on K <= 1024 slices (|sum| < 2^24); the slices add in f64
        _record("i", a, b)
        xp = self.xp
        if self.is_numpy and np.ndim(a) == 2 and np.ndim(b) == 2 and np.shape(a)[-1]:
            return _int_mm_np(a, b)
        a32, b32 = xp.asarray(a).astype(xp.float32), xp.asarray(b).astype(xp.float32)
        K = a32.shape[-1]
        out = 0.0
        for k0 in range(0, K, EXACT_F32_K):
            out = out + (a32[..., k0:k0 + EXACT_F32_K] @ b32[k0:k0 + EXACT_F32_K]).astype(self.f)
        return out

    def w8a8(self, x, w_i8, w_scale):
        """y = Q8(x) @ W: x [..., K]; w_i8 [K, N] int8; w_scale [N] (per output channel)."""
        if self.mode != "device":
            return self.act(x) @ (self.asf(w_i8) * self.asf(w_scale))
        xi, dq = self.q8(x)
        return self.int_mm(xi, w_i8) * dq * self.asf(w_scale)

    # ---- the indexer's Hadamard rotation ------------------------------------------------------
    def rotation(self, hadamard):
        """The indexer's Hadamard matrix [n, n] as a GEMM operand.  Device: the ABI's BF16 tensor as
        given (bf16(1/sqrt(n)) is 0.3 % off, a uniform factor the INT8 scales absorb).  Exact and
        official: the exact orthonormal +-1/sqrt(n) with the given sign pattern, as the official
        `rotate_activation` (a fast Walsh-Hadamard transform scaled by n^-0.5) computes it; ahead
        of the FP4 round trip the BF16 factor would move values across FP4 steps."""
        h = self.asf(hadamard)
        if self.mode == "device":
            return h
        return self.xp.sign(h) * (h.shape[-1] ** -0.5)

    # ---- official-mode round trips -----------------------------------------------------------
    def act(self, x, block: int = 128):
        """Input of a linear that is FP8 in the official release: block-128 e4m3 round trip in
        official mode when the checkpoint's weights are FP8 (`fp8_linears`), else x as it is."""
        x = self.asf(x)
        if self.fp8_linears:
            return block_round_trip(x, fit_block(x, block), FP8, FP8_MAX, self.xp)
        return x

    def kv_fp8(self, x, block: int = 64):
        """Official FP8 simulation of the non-RoPE KV dims (blocks of 64)."""
        x = self.asf(x)
        return block_round_trip(x, fit_block(x, block), FP8, FP8_MAX, self.xp) if self.mode == "official" else x

    def fp4(self, x, block: int = 32):
        """Official FP4 e2m1 simulation of the indexer query and key (blocks of 32)."""
        x = self.asf(x)
        return block_round_trip(x, fit_block(x, block), FP4, FP4_MAX, self.xp) if self.mode == "official" else x

    # ---- functional scatter ----------------------------------------------------------------
    def set_rows(self, pool, slots, rows):
        """pool viewed as [pages*rows_per_page, row] gets row at every slot >= 0 for every slot >= 0; returns the new pool.

        NumPy copies (inputs are never mutated); JAX drops out-of-range writes."""
        xp = self.xp
        flat = pool.reshape(pool.shape[0] * pool.shape[1], -1)
        if self.is_numpy:
            rows = np.asarray(rows).astype(pool.dtype, copy=False).reshape(-1, flat.shape[1])
            flat = flat.copy()
            slots = np.asarray(slots)
            if slots.size and slots.min() >= 0:      # every row is written (the usual case)
                flat[slots] = rows
            else:
                ok = slots >= 0
                flat[slots[ok]] = rows[ok]
            return flat.reshape(pool.shape)
        rows = xp.asarray(rows).astype(pool.dtype).reshape(-1, flat.shape[1])
        n = flat.shape[0]
        idx = xp.where(slots >= 0, slots, n)
        return flat.at[idx].set(rows, mode="drop").reshape(pool.shape)

    def get_rows(self, pool, slots):
        """Rows of a paged pool at flat slots (slot < 0 reads row 0; callers mask)."""
        xp = self.xp
        flat = pool.reshape(pool.shape[0] * pool.shape[1], -1)
        if self.is_numpy:       # take (clip: a slot < 0 reads row 0) gathers ~2x faster than indexing
            slots = np.asarray(slots)
            if slots.size and slots.max() >= flat.shape[0]:
                raise AbiError("slots", int(slots.max()), f"pool slots < {flat.shape[0]}", where="get_rows")
            return np.take(flat, slots, axis=0, mode="clip")
        return flat[xp.where(slots >= 0, slots, 0)]


def _weight_transposed(b) -> bool:
    """b is a weight stored [out, in] and passed as w.T: the layout _int_mm_np multiplies from the
    left in blocks when few rows come against it."""
    return b.ndim == 2 and b.flags.f_contiguous and not b.flags.c_contiguous


def _record(kind, a, b):
    if _RECORDERS:
        if kind == "i" and isinstance(b, np.ndarray) and _weight_transposed(b):
            kind = "iT"
        _RECORDERS[-1].append((kind, tuple(a.shape), tuple(b.shape)))
        if _RECORDERS[-1].operands is not None:
            _RECORDERS[-1].operands.append((a, b))


def _int_mm_np(a, b):
    """Numerics.int_mm on NumPy 2-D operands.  The products are exact integers in any order, so
    only the layout is chosen, for speed.  A weight passed transposed ([out, in] int8, read as w.T)
    against at most 64 rows (a routed expert's few rows) is widened a block of output channels at
    a time into one cache-sized f32 buffer and multiplied from the left (C^T = W A^T): widening the
    whole weight would write and read it 4x its int8 size through memory, which costs more than
    the GEMM itself (OpenBLAS's SGEMM against a transposed B is ~2-3x slower, a transposing widen
    ~4x a plain one).  One K slice comes back as its f32 integers (exact); more slices add in f64
    from 0.0, as the generic path does.  (The one difference: an all -0 product sum stays -0 in
    f32 where the generic path's 0.0 + s gives +0; both are the integer 0.)"""
    a32 = np.asarray(a, dtype=np.float32)
    b = np.asarray(b)
    if _weight_transposed(b) and a32.shape[0] <= 64:
        return _int_mm_weight_blocks(a32, b.T)
    w32 = b.astype(np.float32)
    if a32.shape[-1] <= EXACT_F32_K:      # one slice: its f32 sum is the exact integer
        return a32 @ w32
    out = None
    for k0 in range(0, a32.shape[-1], EXACT_F32_K):
        k1 = k0 + EXACT_F32_K
        r = a32[:, k0:k1] @ w32[k0:k1]
        out = np.add(r, 0.0, dtype=np.float64, order="C") if out is None else out + r
    return out


WIDEN_BLOCK_BYTES = 1 << 20     # the f32 weight block of _int_mm_weight_blocks: fits a core's L2


def _int_mm_weight_blocks(a32, w):
    """a32 [n, K] f32 integers @ w.T, w [N, K] int8 C-contiguous, one block of output channels at a
    time (see _int_mm_np); the same f32 slice sums and f64 slice additions as the whole-weight path."""
    n, K = a32.shape
    N = w.shape[0]
    rows = max(16, WIDEN_BLOCK_BYTES // (4 * max(K, 1)))
    out = np.empty((n, N), np.float32 if K <= EXACT_F32_K else np.float64)
    buf = np.empty((min(rows, N), K), np.float32)
    for o0 in range(0, N, rows):
        blk = buf[:min(rows, N - o0)]
        np.copyto(blk, w[o0:o0 + rows])
        if K <= EXACT_F32_K:
            out[:, o0:o0 + rows] = (blk @ a32.T).T
            continue
        acc = None
        for k0 in range(0, K, EXACT_F32_K):
            r = (blk[:, k0:k0 + EXACT_F32_K] @ a32[:, k0:k0 + EXACT_F32_K].T).T
            acc = np.add(r, 0.0, dtype=np.float64) if acc is None else acc + r
        out[:, o0:o0 + rows] = acc
    return out


DEVICE = Numerics("device")
EXACT = Numerics("exact")
OFFICIAL = Numerics("official")


def numerics(mode: str | Numerics, xp=np, cfg=None) -> Numerics:
    """A mode name or Numerics -> Numerics; with `cfg`, for that config's checkpoint (for_config)."""
    nm = mode if isinstance(mode, Numerics) else Numerics(mode, xp)
    return nm if cfg is None else nm.for_config(cfg)
