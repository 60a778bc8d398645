"""The fleet fidelity's results half: a step's result applied (`update_from_output`: stale rows
discarded, prompt blocks published, pins released, token accounting, EOS / length / stop
finishes) and requests leaving the running set (finish, preemption, worker errors, stalls), their
pages and prefix-cache references returned.

Mixed into `fleet.FleetSim`, whose request arrays and page pools it reads and writes.
"""
from __future__ import annotations

import numpy as np

from . import fleet_kernels as fk
from .fleet_command import ERROR, NEVER, REJECTED, STOP, WAITING, Command


class FleetApply:
    # ---- releasing ---------------------------------------------------------------------------------
    def _release_kv(self, i: int) -> None:
        p = int(self.part[i])
        if p < 0:
            return
        self._release_refs(i, p)
        self._free_slots.extend(fk.release_pages(np.array([i]), self.part, self.slot, self.pins, self.kv4, self.kv.free,
                                                 self.kv.load).tolist())

    def _release_refs(self, i: int, p: int) -> None:
        """Request `i`'s prefix-cache references in partition `p` (entries and held rolling tails)."""
        kv = self.kv
        if self.entries[i]:
            kv.release_entries(self.entries[i], p)
        if self.drops[i]:
            kv.drop_tails(self.drops[i], NEVER + 1, p)
            self.next_drop[i] = NEVER

    def _remove_running(self, i: int) -> None:
        self.running = self.running[self.running != i]

    def _preempt(self, v: int, by: int) -> None:
        self.rec.preempted(v, by, int(self.n_out[v]), int(self.part[v]), self.now)
        self._release_kv(v)
        self._remove_running(v)
        self.preempts[v] += 1
        if self.max_preemptions is not None and self.preempts[v] >= self.max_preemptions:
            # _finish hands its lease back (once: it queues v for release itself)
            return self._finish(v, ERROR, f"preempted {self.preempts[v]} times: preemption livelock")
        self._pending_ids.append(v)
        self.computed[v] = self.ph[v] = 0
        self.tpif[v] = False
        self.lease[v] = self.gen[v] = -1
        self.inc[v] += 1
        self.ver[v] += 1
        self.status[v] = WAITING
        self.in_pass[v] = self._pass
        self.waiting.appendleft(v)

    def _finish(self, i: int, code: int, detail: str = "") -> None:
        if detail:
            self.detail[i] = detail
        if self.status[i] == WAITING and i in self.waiting:
            self.waiting.remove(i)
        self._end(np.array([i]), np.array([code]))

    def _end(self, ids: np.ndarray, codes: np.ndarray) -> None:
        """Requests that finish (running or not) with these finish codes: every prefix reference
        goes back before any page does (as one at a time would see the pools), then the rest in
        `fleet_kernels.end_rows`."""
        ids_l = ids.tolist()
        part = self.part
        for i in ids_l:
            p = int(part[i])
            if p >= 0:
                self._release_refs(i, p)
        freed, self.running = fk.end_rows(ids, codes, self.now, self.status, self.ver, self.finish, self.ph, self.tpif,
                                          self.end, part, self.slot, self.pins, self.kv4, self.kv.free, self.kv.load,
                                          self.running, self._mark)
        self._free_slots.extend(freed.tolist())
        self._pending_ids.extend(ids_l)
        self.finished += len(ids_l)

    # ---- apply (update_from_output + stop strings) -------------------------------------------------
    def apply(self, cmd: Command) -> None:
        """`update_from_output`: the rows' arrays in `fleet_kernels.apply_rows`; publication,
        finishes and stop strings per event, in the order the exact engine applies them."""
        idx = cmd.idx
        now = self.now
        kv = self.kv
        flags = self._apply_flags
        flags[0] = cmd.n_prefill > 0
        flags[1] = self._stops
        flags[2] = self._pinned_any
        self._pinned_any = False
        itl, ends, stops = fk.apply_rows(
            idx, cmd.ver, cmd.samples, cmd.counts, cmd.spec, self.ver, self.n_out, self.ph, self.computed, self.tpif,
            self.pins, self.discarded, self.dropped, self.chunks, self.first, self.last, self.fin, self.eos_at,
            self.stop_end, now, flags, self.spart, self.pinned, kv.free)
        if self.prefix and cmd.n_prefill:
            # a few prefill rows: their publication (a confirmed chunk indexes its blocks)
            A, pub, plen, ver = kv.align, self.pub, self._plen, self.ver
            pr = cmd.prefill.nonzero()[0]
            for i, v, st, nn in zip(idx.take(pr).tolist(), cmd.ver.take(pr).tolist(), cmd.start.take(pr).tolist(),
                                    cmd.num_new.take(pr).tolist()):
                end = min((st + nn) // A, plen[i] // A)
                if end > pub[i] and ver[i] == v:
                    moved = kv.publish(self.hashes[i], pub[i], end, st + nn, int(self.part[i]),
                                       self.entries[i], self.drops[i])
                    if self.drops[i]:
                        self.next_drop[i] = self.drops[i][0][0]
                    if moved:
                        self.own[self.slot[i]] -= moved * kv.block_pages
                    pub[i] = end
        self.rec.applied(itl, cmd)
        if ends.shape[1]:
            self._end(ends[0], ends[1])
        for i, end, Lx, n in stops.tolist():
            self._stop(i, end, Lx, n)

    def _stop(self, i: int, end: int, L: int, n: int) -> None:
        if end < L:
            self.rec.stop_in_chunk(i, end, n, self.now)
            later = [e for e in self._more_stops.get(i, ()) if e > end]
            if self.stop_token_mode:
                self.dropped[i] += L - end
                self.n_out[i] = end
            elif L not in later:                  # upstream's endswith() misses it: generation goes on
                nxt = [e for e in later if e > L]
                self.stop_end[i] = nxt[0] if nxt else NEVER
                return
        self._finish(i, STOP)

    def fail_inflight(self, cmds, detail: str) -> None:
        for cmd in cmds:
            for i, ver in zip(cmd.idx.tolist(), cmd.ver.tolist()):
                if self.ver[i] == ver:
                    self._finish(i, ERROR, detail)

    def break_stall(self) -> int:
        if len(self.running):
            i = int(self.running[0])
            self._finish(i, ERROR, "stalled: KV tables cannot grow and no request can be preempted")
        else:
            i = self.waiting[0]
            self._finish(i, REJECTED, "does not fit in any partition's KV pools")
        self.rec.stall(i, self.detail.get(i, ""), self.now)
        return i
