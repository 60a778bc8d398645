"""The golden runs what a dispatch stages: page addressing and the dispatch/golden cross-check.

Golden keeps one pool per cache family holding every partition: the scheduler's partition-local
page `b` of partition `p` is golden's page `p * num_blocks + b` (`num_blocks` = the scheduler's
block count per partition, `LoweringContext.num_blocks`), so a paged slot `b * page + o` moves by
`p * num_blocks * page` and a compressed-row slot by `p * num_blocks * rows_per_page` (`PageMap`).

Golden addresses its pools through its own lowering (`golden.paged.lower`), the device program
through `twin.abi.lowering`'s dispatch.  `check_prefill` checks, request by request, that both put
the same tokens at the same positions and write through the same slots of all seven families
(after the page shift); `check_decode` that each verify row's stream slot carries the lease and
generation of the drafter state golden verifies.  Both the functional twin (`twin.functional`)
and the real-golden lockstep (`hw.real`) run these, so neither can pass while a dispatch is wrong.
"""
from __future__ import annotations

import numpy as np

from twin.abi import constants as C
from twin.abi.errors import AbiError

# golden slot key -> (cache family, unit of the slot: page tokens or rows per page)
SLOTS = {"ori": ("ori", "page"), "hca_state": ("hca_state", "page"), "csa_state": ("csa_state", "page"),
         "csa_inner_state": ("csa_inner_state", "page"), "hca_cmp": ("cmp_c128", "rows"),
         "csa_cmp": ("cmp_c4", "rows"), "csa_idx": ("idx", "rows")}


class PageMap:
    """Partition-local page ids (the scheduler's) to golden's one-pool-per-family page ids."""

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

    def slot_shift(self, partition: int, key: str) -> int:
        """The same for golden's slot key (`SLOTS`)."""
        fam, unit = SLOTS[key]
        f = self.ctx.families[fam]
        return self.slot_offset(partition, fam, f.page_tokens if unit == "page" else f.rows_per_page)


def _fail(program: str, rid: str, arg: str, got, want) -> None:
    raise AbiError(arg, got, f"golden's {want}", where=f"{program} request {rid}")


def prefill_stream(d, rid: str) -> tuple[np.ndarray, np.ndarray, int, int]:
    """A request's chunk in a packed prefill dispatch: (tokens, positions, leader rank, offset)."""
    pl = d.meta["placement"][rid]
    r0, o, n = C.TP_SIZE * pl["group"], pl["offset"], pl["len"]
    toks = np.asarray(d.args["input_ids"][r0:r0 + C.TP_SIZE]).reshape(-1)[o:o + n]
    return toks, np.asarray(d.args["position_ids_full"][r0, o:o + n]), r0, o


def check_prefill(d, meta, items, pages: PageMap) -> None:
    """Golden's lowering `meta` of the dispatch's requests (in `items` order) against the dispatch."""
    base = 0
    for it in items:
        rid, n = it.request_id, len(it.chunk_tokens)
        if d.meta["placement"][rid]["len"] != n:
            _fail(d.program, rid, "query_start_loc", d.meta["placement"][rid]["len"], f"chunk of {n} tokens")
        rows = slice(base, base + n)
        toks, pos, r0, o = prefill_stream(d, rid)
        if not np.array_equal(toks, meta.input_ids[rows]):
            _fail(d.program, rid, "input_ids", toks[:8].tolist(), "chunk tokens")
        if not np.array_equal(pos, meta.position_ids[rows]):
            _fail(d.program, rid, "position_ids_full", pos[:8].tolist(),
                  f"positions from {int(meta.position_ids[base])}")
        for key in SLOTS:
            staged = np.asarray(d.args[f"{key}_slot_mapping_full"][r0, o:o + n], np.int64)
            shift = pages.slot_shift(it.partition, key)
            want = meta.slots[key][rows]
            got = np.where(staged >= 0, staged + shift, -1)
            if not np.array_equal(got, want):
                i = int(np.argmax(got != want))
                _fail(d.program, rid, f"{key}_slot_mapping_full", f"position {int(pos[i])}: {int(staged[i])}",
                      f"slot {int(want[i])} (shifted by {shift})")
        base += n


def check_decode(d, items, seqs, k: int) -> None:
    """Every decode request has a stream slot; at K=7 it carries the request's drafter slot."""
    place = d.meta["placement"]
    for it, s in zip(items, seqs):
        pl = place.get(it.request_id)
        if pl is None:
            _fail(d.program, it.request_id, "placement", None, "a stream slot for every decode request")
        if k:
            r0 = C.TP_SIZE * pl["group"]
            lease = int(d.args["group_state_slot_ids"][r0, pl["stream_slot"]])
            gen = int(d.args["group_state_generations"][r0, pl["stream_slot"]])
            if (lease, gen) != (s.lease, s.generation):
                _fail(d.program, it.request_id, "group_state_slot_ids", (lease, gen),
                      f"drafter slot {(s.lease, s.generation)}")
