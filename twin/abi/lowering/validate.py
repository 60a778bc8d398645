"""`validate(dispatch, ctx)`: a dispatch against the ABI, before a device sees it.

Order: the program is known; no unknown argument; every host-staged input ("input" role) present;
the dynamic extents (P, L, Q, B, T_MAIN) read from the arrays are legal; every present argument
has its bound shape and dtype; then the program's content rules.  Weights, cache pools, scratch
and outputs are not built by lowering: when present they are checked for shape and dtype only.
The first broken rule raises `DispatchError(program, arg, rule)`; `RULES` lists the rule ids.
The content rules live in `target_rules` (prefill, split and fused decode) and `drafter_rules`.
"""
from __future__ import annotations

import numpy as np

from .. import constants as C
from ..batches import Dispatch
from ..programs import INPUT, PROGRAMS
from .context import NP_DTYPES, DispatchError, LoweringContext
from . import drafter_rules, target_rules
from .grammar import HEADER_WORD, MASKED, PLAIN, padding_ok

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



def validate(dispatch: Dispatch, ctx: LoweringContext) -> dict:
    """Raise `DispatchError` at the first broken rule; return the extents on success."""
    prog = PROGRAMS.get(dispatch.program)
    if prog is None:
        raise DispatchError(str(dispatch.program), "program", "program", dispatch.program, f"one of {list(PROGRAMS)}")
    v = _Validator(prog, dispatch.args, ctx)
    v.structure()
    SEMANTICS[prog.name](v)
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
        nb = self.ctx.num_blocks[family]
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



# the content rules of each program, after the structural checks
SEMANTICS = {"l3_prefill_fwd": target_rules.prefill, "l3_decode_fwd": target_rules.decode,
             "l3_decode_fwd_dspark": target_rules.fused, "l3_dspark_drafter": drafter_rules.drafter,
             "l3_dspark_draft_step_device_state": drafter_rules.drafter,
             "l3_distributed_markov_sample": drafter_rules.markov}


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
