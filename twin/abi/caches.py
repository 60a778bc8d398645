"""The seven target cache families and the drafter's private pools.

A family is described once (page geometry, row content, window, device tensors); its sizes at a
deployment follow upstream's `build_dspark_cache_group_specs` and `init_kv_cache` formulas.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

import numpy as np

from . import constants as C
from .presets import CSA, HCA, ModelConfig

DTYPE_BYTES = {"bf16": 2, "f32": 4, "i8": 1, "i16": 2, "i32": 4, "i64": 8}


@dataclass(frozen=True)
class PoolTensor:
    """One device tensor of a family: [R, layers * pages, rows_per_page, *row_shape]."""

    name: str
    decode_name: str | None
    row_shape: tuple[int, ...]
    dtype: str

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape)) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class CacheFamily:
    """A scheduler-visible KV cache group (`KVCacheGroupSpec`)."""

    name: str
    layers: tuple[int, ...]
    page_tokens: int            # source tokens per page (= token capacity, the hash page)
    compress_ratio: int         # source tokens per stored row
    window: int | None          # None: full-history, append-only; int: rolling ring
    tensors: tuple[PoolTensor, ...]
    kind: str                   # "raw", "compressed", "state"

    @property
    def rows_per_page(self) -> int:
        return self.page_tokens // self.compress_ratio

    @property
    def rolling(self) -> bool:
        return self.window is not None

    @property
    def row_bytes(self) -> int:
        return sum(t.row_bytes for t in self.tensors)

    @property
    def page_bytes(self) -> int:
        """len(layers) x rows per page x (row width x element bytes + extra row bytes)."""
        return len(self.layers) * self.rows_per_page * self.row_bytes

    @property
    def tail_pages(self) -> int:
        """Immutable rolling tail a prefix hit must find: window / page_tokens pages."""
        return (self.window // self.page_tokens) if self.rolling else 0

    def max_blocks_per_seq(self, max_seq_len: int, max_prefill_tokens: int) -> int:
        if not self.rolling:
            return math.ceil(max_seq_len / C.COMPRESSED_BLOCK_TOKENS)
        in_flight = max(min(max_prefill_tokens, max_seq_len), 8)
        return ring_pages(self.window, self.page_tokens, in_flight)

    def frozen_depth(self, max_positions: int) -> int:
        """The kernels' frozen prefill table depth: one entry per page up to the position ceiling."""
        return math.ceil(max_positions / self.page_tokens)


def ring_pages(window: int, page: int, in_flight: int) -> int:
    """ceil((window - 1 + in_flight) / page) + 1: history, one in-flight chunk and a boundary page."""
    return math.ceil((window - 1 + in_flight) / page) + 1


def cache_families(model: ModelConfig) -> tuple[CacheFamily, ...]:
    """The seven groups, in upstream's fixed order (DSPARK_CACHE_GROUP_NAMES)."""
    all_layers = tuple(range(model.num_hidden_layers))
    hd, ihd = model.head_dim, model.index_head_dim
    csa, hca = model.csa_layers, model.hca_layers
    T = PoolTensor
    return (
        CacheFamily("ori", all_layers, C.BLOCK_SIZE, 1, C.SLIDING_WINDOW,
                    (T("kv_cache", "raw_kv_pool", (1, hd), "bf16"),), "raw"),
        CacheFamily("cmp_c128", hca, C.COMPRESSED_BLOCK_TOKENS, HCA, None,
                    (T("hca_cmp_kv", None, (1, hd), "bf16"),), "compressed"),
        CacheFamily("cmp_c4", csa, C.COMPRESSED_BLOCK_TOKENS, CSA, None,
                    (T("csa_cmp_kv", None, (1, hd), "bf16"),), "compressed"),
        CacheFamily("idx", csa, C.COMPRESSED_BLOCK_TOKENS, CSA, None,
                    (T("idx_kv_cache", "csa_idx_kv_cache", (1, ihd), "i8"),
                     T("idx_kv_scale", "csa_idx_kv_scale", (1, 1), "f32")), "compressed"),
        CacheFamily("hca_state", hca, 8, 1, C.SLIDING_WINDOW,
                    (T("hca_compress_state", None, (2 * hd,), "f32"),), "state"),
        CacheFamily("csa_state", csa, 2, 1, 8,
                    (T("csa_compress_state", None, (4 * hd,), "f32"),), "state"),
        CacheFamily("csa_inner_state", csa, 2, 1, 8,
                    (T("csa_inner_compress_state", None, (4 * ihd,), "f32"),), "state"),
    )


FAMILY_NAMES = ("ori", "cmp_c128", "cmp_c4", "idx", "hca_state", "csa_state", "csa_inner_state")


def page_alignment(families) -> int:
    """lcm of the families' token capacities (128 for DSpark): prefix hits are multiples of it."""
    return reduce(math.lcm, (f.page_tokens for f in families))


@dataclass(frozen=True)
class FamilySizing:
    family: CacheFamily
    max_blocks_per_seq: int
    frozen_depth: int

    @property
    def bytes_per_slot(self) -> int:
        return self.max_blocks_per_seq * self.family.page_bytes

    @property
    def scratch_bytes(self) -> int:
        return C.SCRATCH_PAGES * self.family.page_bytes

    def pool_pages(self, slots: int) -> int:
        """Pages per layer in the device tensor: scheduler blocks plus the 64 scratch pages."""
        return slots * self.max_blocks_per_seq + C.SCRATCH_PAGES


def size_families(model: ModelConfig, max_seq_len: int, max_prefill_tokens: int) -> dict[str, FamilySizing]:
    return {f.name: FamilySizing(f, f.max_blocks_per_seq(max_seq_len, max_prefill_tokens),
                                 f.frozen_depth(model.max_position_embeddings))
            for f in cache_families(model)}


# ---- the drafter's private pools (K=7), never visible to the scheduler -------------------------
@dataclass(frozen=True)
class DrafterPools:
    model: ModelConfig

    @property
    def kv_cache_bytes(self) -> int:
        """kv_caches [3 layers, 512 blocks, 32, 1, head_dim] BF16 per rank (48 MiB at FLASH)."""
        m = self.model
        return m.dspark_num_layers * C.DRAFTER_POOL_BLOCKS * C.BLOCK_SIZE * m.head_dim * 2

    @property
    def state_bytes(self) -> int:
        """state_tokens [64, 8] INT64 + state_meta [64, 6] INT32 per rank."""
        return C.DRAFTER_LEASES_PER_GROUP * (8 * 8 + len(C.STATE_META_FIELDS) * 4)


def lease_block(lease: int, logical_block, draft_layer: int):
    """Physical drafter block: lease*6 + (Lb + 7*l) mod 6 (the three layers rotate one range);
    logical_block an int or an integer array (then an array of blocks)."""
    n = C.DRAFTER_BLOCKS_PER_LEASE
    return lease * n + (logical_block + C.DSPARK_QUERY_WIDTH * draft_layer) % n


def filler_block(logical_block, draft_layer: int):
    """The filler range's block for logical_block (an int or an integer array), rotated as lease_block."""
    return C.DRAFTER_FILLER_BLOCK_BASE + (logical_block + C.DSPARK_QUERY_WIDTH * draft_layer) % C.DRAFTER_BLOCKS_PER_LEASE
