"""The fleet fidelity's scheduler half: one pass over the running set (phase 1: budget, chunked
prefill, table growth with preemption where a partition runs out) and the waiting queue (phase 2:
prefix lookup, partition choice, head-of-line blocking), then the step command.

Mixed into `fleet.FleetSim`, whose request arrays and page pools it reads and writes.
"""
from __future__ import annotations

import numpy as np

from . import fleet_kernels as fk
from .fleet_command import NEVER, RUNNING, Command
from .leases import LeasesExhausted


class FleetSchedule:
    # ---- schedule ----------------------------------------------------------------------------------
    def schedule(self) -> Command | None:
        self._pass += 1
        if self.leases:
            for i in self._pending_ids:
                self.leases.release(i)
        finished_ids, self._pending_ids = self._pending_ids, []
        budget = self.budget
        ints, flags, n, used, n_pre = self._phase1(budget)
        k, toks = self._phase2(budget - used, ints, flags, n)
        if n + k == 0:
            self._pending_ids[:0] = finished_ids
            return None
        n += k
        n_pre += k
        used += toks                                    # new rows: no drafts
        idx, num_new, spec, start = ints[:4, :n]
        pre, samples = flags[:2, :n]
        self._step += 1
        cmd = Command(self._step, idx, num_new, spec, start, pre, samples, self.ver.take(idx))
        cmd.n_prefill = n_pre
        cmd.tokens = used
        if n_pre and self.leases is not None:
            lease = self.lease
            for i in idx[pre].tolist():
                if lease[i] < 0:
                    try:
                        lease[i], self.gen[i] = self.leases.reserve(i, int(self.part[i]))
                    except LeasesExhausted as e:
                        cmd.error = cmd.error or str(e)
        return cmd

    def _phase1(self, budget: int):
        """The running requests' rows, already advanced as scheduled: ints rows (request, num_new,
        spec, start, -) and flags rows (prefill, samples, -), with room after the `n` kept rows
        for phase 2's admissions; the budget they use and how many are prefill chunks
        (`fleet_kernels.phase1`: budget walk, growth, overflow search; the victims it chooses are
        preempted here, in its order, before `commit_rows` writes the growth)."""
        run = self.running
        room = self.max_running - len(run)
        if not len(run):
            return np.empty((5, room), dtype=np.int64), np.empty((3, room), dtype=bool), 0, 0, 0
        kv = self.kv
        state = self._state
        self._limits[4] = room
        ints, flags, growth, victims, st = fk.phase1(run, state, self.n_out, self.slot, self.part, self.rank, self.kv4,
                                                     kv.free, kv.takes, kv.fam, self._limits)
        if st[0] < 0:
            for v, r in victims.tolist():
                self._preempt(v, r)
            st = fk.commit_rows(ints, flags, growth, self.slot, self.part, self.kv4, kv.free, kv.takes, state, self.k)
        n, used, n_pre, det, rot, n_due = st.tolist()
        if det:
            self._pinned_any = True
        kv.stats["detaches"] += det
        kv.stats["rotations"] += rot
        if n_due:
            # the pools as they stand after this step's growth (read at most once); a due row's end
            # (chunk + drafts) is its request's computed count, as `commit_rows` just left it
            ids = ints[0].take(ints[4, :n_due])
            drops, nd, ends = self.drops, self.next_drop, None
            for i, t, p in zip(ids.tolist(), self.computed.take(ids).tolist(), self.part.take(ids).tolist()):
                d = drops[i]
                ends = kv.drop_tails(d, t, p, ends)
                nd[i] = d[0][0] if d else NEVER
        return ints, flags, n, used, n_pre

    def _phase2(self, budget: int, ints: np.ndarray, flags: np.ndarray, n: int) -> tuple[int, int]:
        """Admissions from the waiting queue, their rows written after the `n` running ones in
        `ints` / `flags`; returns how many were admitted and the tokens they use."""
        new = []
        kv = self.kv
        room = self.max_running - len(self.running)
        budget0 = budget
        waiting, in_pass, this_pass, plen = self.waiting, self.in_pass, self._pass, self._plen
        prefix, hashes, offset = self.prefix, self.hashes, self.max_hit_offset
        status, cached, pub, pins, computed, ph, tpif = (self.status, self.cached, self.pub, self.pins, self.computed,
                                                        self.ph, self.tpif)
        k, A, admitted, now = self.k, kv.align, self.rec.admitted, self.now
        while waiting and budget > 0 and len(new) < room:
            i = waiting[0]
            if in_pass[i] == this_pass:
                break
            pl = plen[i]
            hit, fallback = 0, False
            if prefix:
                hit, p = kv.lookup(hashes[i], pl - offset)
            if hit:
                L, S, own = kv.attach(hashes[i], hit, p, self.entries[i], self.drops[i])
                self.next_drop[i] = self.drops[i][0][0] if self.drops[i] else NEVER
                s = self._take_slot(i, p)
                self.L[s], self.S[s], self.own[s] = L, S, own
                self.part[i] = p
                kv.load[p] += 1
                nn = self._first_chunk(i, hit, budget)
                if not self._grow_one(i, hit + nn):
                    self._release_kv(i)
                    hit, fallback = 0, True
            if not hit:
                nn = min(pl, budget, self.max_seq, self.chunk)          # `_first_chunk(i, 0, budget)` inline
                need, row = kv.first_rows(nn)
                if fk.place(i, self._next_free_slot(), need, row, kv.free, kv.takes, kv.load, kv.next_partition,
                            self.kv4, self.occ, self.spart, self.slot, self.part) < 0:
                    break
                self._free_slots.pop()
            waiting.popleft()
            status[i] = RUNNING
            cached[i] = hit
            pub[i] = hit // A
            admitted(i, hit, fallback, now)
            # advance_after_schedule (as `fleet_kernels.commit_rows` for the running rows)
            smp = hit + nn >= pl
            pins[i] += 1
            computed[i] = hit + nn
            ph[i] += smp
            if smp and k:
                tpif[i] = True
            c = n + len(new)
            ints[0, c], ints[1, c], ints[2, c], ints[3, c] = i, nn, 0, hit
            flags[0, c], flags[1, c] = True, smp
            new.append(i)
            budget -= nn
        if new:
            self.running = np.concatenate([self.running, np.array(new, dtype=np.int64)])
        return len(new), budget0 - budget

    def _first_chunk(self, i: int, computed: int, budget: int) -> int:
        return min(self._plen[i] - computed, budget, self.max_seq - computed, self.chunk)

    def _grow_one(self, i: int, tokens: int) -> bool:
        """Grow request `i`'s tables to `tokens` if its partition holds the pages (a prefix hit's
        first chunk)."""
        kv = self.kv
        s = int(self.slot[i])
        growth = fk.grow_rows(np.array([tokens]), self.L[s:s + 1], self.S[s:s + 1], self.pins[i:i + 1] > 0, kv.fam)
        if (growth[0, 0] > kv.free[self.part[i]]).any():
            return False
        det, rot = fk.commit(np.array([i]), np.ones(1, dtype=bool), self.slot, self.part, self.kv4, kv.free, kv.takes,
                             growth)
        self._pinned_any = self._pinned_any or det > 0
        kv.stats["detaches"] += det
        kv.stats["rotations"] += rot
        return True
