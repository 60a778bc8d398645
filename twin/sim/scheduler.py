"""The serving scheduler, as upstream's `Scheduler` (serving-contract.md §4.2-§4.10).

Plain Python, no SimPy: the same object drives a virtual-time run (the SimPy engine) or a
wall-clock loop with a golden or device executor.  One `schedule()` is one step command:

- phase 1, running requests in order, under a *global* token budget in which a K=7 decode
  request costs 1 + 7; chunked prefill at the per-request chunk limit; on a table-growth
  failure the latest arrival is preempted (same partition first) and the growth retried once;
- phase 2, waiting requests FIFO: prefix lookup, partition choice, head-of-line blocking.

`advance_after_schedule` and `update_from_output` do the async accounting (placeholders, the
terminal-prefill barrier, pins, publication after confirmation, per-token EOS/length truncation).
Stop strings are the engine's job (`check_stop`), as upstream.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable

from twin.abi.batches import (PLACEHOLDER_TOKEN, BlockTables, DecodeBatch, DecodeItem, Finish, PrefillBatch,
                              PrefillItem, Request, Status)
from twin.abi.errors import ConfigError

from .kvcache import KVCacheCapacityError, KvCacheManager, Pin
from .leases import LeaseManager, LeasesExhausted
from .worker import dispatch_waves, split_prefill


def check_max_preemptions(n) -> None:
    """The preemption cap's rule, for SchedulerConfig and for SimConfig before any work."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError("max_preemptions", n, "None (upstream: no cap) or >= 1")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_running: int
    chunk_limit: int                 # min(max_prefill_tokens_per_request, long_prefill_token_threshold)
    max_seq_len: int
    k: int
    prefix_caching: bool = True
    replay_tokens: int = 0           # speculative_prefix_cache_replay_tokens (128 at K=7)
    async_depth: int = 2
    stop_check: str = "end"          # "end": upstream (text.endswith after all tokens); "token": per token
    max_preemptions: int | None = None   # None: upstream (unbounded); n: a request preempted n times errors out
    prefill_batch: int = 256             # the executor's packed-prefill limits (dispatch splitting)
    prefill_requests_per_partition: int = 64
    livelock_steps: int | None = None    # steps without progress that end a run as a livelock (None: derived)

    @property
    def livelock_window(self) -> int:
        """Steps with no token kept and no request finished after which the run is a livelock: four
        times the chunks of a longest prompt (the oldest running prefill gets its chunk every step
        unless preempted) plus slack; decisions never depend on it."""
        if self.livelock_steps is not None:
            return self.livelock_steps
        return 4 * -(-self.max_seq_len // max(1, min(self.chunk_limit, self.max_num_batched_tokens))) + 256

    @classmethod
    def from_deployment(cls, dep, **kw) -> "SchedulerConfig":
        lim = dep.limits
        kw.setdefault("prefill_batch", dep.prefill_batch)
        kw.setdefault("prefill_requests_per_partition", dep.prefill_requests_per_partition)
        return cls(lim.max_num_batched_tokens, lim.max_num_seqs, lim.max_prefill_tokens_per_request,
                   lim.max_model_len, lim.k, lim.enable_prefix_caching,
                   lim.speculative_prefix_cache_replay_tokens, **kw)

    def __post_init__(self):
        if self.async_depth not in (1, 2):
            raise ConfigError("async_depth", self.async_depth, "1 (synchronous) or 2 (async scheduling)")
        if self.stop_check not in ("end", "token"):
            raise ConfigError("stop_check", self.stop_check, "'end' (upstream) or 'token'")
        check_max_preemptions(self.max_preemptions)
        if self.livelock_steps is not None and self.livelock_steps < 1:
            raise ConfigError("livelock_steps", self.livelock_steps, "None (derived) or >= 1 steps")


def _neg_arrival(r: Request) -> float:
    return -r.arrival


def _first_other(order: list[Request], req: Request) -> Request | None:
    """The first running request of `order` other than `req`; requests no longer running (preempted
    or finished in this pass) are dropped from `order` for good."""
    running = Status.RUNNING
    i = 0
    while i < len(order):
        r = order[i]
        if r.status is not running:
            del order[i]
        elif r is req:
            i += 1
        else:
            return r
    return None


class Scheduled:
    """One request in a step command (`ScheduledRequest` plus what advance/update need)."""

    __slots__ = ("req", "num_new", "spec", "start", "prefill", "samples", "incarnation", "pin")

    def __init__(self, req: Request, num_new: int, spec: int, start: int, prefill: bool, samples: bool,
                 incarnation: int):
        self.req, self.num_new, self.spec, self.start = req, num_new, spec, start   # start: num_computed
        self.prefill, self.samples, self.incarnation = prefill, samples, incarnation
        self.pin: Pin | None = None


@dataclass(eq=False)
class StepCommand:
    """What the engine sends the worker (`StepCommand`): deltas only."""

    step_id: int
    scheduled: list[Scheduled]
    prefill: PrefillBatch
    decode: DecodeBatch
    new_requests: tuple[Request, ...]
    finished_ids: tuple[str, ...]
    error: str | None = None         # a worker-side failure this command will raise (lease exhaustion)
    dispatches: list[PrefillBatch] | None = None   # the packed-prefill split (None: the worker splits)

    @property
    def decode_only(self) -> bool:
        return not self.prefill.items and bool(self.decode.items)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new + s.spec for s in self.scheduled)


class SchedulerProbe:
    """Hooks for monitoring; the scheduler calls them and never reads anything back."""

    def admitted(self, req: Request, hit_tokens: int, fallback: bool) -> None: ...
    def preempted(self, req: Request, by: Request) -> None: ...
    def finished(self, req: Request) -> None: ...
    def stop_in_chunk(self, req: Request, index: int, n_new: int) -> None: ...


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KvCacheManager, *, leases: LeaseManager | None = None,
                 probe: SchedulerProbe | None = None, noise_token: int = 0):
        self.cfg = cfg
        self.kv = kv
        self.leases = leases if leases is not None else (LeaseManager(kv.partitions) if cfg.k else None)
        self.probe = probe or SchedulerProbe()
        self.log = None                      # a DecisionLog when the run keeps one
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished: list[Request] = []
        self._finished_ids: list[str] = []
        self._step = 0
        self._pass = 0
        self._noise = (noise_token,) * cfg.k
        # the prompts of admitted, unfinished requests as ints (a preempted one prefills again; a
        # scheduler that replaces a prompt array at preemption gets the new one converted)
        self._prompt_tokens: dict[str, tuple] = {}
        self._family_index = {name: f for f, name in enumerate(kv.names)}   # family -> its slot in a pin's tables
        self.max_hit_offset = max(1, cfg.replay_tokens)
        self._progress_step = 0             # the last step whose result kept a token or finished a request
        self._thrash: list[tuple[str, str, int]] = []   # (victim, by, partition) since then

    # ---- admission (`add_request`) -------------------------------------------------------------
    def add_request(self, req: Request) -> bool:
        if req.request_id in self.requests:
            raise ConfigError("request_id", req.request_id, "an id not already submitted")
        self.requests[req.request_id] = req
        L = self.cfg.max_seq_len
        if req.prompt_len == 0 or req.prompt_len >= L:
            why = "empty prompt" if req.prompt_len == 0 else (
                f"prompt_len {req.prompt_len} leaves nothing to generate under max_seq_len {L}"
                if req.prompt_len == L else f"prompt_len {req.prompt_len} > max_seq_len {L}")
            self._finish(req, Finish.REJECTED, why)
            return False
        if req.sampling.max_new_tokens < 1:
            self._finish(req, Finish.REJECTED, f"max_new_tokens {req.sampling.max_new_tokens} < 1")
            return False
        req.max_new_tokens = min(req.sampling.max_new_tokens, L - req.prompt_len)
        if self.cfg.prefix_caching and req.hashes is None:
            req.hashes = self.kv.prompt_hashes(req.prompt)
        req.status = Status.WAITING
        self.waiting.append(req)
        return True

    def abort(self, rid: str, detail: str = "aborted by client") -> None:
        req = self.requests[rid]
        if not req.finished:
            if self.log is not None:
                self.log.begin_event("abort", self._step)
            self._finish(req, Finish.ABORTED, detail)

    def drain_finished(self) -> tuple[str, ...]:
        """The finished ids no command has carried yet, handed to the worker now (it frees their
        leases), as when a run ends with nothing left to schedule."""
        ids, self._finished_ids = tuple(self._finished_ids), []
        if self.leases is not None:
            for rid in ids:
                self.leases.release(rid)
        return ids

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- schedule() -------------------------------------------------------------------------
    def _limit(self, req: Request, budget: int) -> int:
        n = min(req.num_new_tokens_needed, budget, self.cfg.max_seq_len - req.num_computed)
        if req.is_prefill:
            n = min(n, self.cfg.chunk_limit)
        return n

    def schedule(self) -> StepCommand:
        cfg = self.cfg
        budget = cfg.max_num_batched_tokens
        max_seq, chunk = cfg.max_seq_len, cfg.chunk_limit
        out: dict[str, Scheduled] = {}
        self._pass += 1
        if self.log is not None:
            self.log.begin_schedule()
        finished_ids, self._finished_ids = self._finished_ids, []     # preemptions below queue here

        # phase 1: running requests, over the list as it stood (a victim later in it is skipped)
        victims = None                   # the pass's victim order, built at its first preemption
        ensure = self.kv.ensure
        running, k = Status.RUNNING, cfg.k
        for req in list(self.running):
            if req.terminal_prefill_in_flight or req.status is not running:
                continue
            computed = req.num_computed
            plen = req.prompt_len
            prefill = computed < plen
            num_new = min(plen + len(req.outputs) + req.num_placeholders - computed, budget, max_seq - computed)
            if prefill and num_new > chunk:
                num_new = chunk
            if num_new <= 0:
                continue
            spec = 0 if prefill else max(0, min(k, max_seq - computed - num_new))
            cost = num_new + spec
            if cost > budget:
                continue
            rid = req.request_id
            try:
                ensure(rid, computed + cost)
            except KVCacheCapacityError:
                if victims is None:
                    victims = self._victim_order()
                victim = self._victim(req, victims)
                if victim is None:
                    continue
                budget += self._preempt(victim, req, out)
                try:
                    ensure(rid, computed + cost)
                except KVCacheCapacityError:
                    continue
            out[rid] = Scheduled(req, num_new, spec, computed, prefill, (not prefill) or computed + num_new >= plen,
                                 req.incarnation)
            budget -= cost

        # phase 2: waiting requests, FIFO, head-of-line blocking; a request preempted in this pass
        # (or with nothing to prefill) is set aside at its place and admission goes on after it
        new_reqs = []
        aside: list[Request] = []
        waiting = self.waiting
        while waiting and budget > 0 and len(self.running) < cfg.max_num_running:
            req = waiting.popleft()
            if req.preempted_in_pass == self._pass:
                aside.append(req)
                continue
            rid = req.request_id
            hit, part = 0, None
            if self.cfg.prefix_caching:
                hit, part = self.kv.lookup(req.hashes, req.prompt_len - self.max_hit_offset)
            fallback = False
            if hit:
                self.kv.attach(rid, req.hashes, hit, part)
                req.num_computed = hit
                num_new = self._limit(req, budget)
                try:
                    self.kv.ensure(rid, hit + num_new)
                except KVCacheCapacityError:
                    self.kv.release(rid)          # prefix_cache_fallback: retry cold anywhere
                    hit, fallback = 0, True
            if not hit:
                req.num_computed = 0
                num_new = self._limit(req, budget)
                if num_new <= 0:
                    aside.append(req)
                    continue
                try:
                    self.kv.ensure(rid, num_new)
                except KVCacheCapacityError:
                    self.kv.release(rid)
                    aside.append(req)
                    break
            req.status = Status.RUNNING
            req.partition = self.kv.partition_of(rid)
            req.cached_tokens = hit
            self.running.append(req)
            self.probe.admitted(req, hit, fallback)
            if self.log is not None:
                self.log.admitted(req, hit, fallback)
            new_reqs.append(req)
            out[rid] = Scheduled(req, num_new, 0, req.num_computed, True,
                                 req.num_computed + num_new >= req.prompt_len, req.incarnation)
            budget -= num_new
        if aside:
            waiting.extendleft(reversed(aside))
        # requests preempted in this pass ride this command, so the worker frees their leases
        # before this command's reservations
        finished_ids += self._finished_ids
        self._finished_ids = []
        if not out:
            self._finished_ids[:0] = finished_ids   # nothing to send: they ride the next command
            finished_ids = []
        return self._command(out, tuple(new_reqs), tuple(finished_ids))

    def _victim_order(self) -> tuple[list[Request], dict]:
        """The running requests by latest arrival first, the first in running order first among
        equal arrivals (a stable sort), overall and per partition: phase 1 preempts many times per
        pass over one running list that only loses requests, so the order is sorted once."""
        order = sorted(self.running, key=_neg_arrival)
        by_part: dict = {}
        for r in order:
            by_part.setdefault(r.partition, []).append(r)
        return order, by_part

    def _victim(self, req: Request, order: tuple[list[Request], dict] | None = None) -> Request | None:
        """Latest arrival among the other running requests, same partition first; `max` keeps the
        first in running order on equal arrival times, as upstream's does.  `order`: this pass's
        `_victim_order` (requests that stopped running since are dropped from it here)."""
        every, by_part = order if order is not None else self._victim_order()
        same = by_part.get(req.partition)
        return (_first_other(same, req) if same else None) or _first_other(every, req)

    def _preempt(self, victim: Request, by: Request, out: dict) -> int:
        """Free the victim's pages (an in-flight step keeps its pins), reset it to computed 0 and
        put it at the front of `waiting`; returns the budget handed back if the victim was already
        scheduled in this pass."""
        back = 0
        s = out.pop(victim.request_id, None)
        if s is not None:
            back = s.num_new + s.spec
        self.probe.preempted(victim, by)
        if self.log is not None:
            self.log.preempted(victim, by)
        self._thrash.append((victim.request_id, by.request_id, victim.partition))
        self.kv.release(victim.request_id)
        self.running.remove(victim)
        victim.num_preemptions += 1
        if self.cfg.max_preemptions is not None and victim.num_preemptions >= self.cfg.max_preemptions:
            # an explicit cap: end a thrashing request visibly instead of preempting it again
            victim.status = Status.PREEMPTED
            self._finish(victim, Finish.ERROR, f"preempted {victim.num_preemptions} times: preemption cap")
            return back
        self._finished_ids.append(victim.request_id)   # the worker drops lease and drafter state
        victim.num_computed = 0
        victim.num_placeholders = 0
        victim.terminal_prefill_in_flight = False
        victim.partition = None
        victim.lease = victim.generation = None
        victim.incarnation += 1
        victim.status = Status.PREEMPTED
        victim.preempted_in_pass = self._pass
        self.waiting.appendleft(victim)
        return back

    def _command(self, out: dict[str, Scheduled], new_reqs, finished_ids) -> StepCommand:
        self._step += 1
        k = self.cfg.k
        kv = self.kv
        index = self._family_index
        prompts = self._prompt_tokens
        noise = self._noise
        pre, dec = [], []
        for s in out.values():
            req = s.req
            rid = req.request_id
            s.pin = pin = kv.pin(rid)
            blocks = BlockTables(index, pin.tables)
            if s.prefill:
                got = prompts.get(rid)
                if got is None or got[0] is not req.prompt:   # the prompt as ints, once per prompt array
                    got = prompts[rid] = (req.prompt, tuple(req.prompt.tolist()))
                toks = got[1]
                pre.append(PrefillItem(rid, toks[s.start:s.start + s.num_new], s.start, req.prompt_len, blocks,
                                       req.partition, req.lease, req.generation))
            else:
                # pending drafts whenever K > 0: the runner falls back on its own committed count
                # (`committed_count + 7 < max_position`), which the scheduler's async anchor overstates
                last = PLACEHOLDER_TOKEN if req.num_placeholders else req.outputs[-1]
                dec.append(DecodeItem(rid, last, s.start + s.num_new - 1, blocks, req.partition,
                                      noise, req.lease, req.generation))
        error = None
        taken: list = []
        dispatches = []
        if pre:
            try:
                dispatches = split_prefill(pre, self.cfg.prefill_batch, self.cfg.prefill_requests_per_partition)
            except ValueError as e:
                error = str(e)                    # no dispatch: the worker fails the step with it
        if self.leases is not None and out:
            for rid in finished_ids:
                self.leases.release(rid)          # the worker frees finished leases before new reservations
            pre, dispatches, lease_error, taken = self._reserve_leases(pre, dispatches)
            error = lease_error or error
        cmd = StepCommand(self._step, list(out.values()), PrefillBatch(tuple(pre)),
                          DecodeBatch(tuple(dec), k), new_reqs, finished_ids, error, dispatches)
        if self.log is not None:
            waves = dispatch_waves(dispatches) if k else []
            self.log.command(cmd, taken, waves)
        return cmd

    def _reserve_leases(self, pre: list[PrefillItem], dispatches):
        """A request's first prefill chunk takes a drafter lease in dispatch order (the runner's
        tail capture runs dispatch by dispatch), not in scheduled order.  Returns the items and
        dispatches with the new leases, the first exhaustion error and the leases taken."""
        order = [it for batch in dispatches for it in batch.items] if dispatches else pre
        error = None
        taken = []
        leased = {}
        for it in order:
            if it.lease is None:
                req = self.requests[it.request_id]
                try:
                    req.lease, req.generation = self.leases.reserve(req.request_id, req.partition)
                except LeasesExhausted as e:
                    error = error or str(e)
                    continue
                taken.append((req.request_id, req.lease, req.generation))
                leased[id(it)] = PrefillItem(it.request_id, it.chunk_tokens, it.num_computed, it.prompt_len,
                                             it.block_ids, it.partition, req.lease, req.generation)
        if leased:
            pre = [leased.get(id(it), it) for it in pre]
            if dispatches:
                dispatches = [PrefillBatch(tuple(leased.get(id(it), it) for it in b.items)) for b in dispatches]
        return pre, dispatches, error, taken

    # ---- async accounting ----------------------------------------------------------------------
    def advance_after_schedule(self, cmd: StepCommand) -> None:
        k = self.cfg.k
        for s in cmd.scheduled:
            req = s.req
            if s.samples:
                req.num_computed += s.num_new + s.spec
                req.num_placeholders += 1 + s.spec
                if s.prefill and k > 0:
                    req.terminal_prefill_in_flight = True
            else:
                req.num_computed += s.num_new

    def update_from_output(self, cmd: StepCommand, tokens: dict[str, list[int]]) -> list[tuple[Request, int]]:
        """Apply one step's accepted tokens; returns (request, tokens appended) for stop checks.
        Requests that finish here free their pages after the whole update, in running order, after
        every snapshot release of this step (upstream's order)."""
        touched = []
        done = False
        log = self.log
        if log is not None:
            log.begin_apply(cmd.step_id)
        publish, unpin = self.kv.publish, self.kv.unpin
        finished = Status.FINISHED
        for s in cmd.scheduled:
            req = s.req
            rid = req.request_id
            if req.status is finished or req.incarnation != s.incarnation:
                if log is not None:
                    log.discarded(req)
                req.discarded_tokens += len(tokens.get(rid, ()))
                unpin(rid, s.pin)                 # a stale result: its snapshot goes now
                continue
            publish(rid, s.pin, s.start + s.num_new, req.hashes)
            unpin(rid, s.pin)
            if not s.samples:
                continue
            req.terminal_prefill_in_flight = False
            toks = tokens.get(rid, ())
            out = req.outputs
            sp = req.sampling
            eos = None if sp.ignore_eos else sp.eos_token_id
            limit = req.max_new_tokens
            if len(out) + len(toks) < limit and (eos is None or eos not in toks):
                out.extend(toks)                        # no finish inside this chunk
                retained = len(toks)
            else:
                retained = 0
                for t in toks:
                    out.append(t)
                    retained += 1
                    if t == eos or len(out) >= limit:   # per token: later tokens are dropped
                        req.dropped_tokens += len(toks) - retained
                        self._end(req, Finish.EOS if t == eos else Finish.LENGTH)
                        done = True
                        break
            touched.append((req, retained))
            if req.status is finished:
                continue
            req.num_placeholders -= 1 + s.spec
            req.num_computed += (retained - 1) - s.spec
        if done:
            for req in [r for r in self.running if r.finished]:
                self._retire(req)
        if done or any(n for _, n in touched):
            self._progress_step = cmd.step_id
            self._thrash.clear()
        return touched

    def livelock(self) -> dict | None:
        """No progress (no token kept, no request finished) over `livelock_window` steps: upstream
        would go on forever (two requests preempting each other).  The run's driver stops and
        reports this; it never changes a decision."""
        if self._step - self._progress_step <= self.cfg.livelock_window or not self.has_work:
            return None
        return {"step": self._step, "since_step": self._progress_step,
                "requests": sorted({v for v, _, _ in self._thrash} | {b for _, b, _ in self._thrash}),
                "partitions": sorted({p for _, _, p in self._thrash if p is not None}),
                "preemptions": len(self._thrash)}

    def check_stop(self, touched: Iterable[tuple[Request, int]]) -> None:
        """The engine's stop-string check after `update_from_output` (serving-contract §4.10):
        upstream tests `endswith(stop)` once on the cumulative output, so a stop completed by an
        earlier token of a multi-token acceptance is missed ("end"); "token" checks each token."""
        for req, n in touched:
            stops = req.sampling.stop
            if not stops or n == 0 or req.finished:
                continue
            out = req.outputs
            L = len(out)
            first = None
            for j in range(L - n + 1, L + 1):     # output lengths after each appended token
                if any(j >= len(st) and tuple(out[j - len(st):j]) == st for st in stops):
                    first = j
                    break
            if first is None:
                continue
            if first < L:
                self.probe.stop_in_chunk(req, first, n)
                if self.cfg.stop_check == "token":
                    req.dropped_tokens += L - first
                    del out[first:]
                elif not any(L >= len(st) and tuple(out[L - len(st):]) == st for st in stops):
                    continue                      # upstream misses it: generation goes on
            self._finish(req, Finish.STOP)

    # ---- finishing ---------------------------------------------------------------------------
    def _finish(self, req: Request, reason: Finish, detail: str = "") -> None:
        self._end(req, reason, detail)
        self._retire(req)

    def _end(self, req: Request, reason: Finish, detail: str = "") -> None:
        """Mark `req` finished; its pages stay until `_retire`."""
        req.status = Status.FINISHED
        req.finish = reason
        req.finish_detail = detail
        req.num_placeholders = 0
        req.terminal_prefill_in_flight = False

    def _retire(self, req: Request) -> None:
        """Free a finished request's pages and queue its id for the worker."""
        self.kv.release(req.request_id)
        self._prompt_tokens.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._finished_ids.append(req.request_id)
        self.finished.append(req)
        self.probe.finished(req)
        if self.log is not None:
            self.log.finished(req)

    def fail_inflight(self, cmds: Iterable[StepCommand], detail: str) -> None:
        """A worker error or timeout: every request in the failed and in-flight batches aborts
        with finish reason "error" (serving-contract §4.11)."""
        cmds = list(cmds)
        if self.log is not None and cmds:
            self.log.begin_event("error", cmds[0].step_id, steps=[c.step_id for c in cmds], error=detail)
        for cmd in cmds:
            for s in cmd.scheduled:
                if not s.req.finished and s.req.incarnation == s.incarnation:
                    self._finish(s.req, Finish.ERROR, detail)
        for cmd in cmds:                          # the dropped steps' snapshots go with them
            for s in cmd.scheduled:
                self.kv.unpin(s.req.request_id, s.pin)

    def break_stall(self) -> Request:
        """Nothing in flight and nothing schedulable: upstream would wait forever.  The twin ends
        the stall with an explicit reason instead (the engine records it as a risk)."""
        if self.log is not None:
            self.log.begin_event("stall", self._step)
        if self.running:
            req = self.running[0]
            self._finish(req, Finish.ERROR, "stalled: KV tables cannot grow and no request can be preempted")
        else:
            req = self.waiting[0]
            self._finish(req, Finish.REJECTED, "does not fit in any partition's KV pools")
        return req

    # ---- accounting checks -----------------------------------------------------------------------
    def check(self) -> None:
        for r in self.running:
            assert r.status is Status.RUNNING and r.num_placeholders >= 0, r
            assert r.num_computed <= self.cfg.max_seq_len, r
            assert len(r.outputs) <= r.max_new_tokens, r
        for r in self.finished:
            assert r.finish is not None and r.status is Status.FINISHED
            assert self.kv.partition_of(r.request_id) is None, f"{r.request_id}: finished but owns blocks"
        assert len(self.running) <= self.cfg.max_num_running
