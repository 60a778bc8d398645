"""The golden runs what the dispatch stages: a cross-check of two lowerings.

Golden addresses its pools through its own lowering (`golden.paged.lower`); the device program
receives `twin.abi.lowering`'s.  For every prefill dispatch the functional twin checks, request by
request, that both put the same tokens at the same positions and write through the same slots of
all seven families (after the partition-local to golden page shift), so a functional run cannot
pass while the staged dispatch is wrong.  For a fused K=7 step it checks that each request's
stream slot carries the lease and generation of the drafter state golden verifies.
"""
from __future__ import annotations

import numpy as np

from golden.paged import PREFILL, lower as golden_lower
from twin.abi import constants as C
from twin.abi.errors import AbiError

# golden slot key -> (cache family, unit of the slot: page tokens or rows per page)
SLOTS = {"ori": ("ori", "page"), "hca_state": ("hca_state", "page"), "csa_state": ("csa_state", "page"),
         "csa_inner_state": ("csa_inner_state", "page"), "hca_cmp": ("cmp_c128", "rows"),
         "csa_cmp": ("cmp_c4", "rows"), "csa_idx": ("idx", "rows")}


def _fail(program: str, rid: str, arg: str, got, want) -> None:
    raise AbiError(arg, got, f"golden's {want}", where=f"{program} request {rid}")


def check_prefill(d, cfg, spans, rids, pages, items) -> None:
    meta = golden_lower(cfg, spans, form=PREFILL)
    fams = pages.ctx.families
    base = 0
    for span, rid, it in zip(spans, rids, items):
        pl = d.meta["placement"][rid]
        r0 = C.TP_SIZE * pl["group"]
        o, n = pl["offset"], pl["len"]
        if n != span.n:
            _fail(d.program, rid, "query_start_loc", n, f"chunk of {span.n} tokens")
        rows = slice(base, base + n)
        stream = np.asarray(d.args["input_ids"][r0:r0 + C.TP_SIZE]).reshape(-1)[o:o + n]
        if not np.array_equal(stream, meta.input_ids[rows]):
            _fail(d.program, rid, "input_ids", stream[:8].tolist(), "chunk tokens")
        pos = np.asarray(d.args["position_ids_full"][r0, o:o + n])
        if not np.array_equal(pos, meta.position_ids[rows]):
            _fail(d.program, rid, "position_ids_full", pos[:8].tolist(), f"positions from {span.start}")
        for key, (fam, unit) in SLOTS.items():
            staged = np.asarray(d.args[f"{key}_slot_mapping_full"][r0, o:o + n], np.int64)
            u = fams[fam].page_tokens if unit == "page" else fams[fam].rows_per_page
            shift = pages.slot_offset(it.partition, fam, u)
            want = meta.slots[key][rows]
            got = np.where(staged >= 0, staged + shift, -1)
            if not np.array_equal(got, want):
                i = int(np.argmax(got != want))
                _fail(d.program, rid, f"{key}_slot_mapping_full", f"position {int(pos[i])}: {int(staged[i])}",
                      f"slot {int(want[i])} (shifted by {shift})")
        base += n


def check_decode(d, items, seqs, k: int) -> None:
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
