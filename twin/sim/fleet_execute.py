"""The fleet fidelity's executor half: a step command's dispatches priced from arrays, and the
accepted counts of its decode rows drawn for the whole batch (no tokens are generated).

Mixed into `fleet.FleetSim`, whose request arrays it reads: packed prefill splitting
(`split_prefill`'s first fit), seeding waves, the decode rows, tile and owner-rank checks
(`fleet_kernels.decode_rows`), the #1213 hang model (`executor`'s helpers, shared with the exact
executor), and `CostModel.prefill_arrays` / `decode_arrays` / `seed`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from . import fleet_kernels as fk
from .executor import HANG_ERROR, prefill_hangs, seed_rows
from .worker import decode_tile_error, owner_rank_error, prefill_chunk_error, split_prefill

if TYPE_CHECKING:
    from .fleet_command import Command

NO_ROWS = np.zeros(0, dtype=np.int64)


class _Chunk(NamedTuple):
    """A prefill row as `split_prefill` reads an item (request_id: the row's position in the step)."""
    request_id: int
    partition: int
    num_tokens: int


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
            cmd.error = decode_tile_error(g, got) if err == 1 else owner_rank_error(g)
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
        """`split_prefill`: one dispatch when everything fits (the kernel's check), else its greedy
        first fit in order.  Each dispatch as (rows, TP groups, chunk tokens, meta)."""
        rows, part, tok = info
        _, max_batch, per_part_cap, tok_cap = self._prefill_limits.tolist()
        fits, big, big_row = chk.tolist()
        if big > tok_cap:
            cmd.error = prefill_chunk_error(self.rid[int(cmd.idx[big_row])], big, tok_cap)
            return []
        if fits:
            return [(rows, part, tok, {"requests_per_group": per_g[0].tolist(), "tokens_per_group": per_g[1].tolist()})]
        # request_id: the row's position here (what a dispatch needs back)
        chunks = [_Chunk(j, p, t) for j, (p, t) in enumerate(zip(part.tolist(), tok.tolist()))]
        out = []
        for batch in split_prefill(chunks, max_batch, per_part_cap, tok_cap):
            cur = [c.request_id for c in batch.items]
            b_part = part[cur]
            out.append((rows[cur], b_part, tok[cur], {
                "requests_per_group": np.bincount(b_part, minlength=self.G).tolist(),
                "tokens_per_group": np.bincount(b_part, weights=tok[cur], minlength=self.G).astype(int).tolist()}))
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
