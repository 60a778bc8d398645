"""Fused K=7 decode lowering (`_prepare_decode_plan` + `_stage_device_prepared_decode`, §6.4).

The host stages only acceptance-independent descriptors, so they can be built while the previous
step still runs: stream slot -> lease and generation, full-depth tables, the rolling state rings
at the depth of the scheduler's ring period (so the device's modulo matches the scheduler after a
wrap and after a prefix-cache hit), rank-local compressed tables, per-owner token counts and the
drafter block tables of the padded batch.  Everything else the kernel derives on device.
"""
from __future__ import annotations

import numpy as np

from .. import constants as C
from ..batches import DecodeBatch, Dispatch
from . import checks
from .context import DispatchError, LoweringContext, alloc
from .decode import place
from .drafter import filler_ring_table, lease_ring_table, padded_batch
from .grammar import stage_rows
from .primitives import absolute_table, ring_table

PROGRAM = "l3_decode_fwd_dspark"
GROUP_TABLES = {
    "group_ori_block_tables": ("ori", "ring", "ORI_DEPTH"),
    "group_hca_cmp_block_tables": ("cmp_c128", "absolute", "CMP_DEPTH"),
    "group_csa_cmp_block_tables": ("cmp_c4", "absolute", "CMP_DEPTH"),
    "group_idx_block_tables": ("idx", "absolute", "CMP_DEPTH"),
    "group_hca_state_block_tables": ("hca_state", "ring", "RING_HCA_STATE"),
    "group_csa_state_block_tables": ("csa_state", "ring", "RING_CSA_STATE"),
    "group_csa_inner_state_block_tables": ("csa_inner_state", "ring", "RING_CSA_STATE"),
}
LOCAL_TABLES = {"csa_cmp_block_table": "cmp_c4", "csa_idx_block_table": "idx", "hca_cmp_block_table": "cmp_c128"}


def lower_fused(batch: DecodeBatch, ctx: LoweringContext, *, grammar=None) -> Dispatch:
    """Lower one fused K=7 decode step.  `grammar` maps request ids to a `Constraint`: mask rows
    at (owner rank, local_row*8 + offset) for offsets 0..v and `valid_draft_counts` = v at the
    request's group ordinal (serving-contract.md §0.2 item 5)."""
    if ctx.deployment.k != C.DSPARK_QUERY_WIDTH:
        raise DispatchError(PROGRAM, "k", "k", ctx.deployment.k, "7: the fused program is compiled only at K=7")
    groups = place(PROGRAM, batch, ctx, by_lease=True)
    per_rank = ctx.local_requests
    counts = [0] * ctx.ranks
    for placed in groups.values():
        for p in placed:
            counts[p.rank] += 1
    B = padded_batch(PROGRAM, max(counts, default=0))
    b = ctx.bind(PROGRAM, B=B)
    nb = ctx.num_blocks
    out = {n: alloc(b[n], -1) for n in ("state_slot_ids", "state_generations", "group_state_slot_ids",
                                        "group_state_generations", "grammar_mask", *LOCAL_TABLES)}
    out.update({n: alloc(b[n], None) for n in GROUP_TABLES})      # every row is written below
    out["num_tokens_per_owner"] = alloc(b["num_tokens_per_owner"])
    out["valid_draft_counts"] = alloc(b["valid_draft_counts"], C.DSPARK_QUERY_WIDTH)
    depth = ctx.depth("ORI_DEPTH")
    dbt = np.empty(b["draft_block_tables"].shape, np.int32)
    for layer in range(3):
        dbt[:, layer] = filler_ring_table(layer, depth)
    out["draft_block_tables"] = dbt
    place_meta = {}
    for g in range(ctx.partitions):
        ranks = ctx.group_ranks(g)
        r0, r1 = ranks.start, ranks.stop
        placed = {p.slot: p for p in groups.get(g, [])}
        for s in range(C.DECODE_BATCH):
            p = placed.get(s)
            if p is None:
                for name, (fam, kind, sym) in GROUP_TABLES.items():
                    scratch = nb[fam] + s
                    out[name][r0:r1, s] = ring_table([scratch], ctx.depth(sym)) if kind == "ring" else \
                        absolute_table([scratch], ctx.depth(sym))
                for name, fam in LOCAL_TABLES.items():
                    out[name][r0 + s // per_rank, s % per_rank, 0] = nb[fam] + s
                continue
            it = p.item
            end = int(it.anchor) + C.DECODE_SEQ
            if not 0 <= int(it.anchor) < ctx.max_position:
                raise DispatchError(PROGRAM, "state_meta", "position_ceiling", f"request {it.request_id}: {it.anchor}",
                                    f"0 <= anchor < max_position = {ctx.max_position}")
            ids = checks.block_rows(PROGRAM, it.request_id, it.block_ids, ctx, min(end, ctx.max_position))
            out["group_state_slot_ids"][r0:r1, s] = it.lease
            out["group_state_generations"][r0:r1, s] = it.generation
            out["state_slot_ids"][p.rank, p.local_row] = it.lease
            out["state_generations"][p.rank, p.local_row] = it.generation
            for name, (fam, kind, sym) in GROUP_TABLES.items():
                build = ring_table if kind == "ring" else absolute_table
                out[name][r0:r1, s] = build(ids[fam], ctx.depth(sym))
            for name, fam in LOCAL_TABLES.items():
                out[name][p.rank, p.local_row] = absolute_table(ids[fam], ctx.depth("CMP_DEPTH"))
            for layer in range(3):
                dbt[p.rank, layer, p.local_row] = lease_ring_table(it.lease, layer, depth)
            place_meta[it.request_id] = {"group": g, "ordinal": p.ordinal, "rank": p.rank, "local_row": p.local_row,
                                         "stream_slot": s, "verify_row": (p.rank, p.local_row * C.DECODE_SEQ)}
        for r in ranks:
            out["num_tokens_per_owner"][r] = sum(1 for p in placed.values() if p.rank == r) * C.DECODE_SEQ
    if grammar:
        targets = {}
        for rid, con in grammar.items():
            pm = place_meta.get(rid)
            if pm is None:
                raise DispatchError(PROGRAM, "grammar_mask", "grammar_row", rid, "a request of this decode batch")
            item = next(i for i in batch.items if i.request_id == rid)
            v = int(con.valid_drafts)
            if not 0 <= v <= min(C.DSPARK_QUERY_WIDTH, len(item.pending_drafts)):
                raise DispatchError(PROGRAM, "valid_draft_counts", "draft_count", f"request {rid}: {v}",
                                    f"0..min(7, pending drafts = {len(item.pending_drafts)})")
            rows = con.rows(ctx.model)
            if rows.shape[0] < v + 1:
                raise DispatchError(PROGRAM, "grammar_mask", "grammar_row", f"request {rid}: {rows.shape[0]} rows",
                                    f"v + 1 = {v + 1} mask rows (the valid draft prefix plus the bonus row)")
            rank, row = pm["verify_row"]
            targets[(rank, row)] = rows[: v + 1]
            g = pm["group"]
            out["valid_draft_counts"][ctx.group_ranks(g).start:ctx.group_ranks(g).stop, pm["ordinal"]] = v
        stage_rows(out["grammar_mask"], targets, PROGRAM)
    meta = {"B": B, "placement": place_meta, "active_groups": sorted(groups),
            "idle_groups": [g for g in range(ctx.partitions) if g not in groups]}
    return Dispatch(PROGRAM, out, meta)
