"""Content rules of the target programs: packed prefill, split decode and fused K=7 decode.

Each function takes the validator (`v.a(name)` reads an argument, `v.fail(arg, rule, value,
allowed)` raises) after the structural checks passed.  Slots are recomputed from the staged
positions and tables, so a write into another request's page is caught, not only an out-of-pool
one.
"""
from __future__ import annotations

import numpy as np

from .. import constants as C
from .drafter_rules import drafter_tables
from .primitives import compressed_slot, paged_slot

PREFILL_TABLES = {
    "ori_block_table": ("ori", "ring"), "hca_cmp_block_table": ("cmp_c128", "absolute"),
    "csa_cmp_block_table": ("cmp_c4", "absolute"), "idx_block_table": ("idx", "absolute"),
    "hca_compress_state_block_table": ("hca_state", "ring"), "csa_compress_state_block_table": ("csa_state", "ring"),
    "csa_inner_compress_state_block_table": ("csa_inner_state", "ring"),
}
PREFILL_SLOTS = {
    "ori_slot_mapping_full": "ori", "hca_cmp_slot_mapping_full": "cmp_c128", "hca_state_slot_mapping_full": "hca_state",
    "csa_cmp_slot_mapping_full": "cmp_c4", "csa_idx_slot_mapping_full": "idx",
    "csa_state_slot_mapping_full": "csa_state", "csa_inner_state_slot_mapping_full": "csa_inner_state",
}
DECODE_SLOTS = {
    "swa_slot_mapping": "ori", "hca_ori_slot_mapping": "ori", "csa_ori_slot_mapping": "ori",
    "csa_cmp_slot_mapping": "cmp_c4", "csa_idx_slot_mapping": "idx", "csa_state_slot_mapping": "csa_state",
    "csa_inner_state_slot_mapping": "csa_inner_state", "hca_cmp_slot_mapping": "cmp_c128",
    "hca_state_slot_mapping": "hca_state",
}
DECODE_GROUP_TABLES = {"hca_compress_state_block_table": ("hca_state", "ring"),
                       "csa_compress_state_block_table": ("csa_state", "trailing"),
                       "csa_inner_compress_state_block_table": ("csa_inner_state", "trailing")}
LOCAL_TABLES = {"csa_cmp_block_table": "cmp_c4", "csa_idx_block_table": "idx", "hca_cmp_block_table": "cmp_c128"}
FUSED_GROUP_TABLES = {
    "group_ori_block_tables": ("ori", "ring"), "group_hca_cmp_block_tables": ("cmp_c128", "absolute"),
    "group_csa_cmp_block_tables": ("cmp_c4", "absolute"), "group_idx_block_tables": ("idx", "absolute"),
    "group_hca_state_block_tables": ("hca_state", "ring"), "group_csa_state_block_tables": ("csa_state", "ring"),
    "group_csa_inner_state_block_tables": ("csa_inner_state", "ring"),
}
_PREFILL_SLOT_TABLE = {fam: n for n, (fam, _) in PREFILL_TABLES.items()}


def prefill(v):
    ctx, tp = v.ctx, v.ctx.tp
    P, Q = v.extents["P"], v.extents["Q"]
    L = P // tp
    group_args = ["query_start_loc", "position_ids_full", *PREFILL_TABLES, *PREFILL_SLOTS]
    group_args += [b + s for b in ("swa_freqs", "compressed_freqs", "csa_cmp_freqs", "hca_cmp_freqs")
                   for s in ("_cos", "_sin")]
    v.replicated(group_args)
    qsl = v.a("query_start_loc")
    posf = v.a("position_ids_full")
    cap = min(ctx.deployment.prefill_requests_per_partition, C.PREFILL_LOGIT_ROWS)
    logit = v.a("logit_row_indices")
    for g in range(ctx.partitions):
        r0 = ctx.group_ranks(g).start
        q = qsl[r0].astype(np.int64)
        d = np.diff(q)
        count = int((d > 0).sum())
        if q[0] != 0 or (d < 0).any() or (count and (d[:count] <= 0).any()) or (d[count:] != 0).any():
            v.fail("query_start_loc", "query_start_loc", f"group {g}: {q[:8].tolist()}",
                      "[0, end_1, ..., end_k] with the terminal repeated to Q+1 entries")
        if count > cap:
            v.fail("query_start_loc", "group_requests", f"group {g}: {count}", f"at most {cap} requests")
        total = int(q[-1])
        if total > P:
            v.fail("query_start_loc", "group_tokens", f"group {g}: {total}", f"the packed extent P = {P}")
        status = ["active"] * count + ["absent"] * (Q - count)
        for n, (fam, kind) in PREFILL_TABLES.items():
            v.table_rows(n, v.a(n)[r0], kind, fam, status, ctx.ring_period(fam))
        for n, fam in PREFILL_SLOTS.items():
            v.slots(n, fam)
            if (v.a(n)[r0, total:] != -1).any():
                v.fail(n, "padding_publish", f"group {g}", f"-1 past the packed length {total}")
        live = posf[r0, :total].astype(np.int64)
        v.positions("position_ids_full", live)
        pad = posf[r0, total:].astype(np.int64)
        if total and pad.size and (pad.min() <= live.max() or np.unique(pad).size != pad.size):
            v.fail("position_ids_full", "padding_positions", f"group {g}",
                      "synthetic padding positions max_real+1, max_real+2, ... (never a live position)")
        for m, r in enumerate(ctx.group_ranks(g)):
            if not np.array_equal(v.a("position_ids_local")[r], posf[r0, m * L:(m + 1) * L]):
                v.fail("position_ids_local", "band_layout", f"rank {r}", f"position_ids_full[{m * L}:{(m + 1) * L}]")
        want = np.full(logit.shape[1], -1)
        want[:count] = q[1:count + 1] - 1
        if not np.array_equal(logit[r0], want) or (logit[r0 + 1:r0 + tp] != -1).any():
            v.fail("logit_row_indices", "logit_rows", f"group {g}: {logit[r0, :8].tolist()}",
                      "the last packed row of each request on the group leader, -1 elsewhere")
        for k in range(count):
            seg = slice(int(q[k]), int(q[k + 1]))
            pos = posf[r0, seg].astype(np.int64)
            for n, fam in PREFILL_SLOTS.items():
                table = v.a(_PREFILL_SLOT_TABLE[fam])[r0, k]
                f = ctx.families[fam]
                want = compressed_slot(pos, table, f.compress_ratio) if f.kind == "compressed" else \
                    paged_slot(pos, table, f.page_tokens)
                got = v.a(n)[r0, seg]
                if not np.array_equal(got, want):
                    j = int(np.argmax(got != want))
                    v.fail(n, "slot_mapping", f"group {g} request {k} position {pos[j]}: {got[j]}",
                              f"{want[j]} (the slot its table row gives)")
    v.tokens("input_ids")
    v.grammar()

def _decode_status(v):
    """stream slot -> active, from num_tokens_per_owner (dense local rows)."""
    ctx, per = v.ctx, v.ctx.local_requests
    ntpo = v.a("num_tokens_per_owner")
    bad = (ntpo < 0) | (ntpo > per * C.DECODE_SEQ) | (ntpo % C.DECODE_SEQ != 0)
    if bad.any():
        v.fail("num_tokens_per_owner", "owner_rows", int(ntpo[bad][0]),
                  f"a multiple of 8 up to {per * C.DECODE_SEQ} (16 requests x 8 rows per owner rank)")
    active = np.zeros((ctx.partitions, C.DECODE_BATCH), bool)
    for g in range(ctx.partitions):
        for m, r in enumerate(ctx.group_ranks(g)):
            active[g, m * per: m * per + ntpo[r] // C.DECODE_SEQ] = True
    return active

def _local_tables(v, active):
    ctx, per = v.ctx, v.ctx.local_requests
    for n, fam in LOCAL_TABLES.items():
        t = v.a(n)
        for g in range(ctx.partitions):
            for m, r in enumerate(ctx.group_ranks(g)):
                st = ["active" if active[g, m * per + l] else "inactive" for l in range(per)]
                v.table_rows(n, t[r], "absolute", fam, st)

def decode(v):
    ctx, per = v.ctx, v.ctx.local_requests
    active = _decode_status(v)
    v.replicated(["position_ids", *DECODE_SLOTS, *DECODE_GROUP_TABLES, "csa_cmp_freqs_cos", "hca_cmp_freqs_cos"])
    for n, (fam, kind) in DECODE_GROUP_TABLES.items():
        for g in range(ctx.partitions):
            st = ["active" if a else "inactive" for a in active[g]]
            v.table_rows(n, v.a(n)[ctx.group_ranks(g).start], kind, fam, st, ctx.ring_period(fam))
    _local_tables(v, active)
    for n, fam in DECODE_SLOTS.items():
        v.slots(n, fam)
        s = v.a(n)
        for g in range(ctx.partitions):
            rows = np.repeat(~active[g], C.DECODE_SEQ)
            if (s[ctx.group_ranks(g).start][rows] != -1).any():
                v.fail(n, "inactive_publish", f"group {g}", "-1 on every row of an inactive stream slot")
    pos = v.a("position_ids")
    v.positions("position_ids", pos)
    band = per * C.DECODE_SEQ
    for g in range(ctx.partitions):
        for m, r in enumerate(ctx.group_ranks(g)):
            if not np.array_equal(v.a("position_ids_local")[r], pos[r, m * band:(m + 1) * band]):
                v.fail("position_ids_local", "band_layout", f"rank {r}", "the rank's band of position_ids")
    ntpo = v.a("num_tokens_per_owner")
    for n in ("csa_kv_seq_lens", "hca_kv_seq_lens"):
        v.positions(n, v.a(n).astype(np.int64) - 1, allow_pad=True)
    W = ctx.model.sliding_window
    for pre in ("swa", "csa_window_swa", "hca_window_swa"):
        idx, lens = v.a(pre + "_indices"), v.a(pre + "_lens")
        v.slots(pre + "_indices", "ori")
        if ((lens < 0) | (lens > W)).any() or ((np.arange(W)[None, None, :] >= lens[..., None]) & (idx != -1)).any():
            v.fail(pre + "_lens", "window_lens", int(lens.max()), f"lens in [0, {W}], indices -1 past the len")
        for r in range(ctx.ranks):
            if (lens[r, ntpo[r]:] != 0).any():
                v.fail(pre + "_lens", "window_lens", f"rank {r}", f"0 past the {ntpo[r]} active owner rows")
    _decode_slots(v, active, pos)
    logit = v.a("logit_row_indices")
    for r in range(ctx.ranks):
        row = logit[r]
        k = int((row >= 0).sum())
        if (row[k:] != -1).any() or (row[:k] >= ntpo[r]).any() or (np.diff(row[:k]) <= 0).any():
            v.fail("logit_row_indices", "logit_rows", f"rank {r}: {row[:8].tolist()}",
                      f"increasing owner rows < num_tokens_per_owner = {ntpo[r]}, packed densely, -1 after")
    for r in range(ctx.ranks):
        v.tokens("input_ids", v.a("input_ids")[r, :ntpo[r]])
    v.grammar()

def _decode_slots(v, active, pos):
    """Recompute every split-decode write from positions, commit and tables."""
    ctx, per, W = v.ctx, v.ctx.local_requests, v.ctx.model.sliding_window
    seq = {n: v.a(n).astype(np.int64) for n in ("csa_kv_seq_lens", "hca_kv_seq_lens")}
    for g in range(ctx.partitions):
        r0 = ctx.group_ranks(g).start
        for s in range(C.DECODE_BATCH):
            rank, local = r0 + s // per, s % per
            rows = slice(s * C.DECODE_SEQ, (s + 1) * C.DECODE_SEQ)
            lens = seq["csa_kv_seq_lens"][rank, local], seq["hca_kv_seq_lens"][rank, local]
            if not active[g, s]:
                if lens != (0, 0):
                    v.fail("csa_kv_seq_lens", "seq_lens", f"rank {rank} row {local}: {lens}", "0 on an empty row")
                continue
            p = pos[r0, rows].astype(np.int64)
            commit = int(lens[0] - p[0])
            if lens[0] != lens[1] or commit not in (1, C.DECODE_SEQ) or \
                    (commit == C.DECODE_SEQ and p[0] + C.DECODE_SEQ > ctx.max_position):
                v.fail("csa_kv_seq_lens", "seq_lens", f"rank {rank} row {local}: {lens}, anchor {p[0]}",
                          "anchor + 8 (speculative, inside max_position) or anchor + 1, equal for CSA and HCA")
            pub = np.arange(C.DECODE_SEQ) < commit
            want = {
                "hca_state_slot_mapping": paged_slot(p, v.a("hca_compress_state_block_table")[r0, s], 8),
                "csa_state_slot_mapping": paged_slot(p % 16, v.a("csa_compress_state_block_table")[r0, s], 2),
                "csa_inner_state_slot_mapping": paged_slot(p % 16, v.a("csa_inner_compress_state_block_table")[r0, s], 2),
            }
            for n, fam in LOCAL_TABLES.items():
                arg = {"cmp_c4": "csa_cmp_slot_mapping", "idx": "csa_idx_slot_mapping",
                       "cmp_c128": "hca_cmp_slot_mapping"}[fam]
                want[arg] = compressed_slot(p, v.a(n)[rank, local], ctx.families[fam].compress_ratio, pub)
            lrows = slice(local * C.DECODE_SEQ, (local + 1) * C.DECODE_SEQ)
            wl = np.minimum(v.a("position_ids_local")[rank, lrows].astype(np.int64) + 1, W)
            idx = v.a("swa_indices")[rank, lrows]
            for pre in ("swa", "csa_window_swa", "hca_window_swa"):
                if not (np.array_equal(v.a(pre + "_lens")[rank, lrows], wl)
                        and np.array_equal(v.a(pre + "_indices")[rank, lrows], idx)):
                    v.fail(pre + "_lens", "window_lens", f"rank {rank} row {local}",
                              f"lens min(p+1, {W}) and the same window for swa, csa and hca")
            newest = idx[np.arange(C.DECODE_SEQ), np.maximum(wl - 1, 0)].astype(np.int64)
            for n in ("swa_slot_mapping", "hca_ori_slot_mapping", "csa_ori_slot_mapping"):
                want[n] = np.where(pub, newest, -1)
            for n, w in want.items():
                w = np.where(pub, w, -1)
                got = v.a(n)[r0, rows]
                if not np.array_equal(got, w):
                    j = int(np.argmax(got != w))
                    v.fail(n, "slot_mapping", f"group {g} slot {s} row {j}: {got[j]}",
                              f"{w[j]} (positions, commit {commit} and the request's tables)")

def fused(v):
    ctx, per, tp = v.ctx, v.ctx.local_requests, v.ctx.tp
    gsid, ggen = v.a("group_state_slot_ids"), v.a("group_state_generations")
    sid, sgen = v.a("state_slot_ids"), v.a("state_generations")
    v.replicated(["group_state_slot_ids", "group_state_generations", "valid_draft_counts", *FUSED_GROUP_TABLES])
    for n, arr in (("group_state_slot_ids", gsid), ("state_slot_ids", sid)):
        if ((arr < -1) | (arr >= C.DRAFTER_LEASES_PER_GROUP)).any():
            v.fail(n, "lease_range", int(arr[(arr < -1) | (arr >= 64)][0]), "-1 or a lease in [0, 64)")
    active = gsid[[ctx.group_ranks(g).start for g in range(ctx.partitions)]] >= 0
    ntpo = v.a("num_tokens_per_owner")
    for g in range(ctx.partitions):
        r0 = ctx.group_ranks(g).start
        live = gsid[r0][active[g]]
        if np.unique(live).size != live.size:
            v.fail("group_state_slot_ids", "lease_unique", f"group {g}: {sorted(live.tolist())[:8]}",
                      "one stream slot per lease in a group")
        gen = ggen[r0]
        if (gen[active[g]] < 1).any() or (gen[~active[g]] != -1).any():
            v.fail("group_state_generations", "generation", f"group {g}", ">= 1 on live slots, -1 on empty ones")
        for m, r in enumerate(ctx.group_ranks(g)):
            band = active[g, m * per:(m + 1) * per]
            n = int(band.sum())
            if not band[:n].all():
                v.fail("group_state_slot_ids", "owner_rows", f"rank {r}", "live local rows dense from row 0")
            if ntpo[r] != n * C.DECODE_SEQ:
                v.fail("num_tokens_per_owner", "owner_rows", int(ntpo[r]), f"8 x {n} live rows on rank {r}")
            if not (np.array_equal(sid[r], gsid[r0, m * per:(m + 1) * per])
                    and np.array_equal(sgen[r], ggen[r0, m * per:(m + 1) * per])):
                v.fail("state_slot_ids", "descriptor_mismatch", f"rank {r}",
                          "state_slot_ids / state_generations equal to the rank's band of the group descriptors")
            leases = sid[r, :n]
            if (leases % tp != m).any():
                v.fail("state_slot_ids", "owner_placement", f"rank {r}: {leases.tolist()}",
                          f"leases with lease % {tp} == {m} (owner rank = lease % 4)")
    for n, (fam, kind) in FUSED_GROUP_TABLES.items():
        for g in range(ctx.partitions):
            st = ["active" if a else "inactive" for a in active[g]]
            v.table_rows(n, v.a(n)[ctx.group_ranks(g).start], kind, fam, st, ctx.ring_period(fam))
    _local_tables(v, active)
    vdc = v.a("valid_draft_counts")
    if ((vdc < 0) | (vdc > C.DSPARK_QUERY_WIDTH)).any():
        v.fail("valid_draft_counts", "draft_count", int(vdc[(vdc < 0) | (vdc > 7)][0]), "0..7")
    B = v.extents["B"]
    if (ntpo // C.DECODE_SEQ > B).any():
        v.fail("draft_block_tables", "drafter_batch", B, f">= the largest owner's {int(ntpo.max()) // 8} rows")
    drafter_tables(v, "draft_block_tables", lambda r, b: int(sid[r, b]) if b < ntpo[r] // 8 else None)
    v.grammar()
