"""Hypothesis stateful test of the scheduler + grouped prefix cache + leases, with no SimPy.

Random operations: arrive (fresh or shared-prefix prompts, planted EOS and stop sequences),
schedule (async, up to two steps in flight), accept 1..8 tokens per decode request (applying the
oldest in-flight step), abort, forced preemption (of requests with steps in flight), and worker
errors.  After every operation: no page leaks, ref counts equal owners plus in-flight pins, no
block twice in one request's row, leases consistent, placeholders and computed tokens exactly
as the async accounting says.  At teardown everything drains: every request finished or
rejected with a reason, and every page and lease is free again.

How the 10,000 operations are counted: `OPS` counts executed rules over all examples of one
run of the machine, and the test that runs it asserts the count reached 10,000.
"""
from __future__ import annotations

from collections import deque

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from twin.abi import deployment
from twin.sim.kvcache import KvCacheManager
from twin.sim.leases import LeaseManager
from twin.abi.batches import Finish, Request, Sampling, Status
from twin.sim.scheduler import Scheduler, SchedulerConfig

OPS = [0]
SEEN = {"prefix_hits": 0, "preemptions": 0, "stops": 0, "eos": 0, "errors": 0}
DEP = deployment("flash", ep=16, max_model_len=512, long_prefill_token_threshold=128, max_num_seqs=48,
                 max_num_batched_tokens=1024, num_speculative_tokens=7)
PREFIXES = [np.random.default_rng(i).integers(2, 1000, 384, dtype=np.int32) for i in range(2)]
EOS = 1
STOP = (7, 8)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(slots=st.integers(1, 3))
    def setup(self, slots):
        self.kv = KvCacheManager.from_deployment(DEP, slots)
        self.leases = LeaseManager(DEP.partitions)
        self.sched = Scheduler(SchedulerConfig.from_deployment(DEP), self.kv, leases=self.leases)
        self.inflight: deque = deque()
        self.delivered: dict[str, int] = {}
        self.n = 0
        self.rng = np.random.default_rng(0)

    def _op(self):
        OPS[0] += 1

    # ---- operations --------------------------------------------------------------------------
    @rule(plen=st.integers(1, 520), out=st.integers(1, 40), shared=st.sampled_from([None, 0, 1]),
          eos_at=st.none() | st.integers(0, 40), stop_at=st.none() | st.integers(0, 40))
    def arrive(self, plen, out, shared, eos_at, stop_at):
        self._op()
        if shared is not None:
            prompt = np.concatenate([PREFIXES[shared], np.full(max(0, plen - 384), 5, np.int32)])[:max(plen, 129)]
        else:
            prompt = self.rng.integers(2, 1000, plen, dtype=np.int32)
        script = {}
        stops = ()
        if stop_at is not None:
            script.update({stop_at: STOP[0], stop_at + 1: STOP[1]})
            stops = (STOP,)
        if eos_at is not None:
            script[eos_at] = EOS
        rid = f"q{self.n}"
        self.n += 1
        self.sched.add_request(Request(rid, prompt, Sampling(out, EOS, False, stops), float(self.n), script))
        self.delivered[rid] = 0

    @precondition(lambda self: len(self.inflight) < 2)
    @rule()
    def schedule(self):
        self._op()
        cmd = self.sched.schedule()
        if cmd.scheduled:
            self.sched.advance_after_schedule(cmd)
            self.inflight.append(cmd)

    @precondition(lambda self: bool(self.inflight))
    @rule(counts=st.lists(st.integers(1, 8), min_size=1, max_size=8))
    def accept(self, counts):
        self._op()
        cmd = self.inflight.popleft()
        tokens = {}
        for i, s in enumerate(cmd.scheduled):
            if not s.samples:
                continue
            n = 1 if s.prefill else min(counts[i % len(counts)], 1 + s.spec)
            req = s.req
            base = len(req.outputs)
            tokens[req.request_id] = [req.script.get(base + j, 100 + (base + j) % 50) for j in range(n)]
            if not req.finished and req.incarnation == s.incarnation:
                self.delivered[req.request_id] += n
        touched = self.sched.update_from_output(cmd, tokens)
        self.sched.check_stop(touched)

    @precondition(lambda self: bool(self.sched.running or self.sched.waiting))
    @rule(i=st.integers(0, 10_000))
    def abort(self, i):
        self._op()
        live = list(self.sched.running) + list(self.sched.waiting)
        self.sched.abort(live[i % len(live)].request_id)

    @precondition(lambda self: len(self.sched.running) >= 1)
    @rule(i=st.integers(0, 10_000))
    def preempt(self, i):
        self._op()
        victim = self.sched.running[i % len(self.sched.running)]
        self.sched._preempt(victim, victim, {})

    @precondition(lambda self: bool(self.inflight))
    @rule()
    def worker_error(self):
        self._op()
        self.sched.fail_inflight(list(self.inflight), "injected worker error")
        self.inflight.clear()

    # ---- invariants ----------------------------------------------------------------------------
    @invariant()
    def pools_and_accounting(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check()
        self.leases.check()
        self.sched.check()
        ph: dict[str, int] = {}
        busy = set()
        for cmd in self.inflight:
            for s in cmd.scheduled:
                if s.req.incarnation == s.incarnation and not s.req.finished:
                    busy.add(s.req.request_id)
                    if s.samples:
                        ph[s.req.request_id] = ph.get(s.req.request_id, 0) + 1 + s.spec
        for r in self.sched.requests.values():
            assert r.num_placeholders == ph.get(r.request_id, 0), r
            assert self.delivered.get(r.request_id, 0) == len(r.outputs) + r.dropped_tokens, r
            if (r.status is Status.RUNNING and r.request_id not in busy and r.outputs and not r.is_prefill
                    and not r.num_preemptions):      # a re-prefill after outputs lags (recompute gap, §4.7)
                assert r.num_computed == r.prompt_len + len(r.outputs) - 1, r
            if r.status is Status.RUNNING:
                assert self.kv.partition_of(r.request_id) == r.partition
            if r.finished:
                assert r.finish is not None
                if r.finish is Finish.LENGTH:
                    assert len(r.outputs) == r.max_new_tokens
                if r.finish is Finish.EOS:
                    assert r.outputs[-1] == EOS
                if r.finish is Finish.STOP:
                    assert tuple(r.outputs[-2:]) == STOP

    def teardown(self):
        """Drain synchronously: with no step in flight no pin forces a detach, so even one-slot
        pools cannot thrash (async draining at one slot can livelock, as upstream would)."""
        if not hasattr(self, "kv"):
            return
        for _ in range(5000):
            if not (self.sched.has_work or self.inflight):
                break
            if not self.inflight:
                cmd = self.sched.schedule()
                if cmd.scheduled:
                    self.sched.advance_after_schedule(cmd)
                    self.inflight.append(cmd)
                    continue
            if self.inflight:
                self.accept([8])
            else:
                self.sched.break_stall()
        assert not self.sched.has_work and not self.inflight
        assert self.sched.schedule().scheduled == []
        self.sched.drain_finished()               # the worker releases the last finished leases
        for r in self.sched.requests.values():
            assert r.finished and r.finish is not None, r
            if r.finish is Finish.REJECTED:
                assert r.finish_detail
        assert all(len(fl) == self.leases.per_group for fl in self.leases.free)
        for r in self.sched.requests.values():
            SEEN["prefix_hits"] += r.cached_tokens > 0
            SEEN["preemptions"] += r.num_preemptions
            SEEN["stops"] += r.finish is Finish.STOP
            SEEN["eos"] += r.finish is Finish.EOS
            SEEN["errors"] += r.finish is Finish.ERROR
        for f, fam in enumerate(self.kv.families):
            for p in range(self.kv.partitions):
                assert len(self.kv.free[f][p]) == fam.blocks_per_partition, f"{fam.name} p{p}: pages leaked"
        self.kv.check()


def test_the_scheduler_machine_runs_10000_operations():
    """The machine's examples, then the count of the operations they executed (in one test, so the
    count does not depend on which other tests ran or in what order)."""
    OPS[0] = 0
    SEEN.update(dict.fromkeys(SEEN, 0))
    run_state_machine_as_test(SchedulerMachine, settings=settings(max_examples=160, stateful_step_count=100,
                                                                  deadline=None))
    print(f"stateful scheduler test: {OPS[0]} operations, {SEEN}")
    assert OPS[0] >= 10_000, f"only {OPS[0]} operations ran"
    assert SEEN["prefix_hits"] > 0 and SEEN["preemptions"] > 0, f"a path was never exercised: {SEEN}"
