"""The fleet fidelity's executor half: a step command's dispatches priced from arrays, and the
accepted counts of its decode rows drawn for the whole batch (no tokens are generated).

Mixed into `fleet.FleetSim`, whose request arrays it reads: packed prefill splitting
(`split_prefill`'s first fit), seeding waves, the decode rows, tile and owner-rank checks
(`fleet_kernels.decode_rows`), the #1213 hang model (`executor`'s helpers, shared with the exact
executor), and `CostModel.prefill_arrays` / `decode_arrays` / `seed`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from twin.abi import constants as C

from . import fleet_kernels as fk
from .executor import HANG_ERROR, prefill_hangs, seed_rows

if TYPE_CHECKING:
    from .fleet_command import Command


class FleetExecute:
    def execute(self, cmd: Command) -> None:
        cm, idx = self.cost, cmd.idx
        n = len(idx)
        cmd.counts = np.zeros(n, dtype=np.int64)
        pre = cmd.prefill
        any_pre = cmd.n_prefill > 0
        dec, d_idx, part, owner, com, fits, per, err = fk.decode_rows(
            idx, pre, cmd.start, cmd.num_new, self.part, self.lease, self.committed, self._decode_limits)
        if cmd.error is None and err[0]:
            g = int(err[1])
            cmd.error = (f"TP group {g} decode batch exceeds local capacity {C.DECODE_BATCH} (got {int(err[2])})"
                         if err[0] == 1 else f"TP group {g} owner rank over {C.LOCAL_REQUESTS} requests")
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
                if prefill_hangs(self.hang_p, self._fault_rng):
                    cmd.error = HANG_ERROR
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
            counts = self._accept(m, fits, self.rng) if self.k else np.ones(m, dtype=np.int64)
            secs, parts = cm.decode_arrays(com + 1, part, owner)
            if any_pre:
                cmd.counts[dec] = counts
            else:
                cmd.counts = counts
            self.committed[d_idx] = com + counts
            cmd.accepted = (counts, fits)
            cmd.dispatches.append(("decode", secs, parts, {"requests_per_group": per.tolist()}))
        self.generated += int(cmd.counts.sum())

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
        """One seeding wave per ordinal within a group (a group's n-th terminal prefill joins wave
        n), priced by its longest prompt (`executor.seed_rows`)."""
        longest: dict[int, int] = {}
        seen: dict[int, int] = {}
        for p, pl in zip(self.part[term_idx].tolist(), self.plen[term_idx].tolist()):
            w = seen.get(p, 0)
            seen[p] = w + 1
            longest[w] = max(longest.get(w, 0), pl)
        for w in range(len(longest)):
            rows = seed_rows(longest[w])
            got = self._seed_cost.get(rows)
            if got is None:
                got = self._seed_cost[rows] = self.cost.seed(rows)
            cmd.dispatches.append(("seed", got[0], got[1], {}))
