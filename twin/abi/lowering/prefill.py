"""Packed prefill lowering (`prepare_prefill_inputs`, serving-contract.md §6.2).

Requests are grouped by partition (= TP group g, ranks tp*g .. tp*g+tp-1).  Within a group, the
ordinal k is the order of arrival and the packed offset the running sum of chunk lengths.  Every
group-level row is written identically on the group's ranks; the local-dynamic rows are the
rank-major bands of the group stream.
"""
from __future__ import annotations

import numpy as np

from .. import constants as C
from ..batches import Dispatch, PrefillBatch
from . import checks
from .context import DispatchError, LoweringContext, align_up, alloc
from .grammar import stage_rows
from .primitives import absolute_table, compressed_slot, paged_slot, ring_table

PROGRAM = "l3_prefill_fwd"

# table argument -> (family, kind, depth symbol)
TABLES = {
    "ori_block_table": ("ori", "ring", "ORI_DEPTH"),
    "hca_cmp_block_table": ("cmp_c128", "absolute", "CMP_DEPTH"),
    "csa_cmp_block_table": ("cmp_c4", "absolute", "CMP_DEPTH"),
    "idx_block_table": ("idx", "absolute", "CMP_DEPTH"),
    "hca_compress_state_block_table": ("hca_state", "ring", "HCA_STATE_DEPTH"),
    "csa_compress_state_block_table": ("csa_state", "ring", "CSA_STATE_DEPTH"),
    "csa_inner_compress_state_block_table": ("csa_inner_state", "ring", "CSA_STATE_DEPTH"),
}
# slot mapping argument -> (family, how, page or ratio)
SLOTS = {
    "ori_slot_mapping_full": ("ori", "paged", C.BLOCK_SIZE),
    "hca_cmp_slot_mapping_full": ("cmp_c128", "compressed", 128),
    "hca_state_slot_mapping_full": ("hca_state", "paged", 8),
    "csa_cmp_slot_mapping_full": ("cmp_c4", "compressed", 4),
    "csa_idx_slot_mapping_full": ("idx", "compressed", 4),
    "csa_state_slot_mapping_full": ("csa_state", "paged", 2),
    "csa_inner_state_slot_mapping_full": ("csa_inner_state", "paged", 2),
}
SLOT_TABLE = {"ori": "ori_block_table", "cmp_c128": "hca_cmp_block_table", "hca_state": "hca_compress_state_block_table",
              "cmp_c4": "csa_cmp_block_table", "idx": "idx_block_table", "csa_state": "csa_compress_state_block_table",
              "csa_inner_state": "csa_inner_compress_state_block_table"}
ROPE_ARGS = ("swa_freqs", "compressed_freqs", "csa_cmp_freqs", "hca_cmp_freqs")


def rope_positions(pos: np.ndarray) -> dict[str, np.ndarray]:
    """Which table row each RoPE argument reads for real positions `pos`: (ratio, row position)."""
    csa = np.where((pos + 1) % 4 == 0, pos - 3, 0)
    return {"swa_freqs": (0, pos), "compressed_freqs": (128, pos), "csa_cmp_freqs": (4, csa),
            "hca_cmp_freqs": (128, pos - pos % 128)}


def lower_prefill(batch: PrefillBatch, ctx: LoweringContext, *, embedding=None, grammar=None) -> Dispatch:
    """Lower one packed prefill dispatch.

    `embedding` ([VOCAB, D] array or a function ids -> [n, D]) fills `x_hc`; without it `x_hc`
    stays zero (capacity runs need no activations).  `grammar` maps request ids of terminal chunks
    to a `Constraint` whose first mask row is staged at (leader rank, ordinal)."""
    items = tuple(batch.items)
    if not items:
        raise DispatchError(PROGRAM, "batch", "empty_batch", 0, "at least one request")
    checks.unique_requests(PROGRAM, items)
    groups: dict[int, list] = {}
    rows = {}
    limit = min(C.MAX_PREFILL_TOKENS_PER_REQUEST, ctx.chunk_limit)
    for it in items:
        g = checks.partition(PROGRAM, it.request_id, it.partition, ctx)
        n = it.num_tokens
        if not 1 <= n <= limit:
            raise DispatchError(PROGRAM, "chunk_tokens", "chunk_tokens", f"request {it.request_id}: {n} tokens",
                                f"1..{limit} (min(8192, the per-request chunk limit))")
        if it.num_computed < 0 or it.end > ctx.max_position:
            raise DispatchError(PROGRAM, "position_ids_full", "position_ceiling",
                                f"request {it.request_id}: [{it.num_computed}, {it.end})",
                                f"0 <= start and start + len <= max_seq_len = {ctx.max_position}")
        for t in it.chunk_tokens:
            checks.token(PROGRAM, "input_ids", it.request_id, t, ctx)
        rows[it.request_id] = checks.block_rows(PROGRAM, it.request_id, it.block_ids, ctx, it.end)
        groups.setdefault(g, []).append(it)
    cap = min(ctx.deployment.prefill_requests_per_partition, C.PREFILL_LOGIT_ROWS)
    for g, its in groups.items():
        if len(its) > cap:
            raise DispatchError(PROGRAM, "query_start_loc", "group_requests", f"group {g}: {len(its)} requests",
                                f"at most {cap} requests per TP group")
        tok = sum(i.num_tokens for i in its)
        if tok > C.PREFILL_TOKENS_PER_GROUP:
            raise DispatchError(PROGRAM, "x_hc", "group_tokens", f"group {g}: {tok} tokens",
                                f"at most {C.PREFILL_TOKENS_PER_GROUP} packed tokens per TP group")

    tp = ctx.tp
    Q = max(len(v) for v in groups.values())
    P = align_up(max(sum(i.num_tokens for i in v) for v in groups.values()), tp)
    L = P // tp
    bound = ctx.bind(PROGRAM, P=P, Q=Q)
    out = {name: alloc(bound[name], -1) for name in list(TABLES) + list(SLOTS) + ["logit_row_indices"]}
    for name in ("query_start_loc", "position_ids_full", "position_ids_local", "input_ids", "x_hc"):
        out[name] = alloc(bound[name])
    for base in ROPE_ARGS:
        out[base + "_cos"] = alloc(bound[base + "_cos"])
        out[base + "_sin"] = alloc(bound[base + "_sin"])
    out["grammar_mask"] = alloc(bound["grammar_mask"], -1)
    embed = _embedder(embedding)

    placement = {}
    for g, its in sorted(groups.items()):
        ranks = ctx.group_ranks(g)
        r0, r1 = ranks.start, ranks.stop
        lens = np.array([i.num_tokens for i in its])
        offs = np.concatenate([[0], np.cumsum(lens)])
        total = int(offs[-1])
        pos = np.concatenate([np.arange(i.num_computed, i.end) for i in its])
        ids = np.concatenate([np.asarray(i.chunk_tokens, np.int64) for i in its])

        qsl = np.full(Q + 1, total, np.int32)
        qsl[: len(offs)] = offs
        out["query_start_loc"][r0:r1] = qsl

        # synthetic padding positions: max_real+1, max_real+2, ... never alias a live position
        pos_full = np.zeros(P, np.int64)
        pos_full[:total] = pos
        pos_full[total:] = pos.max() + 1 + np.arange(P - total)
        out["position_ids_full"][r0:r1] = pos_full
        stream_ids = np.zeros(P, np.int64)
        stream_ids[:total] = ids
        for m, r in enumerate(ranks):
            out["position_ids_local"][r] = pos_full[m * L:(m + 1) * L]
            out["input_ids"][r] = stream_ids[m * L:(m + 1) * L]

        for name, (fam, kind, sym) in TABLES.items():
            depth = ctx.depth(sym)
            build = ring_table if kind == "ring" else absolute_table
            for k, it in enumerate(its):
                out[name][r0:r1, k] = build(rows[it.request_id][fam], depth)

        for k, it in enumerate(its):
            seg = slice(int(offs[k]), int(offs[k + 1]))
            p = pos[seg]
            for name, (fam, how, n) in SLOTS.items():
                table = out[SLOT_TABLE[fam]][r0, k]
                s = paged_slot(p, table, n) if how == "paged" else compressed_slot(p, table, n)
                out[name][r0:r1, seg] = s
            placement[it.request_id] = {"group": g, "ordinal": k, "offset": int(offs[k]), "len": int(lens[k]),
                                        "sampled_slot": (r0, k)}
            if embed is not None:
                e = np.asarray(embed(np.asarray(it.chunk_tokens, np.int64)), np.float32)
                out["x_hc"][r0:r1, seg] = e[None, :, None, :]

        for base, (ratio, rp) in rope_positions(pos).items():
            c, s = ctx.rope_bits(ratio, rp)
            out[base + "_cos"][r0:r1, :total] = c
            out[base + "_sin"][r0:r1, :total] = s

        out["logit_row_indices"][r0, : len(its)] = offs[1:] - 1

    if grammar:
        targets = {}
        for rid, con in grammar.items():
            pl = placement.get(rid)
            it = next((i for i in items if i.request_id == rid), None)
            if pl is None or not it.terminal:
                raise DispatchError(PROGRAM, "grammar_mask", "grammar_row", rid,
                                    "constraints only for requests whose terminal chunk is in this dispatch")
            targets[pl["sampled_slot"]] = con.rows(ctx.model)[:1]
        stage_rows(out["grammar_mask"], targets, PROGRAM)

    meta = {"P": P, "L": L, "Q": Q, "placement": placement, "groups": sorted(groups),
            "flag_q_gt_1": Q > 1, "x_hc_embedded": embed is not None,
            "terminal": {i.request_id: i.terminal for i in items}}
    return Dispatch(PROGRAM, out, meta)


def _embedder(embedding):
    if embedding is None:
        return None
    if callable(embedding):
        return embedding
    table = np.asarray(embedding)
    return lambda ids: table[ids]
