"""The fleet fidelity: the same scheduler, pipeline and cost model over struct-of-arrays state.

`SimConfig(fidelity="fleet")` runs here instead of the exact engine (docs/simulation.md,
"Fidelity").  Running requests are numpy arrays indexed by request; one step is a fixed number
of array operations whatever the batch size:

- phase 1 (running, in order, global token budget, K=7 costing 8, chunked prefill) and the
  table growth are vectorised; a growth that does not fit is found by per-partition cumulative
  sums, and only there does Python act (preempt the latest arrival, same partition first; retry);
- phase 2 (waiting FIFO, prefix lookup, partition choice, head-of-line blocking), finishes,
  preemptions and publication are per-event Python (each happens O(1) times per request);
- acceptance is sampled for the whole decode batch at once, token accounting, EOS / length /
  stop detection are vectorised over the planted script positions (tokens are not generated);
- the cost model prices each dispatch from arrays (`CostModel.decode_arrays` / `prefill_arrays`);
- virtual time: the engine's depth-2 pipeline (schedule, prepare with ping-pong slots, serial
  device, reclaim) as closed-form lane times, not SimPy processes.

KV pages are counts (`fleet_pool.PagePools`), dispatch pricing and acceptance are the mixin in
`fleet_execute`, the recorder is `fleet_record`.  Leases use the exact `LeaseManager`.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from twin.abi.errors import ConfigError

from .fleet_execute import FleetExecute
from .fleet_pool import PagePools
from .kvcache import chained_hashes
from .leases import LeaseManager, LeasesExhausted
from .request import Finish, Status

WAITING, RUNNING, FINISHED = 1, 2, 3
FINISH_CODES = (None, Finish.EOS, Finish.LENGTH, Finish.STOP, Finish.ABORTED, Finish.ERROR, Finish.REJECTED)
EOS, LENGTH, STOP, ABORTED, ERROR, REJECTED = range(1, 7)
NEVER = 1 << 40


class Command:
    """One step command as arrays over its scheduled rows (request index order = dispatch order)."""

    __slots__ = ("step_id", "idx", "num_new", "spec", "start", "prefill", "samples", "ver", "counts",
                 "drafts", "dispatches", "error", "t_result", "decode_only")

    def __init__(self, step_id, idx, num_new, spec, start, prefill, samples, ver):
        self.step_id, self.idx, self.num_new, self.spec, self.start = step_id, idx, num_new, spec, start
        self.prefill, self.samples, self.ver = prefill, samples, ver      # ver: the stale-result check
        self.counts = self.drafts = None
        self.dispatches: list = []
        self.error: str | None = None
        self.t_result = 0.0
        self.decode_only = False


class FleetSim(FleetExecute):
    """Scheduler + executor + engine timing of one fleet run (plain object, no SimPy)."""

    def __init__(self, cfg, slots: int, cost, device, recorder):
        dep = self.dep = cfg.dep
        lim = dep.limits
        self.cfg, self.cost, self.dev, self.rec = cfg, cost, device, recorder
        self.k = dep.k
        self.max_seq, self.chunk, self.budget = lim.max_model_len, lim.max_prefill_tokens_per_request, lim.max_num_batched_tokens
        self.max_running = lim.max_num_seqs
        self.prefix = lim.enable_prefix_caching
        self.max_hit_offset = max(1, lim.speculative_prefix_cache_replay_tokens)
        self.max_preemptions = cfg.max_preemptions
        self.stop_token_mode = cfg.stop_check == "token"
        self.depth = cfg.async_depth
        self.kv = PagePools.from_deployment(dep, slots)
        self.leases = LeaseManager(dep.partitions) if self.k else None
        self.acceptance = cfg.acceptance
        # one uniform per request where the model has an inverse form (the same distribution)
        self._accept = getattr(cfg.acceptance, "counts_inverse", None) or cfg.acceptance.counts
        self.rng = np.random.default_rng(cfg.seed)
        self._fault_rng = np.random.default_rng(cfg.seed + 1213)
        self.hang_p = cfg.prefill_hang_probability if dep.topology.ep == 16 else 0.0
        self.G = dep.partitions
        self._groups = np.arange(self.G)
        self._seed_cost: dict[int, tuple] = {}
        self._load_requests(cfg.requests)
        self.waiting: deque[int] = deque()
        self.running = np.zeros(0, dtype=np.int64)
        self._pending_ids: list[int] = []
        self._pass = 0
        self._step = 0
        self.now = 0.0
        self.finished = 0
        self.generated = 0            # tokens the executor accepted (for the conservation check)
        self.lost = 0                 # of those, in results dropped after a worker error

    # ---- request arrays --------------------------------------------------------------------------
    def _load_requests(self, reqs) -> None:
        self.reqs = list(reqs)
        n = self.N = len(self.reqs)
        F = self.kv.F
        self.rid = [r.request_id for r in self.reqs]
        if len(set(self.rid)) != n:
            dup = next(x for x in self.rid if self.rid.count(x) > 1)
            raise ConfigError("request_id", dup, "an id not already submitted")
        self.arrival = np.array([r.arrival for r in self.reqs], dtype=float)
        self.plen = np.array([r.prompt_len for r in self.reqs], dtype=np.int64)
        self.max_new = np.array([r.sampling.max_new_tokens for r in self.reqs], dtype=np.int64)
        self.eos_at = np.full(n, NEVER, dtype=np.int64)
        self.stop_end = np.full(n, NEVER, dtype=np.int64)
        self._more_stops: dict[int, list[int]] = {}
        for i, r in enumerate(self.reqs):
            sp = r.sampling
            if r.script and sp.eos_token_id is not None and not sp.ignore_eos:
                at = [j for j, t in r.script.items() if t == sp.eos_token_id]
                if at:
                    self.eos_at[i] = min(at)
            if r.script and sp.stop:
                ends = sorted({j + len(st) for st in sp.stop for j in r.script
                               if all(r.script.get(j + m) == x for m, x in enumerate(st))})
                if ends:
                    self.stop_end[i] = ends[0]
                    self._more_stops[i] = ends[1:]
        order = sorted(range(n), key=lambda i: (self.reqs[i].arrival, self.rid[i]))
        self.rank = np.empty(n, dtype=np.int64)
        self.rank[order] = np.arange(n)                        # victim key: latest (arrival, id)
        self.hashes: list = [None] * n
        z = lambda dt=np.int64: np.zeros(n, dtype=dt)          # noqa: E731
        self.status, self.computed, self.n_out, self.ph = z(np.int8), z(), z(), z()
        self.part = np.full(n, -1, dtype=np.int64)
        self.tpif = z(bool)
        self.ver = z()                                         # bumped by a finish or a preemption
        self.inc, self.pins, self.preempts, self.dropped, self.discarded, self.cached = z(), z(), z(), z(), z(), z()
        self.lease = np.full(n, -1, dtype=np.int64)
        self.gen = np.full(n, -1, dtype=np.int64)
        self.committed, self.chunks, self.finish = z(), z(), z(np.int8)
        self.pub = z()                                         # prompt blocks published (or attached)
        self.in_pass = np.full(n, -1, dtype=np.int64)
        self._mark = np.zeros(n, dtype=bool)                  # scratch: requests leaving `running`
        self.detail: dict[int, str] = {}
        nan = lambda: np.full(n, np.nan)                       # noqa: E731
        self.first, self.last, self.end, self.admitted = nan(), nan(), nan(), nan()
        # per request and family: logical pages, filled ring slots, own pages, pages held by an
        # in-flight snapshot (one matrix, so a step gathers and scatters them once)
        self.kvrows = np.zeros((n, 4 * F), dtype=np.int64)
        self.L, self.S = self.kvrows[:, :F], self.kvrows[:, F:2 * F]
        self.own, self.pinned = self.kvrows[:, 2 * F:3 * F], self.kvrows[:, 3 * F:]
        self.entries: list[list] = [[] for _ in range(n)]
        self.drops: list[list] = [[] for _ in range(n)]        # (tokens, id, entry, family) tails held
        self.next_drop = np.full(n, NEVER, dtype=np.int64)
        self.prefix_stats = {"queries": 0, "hits": 0, "query_tokens": 0, "hit_tokens": 0, "fallbacks": 0}

    # ---- admission ---------------------------------------------------------------------------------
    def add_request(self, i: int) -> None:
        L = self.max_seq
        pl = int(self.plen[i])
        self.rec.arrived(i)
        if pl == 0 or pl >= L:
            why = "empty prompt" if pl == 0 else (
                f"prompt_len {pl} leaves nothing to generate under max_seq_len {L}" if pl == L
                else f"prompt_len {pl} > max_seq_len {L}")
            return self._finish(i, REJECTED, why)
        if self.max_new[i] < 1:
            return self._finish(i, REJECTED, f"max_new_tokens {self.max_new[i]} < 1")
        self.max_new[i] = min(self.max_new[i], L - pl)
        if self.prefix and self.hashes[i] is None:
            self.hashes[i] = chained_hashes(self.reqs[i].prompt, self.kv.align)
        self.status[i] = WAITING
        self.waiting.append(i)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or len(self.running) > 0

    # ---- schedule ----------------------------------------------------------------------------------
    def schedule(self) -> Command | None:
        self._pass += 1
        if self.leases:
            for i in self._pending_ids:
                self.leases.release(i)
        finished_ids, self._pending_ids = self._pending_ids, []
        budget = self.budget
        rows = self._phase1(budget)
        budget -= int((rows[1] + rows[2]).sum()) if len(rows[0]) else 0
        new = self._phase2(budget)
        if len(rows[0]) == 0 and not new:
            self._pending_ids[:0] = finished_ids
            return None
        if new:
            cols = [np.concatenate([r, np.asarray(c, dtype=r.dtype)]) for r, c in zip(rows, zip(*new))]
        else:
            cols = rows
        idx, num_new, spec, start, pre = cols
        self._step += 1
        samples = ~pre | (start + num_new >= self.plen[idx])
        cmd = Command(self._step, idx, num_new, spec, start, pre, samples, self.ver[idx])
        self.pins[idx] += 1
        if self.leases is not None:
            for i in idx[pre & (self.lease[idx] < 0)].tolist():
                try:
                    self.lease[i], self.gen[i] = self.leases.reserve(i, int(self.part[i]))
                except LeasesExhausted as e:
                    cmd.error = cmd.error or str(e)
        # advance_after_schedule (spec is 0 on every row that does not sample: prefill chunks)
        self.computed[idx] += num_new + spec
        self.ph[idx] += samples + spec
        if self.k:
            self.tpif[idx[samples & pre]] = True
        return cmd

    def _phase1(self, budget: int):
        run = self.running
        empty = np.zeros(0, dtype=np.int64)
        if not len(run):
            return empty, empty, empty, empty, np.zeros(0, dtype=bool)
        act = run[~self.tpif[run]]
        c = self.computed[act]
        pl = self.plen[act]
        pre = c < pl
        nn = np.minimum(np.minimum(pl + self.n_out[act] + self.ph[act] - c, budget), self.max_seq - c)
        nn = np.where(pre, np.minimum(nn, self.chunk), nn)
        ok = nn > 0
        if not ok.all():
            act, c, pre, nn = act[ok], c[ok], pre[ok], nn[ok]
        spec = np.where(pre, 0, np.maximum(np.minimum(self.k, self.max_seq - c - nn), 0))
        cost = nn + spec
        if int(cost.sum()) > budget:
            act, c, pre, nn, spec, cost = self._budget_scan(act, c, pre, nn, spec, cost, budget)
        tokens = c + cost
        keep = self._grow_all(act, tokens, cost)
        if self.prefix:
            due = (keep & (tokens > self.next_drop[act])).nonzero()[0]
            for j in due.tolist():
                i = int(act[j])
                self.kv.drop_tails(self.drops[i], int(tokens[j]), int(self.part[i]))
                self.next_drop[i] = self.drops[i][0][0] if self.drops[i] else NEVER
        if not keep.all():
            act, c, nn, spec, pre = act[keep], c[keep], nn[keep], spec[keep], pre[keep]
        return act, nn, spec, c, pre

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
            cj = int(c[j])
            if pre[j]:
                n = min(int(nn[j]), left)
                s = 0
            else:
                n = min(int(nn[j]), left)
                s = max(0, min(self.k, self.max_seq - cj - n))
            if n <= 0 or n + s > left:
                continue
            nn[j] = n
            spec[j] = s
            keep[j] = True
            left -= n + s
        cost = nn + spec
        return act[keep], c[keep], pre[keep], nn[keep], spec[keep], cost[keep]

    def _grow_all(self, act, tokens, cost) -> np.ndarray:
        """Grow every row's tables in order.  Per-partition cumulative needs find the first row a
        partition cannot hold; there (only) the latest arrival is preempted, same partition first,
        and the row retried once.  Returns the mask of rows that were scheduled."""
        kv = self.kv
        n = len(act)
        keep = np.ones(n, dtype=bool)
        if not n:
            return keep
        F, G = kv.F, self.G
        rows = self.kvrows.take(act, axis=0)               # take: ~2x a fancy-index row gather
        need, own, taken, L2, S2 = kv.growth(tokens, rows[:, :F], rows[:, F:2 * F], self.pins[act] > 0)
        part = self.part[act]
        flat = ((part * F)[:, None] + kv.fam).ravel()         # (partition, family) cell of each entry
        sums = np.bincount(flat, weights=need.ravel(), minlength=G * F).reshape(G, F)   # exact below 2^53
        over = (sums > kv.free).any(axis=1).nonzero()[0]
        if len(over):
            free = kv.free.astype(float)                     # free pages before this step's growth
            # per partition that runs out: its rows in order and their cumulative need; a row dropped
            # or preempted leaves the rows after it, pages a preemption frees add to what is free
            # (free only grows and needs only shrink here, so no other partition can run out)
            groups = {}
            for g in over.tolist():
                rows_g = (part == g).nonzero()[0]
                groups[g] = (rows_g, need[rows_g].cumsum(axis=0))
            base = 0
            while True:
                j = None
                for g, (rows_g, cs_g) in groups.items():
                    k0 = int(rows_g.searchsorted(base))
                    bad = (cs_g[k0:] > free[g]).any(axis=1)
                    if bad.any():
                        first = int(rows_g[k0 + int(bad.argmax())])
                        j = first if j is None else min(j, first)
                if j is None:
                    break
                pj = int(part[j])
                rows_j, cs_j = groups[pj]
                kj = int(rows_j.searchsorted(j))
                keep[j] = False
                cs_j[kj:] -= need[j]
                r = int(act[j])
                victim = self._victim(r)
                if victim is not None:
                    vrow = (act == victim).nonzero()[0]
                    if len(vrow):
                        v = int(vrow[0])
                        pv_row = int(part[v])
                        if keep[v] and pv_row in groups:
                            rows_v, cs_v = groups[pv_row]
                            cs_v[int(rows_v.searchsorted(v)):] -= need[v]   # its growth here is undone
                        keep[v] = False
                    pv = int(self.part[victim])
                    free[pv] += self.own[victim] + self.pinned[victim]
                    self._preempt(victim, r)
                    before = cs_j[kj - 1] if kj else 0
                    if (before + need[j] <= free[pj]).all():
                        keep[j] = True
                        cs_j[kj:] += need[j]
                base = j + 1
        det = need - own
        rows[:, :F] = L2
        rows[:, F:2 * F] = S2
        rows[:, 2 * F:3 * F] += own
        rows[:, 3 * F:] += det
        if keep.all():
            self.kvrows[act] = rows
            d_, r_ = int(det.sum()), int(taken.sum()) - int(own.sum())
        else:
            self.kvrows[act[keep]] = rows[keep]
            sums = np.bincount(flat, weights=(need * keep[:, None]).ravel(), minlength=G * F).reshape(G, F)
            taken = taken * keep[:, None]
            d_, r_ = int(det[keep].sum()), int(taken.sum()) - int(own[keep].sum())
        kv.free -= sums.astype(np.int64)
        kv.takes += np.bincount(flat, weights=taken.ravel(), minlength=G * F).astype(np.int64).reshape(G, F)
        kv.stats["detaches"] += d_
        kv.stats["rotations"] += r_ - d_
        return keep

    def _commit(self, idx, need, own, taken, L2, S2) -> None:
        if not len(idx):
            return
        kv = self.kv
        p = self.part[idx]
        G, F = self.G, kv.F
        flat = (p[:, None] * F + np.arange(F)).ravel()
        kv.free -= np.bincount(flat, weights=need.ravel(), minlength=G * F).astype(np.int64).reshape(G, F)
        kv.takes += np.bincount(flat, weights=taken.ravel(), minlength=G * F).astype(np.int64).reshape(G, F)
        det = need - own
        self.own[idx] += own
        self.pinned[idx] += det
        self.L[idx] = L2
        self.S[idx] = S2
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
            pl = int(self.plen[i])
            hit, p, fallback = 0, None, False
            if self.prefix:
                hit, p = kv.lookup(self.hashes[i], pl - self.max_hit_offset)
            if hit:
                L, S, own = kv.attach(self.hashes[i], hit, p, self.entries[i], self.drops[i])
                self.next_drop[i] = self.drops[i][0][0] if self.drops[i] else NEVER
                self.L[i], self.S[i], self.own[i] = L, S, own
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
                self.kvrows[i] = row
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
        return min(int(self.plen[i]) - computed, budget, self.max_seq - computed, self.chunk)

    def _grow_one(self, i: int, tokens: int) -> bool:
        idx = np.array([i])
        need, own, taken, L2, S2 = self.kv.growth(np.array([tokens]), self.L[idx], self.S[idx], self.pins[idx] > 0)
        if (need[0] > self.kv.free[self.part[i]]).any():
            return False
        self._commit(idx, need, own, taken, L2, S2)
        return True

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
        kv.free[p] += self.own[i] + self.pinned[i]
        self.own[i] = self.pinned[i] = self.L[i] = self.S[i] = 0
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
        F, G = kv.F, self.G
        held = self.own[ids] + self.pinned[ids]
        flat = ((p * F)[:, None] + kv.fam).ravel()
        kv.free += np.bincount(flat, weights=held.ravel(), minlength=G * F).astype(np.int64).reshape(G, F)
        self.kvrows[ids] = 0
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
                self.own[i] -= moved * kv.block_pages
                self.pub[i] = end
        # unpin: the pages detached into this step's snapshots go back to the pool
        self.pins[idx] -= 1
        held = self.pinned[idx]
        if held.any():
            G, F = self.G, kv.F
            flat = ((self.part[idx] * F)[:, None] + kv.fam).ravel()
            kv.free += np.bincount(flat, weights=held.ravel(), minlength=G * F).astype(np.int64).reshape(G, F)
            self.pinned[idx] = 0
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

    # ---- the engine: arrivals, the depth-2 pipeline and its lanes in closed form --------------------
    def run(self, until: float | None = None) -> None:
        dev = self.dev
        order = np.argsort(self.arrival, kind="stable")
        arr = self.arrival[order]
        ai, n = 0, len(order)
        inflight: deque[Command] = deque()
        discard: set[int] = set()
        prep_free = dev_free = rec_free = 0.0
        slot_free = [0.0, 0.0]
        per_req, per_prep, lifecycle, reclaim = (dev.host_schedule_per_request, dev.host_prepare_per_request,
                                                 dev.lifecycle, dev.host_reclaim)
        while True:
            while ai < n and arr[ai] <= self.now:
                self.add_request(int(order[ai]))
                ai += 1
            if until is not None and self.now >= until:
                return
            if len(inflight) < self.depth and self.has_work:
                cmd = self.schedule()
                if cmd is not None:
                    self.execute(cmd)
                    self.rec.scheduled(cmd, self)
                    m = len(cmd.idx)
                    self.now += per_req * m
                    t = max(self.now, prep_free)
                    if cmd.decode_only:
                        t = max(t, slot_free[cmd.step_id % 2])
                    t += per_prep * m
                    prep_free = t
                    start = max(t, dev_free) + lifecycle
                    t_end = start
                    for kind, secs, parts, meta in cmd.dispatches:
                        self.rec.dispatch(cmd.step_id, kind, t_end, secs, meta, parts)
                        t_end += secs
                    dev_free = t_end
                    rec_free = max(rec_free, t_end) + reclaim
                    if cmd.decode_only:
                        slot_free[cmd.step_id % 2] = rec_free
                    cmd.t_result = rec_free
                    inflight.append(cmd)
                    continue
            if inflight:
                cmd = inflight.popleft()
                if cmd.t_result > self.now:
                    if ai < n and arr[ai] < cmd.t_result:
                        # arrivals while waiting join the queue at their own times (no scheduling)
                        while ai < n and arr[ai] < cmd.t_result:
                            self.now = max(self.now, float(arr[ai]))
                            self.add_request(int(order[ai]))
                            ai += 1
                    self.now = cmd.t_result
                if cmd.step_id in discard:
                    discard.discard(cmd.step_id)
                    self.lost += int(cmd.counts.sum())
                    continue
                if cmd.error:
                    discard.update(c.step_id for c in inflight)
                    self.fail_inflight([cmd, *inflight], cmd.error)
                    self.rec.worker_error(cmd.step_id, cmd.error, self.now)
                    continue
                self.apply(cmd)
                continue
            if not self.has_work:
                if ai == n:
                    return
                self.now = max(self.now, float(arr[ai]))
                continue
            self.break_stall()

    # ---- results -----------------------------------------------------------------------------------
    def write_back(self) -> None:
        """Final per-request state onto the `Request` objects (the metrics read them).  Output
        token values are not generated: outputs hold the planted script tokens, 0 elsewhere."""
        for i, r in enumerate(self.reqs):
            n = int(self.n_out[i])
            out = [0] * n
            for j, t in r.script.items():
                if j < n:
                    out[j] = t
            r.outputs = out
            st = self.status[i]
            r.status = Status.FINISHED if st == FINISHED else Status.RUNNING if st == RUNNING else Status.WAITING
            r.finish = FINISH_CODES[int(self.finish[i])]
            r.finish_detail = self.detail.get(i, "")
            r.max_new_tokens = int(self.max_new[i])
            r.num_preemptions = int(self.preempts[i])
            r.dropped_tokens = int(self.dropped[i])
            r.discarded_tokens = int(self.discarded[i])
            r.cached_tokens = int(self.cached[i])
            r.num_computed = int(self.computed[i])
            r.incarnation = int(self.inc[i])
            r.partition = None if self.part[i] < 0 else int(self.part[i])

    def check(self) -> None:
        """Pool invariants: free = capacity - own - pinned - referenced entry pages, never negative."""
        kv = self.kv
        used = np.zeros_like(kv.free)
        live = self.part >= 0
        np.add.at(used, self.part[live], self.own[live] + self.pinned[live])
        used += kv.live_entry_pages()
        assert (kv.free >= 0).all(), f"negative free pages {kv.free.tolist()}"
        assert (used == kv.cap[None, :] - kv.free).all(), f"page counts drift: used {used.tolist()} free {kv.free.tolist()}"
        assert (self.own >= 0).all() and (self.pinned >= 0).all()
        assert int(kv.load.sum()) == int(live.sum())
        assert len(self.running) <= self.max_running

