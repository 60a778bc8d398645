"""The fleet fidelity's results half: a step's result applied (`update_from_output`: stale rows
discarded, prompt blocks published, pins released, token accounting, EOS / length / stop
finishes) and requests leaving the running set (finish, preemption, worker errors, stalls), their
pages and prefix-cache references returned.

Mixed into `fleet.FleetSim`, whose request arrays and page pools it reads and writes.
"""
from __future__ import annotations

import numpy as np

from .fleet_command import EOS, ERROR, FINISHED, LENGTH, NEVER, REJECTED, RUNNING, STOP, WAITING, Command


class FleetApply:
    # ---- releasing ---------------------------------------------------------------------------------
    def _release_kv(self, i: int) -> None:
        p = int(self.part[i])
        if p < 0:
            return
        kv = self.kv
        kv.release_entries(self.entries[i], p)
        if self.drops[i]:
            kv.drop_tails(self.drops[i], NEVER + 1, p)
            self.next_drop[i] = NEVER
        s = int(self.slot[i])
        kv.free[p] += self.own[s] + self.pinned[s]
        self.kv4[:, s] = 0
        self.slot[i] = -1
        self._free_slots.append(s)
        self.pins[i] = 0
        kv.load[p] -= 1
        self.part[i] = -1

    def _remove_running(self, i: int) -> None:
        self.running = self.running[self.running != i]

    def _preempt(self, v: int, by: int) -> None:
        self.rec.preempted(v, by, int(self.n_out[v]), int(self.part[v]), self.now)
        self._release_kv(v)
        self._pending_ids.append(v)
        self._remove_running(v)
        self.preempts[v] += 1
        if self.max_preemptions is not None and self.preempts[v] >= self.max_preemptions:
            return self._finish(v, ERROR, f"preempted {self.preempts[v]} times: preemption livelock")
        self.computed[v] = self.ph[v] = 0
        self.tpif[v] = False
        self.lease[v] = self.gen[v] = -1
        self.inc[v] += 1
        self.ver[v] += 1
        self.status[v] = WAITING
        self.in_pass[v] = self._pass
        self.waiting.appendleft(v)

    def _finish(self, i: int, code: int, detail: str = "") -> None:
        was = self.status[i]
        self.status[i] = FINISHED
        self.ver[i] += 1
        self.finish[i] = code
        if detail:
            self.detail[i] = detail
        self.ph[i] = 0
        self.tpif[i] = False
        self._release_kv(i)
        if was == RUNNING:
            self._remove_running(i)
        elif was == WAITING and i in self.waiting:
            self.waiting.remove(i)
        self._pending_ids.append(i)
        self.end[i] = self.now
        self.finished += 1

    def _finish_running(self, ids: np.ndarray, codes: np.ndarray) -> None:
        """`_finish` for running requests that end in one step, their pages released in bulk."""
        kv = self.kv
        self.status[ids] = FINISHED
        self.ver[ids] += 1
        self.finish[ids] = codes
        self.ph[ids] = 0
        self.tpif[ids] = False
        p = self.part[ids]
        for i, pi in zip(ids.tolist(), p.tolist()):
            if self.entries[i]:
                kv.release_entries(self.entries[i], pi)
            if self.drops[i]:
                kv.drop_tails(self.drops[i], NEVER + 1, pi)
                self.next_drop[i] = NEVER
        sl = self.slot[ids]
        kv.free += kv.per_cell(kv.cells(p), self.own.take(sl, axis=0) + self.pinned.take(sl, axis=0))
        self.kv4[:, sl] = 0
        self.slot[ids] = -1
        self._free_slots.extend(sl.tolist())
        self.pins[ids] = 0
        kv.load -= np.bincount(p, minlength=self.G)
        self.part[ids] = -1
        gone = self._mark
        gone[ids] = True
        self.running = self.running[~gone[self.running]]
        gone[ids] = False
        self._pending_ids.extend(ids.tolist())
        self.end[ids] = self.now
        self.finished += len(ids)

    # ---- apply (update_from_output + stop strings) -------------------------------------------------
    def apply(self, cmd: Command) -> None:
        idx = cmd.idx
        now = self.now
        stale = self.ver[idx] != cmd.ver
        if stale.any():
            s = idx[stale]
            self.discarded[s] += cmd.counts[stale]
            ok = ~stale
            idx, rows = idx[ok], ok.nonzero()[0]
        else:
            rows = None
        take = (lambda a: a) if rows is None else (lambda a: a[rows])        # noqa: E731
        start, num_new, spec, samples, counts, pre = (take(cmd.start), take(cmd.num_new), take(cmd.spec),
                                                      take(cmd.samples), take(cmd.counts), take(cmd.prefill))
        kv = self.kv
        if self.prefix and pre.any():
            conf = (start + num_new) // kv.align
            pub = self.pub[idx]
            nb = self.plen[idx] // kv.align
            todo = (pre & (np.minimum(conf, nb) > pub)).nonzero()[0]
            for j in todo.tolist():
                i = int(idx[j])
                end = int(min(conf[j], nb[j]))
                moved = kv.publish(self.hashes[i], int(pub[j]), end, int(start[j] + num_new[j]), int(self.part[i]),
                                   self.entries[i], self.drops[i])
                if self.drops[i]:
                    self.next_drop[i] = self.drops[i][0][0]
                if moved:
                    self.own[self.slot[i]] -= moved * kv.block_pages
                self.pub[i] = end
        # unpin: the pages detached into this step's snapshots go back to the pool
        self.pins[idx] -= 1
        sl = self.slot[idx]
        held = self.pinned.take(sl, axis=0)              # take: ~5x a 2-D fancy-index gather
        if held.any():
            kv.free += kv.per_cell(kv.cells(self.spart[sl]), held)
            self.pinned[sl] = 0
        if samples.all():
            s_idx, cnt, sp = idx, counts, spec
        else:
            s_idx = idx[samples]
            if not len(s_idx):
                return
            cnt, sp = counts[samples], spec[samples]
        self.tpif[s_idx] = False
        n_out, mx = self.n_out[s_idx], self.max_new[s_idx]
        eos_room = self.eos_at[s_idx] - n_out + 1                # tokens up to and including the EOS
        retained = np.minimum(cnt, np.minimum(mx - n_out, np.maximum(eos_room, 1)))
        L = n_out + retained
        eos_hit = (eos_room >= 1) & (eos_room <= retained)
        done = eos_hit | (L >= mx)
        self.n_out[s_idx] = L
        live = ~done
        l_idx, r_l, sp_l = s_idx[live], retained[live], sp[live]
        self.ph[l_idx] -= 1 + sp_l
        self.computed[l_idx] += r_l - 1 - sp_l
        # streamed chunks (every sampled row retains >= 1 token)
        self.rec.applied(s_idx, now, self.first, self.last, self.chunks, cmd, rows)
        if done.any():
            d = s_idx[done]
            self.dropped[d] += cnt[done] - retained[done]
            self._finish_running(d, np.where(eos_hit[done], EOS, LENGTH))
        # stop strings: the engine's check on the cumulative output after the step
        L_l = L[live]
        se = self.stop_end[l_idx]
        got = (se > L_l - r_l) & (se <= L_l)
        if got.any():
            for i, end, Lx, n in zip(l_idx[got].tolist(), se[got].tolist(), L_l[got].tolist(), r_l[got].tolist()):
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
