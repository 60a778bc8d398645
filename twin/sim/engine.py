"""The SimPy engine: upstream's engine loop and worker lanes in virtual time.

- engine loop: while the batch queue (depth 2 when async) has room and there is work,
  `schedule()`, send the command and `advance_after_schedule`; otherwise wait for the oldest
  result and apply it (`update_from_output`, then stop strings);
- worker lanes, FIFO: *prepare* (decode-only commands into ping-pong slot step_id % 2, one
  semaphore per slot), *device* (lifecycle, then the dispatches one after the other: packed
  prefills, seeding waves, decode; a decode-only K=7 command is submitted and left to the
  reclaim lane: split reclaim), *reclaim* (waits for the device, reads outputs, publishes
  results in dispatch order);
- a worker error aborts the failed batch and every in-flight batch (serving-contract §4.11);
- a run with no progress over the scheduler's livelock window stops and reports the livelock.

The scheduler and the executor are plain objects handed in; this module only adds time.
"""
from __future__ import annotations

from collections import deque

import simpy

from .costmodel import DeviceLimits
from .scheduler import Scheduler
from .worker import plan as make_plan


class Engine:
    def __init__(self, env: simpy.Environment, scheduler: Scheduler, executor, dep, device: DeviceLimits,
                 recorder=None, *, depth: int = 2, max_concurrency: int | None = None):
        self.env, self.sched, self.executor, self.dep, self.dev = env, scheduler, executor, dep, device
        self.rec = recorder
        self.depth = depth
        self.inflight: deque = deque()
        self.discard: set[int] = set()
        self.cmd_q = simpy.Store(env)
        self.dev_q = simpy.Store(env)
        self.reclaim_q = simpy.Store(env)
        self.res_q = simpy.Store(env)
        self.slots = (simpy.Resource(env, 1), simpy.Resource(env, 1))
        self.device_free = 0.0
        self._wake = env.event()
        self._arrivals_left = 0
        # `vllm bench serve --max-concurrency`: a closed loop; a request is sent only while fewer
        # than this many of the client's requests are unfinished, and its clock starts when sent
        self.max_concurrency = max_concurrency
        self._sent = 0
        self._finished_ev = env.event()
        self.done = env.event()
        self.split_reclaim = bool(dep.k)          # only the fused K=7 path reclaims split
        self.livelock: dict | None = None          # the scheduler's livelock report, when it stopped the run
        for proc in (self._engine(), self._prepare(), self._device(), self._reclaim()):
            env.process(proc)

    # ---- arrivals -----------------------------------------------------------------------------
    def submit(self, requests) -> None:
        reqs = sorted(requests, key=lambda r: r.arrival)
        self._arrivals_left += len(reqs)
        self.env.process(self._arrive(reqs))

    def _arrive(self, reqs):
        env = self.env
        mc = self.max_concurrency
        for r in reqs:
            if r.arrival > env.now:
                yield env.timeout(r.arrival - env.now)
            if mc is not None:
                while self._sent - len(self.sched.finished) >= mc:
                    self._finished_ev = env.event()
                    yield self._finished_ev
                if env.now > r.arrival:
                    wait, r.arrival = env.now - r.arrival, env.now
                    if self.rec:
                        self.rec.client_queue[r.request_id] = wait
                self._sent += 1
            self._arrivals_left -= 1
            self.sched.add_request(r)
            if self.rec:
                self.rec.arrived(r)
            self._poke()

    def _poke(self):
        if not self._wake.triggered:
            self._wake.succeed()

    def _finishes_seen(self):
        """A result, failure or stall may have finished requests: let a gated arrival go."""
        if self.max_concurrency is not None and not self._finished_ev.triggered:
            self._finished_ev.succeed()

    # ---- engine loop ---------------------------------------------------------------------------
    def _engine(self):
        env, sched = self.env, self.sched
        per_req = self.dev.host_schedule_per_request
        while True:
            if len(self.inflight) < self.depth and sched.has_work:
                cmd = sched.schedule()
                if cmd.scheduled:
                    sched.advance_after_schedule(cmd)
                    self.inflight.append(cmd)
                    if self.rec:
                        self.rec.scheduled(cmd, sched)
                    t0 = env.now
                    yield env.timeout(per_req * len(cmd.scheduled))
                    if self.rec:
                        self.rec.host("schedule", cmd.step_id, t0, env.now)
                    self.cmd_q.put(cmd)
                    continue
            if self.inflight:
                res = yield self.res_q.get()
                cmd = self.inflight.popleft()
                if res.step_id != cmd.step_id:
                    raise AssertionError(f"step-id desync: result {res.step_id} for command {cmd.step_id}")
                if cmd.step_id in self.discard:
                    self.discard.discard(cmd.step_id)
                    continue
                if res.error:
                    doomed = [cmd, *self.inflight]
                    self.discard.update(c.step_id for c in self.inflight)
                    sched.fail_inflight(doomed, res.error)
                    if self.rec:
                        self.rec.worker_error(cmd, res.error)
                    self._finishes_seen()
                    continue
                touched = sched.update_from_output(cmd, res.tokens)
                sched.check_stop(touched)
                if self.rec:
                    self.rec.applied(cmd, res, touched)
                self._finishes_seen()
                lock = sched.livelock()
                if lock is not None:          # upstream would never end: stop and report it
                    self.livelock = lock
                    if self.rec:
                        self.rec.livelock(lock)
                    self.done.succeed()
                    return
                continue
            if not sched.has_work:
                if self._arrivals_left == 0:
                    self.done.succeed()
                    return
            else:                 # work, nothing in flight, nothing schedulable: a stall
                self._break_stall()
                continue
            self._wake = env.event()
            yield self._wake

    def _break_stall(self):
        req = self.sched.break_stall()
        if self.rec:
            self.rec.stall(req)
        self._finishes_seen()

    # ---- worker lanes ----------------------------------------------------------------------------
    def _prepare(self):
        env = self.env
        while True:
            cmd = yield self.cmd_q.get()
            plan = make_plan(cmd, self.dep)
            slot_req = None
            if plan.decode_only:
                slot_req = self.slots[cmd.step_id % 2].request()
                yield slot_req
            t0 = env.now
            yield env.timeout(self.dev.host_prepare_per_request * len(cmd.scheduled))
            if self.rec:
                self.rec.host("prepare", cmd.step_id, t0, env.now)
            self.dev_q.put((cmd, plan, slot_req))

    def _device(self):
        env = self.env
        while True:
            cmd, plan, slot_req = yield self.dev_q.get()
            if self.device_free > env.now:
                yield env.timeout(self.device_free - env.now)      # one device: dispatches are serial
            yield env.timeout(self.dev.lifecycle)
            res = self.executor.execute(plan)
            t = env.now
            for d in res.dispatches:
                if self.rec:
                    self.rec.dispatch(cmd, d, t)
                t += d.seconds
            if self.split_reclaim and plan.decode_only and not plan.requests and not res.error:
                self.device_free = t
                self.reclaim_q.put((cmd, res, env.timeout(t - env.now), slot_req))
            else:
                yield env.timeout(t - env.now)
                self.device_free = env.now
                self.reclaim_q.put((cmd, res, None, slot_req))

    def _reclaim(self):
        env = self.env
        while True:
            cmd, res, done, slot_req = yield self.reclaim_q.get()
            if done is not None:
                yield done
            t0 = env.now
            yield env.timeout(self.dev.host_reclaim)
            if self.rec:
                self.rec.host("reclaim", cmd.step_id, t0, env.now)
            if slot_req is not None:
                self.slots[cmd.step_id % 2].release(slot_req)
            self.res_q.put(res)
