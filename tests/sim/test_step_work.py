"""The scheduler's per-step work in its fast forms, each against the rule it computes: the victim
from a pass's sorted order, the packed-prefill split made once and carried on the command, and a
request's prompt converted to ints once per prompt array."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from twin.abi.batches import Request, Sampling, Status
from twin.functional import ReplayScheduler
from twin.sim.kvcache import FamilySpec, KvCacheManager
from twin.sim.leases import LeaseManager
from twin.sim.scheduler import Scheduler, SchedulerConfig
from twin.sim.worker import plan, split_prefill


def scan_victim(running: list[Request], req: Request) -> Request | None:
    """The rule as one scan of the live running list: the latest arrival other than `req`, same
    partition first, the first in running order among equal arrivals."""
    others = [r for r in running if r is not req and r.status is Status.RUNNING]
    same = [r for r in others if r.partition == req.partition]
    pick = same or others
    if not pick:
        return None
    latest = max(r.arrival for r in pick)
    return next(r for r in pick if r.arrival == latest)


def sched(partitions=2, k=0, budget=64, chunk=16, max_seq=64, running=64, full_pages=64, leases=False, cls=Scheduler):
    fams = (FamilySpec("full", 4, None, -(-max_seq // 4), full_pages), FamilySpec("roll", 2, 4, 12, 400))
    kv = KvCacheManager(fams, partitions, prefix_caching=False)
    cfg = SchedulerConfig(budget, running, chunk, max_seq, k, prefix_caching=False)
    return cls(cfg, kv, leases=LeaseManager(partitions) if leases else None)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=24),
       st.lists(st.integers(0, 10_000), min_size=1, max_size=30))
def test_victim_from_the_pass_order_is_the_scan_of_the_live_list(rows, picks):
    # few distinct arrivals and partitions: ties and empty partitions are the common case
    s = sched()
    for i, (arrival, part) in enumerate(rows):
        # ids descending in running order, so a tie broken by id is told apart from running order
        x = Request(f"r{len(rows) - i:03d}", np.arange(2, 6), Sampling(4), float(arrival))
        x.partition, x.status = part, Status.RUNNING
        s.running.append(x)
    order = s._victim_order()
    for p in picks:                            # a pass: each preemption removes its victim
        if not s.running:
            break
        req = s.running[p % len(s.running)]
        want = scan_victim(s.running, req)
        assert s._victim(req, order) is want
        assert s._victim(req) is want          # without the pass order: sorted afresh
        if want is None:
            break
        s.running.remove(want)
        want.status = Status.PREEMPTED if p % 2 else Status.FINISHED


def test_a_pass_of_many_preemptions_keeps_the_rule():
    """A tight pool: one pass preempts several times; every victim is the scan's over the running
    list as it stood at that preemption."""
    s = sched(partitions=1, budget=256, chunk=16, max_seq=64, full_pages=40)
    seen = []
    orig = s._preempt

    def preempt(victim, by, out):
        seen.append(victim is scan_victim(s.running, by))
        return orig(victim, by, out)

    s._preempt = preempt
    for i in range(12):
        s.add_request(Request(f"r{i}", np.arange(2, 18), Sampling(40, None, True), float(i % 3)))
    for _ in range(60):
        cmd = s.schedule()
        if not cmd.scheduled:
            break
        s.advance_after_schedule(cmd)
        s.update_from_output(cmd, {x.req.request_id: [5] for x in cmd.scheduled if x.samples})
    assert len(seen) >= 3 and all(seen)


def test_the_command_carries_its_split_with_the_leases_it_took():
    # two partitions, 8,000-token chunks: a partition holds one per dispatch, so the step splits
    s = sched(partitions=2, k=7, budget=40_000, chunk=8192, max_seq=16_384, full_pages=20_000, leases=True)
    for rid, n in (("A", 8000), ("B", 8000), ("C", 8000), ("D", 100)):
        s.add_request(Request(rid, np.arange(2, 2 + n), Sampling(4, None, True)))
    cmd = s.schedule()
    assert len(cmd.dispatches) > 1
    assert [d.items for d in cmd.dispatches] == [d.items for d in split_prefill(cmd.prefill.items, 256, 64)]
    carried = {id(it) for d in cmd.dispatches for it in d.items}
    assert carried == {id(it) for it in cmd.prefill.items}         # the same items, leases included
    assert all(it.lease is not None for it in cmd.prefill.items)
    dep = type("Dep", (), {"k": 7, "partitions": 2, "prefill_batch": 256, "prefill_requests_per_partition": 64})()
    assert plan(cmd, dep).prefill == tuple(cmd.dispatches)


def test_chunk_tokens_follow_a_prompt_replaced_at_preemption():
    """The replay scheduler folds the outputs into the prompt at a preemption: the re-prefill's
    chunks are slices of the new prompt, not of the converted old one."""
    s = sched(partitions=1, budget=64, chunk=8, max_seq=64, full_pages=64, cls=ReplayScheduler)
    a = Request("a", np.arange(100, 112), Sampling(20, None, True))
    s.add_request(a)
    for _ in range(4):                         # 12 prompt tokens in chunks of 8, then decode steps
        cmd = s.schedule()
        s.advance_after_schedule(cmd)
        s.update_from_output(cmd, {x.req.request_id: [7] for x in cmd.scheduled if x.samples})
    assert a.outputs
    s._preempt(a, a, {})
    assert a.prompt_len > 12                   # folded: prompt + outputs
    chunks = []
    while a.num_computed < a.prompt_len:
        cmd = s.schedule()
        chunks += [it.chunk_tokens for it in cmd.prefill.items]
        s.advance_after_schedule(cmd)
        s.update_from_output(cmd, {x.req.request_id: [7] for x in cmd.scheduled if x.samples})
    assert sum(chunks, ()) == tuple(a.prompt.tolist())
