"""The drafter's private SWA pools and the lease rings that address them (serving-contract.md §7.1).

Per TP group one replica of `kv_caches [3 layers, 512 blocks, 32, 1, HD]` (the four ranks of the
group hold identical copies; golden keeps one).  Position p of lease L in draft layer l lives in
physical block `lease_block(L, p // 32, l)`, row p % 32; padding rows use the filler ring at blocks
384..389, which no lease reaches.  Slots are -1 where nothing may be written.
"""
from __future__ import annotations

import numpy as np

from twin.abi import constants as C
from twin.abi.errors import AbiError


def ring_slots(lease: int | None, positions, draft_layer: int) -> np.ndarray:
    """Flat pool rows of `positions` in `lease`'s ring (lease None: the filler ring); -1 stays -1.

    Vectorised `twin.abi.caches.lease_block` / `filler_block` (the tests pin the equality)."""
    pos = np.asarray(positions, np.int64)
    if lease is not None and not 0 <= lease < C.DRAFTER_LEASES_PER_GROUP:
        raise AbiError("lease", lease, f"0..{C.DRAFTER_LEASES_PER_GROUP - 1}", where="drafter ring")
    lb = np.where(pos >= 0, pos, 0) // C.BLOCK_SIZE
    n = C.DRAFTER_BLOCKS_PER_LEASE
    rot = (lb + C.DSPARK_QUERY_WIDTH * draft_layer) % n
    base = (C.DRAFTER_FILLER_BLOCK_BASE if lease is None else lease * n)
    phys = base + rot
    return np.where(pos >= 0, phys * C.BLOCK_SIZE + pos % C.BLOCK_SIZE, -1)


def block_table(lease: int | None, draft_layer: int, depth: int = C.ORI_MAX_BLOCKS) -> np.ndarray:
    """`block_tables[., l, b, :]`: every logical entry filled with the rotating ring ids."""
    lb = np.arange(depth)
    n = C.DRAFTER_BLOCKS_PER_LEASE
    base = C.DRAFTER_FILLER_BLOCK_BASE if lease is None else lease * n
    return (base + (lb + C.DSPARK_QUERY_WIDTH * draft_layer) % n).astype(np.int32)


def new_pools(cfg, groups: int, nm) -> list:
    """Zeroed drafter pools, one group replica each: [DL, 512, 32, 1, HD] in the storage dtype."""
    shape = (cfg.dspark_num_layers, C.DRAFTER_POOL_BLOCKS, C.BLOCK_SIZE, 1, cfg.head_dim)
    return [nm.xp.zeros(shape, nm.store_dtype) for _ in range(groups)]


def window_positions(anchor: int) -> np.ndarray:
    """Rows a query block at anchor a reads: a-127 .. a (context) and a+1 .. a+7 (the block),
    clipped at 0, padded to the 192-wide DSPARK_SWA_INDEX_WIDTH with -1."""
    width = -(-(C.SLIDING_WINDOW + C.DSPARK_QUERY_WIDTH) // 64) * 64
    s = anchor + 1
    pos = np.arange(max(0, s - C.SLIDING_WINDOW), s + C.DSPARK_QUERY_WIDTH)
    out = np.full(width, -1, np.int64)
    out[: pos.size] = pos
    return out
