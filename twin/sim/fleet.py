"""The fleet fidelity: the same scheduler, pipeline and cost model over struct-of-arrays state.

`SimConfig(fidelity="fleet")` runs here instead of the exact engine (docs/simulation.md,
"Fidelity").  Requests are numpy arrays indexed by request, and the running ones' page rows sit in
fixed slots (one per running request); a step's array work is a few compiled loops over the
running rows in request order (`fleet_kernels`, numba), whatever the batch size:

- phase 1 (running, in order, global token budget, K=7 costing 8, chunked prefill), the table
  growth and the overflow search (the first row a partition cannot hold; the latest arrival
  preempted, same partition first; one retry) in `fleet_kernels.phase1`; Python preempts the
  victims it chose;
- phase 2 (waiting FIFO, prefix lookup, partition choice, head-of-line blocking), finishes,
  preemptions and publication are per-event Python (each happens O(1) times per request);
- acceptance is sampled for the whole decode batch at once; token accounting, EOS / length /
  stop detection run over the planted script positions (tokens are not generated);
- the cost model prices each dispatch from arrays (`CostModel.decode_arrays` / `prefill_arrays`);
- virtual time: the engine's depth-2 pipeline (schedule, prepare with ping-pong slots, serial
  device, reclaim) as closed-form lane times, not SimPy processes.

This module holds the request arrays and the engine loop; the scheduler is `fleet_schedule`,
dispatch pricing and acceptance `fleet_execute`, result application and request exits
`fleet_apply` (three mixins over the same arrays), their compiled loops `fleet_kernels`, KV page
counts `fleet_pool.PagePools`, the step command and codes `fleet_command`, the recorder
`fleet_record`.  Leases use the exact `LeaseManager`.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from twin.abi import constants as C
from twin.abi.batches import Status
from twin.abi.errors import ConfigError

from .executor import fault_rng, hang_probability
from .fleet_apply import FleetApply
from .fleet_command import FINISH_CODES, FINISHED, NEVER, REJECTED, RUNNING, WAITING, Command
from .fleet_execute import FleetExecute
from .fleet_pool import PagePools
from .fleet_schedule import FleetSchedule
from .kvcache import chained_hashes
from .leases import LeaseManager
from .scheduler import SchedulerConfig


FLEET_PREEMPTION_CAP = 100


class FleetSim(FleetSchedule, FleetApply, FleetExecute):
    """Scheduler + executor + engine timing of one fleet run (plain object, no SimPy)."""

    def __init__(self, cfg, slots: int, cost, device, recorder):
        dep = self.dep = cfg.dep
        lim = dep.limits
        self.cfg, self.cost, self.dev, self.rec = cfg, cost, device, recorder
        self.k = dep.k
        self.max_seq, self.chunk, self.budget = lim.max_model_len, lim.max_prefill_tokens_per_request, lim.max_num_batched_tokens
        self.max_running = lim.max_num_seqs
        self._limits = np.array([self.max_seq, self.budget, self.chunk, self.k, 0], dtype=np.int64)   # phase 1's
        self._apply_flags = np.zeros(3, dtype=bool)
        self._decode_limits = np.array([self.max_seq, self.k, dep.partitions, C.TP_SIZE, C.DECODE_BATCH,
                                        C.LOCAL_REQUESTS, C.DECODE_SEQ], dtype=np.int64)
        self._prefill_limits = np.array([dep.partitions, dep.prefill_batch, dep.prefill_requests_per_partition,
                                         C.PREFILL_TOKENS_PER_GROUP], dtype=np.int64)
        self.prefix = lim.enable_prefix_caching
        self.max_hit_offset = max(1, lim.speculative_prefix_cache_replay_tokens)
        # the exact scheduler's config validates async_depth (`apply` relies on 1 or 2) and stop_check
        scfg = SchedulerConfig.from_deployment(dep, async_depth=cfg.async_depth, stop_check=cfg.stop_check,
                                               max_preemptions=cfg.max_preemptions)
        # no cap given: the fleet fidelity still ends a request at its 100th preemption; its decisions
        # are not upstream's, and without one its thrash on a saturated burst runs on and on
        self.max_preemptions = scfg.max_preemptions if scfg.max_preemptions is not None else FLEET_PREEMPTION_CAP
        self.livelock_window = scfg.livelock_window
        self.stop_token_mode = scfg.stop_check == "token"
        self.depth = scfg.async_depth
        self.kv = PagePools.from_deployment(dep, slots)
        self.leases = LeaseManager(dep.partitions) if self.k else None
        # one uniform per request where the model has an inverse form (the same distribution)
        self._accept = getattr(cfg.acceptance, "counts_inverse", None) or cfg.acceptance.counts
        self.rng = np.random.default_rng(cfg.seed)
        self._fault_rng = fault_rng(cfg.seed)
        self.hang_p = hang_probability(cfg.prefill_hang_probability, dep)      # pypto-lib#1213
        self.G = dep.partitions
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
        self.fin = self.max_new.copy()                          # set at admission (max_new is capped there)
        self._stops = bool((self.stop_end < NEVER).any())      # any planted stop string at all
        self._plen = self.plen.tolist()                         # read one at a time in Python
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
        self.pub = [0] * n                                     # prompt blocks published (or attached)
        self.in_pass = [-1] * n                                # the pass a preemption returned it in
        self._mark = np.zeros(n, dtype=bool)                  # scratch: requests leaving `running`
        self.detail: dict[int, str] = {}
        nan = lambda: np.full(n, np.nan)                       # noqa: E731
        self.first, self.last, self.end, self.admitted = nan(), nan(), nan(), nan()
        # page rows live in fixed slots, one per running request (`slot`: request -> slot,
        # `occ`: slot -> request, `spart`: slot -> partition): the kernels reach a request's rows
        # through `slot[i]` and grow only the scheduled ones, and a released slot is zeroed in one
        # write, instead of gathering and scattering rows of a request-indexed matrix
        self.slot = np.full(n, -1, dtype=np.int64)
        self._pinned_any = False                                # some slot holds pinned pages
        self._slots(max(1, self.max_running))
        self.entries: list[list] = [[] for _ in range(n)]
        self.drops: list[list] = [[] for _ in range(n)]        # (tokens, id, entry, family) tails held
        self.next_drop = np.full(n, NEVER, dtype=np.int64)
        # phase 1's by-request state (the arrays themselves: the kernels write them in place)
        self._state = (self.computed, self.plen, self.ph, self.pins, self.tpif, self.next_drop)

    def _slots(self, m: int) -> None:
        """Size the slot arrays to `m` slots, keeping the occupied ones (the running set is capped
        at max_num_seqs, so this grows them only for a direct caller that runs more)."""
        k = len(self.occ) if hasattr(self, "occ") else 0
        # per slot and family: logical pages, filled ring slots, own pages, pages held by an
        # in-flight snapshot (one matrix: a released slot is zeroed in one write)
        kv4 = np.zeros((4, m, self.kv.F), dtype=np.int64)
        occ, spart = np.zeros(m, dtype=np.int64), np.zeros(m, dtype=np.int64)
        if k:
            kv4[:, :k], occ[:k], spart[:k] = self.kv4, self.occ, self.spart
        self.kv4, self.occ, self.spart = kv4, occ, spart
        self.L, self.S, self.own, self.pinned = kv4             # each contiguous (slots x F)
        self._free_slots = list(range(m - 1, k - 1, -1))        # a stack: the lowest slot first

    def _next_free_slot(self) -> int:
        """The slot the next admission takes (the free stack's top; the arrays grow if none is free)."""
        if not self._free_slots:
            self._slots(2 * len(self.occ))
        return self._free_slots[-1]

    def _take_slot(self, i: int, p: int) -> int:
        s = self._next_free_slot()
        self._free_slots.pop()
        self.slot[i] = s
        self.occ[s] = i
        self.spart[s] = p
        return s

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
        self.fin[i] = min(self.max_new[i], self.eos_at[i] + 1)
        if self.prefix and self.hashes[i] is None:
            self.hashes[i] = chained_hashes(self.reqs[i].prompt, self.kv.align)
        self.status[i] = WAITING
        self.waiting.append(i)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or len(self.running) > 0

    # ---- the engine: arrivals, the depth-2 pipeline and its lanes in closed form --------------------
    def run(self, until: float | None = None) -> None:
        dev = self.dev
        order = np.argsort(self.arrival, kind="stable")
        arr = self.arrival[order].tolist()
        order = order.tolist()
        ai, n = 0, len(order)
        inflight: deque[Command] = deque()
        discard: set[int] = set()
        prep_free = dev_free = rec_free = 0.0
        slot_free = [0.0, 0.0]
        progress, window = 0, self.livelock_window
        per_req, per_prep, lifecycle, reclaim = (dev.host_schedule_per_request, dev.host_prepare_per_request,
                                                 dev.lifecycle, dev.host_reclaim)
        while True:
            while ai < n and arr[ai] <= self.now:
                self.add_request(order[ai])
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
                    if not cmd.n_prefill:
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
                    if not cmd.n_prefill:
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
                            self.now = max(self.now, arr[ai])
                            self.add_request(order[ai])
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
                done_before = self.finished
                self.apply(cmd)
                if self.finished != done_before or (cmd.counts is not None and cmd.counts.any()):
                    progress = cmd.step_id
                elif cmd.step_id - progress > window and self.has_work:
                    # no progress over the livelock window: upstream would never end
                    self.rec.events.append((self.now, "livelock", None, {"step": cmd.step_id, "since_step": progress}))
                    return
                continue
            if not self.has_work:
                if ai == n:
                    return
                self.now = max(self.now, arr[ai])
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
        sl = self.slot[live]
        assert (sl >= 0).all() and len(set(sl.tolist())) == len(sl) and (self.occ[sl] == live.nonzero()[0]).all()
        np.add.at(used, self.part[live], self.own[sl] + self.pinned[sl])
        idle = np.ones(len(self.occ), dtype=bool)
        idle[sl] = False
        assert not self.kv4[:, idle].any(), "an idle slot holds pages"
        used += kv.live_entry_pages()
        assert (kv.free >= 0).all(), f"negative free pages {kv.free.tolist()}"
        assert (used == kv.cap[None, :] - kv.free).all(), f"page counts drift: used {used.tolist()} free {kv.free.tolist()}"
        assert (self.own >= 0).all() and (self.pinned >= 0).all()
        assert int(kv.load.sum()) == int(live.sum())
        assert len(self.running) <= self.max_running
