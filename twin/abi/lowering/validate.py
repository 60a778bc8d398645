"""`validate(dispatch, ctx)`: a dispatch against the ABI, before a device sees it.

Order: the program is known; no unknown argument; every host-staged input ("input" role) present;
the dynamic extents (P, L, Q, B, T_MAIN) read from the arrays are legal; every present argument
has its bound shape and dtype; then the program's content rules.  Weights, cache pools, scratch
and outputs are not built by lowering: when present they are checked for shape and dtype only.
The first broken rule raises `DispatchError(program, arg, rule)`; `RULES` lists the rule ids.
"""
from __future__ import annotations

import numpy as np

from .. import constants as C
from ..batches import Dispatch
from ..programs import INPUT, PROGRAMS
from .context import NP_DTYPES, DispatchError, LoweringContext
from .drafter import filler_ring_table, lease_ring_table, lease_slot
from .grammar import HEADER_WORD, MASKED, PLAIN, padding_ok
from .primitives import compressed_slot, paged_slot

RULES = {
    "program": "the program is one of the six",
    "unknown_arg": "every argument is an argument of the program",
    "missing_arg": "every host-staged input of the program is present",
    "shape": "every argument has its bound shape (dynamic axes as compact prefixes)",
    "dtype": "every argument has its ABI dtype (bf16: uint16 bits or ml_dtypes bfloat16)",
    "group_requests": "at most 64 (and min(max_num_seqs, 64)) requests per TP group",
    "group_tokens": "at most 8192 packed prefill tokens per TP group",
    "drafter_batch": "drafter B in {4, 8, 12, 16}, holding every rank's rows",
    "drafter_context": "T_MAIN in {32, 64, 96, 128}",
    "query_start_loc": "0, strictly increasing request ends, repeated terminal; idle groups all 0",
    "replication": "group-level arguments identical on the group's ranks",
    "table_layout": "ring rows full, absolute rows a prefix then -1, absent rows all -1",
    "table_depth": "tables exactly at the kernels' frozen depth (or the ring period)",
    "block_range": "block ids in [0, num_blocks); scratch pages only on inactive decode rows",
    "block_repeat": "no block id repeated within one request's row",
    "ring_period": "a rolling ring no longer than the family's ring period",
    "slot_range": "slots -1 or inside the pool",
    "slot_mapping": "slots equal what the positions and tables give: no write lands in another request's page",
    "seq_lens": "kv_seq_lens = anchor + 1 or anchor + 8 on live decode rows, 0 elsewhere",
    "padding_publish": "padding rows and idle groups write nothing (-1 slots)",
    "inactive_publish": "inactive decode slots write nothing",
    "position_ceiling": "live positions in [0, max_position)",
    "padding_positions": "prefill padding positions distinct from every live position",
    "band_layout": "local rows are the rank-major band of the group stream",
    "token_range": "token ids in [0, vocab)",
    "logit_rows": "logit rows dense, in range, -1 elsewhere",
    "owner_rows": "at most 16 requests (128 rows) per owner rank, dense from row 0",
    "owner_placement": "a K=7 request sits on owner rank lease % 4",
    "descriptor_mismatch": "rank-local descriptors agree with the group descriptors",
    "lease_range": "leases in [0, 64)",
    "lease_unique": "leases unique within a group",
    "generation": "live rows carry a generation >= 1, empty rows -1",
    "draft_count": "valid_draft_counts in [0, 7]",
    "drafter_mode": "num_sampled 0 (seed / filler) or 1 (redraft)",
    "drafter_ring": "drafter block rows are a lease ring or the filler ring",
    "window_lens": "window lens in [0, 128], indices -1 past the len",
    "grammar_header": "row-mode header -1 (plain) or 0 (masked)",
    "grammar_padding": "grammar padding bits 808..1023 set to 1",
}

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
DRAFTER_BLOCKS = C.DRAFTER_FILLER_BLOCK_BASE + C.DRAFTER_BLOCKS_PER_LEASE      # lease rings + filler ring
DRAFTER_SLOTS = C.DRAFTER_FILLER_BLOCK_BASE * C.BLOCK_SIZE                       # filler is never written


def validate(dispatch: Dispatch, ctx: LoweringContext) -> dict:
    """Raise `DispatchError` at the first broken rule; return the extents on success."""
    prog = PROGRAMS.get(dispatch.program)
    if prog is None:
        raise DispatchError(str(dispatch.program), "program", "program", dispatch.program, f"one of {list(PROGRAMS)}")
    v = _Validator(prog, dispatch.args, ctx)
    v.structure()
    getattr(v, _SEMANTICS[prog.name])()
    return v.extents


class _Validator:
    def __init__(self, prog, args, ctx: LoweringContext):
        self.prog, self.args, self.ctx = prog, dict(args), ctx
        self.name = prog.name
        self.extents: dict[str, int] = {}

    def fail(self, arg, rule, value, allowed):
        raise DispatchError(self.name, arg, rule, value, allowed)

    # ---- structure ---------------------------------------------------------------------
    def structure(self):
        known = set(self.prog.names)
        for n in self.args:
            if n not in known:
                self.fail(n, "unknown_arg", n, f"an argument of {self.name}")
        for a in self.prog.args:
            if a.role == INPUT and a.name not in self.args:
                self.fail(a.name, "missing_arg", None, f"the host-staged {a.shape} {a.dtype} input")
        self._extents()
        bound = self.ctx.bind(self.name, **self.extents)
        for n, arr in self.args.items():
            b = bound[n]
            a = np.asarray(arr) if not hasattr(arr, "shape") else arr
            if tuple(a.shape) != b.shape:
                rule = "table_depth" if _is_table(n) and len(a.shape) == len(b.shape) and a.shape[:-1] == b.shape[:-1] \
                    else "shape"
                self.fail(n, rule, tuple(a.shape), f"{b.shape} ({b.arg.shape})")
            try:
                ok = _dtype_ok(a.dtype, b.dtype)
            except TypeError:                # e.g. a torch tensor: validate takes numpy arrays
                ok = False
            if not ok:
                self.fail(n, "dtype", str(a.dtype), f"{b.dtype} ({np.dtype(NP_DTYPES[b.dtype]).name})")

    def _extents(self):
        tp = self.ctx.tp
        seen: dict[str, tuple[int, str]] = {}
        for a in self.prog.args:
            if a.dyn is None or a.name not in self.args:
                continue
            shape = np.shape(self.args[a.name])
            idx = next(i for i, d in enumerate(a.dims) if a.dyn in d.replace("+", " ").replace("*", " ").split())
            if len(shape) != len(a.dims):
                self.fail(a.name, "shape", tuple(shape), f"rank {len(a.dims)} ({a.shape})")
            val, dim = shape[idx], a.dims[idx]
            sym = a.dyn
            if dim == "Q+1":
                val -= 1
            elif dim == "TP*T_MAIN":
                if val % tp:
                    self.fail(a.name, "shape", tuple(shape), f"axis {idx} a multiple of tp={tp} ({dim})")
                val //= tp
            if sym == "L":
                sym, val = "P", val * tp
            if sym in seen and seen[sym][0] != val:
                self.fail(a.name, "shape", tuple(shape), f"{sym}={seen[sym][0]} as in {seen[sym][1]}")
            seen.setdefault(sym, (val, a.name))
        for sym, (val, src) in seen.items():
            if sym == "Q" and not 1 <= val <= C.PREFILL_REQUESTS_PER_GROUP:
                self.fail(src, "group_requests" if val > 0 else "shape", val,
                          f"Q in 1..{C.PREFILL_REQUESTS_PER_GROUP} requests per TP group")
            if sym == "P":
                if val > C.PREFILL_TOKENS_PER_GROUP:
                    self.fail(src, "group_tokens", val, f"P <= {C.PREFILL_TOKENS_PER_GROUP} packed tokens per group")
                if val < tp or val % tp:
                    self.fail(src, "shape", val, f"P a positive multiple of tp={tp}")
            if sym == "B" and val not in C.DRAFTER_BATCHES:
                self.fail(src, "drafter_batch", val, f"B in {C.DRAFTER_BATCHES}")
            if sym == "T_MAIN" and val not in C.DRAFTER_CONTEXT_BUCKETS:
                self.fail(src, "drafter_context", val, f"T_MAIN in {C.DRAFTER_CONTEXT_BUCKETS}")
            self.extents[sym] = val

    # ---- shared content rules -----------------------------------------------------------
    def a(self, n):
        return np.asarray(self.args[n])

    def replicated(self, names):
        for n in names:
            arr = self.a(n)
            for g in range(self.ctx.partitions):
                rr = self.ctx.group_ranks(g)
                for r in rr[1:]:
                    if not np.array_equal(arr[r], arr[rr.start]):
                        self.fail(n, "replication", f"rank {r} differs from rank {rr.start}",
                                  "identical rows on every rank of the TP group")

    def slots(self, n, family, bound=None):
        s = self.a(n)
        lim = bound if bound is not None else self.ctx.num_blocks[family] * self.ctx.families[family].rows_per_page
        bad = (s < -1) | (s >= lim)
        if bad.any():
            self.fail(n, "slot_range", int(s[bad].flat[0]), f"-1 or a slot in [0, {lim})")

    def table_rows(self, n, rows, kind, family, status, period=None):
        """rows [k, depth]; status[k] in {'active', 'absent', 'inactive'}."""
        nb = self.ctx.num_blocks[family] if family else DRAFTER_BLOCKS
        for i, st in enumerate(status):
            row = rows[i]
            if st == "absent":
                if (row != -1).any():
                    self.fail(n, "table_layout", f"row {i}", "-1 everywhere on a row without a request")
                continue
            if st == "inactive":
                live = row[row >= 0]
                if ((live < nb) | (live >= nb + C.SCRATCH_PAGES)).any() or live.size == 0:
                    self.fail(n, "block_range", f"row {i}: {live[:4].tolist()}",
                              f"an inactive decode row reads only scratch pages [{nb}, {nb + C.SCRATCH_PAGES})")
                continue
            _check_row(self, n, row, kind, nb, period, i)

    def grammar(self):
        m = self.a("grammar_mask")
        head = m[..., 0, HEADER_WORD]
        bad = (head != PLAIN) & (head != MASKED)
        if bad.any():
            self.fail("grammar_mask", "grammar_header", int(head[bad][0]), "-1 (plain argmax) or 0 (masked)")
        ok = padding_ok(m)
        if not ok.all():
            r = np.argwhere(~ok)[0]
            self.fail("grammar_mask", "grammar_padding", f"rank {r[0]} row {r[1]}", "padding bits 808..1023 all 1")

    def tokens(self, n, arr=None):
        t = self.a(n) if arr is None else arr
        bad = (t < 0) | (t >= self.ctx.model.vocab_size)
        if bad.any():
            self.fail(n, "token_range", int(t[bad].flat[0]), f"[0, {self.ctx.model.vocab_size})")

    def positions(self, n, pos, allow_pad=False):
        bad = (pos >= self.ctx.max_position) | (pos < (-1 if allow_pad else 0))
        if bad.any():
            self.fail(n, "position_ceiling", int(pos[bad].flat[0]), f"[0, max_position = {self.ctx.max_position})")

    # ---- programs ------------------------------------------------------------------------
    def prefill(self):
        ctx, tp = self.ctx, self.ctx.tp
        P, Q = self.extents["P"], self.extents["Q"]
        L = P // tp
        group_args = ["query_start_loc", "position_ids_full", *PREFILL_TABLES, *PREFILL_SLOTS]
        group_args += [b + s for b in ("swa_freqs", "compressed_freqs", "csa_cmp_freqs", "hca_cmp_freqs")
                       for s in ("_cos", "_sin")]
        self.replicated(group_args)
        qsl = self.a("query_start_loc")
        posf = self.a("position_ids_full")
        cap = min(ctx.deployment.prefill_requests_per_partition, C.PREFILL_LOGIT_ROWS)
        logit = self.a("logit_row_indices")
        for g in range(ctx.partitions):
            r0 = ctx.group_ranks(g).start
            q = qsl[r0].astype(np.int64)
            d = np.diff(q)
            count = int((d > 0).sum())
            if q[0] != 0 or (d < 0).any() or (count and (d[:count] <= 0).any()) or (d[count:] != 0).any():
                self.fail("query_start_loc", "query_start_loc", f"group {g}: {q[:8].tolist()}",
                          "[0, end_1, ..., end_k] with the terminal repeated to Q+1 entries")
            if count > cap:
                self.fail("query_start_loc", "group_requests", f"group {g}: {count}", f"at most {cap} requests")
            total = int(q[-1])
            if total > P:
                self.fail("query_start_loc", "group_tokens", f"group {g}: {total}", f"the packed extent P = {P}")
            status = ["active"] * count + ["absent"] * (Q - count)
            for n, (fam, kind) in PREFILL_TABLES.items():
                self.table_rows(n, self.a(n)[r0], kind, fam, status, ctx.ring_period(fam))
            for n, fam in PREFILL_SLOTS.items():
                self.slots(n, fam)
                if (self.a(n)[r0, total:] != -1).any():
                    self.fail(n, "padding_publish", f"group {g}", f"-1 past the packed length {total}")
            live = posf[r0, :total].astype(np.int64)
            self.positions("position_ids_full", live)
            pad = posf[r0, total:].astype(np.int64)
            if total and pad.size and (pad.min() <= live.max() or np.unique(pad).size != pad.size):
                self.fail("position_ids_full", "padding_positions", f"group {g}",
                          "synthetic padding positions max_real+1, max_real+2, ... (never a live position)")
            for m, r in enumerate(ctx.group_ranks(g)):
                if not np.array_equal(self.a("position_ids_local")[r], posf[r0, m * L:(m + 1) * L]):
                    self.fail("position_ids_local", "band_layout", f"rank {r}", f"position_ids_full[{m * L}:{(m + 1) * L}]")
            want = np.full(logit.shape[1], -1)
            want[:count] = q[1:count + 1] - 1
            if not np.array_equal(logit[r0], want) or (logit[r0 + 1:r0 + tp] != -1).any():
                self.fail("logit_row_indices", "logit_rows", f"group {g}: {logit[r0, :8].tolist()}",
                          "the last packed row of each request on the group leader, -1 elsewhere")
            for k in range(count):
                seg = slice(int(q[k]), int(q[k + 1]))
                pos = posf[r0, seg].astype(np.int64)
                for n, fam in PREFILL_SLOTS.items():
                    table = self.a(_PREFILL_SLOT_TABLE[fam])[r0, k]
                    f = ctx.families[fam]
                    want = compressed_slot(pos, table, f.compress_ratio) if f.kind == "compressed" else \
                        paged_slot(pos, table, f.page_tokens)
                    got = self.a(n)[r0, seg]
                    if not np.array_equal(got, want):
                        j = int(np.argmax(got != want))
                        self.fail(n, "slot_mapping", f"group {g} request {k} position {pos[j]}: {got[j]}",
                                  f"{want[j]} (the slot its table row gives)")
        self.tokens("input_ids")
        self.grammar()

    def _decode_status(self):
        """stream slot -> active, from num_tokens_per_owner (dense local rows)."""
        ctx, per = self.ctx, self.ctx.local_requests
        ntpo = self.a("num_tokens_per_owner")
        bad = (ntpo < 0) | (ntpo > per * C.DECODE_SEQ) | (ntpo % C.DECODE_SEQ != 0)
        if bad.any():
            self.fail("num_tokens_per_owner", "owner_rows", int(ntpo[bad][0]),
                      f"a multiple of 8 up to {per * C.DECODE_SEQ} (16 requests x 8 rows per owner rank)")
        active = np.zeros((ctx.partitions, C.DECODE_BATCH), bool)
        for g in range(ctx.partitions):
            for m, r in enumerate(ctx.group_ranks(g)):
                active[g, m * per: m * per + ntpo[r] // C.DECODE_SEQ] = True
        return active

    def _local_tables(self, active):
        ctx, per = self.ctx, self.ctx.local_requests
        for n, fam in LOCAL_TABLES.items():
            t = self.a(n)
            for g in range(ctx.partitions):
                for m, r in enumerate(ctx.group_ranks(g)):
                    st = ["active" if active[g, m * per + l] else "inactive" for l in range(per)]
                    self.table_rows(n, t[r], "absolute", fam, st)

    def decode(self):
        ctx, per, tp = self.ctx, self.ctx.local_requests, self.ctx.tp
        active = self._decode_status()
        self.replicated(["position_ids", *DECODE_SLOTS, *DECODE_GROUP_TABLES, "csa_cmp_freqs_cos", "hca_cmp_freqs_cos"])
        for n, (fam, kind) in DECODE_GROUP_TABLES.items():
            for g in range(ctx.partitions):
                st = ["active" if a else "inactive" for a in active[g]]
                self.table_rows(n, self.a(n)[ctx.group_ranks(g).start], kind, fam, st, ctx.ring_period(fam))
        self._local_tables(active)
        for n, fam in DECODE_SLOTS.items():
            self.slots(n, fam)
            s = self.a(n)
            for g in range(ctx.partitions):
                rows = np.repeat(~active[g], C.DECODE_SEQ)
                if (s[ctx.group_ranks(g).start][rows] != -1).any():
                    self.fail(n, "inactive_publish", f"group {g}", "-1 on every row of an inactive stream slot")
        pos = self.a("position_ids")
        self.positions("position_ids", pos)
        band = per * C.DECODE_SEQ
        for g in range(ctx.partitions):
            for m, r in enumerate(ctx.group_ranks(g)):
                if not np.array_equal(self.a("position_ids_local")[r], pos[r, m * band:(m + 1) * band]):
                    self.fail("position_ids_local", "band_layout", f"rank {r}", "the rank's band of position_ids")
        ntpo = self.a("num_tokens_per_owner")
        for n in ("csa_kv_seq_lens", "hca_kv_seq_lens"):
            self.positions(n, self.a(n).astype(np.int64) - 1, allow_pad=True)
        W = ctx.model.sliding_window
        for pre in ("swa", "csa_window_swa", "hca_window_swa"):
            idx, lens = self.a(pre + "_indices"), self.a(pre + "_lens")
            self.slots(pre + "_indices", "ori")
            if ((lens < 0) | (lens > W)).any() or ((np.arange(W)[None, None, :] >= lens[..., None]) & (idx != -1)).any():
                self.fail(pre + "_lens", "window_lens", int(lens.max()), f"lens in [0, {W}], indices -1 past the len")
            for r in range(ctx.ranks):
                if (lens[r, ntpo[r]:] != 0).any():
                    self.fail(pre + "_lens", "window_lens", f"rank {r}", f"0 past the {ntpo[r]} active owner rows")
        self._decode_slots(active, pos)
        logit = self.a("logit_row_indices")
        for r in range(ctx.ranks):
            row = logit[r]
            k = int((row >= 0).sum())
            if (row[k:] != -1).any() or (row[:k] >= ntpo[r]).any() or (np.diff(row[:k]) <= 0).any():
                self.fail("logit_row_indices", "logit_rows", f"rank {r}: {row[:8].tolist()}",
                          f"increasing owner rows < num_tokens_per_owner = {ntpo[r]}, packed densely, -1 after")
        for r in range(ctx.ranks):
            self.tokens("input_ids", self.a("input_ids")[r, :ntpo[r]])
        self.grammar()

    def _decode_slots(self, active, pos):
        """Recompute every split-decode write from positions, commit and tables."""
        ctx, per, W = self.ctx, self.ctx.local_requests, self.ctx.model.sliding_window
        seq = {n: self.a(n).astype(np.int64) for n in ("csa_kv_seq_lens", "hca_kv_seq_lens")}
        for g in range(ctx.partitions):
            r0 = ctx.group_ranks(g).start
            for s in range(C.DECODE_BATCH):
                rank, local = r0 + s // per, s % per
                rows = slice(s * C.DECODE_SEQ, (s + 1) * C.DECODE_SEQ)
                lens = seq["csa_kv_seq_lens"][rank, local], seq["hca_kv_seq_lens"][rank, local]
                if not active[g, s]:
                    if lens != (0, 0):
                        self.fail("csa_kv_seq_lens", "seq_lens", f"rank {rank} row {local}: {lens}", "0 on an empty row")
                    continue
                p = pos[r0, rows].astype(np.int64)
                commit = int(lens[0] - p[0])
                if lens[0] != lens[1] or commit not in (1, C.DECODE_SEQ) or \
                        (commit == C.DECODE_SEQ and p[0] + C.DECODE_SEQ > ctx.max_position):
                    self.fail("csa_kv_seq_lens", "seq_lens", f"rank {rank} row {local}: {lens}, anchor {p[0]}",
                              "anchor + 8 (speculative, inside max_position) or anchor + 1, equal for CSA and HCA")
                pub = np.arange(C.DECODE_SEQ) < commit
                want = {
                    "hca_state_slot_mapping": paged_slot(p, self.a("hca_compress_state_block_table")[r0, s], 8),
                    "csa_state_slot_mapping": paged_slot(p % 16, self.a("csa_compress_state_block_table")[r0, s], 2),
                    "csa_inner_state_slot_mapping": paged_slot(p % 16, self.a("csa_inner_compress_state_block_table")[r0, s], 2),
                }
                for n, fam in LOCAL_TABLES.items():
                    arg = {"cmp_c4": "csa_cmp_slot_mapping", "idx": "csa_idx_slot_mapping",
                           "cmp_c128": "hca_cmp_slot_mapping"}[fam]
                    want[arg] = compressed_slot(p, self.a(n)[rank, local], ctx.families[fam].compress_ratio, pub)
                lrows = slice(local * C.DECODE_SEQ, (local + 1) * C.DECODE_SEQ)
                wl = np.minimum(self.a("position_ids_local")[rank, lrows].astype(np.int64) + 1, W)
                idx = self.a("swa_indices")[rank, lrows]
                for pre in ("swa", "csa_window_swa", "hca_window_swa"):
                    if not (np.array_equal(self.a(pre + "_lens")[rank, lrows], wl)
                            and np.array_equal(self.a(pre + "_indices")[rank, lrows], idx)):
                        self.fail(pre + "_lens", "window_lens", f"rank {rank} row {local}",
                                  f"lens min(p+1, {W}) and the same window for swa, csa and hca")
                newest = idx[np.arange(C.DECODE_SEQ), np.maximum(wl - 1, 0)].astype(np.int64)
                for n in ("swa_slot_mapping", "hca_ori_slot_mapping", "csa_ori_slot_mapping"):
                    want[n] = np.where(pub, newest, -1)
                for n, w in want.items():
                    w = np.where(pub, w, -1)
                    got = self.a(n)[r0, rows]
                    if not np.array_equal(got, w):
                        j = int(np.argmax(got != w))
                        self.fail(n, "slot_mapping", f"group {g} slot {s} row {j}: {got[j]}",
                                  f"{w[j]} (positions, commit {commit} and the request's tables)")

    def fused(self):
        ctx, per, tp = self.ctx, self.ctx.local_requests, self.ctx.tp
        gsid, ggen = self.a("group_state_slot_ids"), self.a("group_state_generations")
        sid, sgen = self.a("state_slot_ids"), self.a("state_generations")
        self.replicated(["group_state_slot_ids", "group_state_generations", "valid_draft_counts", *FUSED_GROUP_TABLES])
        for n, arr in (("group_state_slot_ids", gsid), ("state_slot_ids", sid)):
            if ((arr < -1) | (arr >= C.DRAFTER_LEASES_PER_GROUP)).any():
                self.fail(n, "lease_range", int(arr[(arr < -1) | (arr >= 64)][0]), "-1 or a lease in [0, 64)")
        active = gsid[[ctx.group_ranks(g).start for g in range(ctx.partitions)]] >= 0
        ntpo = self.a("num_tokens_per_owner")
        for g in range(ctx.partitions):
            r0 = ctx.group_ranks(g).start
            live = gsid[r0][active[g]]
            if np.unique(live).size != live.size:
                self.fail("group_state_slot_ids", "lease_unique", f"group {g}: {sorted(live.tolist())[:8]}",
                          "one stream slot per lease in a group")
            gen = ggen[r0]
            if (gen[active[g]] < 1).any() or (gen[~active[g]] != -1).any():
                self.fail("group_state_generations", "generation", f"group {g}", ">= 1 on live slots, -1 on empty ones")
            for m, r in enumerate(ctx.group_ranks(g)):
                band = active[g, m * per:(m + 1) * per]
                n = int(band.sum())
                if not band[:n].all():
                    self.fail("group_state_slot_ids", "owner_rows", f"rank {r}", "live local rows dense from row 0")
                if ntpo[r] != n * C.DECODE_SEQ:
                    self.fail("num_tokens_per_owner", "owner_rows", int(ntpo[r]), f"8 x {n} live rows on rank {r}")
                if not (np.array_equal(sid[r], gsid[r0, m * per:(m + 1) * per])
                        and np.array_equal(sgen[r], ggen[r0, m * per:(m + 1) * per])):
                    self.fail("state_slot_ids", "descriptor_mismatch", f"rank {r}",
                              "state_slot_ids / state_generations equal to the rank's band of the group descriptors")
                leases = sid[r, :n]
                if (leases % tp != m).any():
                    self.fail("state_slot_ids", "owner_placement", f"rank {r}: {leases.tolist()}",
                              f"leases with lease % {tp} == {m} (owner rank = lease % 4)")
        for n, (fam, kind) in FUSED_GROUP_TABLES.items():
            for g in range(ctx.partitions):
                st = ["active" if a else "inactive" for a in active[g]]
                self.table_rows(n, self.a(n)[ctx.group_ranks(g).start], kind, fam, st, ctx.ring_period(fam))
        self._local_tables(active)
        vdc = self.a("valid_draft_counts")
        if ((vdc < 0) | (vdc > C.DSPARK_QUERY_WIDTH)).any():
            self.fail("valid_draft_counts", "draft_count", int(vdc[(vdc < 0) | (vdc > 7)][0]), "0..7")
        B = self.extents["B"]
        if (ntpo // C.DECODE_SEQ > B).any():
            self.fail("draft_block_tables", "drafter_batch", B, f">= the largest owner's {int(ntpo.max()) // 8} rows")
        self._drafter_tables("draft_block_tables", lambda r, b: int(sid[r, b]) if b < ntpo[r] // 8 else None)
        self.grammar()

    def _drafter_tables(self, n, lease_of):
        bt = self.a(n)
        if ((bt < 0) | (bt >= DRAFTER_BLOCKS)).any():
            self.fail(n, "block_range", int(bt[(bt < 0) | (bt >= DRAFTER_BLOCKS)][0]),
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
                        self.fail(n, "drafter_ring", f"rank {r} layer {layer} row {b}", what)

    def drafter(self):
        ctx = self.ctx
        ns = self.a("num_sampled")
        if ((ns != 0) & (ns != 1)).any():
            self.fail("num_sampled", "drafter_mode", int(ns[(ns != 0) & (ns != 1)][0]), "0 (seed/filler) or 1 (redraft)")
        bt = self.a("block_tables")
        if ((bt < 0) | (bt >= DRAFTER_BLOCKS)).any():
            self.fail("block_tables", "block_range", int(bt[(bt < 0) | (bt >= DRAFTER_BLOCKS)][0]),
                      f"drafter blocks in [0, {DRAFTER_BLOCKS})")
        first = bt[:, 0, :, 0].astype(np.int64)          # layer 0 entry 0 = lease*6 for a lease ring
        leases = np.where(first < C.DRAFTER_FILLER_BLOCK_BASE, first // C.DRAFTER_BLOCKS_PER_LEASE, -1)
        self._drafter_tables("block_tables", lambda r, b: None if leases[r, b] < 0 else int(leases[r, b]))
        for g in range(ctx.partitions):
            rr = ctx.group_ranks(g)
            live = leases[rr.start:rr.stop][leases[rr.start:rr.stop] >= 0]
            if np.unique(live).size != live.size:
                self.fail("block_tables", "lease_unique", f"group {g}: {sorted(live.tolist())}", "distinct leases")
        self.replicated(["context_group_position_ids", "context_group_slot_mapping", "query_group_position_ids",
                         "query_group_slot_mapping"])
        for pos_n, slot_n in (("context_group_position_ids", "context_group_slot_mapping"),
                              ("query_group_position_ids", "query_group_slot_mapping")):
            pos, sl = self.a(pos_n).astype(np.int64), self.a(slot_n)
            self.positions(pos_n, pos, allow_pad=True)
            self.slots(slot_n, None, DRAFTER_SLOTS)
            if ((pos[:, None, :] < 0) & (sl != -1)).any():
                self.fail(slot_n, "padding_publish", "a row with position -1", "-1 slots on padding rows")
            owner = self._drafter_row_owner(pos_n, leases, ns)
            for g in range(ctx.partitions):
                r0 = ctx.group_ranks(g).start
                p, own = pos[r0], owner[g]
                for layer in range(3):
                    got = sl[r0, layer].astype(np.int64)
                    ok = (p >= 0) & (own >= 0)
                    want = np.where(ok, lease_slot(np.where(ok, p, 0), np.maximum(own, 0), layer), -1)
                    if not np.array_equal(got, want):
                        j = int(np.argmax(got != want))
                        self.fail(slot_n, "slot_mapping", f"group {g} layer {layer} row {j}: {got[j]}",
                                  f"{want[j]}: position {p[j]} in the ring of the row's own lease {own[j]}")
        live = ns == 1
        for n in ("last_sampled",):
            self.tokens(n, self.a(n)[live])
        self.tokens("next_prefill_tokens")
        if self.name == "l3_dspark_draft_step_device_state":
            self._markov_rows(live_rows=(leases >= 0).sum(axis=1))
            s = self.a("state_slot_ids")
            if ((s < -1) | (s >= C.DRAFTER_LEASES_PER_GROUP)).any():
                self.fail("state_slot_ids", "lease_range", int(s.max()), "-1 or a lease in [0, 64)")

    def _drafter_row_owner(self, pos_n, leases, ns):
        """Per group, the lease that owns each group context / query row (-1: padding).  Redraft
        rows belong to the member's row `j // 8` (context) or `j // 7` (query); a seed's whole
        context belongs to the leader's row 0."""
        ctx, tp = self.ctx, self.ctx.tp
        width = self.a(pos_n).shape[1] // tp
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

    def _markov_rows(self, live_rows):
        rows = self.a("logit_row_indices")
        for r in range(rows.shape[0]):
            n = C.DSPARK_QUERY_WIDTH * int(live_rows[r])
            want = np.full(rows.shape[1], -1)
            want[:n] = np.arange(n)
            if not np.array_equal(rows[r], want):
                self.fail("logit_row_indices", "logit_rows", f"rank {r}: {rows[r, :8].tolist()}",
                          f"0..{n - 1} (7 per live drafter row) then -1")

    def markov(self):
        ns = self.a("num_sampled")
        if ((ns != 0) & (ns != 1)).any():
            self.fail("num_sampled", "drafter_mode", int(ns[(ns != 0) & (ns != 1)][0]), "0 or 1")
        rows = self.a("logit_row_indices")
        live = (rows >= 0).sum(axis=1) // C.DSPARK_QUERY_WIDTH
        if ((rows >= 0).sum(axis=1) % C.DSPARK_QUERY_WIDTH).any() or (live > self.extents["B"]).any():
            self.fail("logit_row_indices", "logit_rows", rows[:, :8].tolist()[0], "7 rows per live request, <= 7 B")
        self._markov_rows(live)
        self.tokens("last_sampled", self.a("last_sampled")[ns == 1])
        self.tokens("next_prefill_tokens")


_SEMANTICS = {"l3_prefill_fwd": "prefill", "l3_decode_fwd": "decode", "l3_decode_fwd_dspark": "fused",
              "l3_dspark_drafter": "drafter", "l3_dspark_draft_step_device_state": "drafter",
              "l3_distributed_markov_sample": "markov"}


def _is_table(name: str) -> bool:
    return "block_table" in name


def _dtype_ok(actual, abi: str) -> bool:
    dt = np.dtype(actual)
    if dt == np.dtype(NP_DTYPES[abi]):
        return True
    return abi == "bf16" and dt.itemsize == 2 and dt.name == "bfloat16"


def _check_row(v: _Validator, n, row, kind, nb, period, i):
    live = row >= 0
    if kind == "absolute":
        k = int(live.sum())
        if k == 0 or not live[:k].all() or (row[k:] != -1).any():
            v.fail(n, "table_layout", f"row {i}", "block ids at [0, n) and -1 after (absolute table)")
        ids = row[:k]
    elif kind == "trailing":
        ids = row[live]
        if ids.size == 0:
            v.fail(n, "table_layout", f"row {i}", "the trailing pages of the transaction ring")
    else:
        if not live.all():
            v.fail(n, "table_layout", f"row {i}: -1 at {int(np.argmin(live))}", "a full ring (no -1 entries)")
        ids = row
    if (ids >= nb).any():
        v.fail(n, "block_range", f"row {i}: id {int(ids[ids >= nb][0])}",
               f"ids in [0, {nb}) (ids >= num_blocks are reserved for kernel padding)")
    if kind == "ring":
        p = _ring_period(row, period)
        if p is None:
            v.fail(n, "ring_period" if _periodic_beyond(row, period) else "table_layout", f"row {i}",
                   f"entry j = ids[j mod n] with n <= the ring period {period}")
        ids = row[:p]
    if np.unique(ids).size != ids.size:
        v.fail(n, "block_repeat", f"row {i}: {ids[:12].tolist()}", "no block id repeated within one request's row")


def _ring_period(row, limit):
    """The smallest n <= limit with row[j] == row[j mod n] for every j, or None."""
    depth = row.size
    cands = (np.flatnonzero(row[1:min(depth, limit + 1)] == row[0]) + 1).tolist()
    if depth <= limit:
        cands.append(depth)
    for p in cands[:32]:
        if np.array_equal(row[p:], row[:depth - p]):
            return p
    return None


def _periodic_beyond(row, limit):
    cands = np.flatnonzero(row[1:] == row[0]) + 1
    return any(np.array_equal(row[p:], row[:row.size - p]) for p in cands[:8] if p > limit)
