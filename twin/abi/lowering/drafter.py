"""Drafter staging (serving-contract.md §7.1-7.4): lease rings, the filler ring, batch geometry,
seeding waves, and the drafter / bootstrap / markov dispatches.

Each request holds a group-local lease; logical block Lb of draft layer l lives in physical block
lease*6 + (Lb + 7 l) mod 6, so the three layers rotate one six-block range and a 128-deep window
plus 7 query rows never aliases itself.  Padding rows use the read-only filler ring (blocks
384..389), token 0, num_sampled 0 and -1 slots: they publish nothing.
"""
from __future__ import annotations

import math

import numpy as np

from .. import constants as C
from ..batches import Dispatch, DrafterBatch
from ..caches import filler_block, lease_block
from . import checks
from .context import DispatchError, LoweringContext, alloc, to_bf16_bits

DRAFTER = "l3_dspark_drafter"
BOOTSTRAP = "l3_dspark_draft_step_device_state"
MARKOV = "l3_distributed_markov_sample"
QW = C.DSPARK_QUERY_WIDTH
LAYERS = 3


def lease_ring_table(lease: int, layer: int, depth: int) -> np.ndarray:
    """Every logical entry of a drafter block table filled with the lease's rotating ring ids."""
    return lease_block(lease, np.arange(depth), layer).astype(np.int32)


def filler_ring_table(layer: int, depth: int) -> np.ndarray:
    return filler_block(np.arange(depth), layer).astype(np.int32)


def _ring_slot(pos, block_of) -> np.ndarray:
    p = np.asarray(pos, dtype=np.int64)
    return np.where(p >= 0, block_of(p // C.BLOCK_SIZE) * C.BLOCK_SIZE + p % C.BLOCK_SIZE, -1)


def lease_slot(pos, lease: int, layer: int) -> np.ndarray:
    """Drafter KV slot of absolute position `pos` in the lease's ring (-1 for pos < 0)."""
    return _ring_slot(pos, lambda lb: lease_block(lease, lb, layer))


def filler_slot(pos, layer: int) -> np.ndarray:
    """The slot a padding row's position `pos` addresses in the filler ring (-1 for pos < 0); the
    kernels read it, nothing writes it."""
    return _ring_slot(pos, lambda lb: filler_block(lb, layer))


def padded_batch(program: str, n: int) -> int:
    """The smallest of {4, 8, 12, 16} that holds `n` rows per rank."""
    for b in C.DRAFTER_BATCHES:
        if n <= b:
            return b
    raise DispatchError(program, "num_sampled", "drafter_batch", f"{n} rows on one rank",
                        f"at most {C.DRAFTER_MAX_BATCH} drafter rows per rank (B in {C.DRAFTER_BATCHES})")


def context_bucket(program: str, n: int) -> int:
    for t in C.DRAFTER_CONTEXT_BUCKETS:
        if n <= t:
            return t
    raise DispatchError(program, "target_hidden", "drafter_context", f"{n} context rows per rank",
                        f"at most {C.DRAFTER_CONTEXT_BUCKETS[-1]} (T_MAIN in {C.DRAFTER_CONTEXT_BUCKETS})")


def seeding_waves(items) -> list[list]:
    """Wave w holds the w-th completed request of every group; order within a group is kept."""
    per_group: dict[int, list] = {}
    for it in items:
        per_group.setdefault(it.partition, []).append(it)
    n = max((len(v) for v in per_group.values()), default=0)
    return [[v[w] for g, v in sorted(per_group.items()) if w < len(v)] for w in range(n)]


def _place(program: str, items, ctx: LoweringContext):
    """rank -> list of items (row order).  Seed rows sit on the group leader, one per group;
    redraft rows on the owner rank lease % tp, dense in batch order."""
    modes = {it.num_sampled for it in items}
    if not modes <= {0, 1} or len(modes) > 1:
        raise DispatchError(program, "num_sampled", "drafter_mode", sorted(modes),
                            "all rows 0 (seed after a terminal prefill) or all 1 (redraft after verify)")
    seed = modes == {0}
    checks.unique_requests(program, items)
    per_group: dict[int, list] = {}
    for it in items:
        g = checks.partition(program, it.request_id, it.partition, ctx)
        checks.lease(program, it.request_id, it.lease, it.generation)
        per_group.setdefault(g, []).append(it)
    checks.unique_leases(program, per_group)
    ranks: dict[int, list] = {r: [] for r in range(ctx.ranks)}
    for g, its in per_group.items():
        if seed and len(its) > 1:
            raise DispatchError(program, "anchor_positions", "seed_wave", f"group {g}: {len(its)} seeds",
                                "one seed per group per wave (split with seeding_waves)")
        for it in its:
            r = ctx.group_ranks(g).start + (0 if seed else it.lease % ctx.tp)
            ranks[r].append(it)
    return seed, per_group, ranks


def _check_positions(program: str, it, ctx: LoweringContext, seed: bool):
    a = int(it.anchor)
    if not 0 <= a or a + QW >= ctx.max_position:
        raise DispatchError(program, "query_group_position_ids", "position_ceiling",
                            f"request {it.request_id}: anchor {a}, queries {a + 1}..{a + QW}",
                            f"query positions in [0, max_position = {ctx.max_position})")
    cp = np.asarray(it.context_positions, np.int64)
    if seed:
        want = np.arange(max(0, a + 1 - C.SLIDING_WINDOW), a + 1)
        if cp.shape != want.shape or (cp != want).any():
            raise DispatchError(program, "context_group_position_ids", "seed_tail",
                                f"request {it.request_id}: {cp.size} rows ending at {cp[-1] if cp.size else None}",
                                f"the complete prompt tail [{want[0]}, {a}] (prefix-cache hits must replay the "
                                f"drafter sliding window)")
    else:
        if not 1 <= cp.size <= C.DECODE_SEQ or (cp != np.arange(a - cp.size + 1, a + 1)).any():
            raise DispatchError(program, "context_group_position_ids", "context_rows",
                                f"request {it.request_id}: {cp.tolist()}",
                                f"1..{C.DECODE_SEQ} committed positions ending at the anchor {a}")
    return cp


def lower_drafter(batch: DrafterBatch, ctx: LoweringContext, *, program: str = DRAFTER,
                  target_hidden=None) -> Dispatch:
    """Stage a drafter batch for `l3_dspark_drafter` or the bootstrap `l3_dspark_draft_step_device_state`.

    `target_hidden` maps request ids to [context rows, 3 D] float rows; without it the rows stay 0."""
    if program not in (DRAFTER, BOOTSTRAP):
        raise DispatchError(program, "program", "program", program, f"{DRAFTER} or {BOOTSTRAP}")
    items = tuple(batch.items)
    if not items:
        raise DispatchError(program, "batch", "empty_batch", 0, "at least one drafter row")
    seed, per_group, ranks = _place(program, items, ctx)
    ctxpos = {it.request_id: _check_positions(program, it, ctx, seed) for it in items}
    B = padded_batch(program, max(len(v) for v in ranks.values()))
    tp = ctx.tp
    if seed:
        band = max(math.ceil(len(ctxpos[it.request_id]) / tp) for it in items)
        T = context_bucket(program, band)
    else:
        band, T = None, B * C.DECODE_SEQ
    bound = ctx.bind(program, B=B, T_MAIN=T)
    out = {n: alloc(bound[n]) for n in ("num_sampled", "last_sampled", "next_prefill_tokens", "anchor_positions",
                                         "target_hidden", "context_group_freqs_cos", "context_group_freqs_sin",
                                         "query_freqs_cos", "query_freqs_sin", "query_group_freqs_cos",
                                         "query_group_freqs_sin")}
    for n in ("context_group_position_ids", "context_group_slot_mapping", "query_group_position_ids",
              "query_group_slot_mapping"):
        out[n] = alloc(bound[n], -1)
    depth = ctx.depth("ORI_DEPTH")
    bt = np.empty(bound["block_tables"].shape, np.int32)
    for layer in range(LAYERS):
        bt[:, layer] = filler_ring_table(layer, depth)
    out["block_tables"] = bt
    qrows_rank = ctx.local_requests * QW
    place = {}
    for g in range(ctx.partitions):
        grp = ctx.group_ranks(g)
        gpos = np.full(tp * T, -1, np.int64)
        gslot = np.full((LAYERS, tp * T), -1, np.int64)
        qpos = np.full(tp * qrows_rank, -1, np.int64)
        qslot = np.full((LAYERS, tp * qrows_rank), -1, np.int64)
        for m, r in enumerate(grp):
            for b, it in enumerate(ranks[r]):
                place[it.request_id] = {"rank": r, "row": b, "group": g}
                out["num_sampled"][r, b] = it.num_sampled
                out["last_sampled"][r, b] = it.last_sampled if not seed else 0
                out["next_prefill_tokens"][r, b] = it.next_prefill_token if seed else 0
                out["anchor_positions"][r, b] = it.anchor
                for layer in range(LAYERS):
                    bt[r, layer, b] = lease_ring_table(it.lease, layer, depth)
                q = int(it.anchor) + 1 + np.arange(QW)
                qs = slice(m * qrows_rank + b * QW, m * qrows_rank + (b + 1) * QW)
                qpos[qs] = q
                for layer in range(LAYERS):
                    qslot[layer, qs] = lease_slot(q, it.lease, layer)
                if not seed:
                    cp = ctxpos[it.request_id]
                    cs = slice(m * T + b * C.DECODE_SEQ, m * T + b * C.DECODE_SEQ + cp.size)
                    _context(gpos, gslot, cs, cp, it.lease)
                    _hidden(out["target_hidden"][r], target_hidden, it, slice(b * C.DECODE_SEQ, b * C.DECODE_SEQ + cp.size))
        if seed and per_group.get(g):
            it = per_group[g][0]
            cp = ctxpos[it.request_id]
            for m, r in enumerate(grp):
                part = cp[m * band:(m + 1) * band]
                _context(gpos, gslot, slice(m * T, m * T + part.size), part, it.lease)
                rows = np.arange(m * band, m * band + part.size)
                _hidden(out["target_hidden"][r], target_hidden, it, slice(0, part.size), rows)
        for r in grp:
            out["context_group_position_ids"][r] = gpos
            out["context_group_slot_mapping"][r] = gslot
            out["query_group_position_ids"][r] = qpos
            out["query_group_slot_mapping"][r] = qslot
        for name, pos in (("context_group_freqs", gpos), ("query_group_freqs", qpos)):
            c, s = _rope0(ctx, pos)
            out[name + "_cos"][grp.start:grp.stop], out[name + "_sin"][grp.start:grp.stop] = c, s
        for m, r in enumerate(grp):
            c, s = _rope0(ctx, qpos[m * qrows_rank:(m + 1) * qrows_rank])
            out["query_freqs_cos"][r], out["query_freqs_sin"][r] = c, s
    if program == BOOTSTRAP:
        out["logit_row_indices"] = markov_logit_rows(ctx, ranks)
        out["state_slot_ids"] = alloc(bound["state_slot_ids"], -1)
        out["state_generations"] = alloc(bound["state_generations"], -1)
        for r, its in ranks.items():
            for b, it in enumerate(its):
                out["state_slot_ids"][r, b] = it.lease
                out["state_generations"][r, b] = it.generation
    meta = {"B": B, "T_MAIN": T, "seed": seed, "placement": place,
            "rows_per_rank": {r: len(v) for r, v in ranks.items()}}
    return Dispatch(program, out, meta)


def lower_bootstrap(batch: DrafterBatch, ctx: LoweringContext, *, target_hidden=None) -> Dispatch:
    """One seeding wave: `l3_dspark_draft_step_device_state` (state args bind private scratch)."""
    return lower_drafter(batch, ctx, program=BOOTSTRAP, target_hidden=target_hidden)


def lower_markov(batch: DrafterBatch, ctx: LoweringContext, *, head_hidden=None) -> Dispatch:
    """The legacy standalone markov sampler: sampling inputs for the drafter's head rows."""
    items = tuple(batch.items)
    if not items:
        raise DispatchError(MARKOV, "batch", "empty_batch", 0, "at least one drafter row")
    seed, _, ranks = _place(MARKOV, items, ctx)
    B = padded_batch(MARKOV, max(len(v) for v in ranks.values()))
    bound = ctx.bind(MARKOV, B=B)
    out = {n: alloc(bound[n]) for n in ("num_sampled", "last_sampled", "next_prefill_tokens")}
    out["head_hidden"] = alloc(bound["head_hidden"]) if head_hidden is None else np.asarray(head_hidden)
    for r, its in ranks.items():
        for b, it in enumerate(its):
            out["num_sampled"][r, b] = it.num_sampled
            out["last_sampled"][r, b] = 0 if seed else it.last_sampled
            out["next_prefill_tokens"][r, b] = it.next_prefill_token if seed else 0
    out["logit_row_indices"] = markov_logit_rows(ctx, ranks)
    return Dispatch(MARKOV, out, {"B": B, "seed": seed})


def markov_logit_rows(ctx: LoweringContext, ranks: dict) -> np.ndarray:
    """logit_row_indices[rank, 0 .. 7 real - 1] = 0 .. 7 real - 1, -1 elsewhere."""
    rows = np.full((ctx.ranks, ctx.local_requests * C.DECODE_SEQ), -1, np.int32)
    for r, its in ranks.items():
        n = QW * len(its)
        rows[r, :n] = np.arange(n)
    return rows


def _context(gpos, gslot, where, positions, lease):
    gpos[where] = positions
    for layer in range(LAYERS):
        gslot[layer, where] = lease_slot(positions, lease, layer)


def _hidden(dst, source, it, where, rows=None):
    if source is None or it.request_id not in source:
        return
    h = np.asarray(source[it.request_id], np.float32)
    dst[where] = to_bf16_bits(h if rows is None else h[rows])


def _rope0(ctx: LoweringContext, pos):
    """Ratio-0 (drafter) RoPE rows; -1 positions stay zero."""
    pos = np.asarray(pos)
    c = np.zeros((pos.size, ctx.model.qk_rope_head_dim), np.uint16)
    s = c.copy()
    ok = pos >= 0
    if ok.any():
        c[ok], s[ok] = ctx.rope_bits(0, pos[ok])
    return c, s
