"""Split target decode lowering (`prepare_decode_inputs`, serving-contract.md §4.8, §6.3).

Each group runs the full tile of 64 stream slots x 8 rows = 512 rows.  Slot s lives on rank
tp*g + s // 16 at local row s % 16; the group stream is rank-major, so rank m's 128 owner rows are
the band [128 m, 128 (m+1)) of the group stream.  Placement is round-robin at K=0 (ordinal o ->
slot (o % 4) * 16 + o // 4) and lease % 4 at K=7; either way active local rows are dense from 0.
Inactive slots get the noise token, positions 0..7, scratch page num_blocks + s and no writes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import constants as C
from ..batches import PLACEHOLDER_TOKEN, DecodeBatch, Dispatch
from . import checks
from .context import DispatchError, LoweringContext, alloc, from_bf16_bits
from .primitives import (absolute_table, compressed_slot, paged_slot, ring_slot, ring_table, swa_window,
                         trailing_ring_table)

PROGRAM = "l3_decode_fwd"
ROWS = C.DECODE_SEQ


@dataclass(frozen=True)
class Placed:
    """Where one decode request sits: group, ordinal, owner rank (global), member (rank within
    the group), local row and group stream slot."""

    item: object
    group: int
    ordinal: int
    rank: int
    member: int
    local_row: int
    slot: int


def owner_member(k: int, lease: int | None, ordinal: int, tp: int = C.TP_SIZE) -> int:
    """The rank within its TP group whose local rows hold a decode request: lease % tp at K=7 (the
    drafter state it verifies lives with its lease), its ordinal in the group % tp at K=0 (round robin)."""
    return lease % tp if k and lease is not None else ordinal % tp


def place(program: str, batch: DecodeBatch, ctx: LoweringContext, by_lease: bool) -> dict[int, list[Placed]]:
    """Owner placement per group (runner `_decode_assignment`)."""
    items = tuple(batch.items)
    checks.unique_requests(program, items)
    groups: dict[int, list] = {}
    for it in items:
        groups.setdefault(checks.partition(program, it.request_id, it.partition, ctx), []).append(it)
    per_rank = ctx.local_requests
    out = {}
    for g, its in sorted(groups.items()):
        if len(its) > C.DECODE_BATCH:
            raise DispatchError(program, "num_tokens_per_owner", "group_requests",
                                f"group {g}: {len(its)} requests",
                                f"at most {C.DECODE_BATCH} decode requests per TP group (local capacity)")
        if by_lease:
            for it in its:
                checks.lease(program, it.request_id, it.lease, it.generation)
            checks.unique_leases(program, {g: its})
        used = [0] * ctx.tp
        placed = []
        for o, it in enumerate(its):
            m = owner_member(by_lease, it.lease, o, ctx.tp)
            local = used[m] if by_lease else o // ctx.tp
            if local >= per_rank:
                raise DispatchError(program, "num_tokens_per_owner", "owner_rows",
                                    f"group {g} rank {m}: request {it.request_id!r} would be local row {local}",
                                    f"at most {per_rank} requests per owner rank")
            used[m] = max(used[m], local + 1)
            placed.append(Placed(it, g, o, ctx.group_ranks(g).start + m, m, local, m * per_rank + local))
        out[g] = placed
    return out


def window(ctx: LoweringContext, it, k: int):
    """(speculative, commit, positions[8], tokens[8]) of one active request."""
    anchor = int(it.anchor)
    if not 0 <= anchor < ctx.max_position:
        raise DispatchError(PROGRAM, "position_ids", "position_ceiling", f"request {it.request_id}: anchor {anchor}",
                            f"0 <= anchor < max_position = {ctx.max_position}")
    drafts = tuple(it.pending_drafts)
    if len(drafts) not in (0, C.DSPARK_QUERY_WIDTH):
        raise DispatchError(PROGRAM, "pending_drafts", "pending_drafts", f"request {it.request_id}: {len(drafts)}",
                            f"0 or {C.DSPARK_QUERY_WIDTH} pending drafts")
    if it.last_token == PLACEHOLDER_TOKEN:
        raise DispatchError(PROGRAM, "input_ids", "placeholder_token", it.request_id,
                            "the committed token (the worker substitutes PLACEHOLDER_TOKEN before lowering)")
    checks.token(PROGRAM, "input_ids", it.request_id, it.last_token, ctx)
    for d in drafts:
        checks.token(PROGRAM, "input_ids", it.request_id, d, ctx)
    spec = k > 0 and len(drafts) == C.DSPARK_QUERY_WIDTH and anchor + ROWS <= ctx.max_position
    commit = ROWS if spec else 1
    pos = np.minimum(anchor + np.arange(ROWS), ctx.max_position - 1)
    toks = np.array([it.last_token] + (list(drafts) if spec else [ctx.noise_token] * (ROWS - 1)), np.int64)
    return spec, commit, pos, toks


def lower_decode(batch: DecodeBatch, ctx: LoweringContext, *, grammar=None) -> Dispatch:
    """Lower one split decode step (K=0, or the legacy K=7 split path when batch.k == 7)."""
    if grammar:
        raise DispatchError(PROGRAM, "grammar_mask", "grammar_path", sorted(grammar)[:4],
                            "no constraints: DSpark grammar constraints require the fused K7 decode path")
    k = batch.k
    if k not in C.SUPPORTED_K:
        raise DispatchError(PROGRAM, "k", "k", k, f"one of {C.SUPPORTED_K}")
    groups = place(PROGRAM, batch, ctx, by_lease=k > 0)
    b = ctx.bind(PROGRAM)
    W = ctx.model.sliding_window
    per_rank = ctx.local_requests
    out = {}
    for name in ("swa_slot_mapping", "hca_ori_slot_mapping", "csa_ori_slot_mapping", "csa_cmp_slot_mapping",
                 "csa_idx_slot_mapping", "csa_state_slot_mapping", "csa_inner_state_slot_mapping",
                 "hca_cmp_slot_mapping", "hca_state_slot_mapping", "swa_indices", "csa_window_swa_indices",
                 "hca_window_swa_indices", "logit_row_indices", "grammar_mask"):
        out[name] = alloc(b[name], -1)
    for name in ("freqs_cos", "freqs_sin", "compressed_freqs_cos", "compressed_freqs_sin", "swa_lens",
                 "position_ids_local", "position_ids", "csa_cmp_freqs_cos", "csa_cmp_freqs_sin",
                 "csa_window_swa_lens", "csa_kv_seq_lens", "hca_cmp_freqs_cos", "hca_cmp_freqs_sin",
                 "hca_window_swa_lens", "hca_kv_seq_lens", "input_ids", "num_tokens_per_owner"):
        out[name] = alloc(b[name])
    tables = {"csa_cmp_block_table": "cmp_c4", "csa_idx_block_table": "idx", "hca_cmp_block_table": "cmp_c128"}
    for name in tables:
        out[name] = alloc(b[name], -1)
    out["hca_compress_state_block_table"] = alloc(b["hca_compress_state_block_table"], None)   # every row written
    out["csa_compress_state_block_table"] = alloc(b["csa_compress_state_block_table"], -1)
    out["csa_inner_compress_state_block_table"] = alloc(b["csa_inner_compress_state_block_table"], -1)
    cmp_depth, hca_depth = ctx.depth("CMP_DEPTH"), ctx.depth("HCA_STATE_DEPTH")
    csa_depth = ctx.depth("SPLIT_CSA_DEPTH")
    nb = ctx.num_blocks
    meta_place, meta_req = {}, {}

    for g in range(ctx.partitions):
        placed = {p.slot: p for p in groups.get(g, [])}
        ranks = ctx.group_ranks(g)
        r0, r1 = ranks.start, ranks.stop
        pos = np.tile(np.arange(ROWS), C.DECODE_BATCH).astype(np.int64)     # inactive: 0..7
        tok = np.full(C.DECODE_TOKENS, ctx.noise_token, np.int64)
        publish = np.zeros(C.DECODE_TOKENS, bool)
        slots = {n: np.full(C.DECODE_TOKENS, -1, np.int64) for n in
                 ("ori", "hca_cmp", "csa_cmp", "csa_idx", "hca_state", "csa_state", "csa_inner_state")}
        hca_start = np.zeros(C.DECODE_BATCH, np.int64)
        active_rows = np.zeros(C.DECODE_TOKENS, bool)
        for s in range(C.DECODE_BATCH):
            seg = slice(s * ROWS, (s + 1) * ROWS)
            p = placed.get(s)
            if p is None:
                scratch = {f: nb[f] + s for f in nb}
                out["hca_compress_state_block_table"][r0:r1, s] = scratch["hca_state"]
                out["csa_compress_state_block_table"][r0:r1, s] = trailing_ring_table([scratch["csa_state"]], ROWS - 1, 2, csa_depth)
                out["csa_inner_compress_state_block_table"][r0:r1, s] = trailing_ring_table(
                    [scratch["csa_inner_state"]], ROWS - 1, 2, csa_depth)
                for name, fam in tables.items():
                    out[name][r0 + s // per_rank, s % per_rank, 0] = scratch[fam]
                continue
            it = p.item
            spec, commit, ppos, toks = window(ctx, it, k)
            ids = checks.block_rows(PROGRAM, it.request_id, it.block_ids, ctx, int(ppos[commit - 1]) + 1)
            pos[seg], tok[seg] = ppos, toks
            pub = np.arange(ROWS) < commit
            publish[seg] = pub
            active_rows[seg] = True
            hca_table = ring_table(ids["hca_state"], hca_depth)
            end = int(ppos[-1])        # the transaction ring is built at the window end
            csa_t = trailing_ring_table(ids["csa_state"], end, 2, csa_depth)
            inner_t = trailing_ring_table(ids["csa_inner_state"], end, 2, csa_depth)
            out["hca_compress_state_block_table"][r0:r1, s] = hca_table
            out["csa_compress_state_block_table"][r0:r1, s] = csa_t
            out["csa_inner_compress_state_block_table"][r0:r1, s] = inner_t
            abs_t = {}
            for name, fam in tables.items():
                abs_t[fam] = absolute_table(ids[fam], cmp_depth)
                out[name][p.rank, p.local_row] = abs_t[fam]
            slots["ori"][seg] = np.where(pub, ring_slot(ppos, ids["ori"], C.BLOCK_SIZE), -1)
            slots["hca_state"][seg] = np.where(pub, paged_slot(ppos, hca_table, 8), -1)
            slots["csa_state"][seg] = np.where(pub, paged_slot(ppos % 16, csa_t, 2), -1)
            slots["csa_inner_state"][seg] = np.where(pub, paged_slot(ppos % 16, inner_t, 2), -1)
            slots["hca_cmp"][seg] = compressed_slot(ppos, abs_t["cmp_c128"], 128, pub)
            slots["csa_cmp"][seg] = compressed_slot(ppos, abs_t["cmp_c4"], 4, pub)
            slots["csa_idx"][seg] = compressed_slot(ppos, abs_t["idx"], 4, pub)
            hca_start[s] = int(it.anchor)
            seq_len = int(it.anchor) + commit
            out["csa_kv_seq_lens"][p.rank, p.local_row] = seq_len
            out["hca_kv_seq_lens"][p.rank, p.local_row] = seq_len
            meta_place[it.request_id] = {"group": g, "ordinal": p.ordinal, "rank": p.rank, "local_row": p.local_row,
                                         "stream_slot": s}
            meta_req[it.request_id] = {"speculative": spec, "commit": commit, "anchor": int(it.anchor)}

        for name in ("swa_slot_mapping", "hca_ori_slot_mapping", "csa_ori_slot_mapping"):
            out[name][r0:r1] = slots["ori"]
        for name, key in (("csa_cmp_slot_mapping", "csa_cmp"), ("csa_idx_slot_mapping", "csa_idx"),
                          ("csa_state_slot_mapping", "csa_state"), ("csa_inner_state_slot_mapping", "csa_inner_state"),
                          ("hca_cmp_slot_mapping", "hca_cmp"), ("hca_state_slot_mapping", "hca_state")):
            out[name][r0:r1] = slots[key]
        out["position_ids"][r0:r1] = pos
        csa_pos = np.where((pos + 1) % 4 == 0, pos - 3, 0)
        c, s_ = ctx.rope_bits(4, csa_pos)
        out["csa_cmp_freqs_cos"][r0:r1], out["csa_cmp_freqs_sin"][r0:r1] = c, s_
        c, s_ = ctx.rope_bits(128, hca_start - hca_start % 128)
        half = ctx.model.qk_rope_head_dim // 2
        out["hca_cmp_freqs_cos"][r0:r1] = from_bf16_bits(c)[:, :half]
        out["hca_cmp_freqs_sin"][r0:r1] = from_bf16_bits(s_)[:, :half]

        band_rows = per_rank * ROWS
        for m, r in enumerate(ranks):
            band = slice(m * band_rows, (m + 1) * band_rows)
            bpos = pos[band]
            n_active = sum(1 for p in placed.values() if p.rank == r)
            n_rows = n_active * ROWS
            out["position_ids_local"][r] = bpos
            out["input_ids"][r, :n_rows] = tok[band][:n_rows]
            out["num_tokens_per_owner"][r] = n_rows
            for ratio, name in ((0, "freqs"), (128, "compressed_freqs")):
                c, s_ = ctx.rope_bits(ratio, bpos)
                out[name + "_cos"][r], out[name + "_sin"][r] = c, s_
            for local in range(n_active):
                p = placed[m * per_rank + local]
                rows = slice(local * ROWS, (local + 1) * ROWS)
                idx, lens = swa_window(bpos[rows], p.item.block_ids["ori"], W)
                for pre in ("swa", "csa_window_swa", "hca_window_swa"):
                    out[pre + "_indices"][r, rows] = idx
                    out[pre + "_lens"][r, rows] = lens
            # split decode packs the logit entries densely: local_row*8 + offset for offset < width
            entries = []
            for local in range(n_active):
                p = placed[m * per_rank + local]
                width = meta_req[p.item.request_id]["commit"]
                meta_req[p.item.request_id]["sampled_slot"] = (r, len(entries))
                entries.extend(local * ROWS + o for o in range(width))
            out["logit_row_indices"][r, : len(entries)] = entries
    meta = {"placement": meta_place, "requests": meta_req, "k": k,
            "active_groups": sorted(groups), "idle_groups": [g for g in range(ctx.partitions) if g not in groups]}
    return Dispatch(PROGRAM, out, meta)
