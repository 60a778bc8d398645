"""The fleet fidelity's scheduler half: one pass over the running set (phase 1: budget, chunked
prefill, table growth with preemption where a partition runs out) and the waiting queue (phase 2:
prefix lookup, partition choice, head-of-line blocking), then the step command.

Mixed into `fleet.FleetSim`, whose request arrays and page pools it reads and writes.
"""
from __future__ import annotations

import numpy as np

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
        rows, used, n_pre = self._phase1(budget)
        new = self._phase2(budget - used)
        if len(rows[0]) == 0 and not new:
            self._pending_ids[:0] = finished_ids
            return None
        if new:
            cols = [np.concatenate([r, c]) for r, c in zip(rows, zip(*new))]
            n_pre += len(new)
        else:
            cols = rows
        idx, num_new, spec, start, pre = cols
        self._step += 1
        end = start + num_new
        samples = end >= self.plen.take(idx) if n_pre else np.ones(len(idx), dtype=bool)
        if n_pre:
            samples |= ~pre
        cmd = Command(self._step, idx, num_new, spec, start, pre, samples, self.ver.take(idx))
        cmd.n_prefill = n_pre
        cmd.tokens = used + sum(x[1] for x in new)     # the budget the step uses (new rows: no drafts)
        self.pins[idx] += 1
        # advance_after_schedule (spec is 0 on every row that does not sample: prefill chunks)
        self.computed[idx] = end + spec
        self.ph[idx] += samples + spec
        if n_pre:
            pre_idx = idx[pre]
            if self.leases is not None:
                lease = self.lease
                for i in pre_idx.tolist():
                    if lease[i] < 0:
                        try:
                            lease[i], self.gen[i] = self.leases.reserve(i, int(self.part[i]))
                        except LeasesExhausted as e:
                            cmd.error = cmd.error or str(e)
            if self.k:
                self.tpif[idx[samples & pre]] = True
        return cmd

    def _phase1(self, budget: int):
        """The running requests' rows (idx, num_new, spec, start, prefill), the budget they use
        and how many are prefill chunks."""
        run = self.running
        empty = np.zeros(0, dtype=np.int64)
        if not len(run):
            return (empty, empty, empty, empty, np.zeros(0, dtype=bool)), 0, 0
        act = run[~self.tpif[run]]
        c = self.computed[act]
        pl = self.plen[act]
        pre = c < pl
        room = self.max_seq - c
        nn = np.minimum(np.minimum(pl + self.n_out[act] + self.ph[act] - c, budget), room)
        nn = np.where(pre, np.minimum(nn, self.chunk), nn)
        ok = nn > 0
        if np.count_nonzero(ok) != len(ok):
            act, c, pre, nn, room = act[ok], c[ok], pre[ok], nn[ok], room[ok]
        spec = np.where(pre, 0, np.maximum(np.minimum(self.k, room - nn), 0))
        cost = nn + spec
        used = int(cost.sum())
        if used > budget:
            act, c, pre, nn, spec, cost = self._budget_scan(act, c, pre, nn, spec, cost, budget)
            used = int(cost.sum())
        tokens = c + cost
        keep = self._grow_all(act, tokens, cost)
        if self.prefix:
            due = tokens > self.next_drop.take(act)
            if keep is not None:
                due &= keep
            due = due.nonzero()[0]
            if len(due):
                # `PagePools.drop_tails` inline: a tail whose last holder leaves gets its FIFO position
                # from the pools as they stand after this step's growth (read once)
                ids = act.take(due)
                drops, nd, tf = self.drops, self.next_drop, None
                for i, t, p in zip(ids.tolist(), tokens.take(due).tolist(), self.part.take(ids).tolist()):
                    d = drops[i]
                    while d and d[0][0] < t:
                        _, _, e, f = d.pop(0)
                        e.tail_refs[f] -= 1
                        if not e.tail_refs[f]:
                            if tf is None:
                                tf = (self.kv.takes + self.kv.free).tolist()
                            e.tail_evict[f] = tf[p][f]
                    nd[i] = d[0][0] if d else NEVER
        if keep is not None:
            act, c, nn, spec, pre, cost = act[keep], c[keep], nn[keep], spec[keep], pre[keep], cost[keep]
            used = int(cost.sum())
        return (act, nn, spec, c, pre), used, int(np.count_nonzero(pre))

    def _budget_scan(self, act, c, pre, nn, spec, cost, budget):
        """The sequential budget walk, from the first request that does not fit in full."""
        cs = cost.cumsum()
        i = int(cs.searchsorted(budget, side="right"))
        keep = np.zeros(len(act), dtype=bool)
        keep[:i] = True
        left = budget - (int(cs[i - 1]) if i else 0)
        nn = nn.copy()
        for j in range(i, len(act)):
            if left <= 0:
                break
            n = min(int(nn[j]), left)
            s = 0 if pre[j] else max(0, min(self.k, self.max_seq - int(c[j]) - n))
            if n <= 0 or n + s > left:
                continue
            nn[j] = n
            spec[j] = s
            keep[j] = True
            left -= n + s
        cost = nn + spec
        return act[keep], c[keep], pre[keep], nn[keep], spec[keep], cost[keep]

    def _grow_all(self, act, tokens, cost) -> np.ndarray | None:
        """Grow every row's tables in order.  Per-partition cumulative needs find the first row a
        partition cannot hold; there (only) the latest arrival is preempted, same partition first,
        and the row retried once.  Returns the mask of rows that were scheduled (None: all were).

        The growth runs over every page-row slot (a slot not scheduled grows to 0 tokens: it
        needs nothing and keeps its rows), so the rows are read and written back whole; only the
        overflow search reads them in the running order."""
        kv = self.kv
        n = len(act)
        keep = None
        if not n:
            return keep
        sl = self.slot.take(act)
        tok = self._tok
        tok[sl] = tokens
        need, own, taken, det, wrapped, L2, S2 = kv.grow_rows(tok, self.L, self.S, self.pins.take(self.occ) > 0)
        tok[sl] = 0
        cells = self._slot_cells()
        sums = kv.per_cell(cells, need)                    # exact below 2^53
        bad = sums > kv.free
        gone = None
        if np.count_nonzero(bad):
            gone = []                                        # slots whose rows are not committed
            keep = np.ones(n, dtype=bool)
            over = bad.any(axis=1).nonzero()[0]
            free = kv.free.astype(float)                     # free pages before this step's growth
            part = self.part.take(act)
            need_a = need.take(sl, axis=0)                   # the rows in the running order
            # per partition that runs out: its rows in order and their cumulative need; a row dropped
            # or preempted leaves the rows after it, pages a preemption frees add to what is free
            # (free only grows and needs only shrink here, so no other partition can run out).
            # Only rows that need pages are walked: one that needs none is never the first to
            # overflow, and the cumulative needs at the others are the same without it.
            groups = {}
            some = need_a.any(axis=1)
            for g in over.tolist():
                rows_g = ((part == g) & some).nonzero()[0]
                groups[g] = (rows_g, need_a[rows_g].cumsum(axis=0))

            def first_bad(g: int, base: int) -> int | None:
                rows_g, cs_g = groups[g]
                k0 = int(rows_g.searchsorted(base))
                bad = (cs_g[k0:] > free[g]).any(axis=1)
                return int(rows_g[k0 + int(bad.argmax())]) if np.count_nonzero(bad) else None

            # each partition's first row that overflows, recomputed only where a drop or a
            # preemption changed its sums or free pages (elsewhere it lies past the row handled)
            firsts = {g: first_bad(g, 0) for g in groups}
            while True:
                j = min((f for f in firsts.values() if f is not None), default=None)
                if j is None:
                    break
                pj = int(part[j])
                changed = {pj}                               # partitions whose first overflow may move
                rows_j, cs_j = groups[pj]
                kj = int(rows_j.searchsorted(j))
                keep[j] = False
                cs_j[kj:] -= need_a[j]
                r = int(act[j])
                victim = self._victim(r)
                if victim is not None:
                    vrow = (act == victim).nonzero()[0]
                    if len(vrow):
                        v = int(vrow[0])
                        pv_row = int(part[v])
                        if keep[v] and pv_row in groups:
                            rows_v, cs_v = groups[pv_row]
                            cs_v[int(rows_v.searchsorted(v)):] -= need_a[v]   # its growth here is undone
                            changed.add(pv_row)
                        keep[v] = False
                    pv = int(self.part[victim])
                    if pv in groups:
                        changed.add(pv)
                    vs = int(self.slot[victim])
                    free[pv] += self.own[vs] + self.pinned[vs]
                    gone.append(vs)
                    self._preempt(victim, r)
                    before = cs_j[kj - 1] if kj else 0
                    if (before + need_a[j] <= free[pj]).all():
                        keep[j] = True
                        cs_j[kj:] += need_a[j]
                for g in changed:
                    firsts[g] = first_bad(g, j + 1)
            if np.count_nonzero(keep) == n:
                keep = None
            else:
                gone.extend(sl[~keep].tolist())
        if gone:
            # rows not scheduled (dropped, or a preempted victim's released slot) keep what they hold
            g = np.array(gone, dtype=np.int64)
            need[g] = own[g] = taken[g] = wrapped[g] = 0
            if det is not None:
                det[g] = 0
            L2[g] = self.L[g]
            S2[g] = self.S[g]
            sums = kv.per_cell(cells, need)
        np.copyto(self.L, L2)
        np.copyto(self.S, S2)
        self.own += own
        d_ = 0
        if det is not None:
            self.pinned += det
            d_ = int(det.sum())
            self._pinned_any = self._pinned_any or d_ > 0
        kv.free -= sums
        kv.takes += kv.per_cell(cells, taken)
        kv.stats["detaches"] += d_
        kv.stats["rotations"] += int(wrapped.sum()) - d_
        return keep

    def _commit(self, i: int, s: int, need, own, taken, L2, S2) -> None:
        kv = self.kv
        p = int(self.part[i])
        kv.free[p] -= need[0]
        kv.takes[p] += taken[0]
        det = need - own
        self.own[s] += own[0]
        self.pinned[s] += det[0]
        self._pinned_any = self._pinned_any or bool(det.any())
        self.L[s] = L2[0]
        self.S[s] = S2[0]
        d = int(det.sum())
        kv.stats["detaches"] += d
        kv.stats["rotations"] += int((taken - own).sum()) - d

    def _victim(self, r: int) -> int | None:
        run = self.running
        cand = run[run != r]
        if not len(cand):
            return None
        same = cand[self.part[cand] == self.part[r]]
        pool = same if len(same) else cand
        return int(pool[self.rank[pool].argmax()])

    def _phase2(self, budget: int) -> list:
        new = []
        kv = self.kv
        room = self.max_running - len(self.running)
        while self.waiting and budget > 0 and len(new) < room:
            i = self.waiting[0]
            if self.in_pass[i] == self._pass:
                break
            pl = self._plen[i]
            hit, p, fallback = 0, None, False
            if self.prefix:
                hit, p = kv.lookup(self.hashes[i], pl - self.max_hit_offset)
            if hit:
                L, S, own = kv.attach(self.hashes[i], hit, p, self.entries[i], self.drops[i])
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
                nn = self._first_chunk(i, 0, budget)
                need, row = kv.first_rows(nn)
                p = kv.choose_partition(need)
                if p is None:
                    break
                self.part[i] = p
                kv.load[p] += 1
                kv.free[p] -= need
                kv.takes[p] += need
                self.kv4[:, self._take_slot(i, p)] = row
            self.waiting.popleft()
            self.status[i] = RUNNING
            self.computed[i] = hit
            self.cached[i] = hit
            self.pub[i] = hit // kv.align
            self.rec.admitted(i, hit, fallback, self.now)
            new.append((i, nn, 0, hit, True))
            budget -= nn
        if new:
            self.running = np.concatenate([self.running, np.array([x[0] for x in new], dtype=np.int64)])
        return new

    def _first_chunk(self, i: int, computed: int, budget: int) -> int:
        return min(self._plen[i] - computed, budget, self.max_seq - computed, self.chunk)

    def _grow_one(self, i: int, tokens: int) -> bool:
        s = int(self.slot[i])
        need, own, taken, _, _, L2, S2 = self.kv.grow_rows(np.array([tokens]), self.L[s:s + 1], self.S[s:s + 1],
                                                           self.pins[i:i + 1] > 0)
        if (need[0] > self.kv.free[self.part[i]]).any():
            return False
        self._commit(i, s, need, own, taken, L2, S2)
        return True
