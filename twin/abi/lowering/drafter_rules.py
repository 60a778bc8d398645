"""Content rules of the drafter programs: the drafter, the bootstrap seed and the markov sampler
(and the drafter block tables the fused decode stages)."""
from __future__ import annotations

import numpy as np

from .. import constants as C
from .drafter import filler_ring_table, lease_ring_table, lease_slot

DRAFTER_BLOCKS = C.DRAFTER_FILLER_BLOCK_BASE + C.DRAFTER_BLOCKS_PER_LEASE      # lease rings + filler ring
DRAFTER_SLOTS = C.DRAFTER_FILLER_BLOCK_BASE * C.BLOCK_SIZE                       # filler is never written


def drafter_tables(v, n, lease_of):
    bt = v.a(n)
    if ((bt < 0) | (bt >= DRAFTER_BLOCKS)).any():
        v.fail(n, "block_range", int(bt[(bt < 0) | (bt >= DRAFTER_BLOCKS)][0]),
                  f"drafter blocks in [0, {DRAFTER_BLOCKS}) (lease rings 0..383, filler 384..389)")
    depth = bt.shape[-1]
    rings = {}
    for r in range(bt.shape[0]):
        for b in range(bt.shape[2]):
            lease = lease_of(r, b)
            for layer in range(3):
                key = (lease, layer)
                if key not in rings:
                    rings[key] = filler_ring_table(layer, depth) if lease is None else \
                        lease_ring_table(lease, layer, depth)
                if not np.array_equal(bt[r, layer, b], rings[key]):
                    what = "the filler ring" if lease is None else f"lease {lease}'s ring"
                    v.fail(n, "drafter_ring", f"rank {r} layer {layer} row {b}", what)

def drafter(v):
    ctx = v.ctx
    ns = v.a("num_sampled")
    if ((ns != 0) & (ns != 1)).any():
        v.fail("num_sampled", "drafter_mode", int(ns[(ns != 0) & (ns != 1)][0]), "0 (seed/filler) or 1 (redraft)")
    bt = v.a("block_tables")
    if ((bt < 0) | (bt >= DRAFTER_BLOCKS)).any():
        v.fail("block_tables", "block_range", int(bt[(bt < 0) | (bt >= DRAFTER_BLOCKS)][0]),
                  f"drafter blocks in [0, {DRAFTER_BLOCKS})")
    first = bt[:, 0, :, 0].astype(np.int64)          # layer 0 entry 0 = lease*6 for a lease ring
    leases = np.where(first < C.DRAFTER_FILLER_BLOCK_BASE, first // C.DRAFTER_BLOCKS_PER_LEASE, -1)
    drafter_tables(v, "block_tables", lambda r, b: None if leases[r, b] < 0 else int(leases[r, b]))
    for g in range(ctx.partitions):
        rr = ctx.group_ranks(g)
        live = leases[rr.start:rr.stop][leases[rr.start:rr.stop] >= 0]
        if np.unique(live).size != live.size:
            v.fail("block_tables", "lease_unique", f"group {g}: {sorted(live.tolist())}", "distinct leases")
    v.replicated(["context_group_position_ids", "context_group_slot_mapping", "query_group_position_ids",
                     "query_group_slot_mapping"])
    for pos_n, slot_n in (("context_group_position_ids", "context_group_slot_mapping"),
                          ("query_group_position_ids", "query_group_slot_mapping")):
        pos, sl = v.a(pos_n).astype(np.int64), v.a(slot_n)
        v.positions(pos_n, pos, allow_pad=True)
        v.slots(slot_n, None, DRAFTER_SLOTS)
        if ((pos[:, None, :] < 0) & (sl != -1)).any():
            v.fail(slot_n, "padding_publish", "a row with position -1", "-1 slots on padding rows")
        owner = _drafter_row_owner(v, pos_n, leases, ns)
        for g in range(ctx.partitions):
            r0 = ctx.group_ranks(g).start
            p, own = pos[r0], owner[g]
            for layer in range(3):
                got = sl[r0, layer].astype(np.int64)
                ok = (p >= 0) & (own >= 0)
                want = np.where(ok, lease_slot(np.where(ok, p, 0), np.maximum(own, 0), layer), -1)
                if not np.array_equal(got, want):
                    j = int(np.argmax(got != want))
                    v.fail(slot_n, "slot_mapping", f"group {g} layer {layer} row {j}: {got[j]}",
                              f"{want[j]}: position {p[j]} in the ring of the row's own lease {own[j]}")
    live = ns == 1
    for n in ("last_sampled",):
        v.tokens(n, v.a(n)[live])
    v.tokens("next_prefill_tokens")
    if v.name == "l3_dspark_draft_step_device_state":
        _markov_rows(v, live_rows=(leases >= 0).sum(axis=1))
        s = v.a("state_slot_ids")
        if ((s < -1) | (s >= C.DRAFTER_LEASES_PER_GROUP)).any():
            v.fail("state_slot_ids", "lease_range", int(s.max()), "-1 or a lease in [0, 64)")

def _drafter_row_owner(v, pos_n, leases, ns):
    """Per group, the lease that owns each group context / query row (-1: padding).  Redraft
    rows belong to the member's row `j // 8` (context) or `j // 7` (query); a seed's whole
    context belongs to the leader's row 0."""
    ctx, tp = v.ctx, v.ctx.tp
    width = v.a(pos_n).shape[1] // tp
    per_row = C.DECODE_SEQ if pos_n.startswith("context") else C.DSPARK_QUERY_WIDTH
    real = leases >= 0
    seed = bool(real.any()) and bool((ns[real] == 0).all())
    m, rem = np.divmod(np.arange(tp * width), width)
    b = rem // per_row
    if seed and per_row == C.DECODE_SEQ:
        m, b = np.zeros_like(m), np.zeros_like(b)
    ok = b < leases.shape[1]
    out = np.full((ctx.partitions, tp * width), -1, np.int64)
    for g in range(ctx.partitions):
        start = ctx.group_ranks(g).start
        out[g, ok] = leases[start + m[ok], b[ok]]
    return out

def _markov_rows(v, live_rows):
    rows = v.a("logit_row_indices")
    for r in range(rows.shape[0]):
        n = C.DSPARK_QUERY_WIDTH * int(live_rows[r])
        want = np.full(rows.shape[1], -1)
        want[:n] = np.arange(n)
        if not np.array_equal(rows[r], want):
            v.fail("logit_row_indices", "logit_rows", f"rank {r}: {rows[r, :8].tolist()}",
                      f"0..{n - 1} (7 per live drafter row) then -1")

def markov(v):
    ns = v.a("num_sampled")
    if ((ns != 0) & (ns != 1)).any():
        v.fail("num_sampled", "drafter_mode", int(ns[(ns != 0) & (ns != 1)][0]), "0 or 1")
    rows = v.a("logit_row_indices")
    live = (rows >= 0).sum(axis=1) // C.DSPARK_QUERY_WIDTH
    if ((rows >= 0).sum(axis=1) % C.DSPARK_QUERY_WIDTH).any() or (live > v.extents["B"]).any():
        v.fail("logit_row_indices", "logit_rows", rows[:, :8].tolist()[0], "7 rows per live request, <= 7 B")
    _markov_rows(v, live)
    v.tokens("last_sampled", v.a("last_sampled")[ns == 1])
    v.tokens("next_prefill_tokens")
