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

NO_ROWS = np.zeros(0, dtype=np.int64)


class FleetExecute:
    def execute(self, cmd: Command) -> None:
        cm, idx = self.cost, cmd.idx
        n = len(idx)
        cmd.counts = np.zeros(n, dtype=np.int64)
        pre = cmd.prefill
        any_pre = cmd.n_prefill > 0
        rows, fits, per = fk.decode_rows(idx, pre, cmd.start, cmd.num_new, self.part, self.lease, self.committed,
                                         self._decode_limits)
        dec, d_idx, part, owner, com = rows
        G = self.G
        if cmd.error is None and per[G]:
            err, g, got = per[G:].tolist()
            cmd.error = (f"TP group {g} decode batch exceeds local capacity {C.DECODE_BATCH} (got {got})"
                         if err == 1 else f"TP group {g} owner rank over {C.LOCAL_REQUESTS} requests")
        if cmd.error:
            cmd.dispatches.append(("error", cm.device.dispatch_overhead, {}, {"error": cmd.error}))
            return
        if any_pre:
            info, term, per_g, waves, chk = fk.prefill_rows(idx, pre, cmd.samples, cmd.num_new, self.part, self.plen,
                                                            self._prefill_limits)
            for rows, p_part, tok, meta in self._pack(info, per_g, chk, cmd):
                secs, parts = cm.prefill_arrays(tok, cmd.start[rows].astype(float), p_part)
                if prefill_hangs(self.hang_p, self._fault_rng):
                    cmd.error = HANG_ERROR
                    cmd.dispatches.append(("prefill", self.cfg.step_timeout, {"timeout": self.cfg.step_timeout},
                                           {**meta, "hang": True}))
                    return
                cmd.dispatches.append(("prefill", secs, parts, meta))
            if self.k and len(term):
                self._seed_waves(waves.tolist(), cmd)
        else:
            term = NO_ROWS
        m = len(d_idx)
        counts = NO_ROWS
        if m:
            counts = self._accept(m, fits, self.rng) if self.k else np.ones(m, dtype=np.int64)
            secs, parts = cm.decode_arrays(com + 1, part, owner)
            cmd.accepted = (counts, fits)
            cmd.dispatches.append(("decode", secs, parts, {"requests_per_group": per[:G].tolist()}))
        self.generated += int(fk.settle(idx, cmd.counts, term, dec, counts, self.committed, self.plen, com))

    def _pack(self, info: np.ndarray, per_g: np.ndarray, chk: np.ndarray, cmd: Command) -> list[tuple]:
        """`split_prefill`: one dispatch when everything fits, else greedy first-fit in order.  Each
        dispatch as (rows, TP groups, chunk tokens, meta)."""
        dep = self.dep
        rows, part, tok = info
        per_part_cap, max_batch, tok_cap = dep.prefill_requests_per_partition, dep.prefill_batch, C.PREFILL_TOKENS_PER_GROUP
        fits, big, big_row = chk.tolist()
        if big > tok_cap:
            cmd.error = f"prefill chunk of {self.rid[int(cmd.idx[big_row])]!r} has {big} tokens > {tok_cap} per partition"
            return []
        if fits:
            return [(rows, part, tok, {"requests_per_group": per_g[0].tolist(), "tokens_per_group": per_g[1].tolist()})]
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
            b_part = part[cur]
            out.append((rows[cur], b_part, tok[cur], {
                "requests_per_group": np.bincount(b_part, minlength=self.G).tolist(),
                "tokens_per_group": np.bincount(b_part, weights=tok[cur], minlength=self.G).astype(int).tolist()}))
            pending = deferred
        return out

    def _seed_waves(self, longest: list[int], cmd: Command) -> None:
        """One seeding wave per ordinal within a group (a group's n-th terminal prefill joins wave
        n), priced by its longest prompt (`executor.seed_rows`)."""
        for pl in longest:
            rows = seed_rows(pl)
            got = self._seed_cost.get(rows)
            if got is None:
                got = self._seed_cost[rows] = self.cost.seed(rows)
            cmd.dispatches.append(("seed", got[0], got[1], {}))
