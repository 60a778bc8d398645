"""The drafter's private SWA pools and the lease rings that address them (serving-contract.md §7.1).

Per TP group one replica of `kv_caches [3 layers, 512 blocks, 32, 1, HD]` (the four ranks of the
group hold identical copies; golden keeps one).  Position p of lease L in draft layer l lives in
physical block `lease_block(L, p // 32, l)`, row p % 32; padding rows use the filler ring at blocks
384..389, which no lease reaches.  The ring formulas are the ABI's (twin.abi.caches' lease_block and
filler_block, as slots in twin.abi.lowering.drafter), so the golden writes exactly where a lowered
dispatch says.  Slots are -1 where nothing is written.
"""
from __future__ import annotations

import numpy as np

from twin.abi import constants as C
from twin.abi.errors import AbiError
from twin.abi.lowering.drafter import filler_ring_table, filler_slot, lease_ring_table, lease_slot


def ring_slots(lease: int | None, positions, draft_layer: int) -> np.ndarray:
    """Flat pool rows of `positions` in `lease`'s ring (lease None: the filler ring); -1 stays -1."""
    if lease is None:
        return filler_slot(positions, draft_layer)
    if not 0 <= lease < C.DRAFTER_LEASES_PER_GROUP:
        raise AbiError("lease", lease, f"0..{C.DRAFTER_LEASES_PER_GROUP - 1}", where="drafter ring")
    return lease_slot(positions, lease, draft_layer)


def block_table(lease: int | None, draft_layer: int, depth: int = C.ORI_MAX_BLOCKS) -> np.ndarray:
    """`block_tables[., l, b, :]`: every logical entry filled with the rotating ring ids."""
    return filler_ring_table(draft_layer, depth) if lease is None else lease_ring_table(lease, draft_layer, depth)


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
