"""A small serving loop that turns requests into the four kinds of dispatch (packed prefill, K=0
decode, the fused K=7 verify+redraft step, drafter seeding) with paged addressing done as the host
lowering does it: block tables, slot mappings (-1 = skip), ring slots for compressor state,
compressed-boundary slots, sliding-window and compressed-row indices, drafter lease tables.

The loop is driven by the device's outputs (sampled ids, accepted counts, drafts, target hidden),
as the real scheduler is; fed the same outputs it makes the same dispatches, which is what lets
a killed lockstep run resume from its records.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from twin.abi.batches import Dispatch
from twin.abi.errors import AbiError
from twin.abi.presets import CSA, HCA

from .spec import (CMP_PAGE_TOKENS, CSA_STATE_PAGE, CSA_STATE_PAGES, DRAFTS, HCA_STATE_PAGE, HCA_STATE_PAGES,
                   LEASE_BLOCKS, PROGRAM_DECODE, PROGRAM_FUSED, PROGRAM_PREFILL, PROGRAM_SEED, ROWS_PER_VERIFY,
                   Geometry)

BLOCK = 32


@dataclass
class Request:
    rid: str
    prompt: np.ndarray
    k: int                        # 0 or 7
    max_new: int
    slot: int = -1
    computed: int = 0             # prompt positions already prefilled
    last: int = -1                # committed token at `anchor`
    anchor: int = -1
    drafts: np.ndarray | None = None
    generated: int = 0
    hidden: list = field(default_factory=list)      # prompt target-hidden rows (for seeding)
    phase: str = "waiting"        # waiting, prefill, seed, decode, done


def initial_pools(geo: Geometry, seed: int = 0) -> dict:
    """Pools start with bf16 garbage, as device memory does: unmapped rows must stay bit-identical."""
    import ml_dtypes

    rng = np.random.default_rng(seed + 7)
    return {k: rng.standard_normal(s).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
            for k, s in geo.pools.items()}


class Workload:
    def __init__(self, geo: Geometry, *, n_requests: int = 6, seed: int = 0, chunk: int = 64,
                 prompt_lens=(80, 40, 100, 30, 60, 50), max_new: int = 48):
        if n_requests < 1:
            raise AbiError("n_requests", n_requests, ">= 1", where="hw.model.workload")
        self.geo, self.cfg, self.chunk = geo, geo.cfg, chunk
        rng = np.random.default_rng(seed)
        V = self.cfg.vocab_size
        self.requests = [Request(f"r{i}", rng.integers(2, V - 1, prompt_lens[i % len(prompt_lens)]),
                                 k=0 if i % 4 == 3 else 7, max_new=max_new) for i in range(n_requests)]
        self.free_slots = list(range(geo.slots))
        self.queue: list[Dispatch] = []
        self.index = 0

    # ---- addressing (host lowering) --------------------------------------------------------------
    def ori_slot(self, r, pos):
        return (r.slot * self.geo.ori_pages + pos // BLOCK) * BLOCK + pos % BLOCK

    def state_table(self, r, ratio):
        n = CSA_STATE_PAGES if ratio == CSA else HCA_STATE_PAGES
        return r.slot * n + np.arange(n, dtype=np.int32)

    def state_slot(self, r, ratio, pos):
        page, n = (CSA_STATE_PAGE, CSA_STATE_PAGES) if ratio == CSA else (HCA_STATE_PAGE, HCA_STATE_PAGES)
        return self.state_table(r, ratio)[(pos // page) % n] * page + pos % page

    def cmp_slot(self, r, ratio, c):
        per_page = CMP_PAGE_TOKENS // ratio
        return (r.slot * self.geo.cmp_pages + c // per_page) * per_page + c % per_page

    def lease_table(self, r):
        return r.slot * LEASE_BLOCKS + np.arange(LEASE_BLOCKS, dtype=np.int32)

    def target_args(self, rows: list[tuple[Request, int, int]], logit_rows) -> dict:
        """rows: (request, position, token) in packed order."""
        m, W = self.cfg, self.cfg.sliding_window
        reqs = []
        for r, _, _ in rows:
            if r not in reqs:
                reqs.append(r)
        qi = {id(r): i for i, r in enumerate(reqs)}
        pos = np.array([p for _, p, _ in rows], np.int32)
        a = {
            "input_ids": np.array([tok for _, _, tok in rows], np.int64),
            "position_ids": pos,
            "row_req": np.array([qi[id(r)] for r, _, _ in rows], np.int32),
            "swa_slot_mapping": np.array([self.ori_slot(r, p) for r, p, _ in rows], np.int64),
            "logit_row_indices": np.asarray(logit_rows, np.int32),
        }
        a["swa_indices"] = np.array([[self.ori_slot(r, q) if q >= 0 else -1 for q in range(p - W + 1, p + 1)]
                                     for r, p, _ in rows], np.int32).reshape(len(rows), W)
        ncmp = {CSA: m.index_topk, HCA: self.geo.cmp_pages}
        last = {}
        for r, p, _ in rows:
            last[id(r)] = max(last.get(id(r), -1), p)
        for ratio, fam in ((CSA, "csa"), (HCA, "hca")):
            ring = CSA_STATE_PAGES * CSA_STATE_PAGE if ratio == CSA else HCA_STATE_PAGES * HCA_STATE_PAGE
            # only the tail a ring can hold is persisted: earlier rows would alias later ones (-1 = skip)
            a[f"{fam}_state_slot_mapping"] = np.array([self.state_slot(r, ratio, p) if p > last[id(r)] - ring else -1
                                                       for r, p, _ in rows], np.int64)
            a[f"{fam}_state_block_table"] = np.stack([self.state_table(r, ratio) for r in reqs])
            a[f"{fam}_cmp_slot_mapping"] = np.array([self.cmp_slot(r, ratio, p // ratio) if (p + 1) % ratio == 0
                                                     else -1 for r, p, _ in rows], np.int64)
            ind = np.full((len(rows), ncmp[ratio]), -1, np.int32)
            for i, (r, p, _) in enumerate(rows):
                vis = np.arange((p + 1) // ratio)[-ncmp[ratio]:]
                ind[i, : len(vis)] = [self.cmp_slot(r, ratio, c) for c in vis]
            a[f"{fam}_cmp_indices"] = ind
        return a

    # ---- scheduling ------------------------------------------------------------------------------
    def _admit(self):
        for r in self.requests:
            if r.phase == "waiting" and self.free_slots:
                r.slot = self.free_slots.pop(0)
                r.phase = "prefill"

    def _plan(self):
        self._admit()
        pre = [r for r in self.requests if r.phase == "prefill"]
        if pre:
            rows, logit_rows, items = [], [], []
            for r in pre:
                n = min(self.chunk, len(r.prompt) - r.computed)
                for i in range(n):
                    p = r.computed + i
                    rows.append((r, p, int(r.prompt[p])))
                if r.computed + n == len(r.prompt):
                    logit_rows.append(len(rows) - 1)
                items.append((r.rid, r.computed, n))
            self.queue.append(self._make(PROGRAM_PREFILL, self.target_args(rows, logit_rows),
                                         {"items": items}))
        seed = [r for r in self.requests if r.phase == "seed"]
        if seed:
            hid, cpos, creq = [], [], []
            for q, r in enumerate(seed):
                P = len(r.prompt)
                lo = max(0, P - self.cfg.sliding_window)
                hid.append(np.concatenate(r.hidden)[lo:P])
                cpos.append(np.arange(lo, P))
                creq.append(np.full(P - lo, q))
            a = {"target_hidden": np.concatenate(hid).astype(np.float32),
                 "ctx_positions": np.concatenate(cpos).astype(np.int32),
                 "ctx_req": np.concatenate(creq).astype(np.int32),
                 "lease_block_table": np.stack([self.lease_table(r) for r in seed]),
                 "anchor": np.array([r.anchor for r in seed], np.int32),
                 "last_token": np.array([r.last for r in seed], np.int64)}
            self.queue.append(self._make(PROGRAM_SEED, a, {"items": [r.rid for r in seed]}))
        spec = [r for r in self.requests if r.phase == "decode" and r.k]
        if spec:
            rows = [(r, r.anchor + i, int(tok)) for r in spec
                    for i, tok in enumerate(np.r_[r.last, r.drafts])]
            a = self.target_args(rows, np.arange(len(rows)))
            a["lease_block_table"] = np.stack([self.lease_table(r) for r in spec])
            self.queue.append(self._make(PROGRAM_FUSED, a, {"items": [r.rid for r in spec]}))
        plain = [r for r in self.requests if r.phase == "decode" and not r.k]
        if plain:
            rows = [(r, r.anchor, r.last) for r in plain]
            self.queue.append(self._make(PROGRAM_DECODE, self.target_args(rows, np.arange(len(rows))),
                                         {"items": [r.rid for r in plain]}))

    def _make(self, program, args, meta) -> Dispatch:
        d = Dispatch(program, args, {**meta, "index": self.index})
        self.index += 1
        return d

    def next_dispatch(self) -> Dispatch | None:
        if not self.queue:
            self._plan()
        return self.queue.pop(0) if self.queue else None

    def observe(self, d: Dispatch, outputs: dict) -> None:
        """Advance request state from a dispatch's (device) outputs."""
        by_id = {r.rid: r for r in self.requests}
        if d.program == PROGRAM_PREFILL:
            start = 0
            j = 0
            for rid, computed, n in d.meta["items"]:
                r = by_id[rid]
                r.hidden.append(np.asarray(outputs["dspark_target_hidden"][start: start + n]))
                r.computed = computed + n
                start += n
                if r.computed == len(r.prompt):
                    r.last = int(outputs["sampled_ids"][j])
                    j += 1
                    r.anchor = len(r.prompt)
                    r.generated = 1
                    r.phase = "seed" if r.k else "decode"
        elif d.program == PROGRAM_SEED:
            for q, rid in enumerate(d.meta["items"]):
                r = by_id[rid]
                r.drafts = np.asarray(outputs["draft_tokens"][q])
                r.hidden = []
                r.phase = "decode"
                self._maybe_finish(r)
        elif d.program == PROGRAM_FUSED:
            s = np.asarray(outputs["sampled_ids"]).reshape(-1, ROWS_PER_VERIFY)
            for q, rid in enumerate(d.meta["items"]):
                r = by_id[rid]
                acc = int(outputs["accepted_counts"][q])
                r.last = int(s[q, acc - 1])
                r.anchor += acc
                r.generated += acc
                r.drafts = np.asarray(outputs["draft_tokens"][q])
                self._maybe_finish(r)
        elif d.program == PROGRAM_DECODE:
            for q, rid in enumerate(d.meta["items"]):
                r = by_id[rid]
                r.last = int(outputs["sampled_ids"][q])
                r.anchor += 1
                r.generated += 1
                self._maybe_finish(r)

    def _maybe_finish(self, r: Request):
        if r.generated >= r.max_new or r.anchor + ROWS_PER_VERIFY + DRAFTS >= self.geo.max_len:
            r.phase = "done"
            self.free_slots.append(r.slot)
