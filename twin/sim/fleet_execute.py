"""The fleet fidelity's executor half: a step command's dispatches priced from arrays, and the
accepted counts of its decode rows drawn for the whole batch (no tokens are generated).

Mixed into `fleet.FleetSim`, whose request arrays it reads: packed prefill splitting
(`split_prefill`'s first fit), seeding waves, the decode tile and owner-rank checks, the #1213
hang model, and `CostModel.prefill_arrays` / `decode_arrays` / `seed`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from twin.abi import constants as C
from twin.abi.lowering.drafter import BOOTSTRAP, context_bucket

if TYPE_CHECKING:
    from .fleet_command import Command


class FleetExecute:
    def execute(self, cmd: Command) -> None:
        cm, idx = self.cost, cmd.idx
        n = len(idx)
        cmd.counts = np.zeros(n, dtype=np.int64)
        pre = cmd.prefill
        any_pre = cmd.n_prefill > 0
        dec = (~pre).nonzero()[0] if any_pre else None
        d_idx = idx[dec] if any_pre else idx
        part = self.part[d_idx]
        per = np.bincount(part, minlength=self.G)
        lease = self.lease.take(d_idx) if self.k else None
        owner = lease % C.TP_SIZE if self.k else None
        if cmd.error is None and len(d_idx):
            cmd.error = self._tile_error(per, part, owner, lease >= 0 if self.k else None)
        if cmd.error:
            cmd.dispatches.append(("error", cm.device.dispatch_overhead, {}, {"error": cmd.error}))
            return
        if any_pre:
            rows = pre.nonzero()[0]
            for batch in self._pack(rows, cmd):
                p_part = self.part[idx[batch]]
                secs, parts = cm.prefill_arrays(cmd.num_new[batch], cmd.start[batch].astype(float), p_part)
                meta = {"requests_per_group": np.bincount(p_part, minlength=self.G).tolist(),
                        "tokens_per_group": np.bincount(p_part, weights=cmd.num_new[batch], minlength=self.G).astype(int).tolist()}
                if self.hang_p and self._fault_rng.random() < self.hang_p:
                    cmd.error = "TENSOR_WAIT_TIMEOUT: l3_prefill_fwd hang at EP16 (pypto-lib#1213 fault model)"
                    cmd.dispatches.append(("prefill", self.cfg.step_timeout, {"timeout": self.cfg.step_timeout},
                                           {**meta, "hang": True}))
                    return
                cmd.dispatches.append(("prefill", secs, parts, meta))
            term = rows[cmd.samples[rows]]
            self.committed[idx[term]] = self.plen[idx[term]]
            cmd.counts[term] = 1
            if self.k and len(term):
                self._seed_waves(idx[term], cmd)
        m = len(d_idx)
        if m:
            com = self.committed[d_idx]
            k = self.k
            if k:
                # drafts fit when the anchor (the chunk's last position) + K and the committed
                # context + the verify rows stay inside max_seq
                end = (cmd.start + cmd.num_new) if dec is None else (cmd.start.take(dec) + cmd.num_new.take(dec))
                fits = (end < self.max_seq - k + 1) & (com <= self.max_seq - C.DECODE_SEQ)
                counts = self._accept(m, fits, self.rng)
            else:
                owner = np.zeros(m, dtype=np.int64)           # K=0: ordinal % TP within the group
                for g in range(self.G):
                    sel = part == g
                    owner[sel] = np.arange(int(sel.sum())) % C.TP_SIZE
                fits = np.zeros(m, dtype=bool)
                counts = np.ones(m, dtype=np.int64)
            secs, parts = cm.decode_arrays(com + 1, part, owner)
            if dec is None:
                cmd.counts = counts
            else:
                cmd.counts[dec] = counts
            self.committed[d_idx] = com + counts
            cmd.accepted = (counts, fits)
            cmd.dispatches.append(("decode", secs, parts, {"requests_per_group": per.tolist()}))
        self.generated += int(cmd.counts.sum())

    def _tile_error(self, per, part, owner, leased) -> str | None:
        if per.max() > C.DECODE_BATCH:
            g = int(np.argmax(per > C.DECODE_BATCH))
            return f"TP group {g} decode batch exceeds local capacity {C.DECODE_BATCH} (got {per[g]})"
        if owner is not None:
            own = np.bincount((part * C.TP_SIZE + owner)[leased], minlength=self.G * C.TP_SIZE)
            if own.max() > C.LOCAL_REQUESTS:
                g = int(np.argmax(own.reshape(self.G, C.TP_SIZE).max(axis=1) > C.LOCAL_REQUESTS))
                return f"TP group {g} owner rank over {C.LOCAL_REQUESTS} requests"
        return None

    def _pack(self, rows: np.ndarray, cmd: Command) -> list[np.ndarray]:
        """`split_prefill`: one dispatch when everything fits, else greedy first-fit in order."""
        dep = self.dep
        part = self.part[cmd.idx[rows]]
        tok = cmd.num_new[rows]
        per_part_cap, max_batch, tok_cap = dep.prefill_requests_per_partition, dep.prefill_batch, C.PREFILL_TOKENS_PER_GROUP
        if tok.max() > tok_cap:
            cmd.error = (f"prefill chunk of {self.rid[int(cmd.idx[rows[int(np.argmax(tok))]])]!r} has {int(tok.max())} "
                         f"tokens > {tok_cap} per partition")
            return []
        if (len(rows) <= max_batch and np.bincount(part, minlength=self.G).max() <= per_part_cap
                and np.bincount(part, weights=tok, minlength=self.G).max() <= tok_cap):
            return [rows]
        out, pending = [], list(range(len(rows)))
        while pending:
            cur, deferred, reqs, toks = [], [], {}, {}
            for j in pending:
                p, t = int(part[j]), int(tok[j])
                if len(cur) < max_batch and reqs.get(p, 0) < per_part_cap and toks.get(p, 0) + t <= tok_cap:
                    cur.append(j)
                    reqs[p] = reqs.get(p, 0) + 1
                    toks[p] = toks.get(p, 0) + t
                else:
                    deferred.append(j)
            out.append(rows[cur])
            pending = deferred
        return out

    def _seed_waves(self, term_idx: np.ndarray, cmd: Command) -> None:
        tails = np.minimum(C.SLIDING_WINDOW, self.plen[term_idx])
        part = self.part[term_idx]
        waves: dict[int, int] = {}
        seen: dict[int, int] = {}
        for p, t in zip(part.tolist(), tails.tolist()):
            w = seen.get(p, 0)
            seen[p] = w + 1
            waves[w] = max(waves.get(w, 0), t)
        for w in range(len(waves)):
            band = -(-waves[w] // C.TP_SIZE)
            rows = context_bucket(BOOTSTRAP, band)
            got = self._seed_cost.get(rows)
            if got is None:
                got = self._seed_cost[rows] = self.cost.seed(rows)
            cmd.dispatches.append(("seed", got[0], got[1], {}))

