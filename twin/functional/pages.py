"""Partition-local page ids (the scheduler's) to golden's one-pool-per-family page ids.

Golden keeps a single pool per cache family; partition `p`'s page `b` is page `p * num_blocks + b`
there, where `num_blocks` is the scheduler-visible block count per partition
(`LoweringContext.num_blocks`).  Slots convert the same way: a paged slot `b * page + o` moves by
`p * num_blocks * page`, a compressed row slot by `p * num_blocks * rows_per_page`.
"""
from __future__ import annotations

from twin.abi.errors import AbiError


class PageMap:
    def __init__(self, ctx):
        self.ctx = ctx
        self.num_blocks = dict(ctx.num_blocks)
        self.partitions = ctx.partitions
        self.pool_pages = {f: self.partitions * n for f, n in self.num_blocks.items()}

    def to_golden(self, partition: int, block_ids) -> dict:
        if not 0 <= partition < self.partitions:
            raise AbiError("partition", partition, f"0..{self.partitions - 1}", where="PageMap")
        out = {}
        for f, ids in block_ids.items():
            nb = self.num_blocks[f]
            bad = [b for b in ids if b is None or not 0 <= b < nb]
            if bad:
                raise AbiError(f"block_ids[{f}]", bad[0], f"partition-local ids in [0, {nb})", where="PageMap")
            out[f] = [partition * nb + int(b) for b in ids]
        return out

    def slot_offset(self, partition: int, family: str, unit: int) -> int:
        """What a partition-local slot of `family` (unit = page tokens or rows per page) moves by."""
        return partition * self.num_blocks[family] * unit
