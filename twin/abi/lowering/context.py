"""What lowering needs to know about a deployment, and the one error it raises.

`LoweringContext(deployment, slots)` fixes the pool sizes (blocks per family per partition =
slots x max_blocks_per_seq, scratch pages num_blocks..num_blocks+63), the frozen table depths of
the kernels, the position ceiling and the RoPE rows.  Lowering and `validate` read every size
from here, so they cannot disagree with the ABI binding.

BF16 arguments are numpy `uint16` arrays holding the bfloat16 bit patterns (numpy has no
bfloat16 and `twin.abi` imports numpy only); `validate` also accepts a 2-byte `bfloat16` dtype
(ml_dtypes), so golden and hw may pass either.  `from_bf16_bits` widens them to float32.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import numpy as np

from .. import constants as C
from ..caches import cache_families, size_families
from ..errors import AbiError
from ..programs import bind, check_slots, get_program, symbols
from ..rope import inv_freq
from ..topology import Deployment

NP_DTYPES = {"f32": np.float32, "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64,
             "bf16": np.uint16}


class DispatchError(AbiError):
    """A batch cannot be lowered, or a dispatch breaks an ABI rule.

    `program`, `arg` and `rule` (a short id such as "table_depth" or "block_repeat") say what broke;
    the message also gives the value and what is allowed.  This is the error the device would
    otherwise report as an opaque AICore 507901 or a hang."""

    def __init__(self, program: str, arg: str, rule: str, value, allowed: str):
        self.program = program
        self.arg = arg
        self.rule = rule
        super().__init__(arg, value, allowed, where=f"{program} [{rule}]")
        self.args = (program, arg, rule, value, allowed)


def to_bf16_bits(x) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def from_bf16_bits(b) -> np.ndarray:
    arr = np.asarray(b)
    if arr.dtype != np.uint16:          # an ml_dtypes bfloat16 array: same bits
        arr = arr.view(np.uint16)
    return (arr.astype(np.uint32) << np.uint32(16)).view(np.float32)


def default_rope(model) -> Callable[[int, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """RoPE rows in the ABI layout (kernel-math.md §3.2): ratio 0 -> theta `rope_theta`, no YaRN;
    ratio 4 or 128 -> `compress_rope_theta` with YaRN frequency interpolation (no mscale).  Rows
    are gathered per position, so a 1M-position table is never materialised.  Golden may inject
    its own function with the same signature."""

    freqs = {r: inv_freq(model, r != 0, np.float32) for r in (0, 4, 128)}

    def rows(ratio: int, positions: np.ndarray):
        ang = np.asarray(positions, dtype=np.float32)[:, None] * freqs[ratio][None, :]
        c, s = np.cos(ang), np.sin(ang)
        return np.concatenate([c, c], -1), np.concatenate([s, s], -1)

    return rows


@dataclass
class LoweringContext:
    """Pool sizes, frozen depths and RoPE of one deployment at a given slot count."""

    deployment: Deployment
    slots: int = 1
    rope: Callable | None = field(default=None, repr=False)

    def __post_init__(self):
        check_slots(self.slots, "LoweringContext")
        if self.rope is None:
            self.rope = default_rope(self.model)

    # ---- deployment facts ------------------------------------------------------------------
    @property
    def model(self):
        return self.deployment.model

    @property
    def tp(self) -> int:
        return self.deployment.topology.tp

    @property
    def ranks(self) -> int:
        return self.deployment.ranks

    @property
    def partitions(self) -> int:
        return self.deployment.partitions

    @property
    def max_position(self) -> int:
        """The runner's position ceiling: max_position = max_seq_len (--max-model-len)."""
        return self.deployment.limits.max_model_len

    @property
    def chunk_limit(self) -> int:
        return self.deployment.limits.max_prefill_tokens_per_request

    @property
    def noise_token(self) -> int:
        return self.model.dspark_noise_token_id

    @property
    def local_requests(self) -> int:
        """Decode requests per owner rank: 64 per group over the group's ranks."""
        return C.DECODE_BATCH // self.tp

    @cached_property
    def sizing(self):
        lim = self.deployment.limits
        return size_families(self.model, lim.max_model_len, lim.max_prefill_tokens_per_request)

    @cached_property
    def families(self):
        return {f.name: f for f in cache_families(self.model)}

    @cached_property
    def num_blocks(self) -> dict[str, int]:
        """Scheduler-visible blocks per partition; ids num_blocks..num_blocks+63 are scratch."""
        return {n: self.slots * s.max_blocks_per_seq for n, s in self.sizing.items()}

    def ring_period(self, family: str) -> int:
        return self.sizing[family].max_blocks_per_seq

    @cached_property
    def symbols(self) -> dict[str, int]:
        return symbols(self.deployment, self.slots)

    def depth(self, symbol: str) -> int:
        return self.symbols[symbol]

    def bind(self, program: str, **extents) -> dict:
        return {b.name: b for b in bind(get_program(program), self.deployment, self.slots, **extents)}

    def group_ranks(self, g: int) -> range:
        return self.deployment.topology.group_ranks(g)

    # ---- RoPE ------------------------------------------------------------------------------
    def rope_bits(self, ratio: int, positions) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin) rows as bf16 bits [n, ROPE] at `positions` of the ratio's profile."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size == 0:
            z = np.zeros((0, self.model.qk_rope_head_dim), np.uint16)
            return z, z
        c, s = self.rope(ratio, pos)
        return to_bf16_bits(c), to_bf16_bits(s)


def alloc(bound, fill=0) -> np.ndarray:
    """A host slot of the bound shape and dtype.  Zero fills use calloc'd pages, so a large
    buffer whose rows are never written costs no memory; `fill=None` leaves it uninitialised for
    a caller that writes every entry (a FLASH decode state table is 512 MiB)."""
    dt = NP_DTYPES[bound.dtype]
    if fill is None:
        return np.empty(bound.shape, dt)
    if fill == 0:
        return np.zeros(bound.shape, dt)
    return np.full(bound.shape, fill, dt)


def align_up(n: int, a: int) -> int:
    return -(-n // a) * a
