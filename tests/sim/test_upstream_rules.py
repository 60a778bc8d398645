"""Upstream's scheduling rules (serving-contract §4.13), each on the small case that tells it apart
from the plausible alternative rule: the decision asserted is upstream's.

Most cases run on a miniature block manager (one full-history family of 4-token pages, one
rolling family of 2-token pages with a 4-token window) so that a few short prompts fill a
partition; the rules do not depend on page sizes.
"""
from __future__ import annotations

import numpy as np
import pytest

from simtest import make_sched, req, step
from twin.abi.batches import PrefillBatch, PrefillItem
from twin.sim.kvcache import FamilySpec, KvCacheManager
from twin.sim.leases import LeaseManager
from twin.sim.loop import run_sync
from twin.abi.batches import Request, Sampling
from twin.sim.run import SimConfig
from twin.sim.scheduler import Scheduler, SchedulerConfig, SchedulerProbe
from twin.sim.worker import plan


class Events(SchedulerProbe):
    def __init__(self):
        self.preemptions = []

    def preempted(self, r, by):
        self.preemptions.append((r.request_id, by.request_id))


def mini(partitions=2, full_pages=8, k=0, chunk=16, max_seq=64, running=8, budget=64, roll_pages=100,
         full_page=4, roll_window=4, leases=False, **kw):
    maxb = -(-(roll_window - 1 + chunk) // 2) + 1
    fams = (FamilySpec("full", full_page, None, -(-max_seq // full_page), full_pages),
            FamilySpec("roll", 2, roll_window, maxb, roll_pages))
    kv = KvCacheManager(fams, partitions, prefix_caching=False)
    cfg = SchedulerConfig(budget, running, chunk, max_seq, k, prefix_caching=False, **kw)
    return Scheduler(cfg, kv, leases=LeaseManager(partitions) if leases else None, probe=Events())


def r(rid, plen, out=40, arrival=0.0):
    return Request(rid, np.arange(2, 2 + plen), Sampling(out, None, True), arrival)


def sync(s, tokens=1):
    """One synchronous step: every sampling request gets `tokens` tokens."""
    cmd = s.schedule()
    s.advance_after_schedule(cmd)
    s.update_from_output(cmd, {x.req.request_id: [5] * (1 if x.prefill else tokens)
                               for x in cmd.scheduled if x.samples})
    return cmd


def preempting_pass(s):
    """Steps until a pass preempts; returns its command."""
    for _ in range(40):
        n = len(s.probe.preemptions)
        cmd = sync(s)
        if len(s.probe.preemptions) > n:
            return cmd
    raise AssertionError("no preemption")


def crowded():
    """A and V share partition 0 (B takes partition 1) and grow until A's growth preempts V; W
    waits behind them (at most three running)."""
    s = mini(running=3)
    for rid, arr in (("A", 0.0), ("B", 1.0), ("V", 2.0)):
        s.add_request(r(rid, 12, arrival=arr))
    s.add_request(r("W", 4, arrival=3.0))
    return s


def test_rule1_admission_goes_on_past_a_request_preempted_in_this_pass():
    s = crowded()
    cmd = preempting_pass(s)
    assert s.probe.preemptions == [("V", "A")]
    # upstream sets V aside (it stays first in waiting) and admits W in the same pass
    assert "W" in [it.request_id for it in cmd.prefill.items]
    assert [q.request_id for q in s.waiting] == ["V"]


def test_rule6_a_preempted_request_rides_this_pass_command():
    s = crowded()
    cmd = preempting_pass(s)
    assert "V" in cmd.finished_ids             # not the next command's


def test_rule2_an_in_flight_step_keeps_the_victims_pages():
    s = crowded()
    while True:                                # async: step N in flight while N+1 is scheduled
        a = s.schedule()
        s.advance_after_schedule(a)
        n = len(s.probe.preemptions)
        b = s.schedule()
        s.advance_after_schedule(b)
        if len(s.probe.preemptions) > n:
            break
        for cmd in (a, b):
            s.update_from_output(cmd, {x.req.request_id: [5] for x in cmd.scheduled if x.samples})
    assert s.probe.preemptions[-1] == ("V", "A")
    # V's pages stay pinned by step `a`, so A's retry in the same pass fails: A is not in `b`
    assert "A" not in [x.req.request_id for x in b.scheduled]
    free_before = s.kv.num_free(0, 0)
    s.update_from_output(a, {x.req.request_id: [5] for x in a.scheduled if x.samples})
    assert s.kv.num_free(0, 0) > free_before   # V's stale result is discarded: its pins go
    s.update_from_output(b, {x.req.request_id: [5] for x in b.scheduled if x.samples})
    assert "A" in [x.req.request_id for x in s.schedule().scheduled]


def test_rule3_pinned_pages_return_in_snapshot_slot_order():
    s = mini(partitions=1, roll_pages=40)
    kv = s.kv
    kv.ensure("x", 12)                         # ring slots 0..5 (12 tokens, 2-token pages)
    ring = kv.table("x", "roll")
    maxb = kv.families[1].max_blocks_per_seq
    kv.ensure("x", 2 * maxb)                   # fill the ring
    pin = kv.pin("x")
    pinned = pin.tables[1]
    kv.ensure("x", 2 * maxb + 4)               # wrap slots 0, 1: detached (the pin still holds them)
    assert kv.table("x", "roll")[:2] != pinned[:2] and ring[:2] == pinned[:2]
    kv.release("x")                            # the owner goes; the pin keeps every page it holds
    assert set(pinned) & set(kv.free[1][0]) == set()
    kv.unpin("x", pin)
    tail = list(kv.free[1][0])[-len(pinned):]
    assert tail == list(pinned)                # slot order, not detach-then-release order


def full_acceptance(cmd):
    return {x.req.request_id: [5] * (1 + x.spec) for x in cmd.scheduled if x.samples}


def test_rule4_finished_requests_free_after_the_other_snapshot_releases():
    # X (first in running order) finishes in step N; Y's ring wrapped while step N was in flight,
    # so applying N releases Y's detached pages; upstream frees X's pages after them
    s = mini(partitions=1, k=7, chunk=16, max_seq=128, roll_pages=200, full_pages=100)
    s.add_request(r("X", 100, out=1))
    s.add_request(r("Y", 4, out=40))
    inflight = []
    for _ in range(30):
        cmd = s.schedule()
        s.advance_after_schedule(cmd)
        inflight.append(cmd)
        if len(inflight) < 2:
            continue
        a = inflight.pop(0)
        x_done = any(x.req.request_id == "X" and x.samples for x in a.scheduled)
        ys = [x for x in a.scheduled if x.req.request_id == "Y"]
        if x_done and ys and ys[0].pin.stored:
            break
        s.update_from_output(a, full_acceptance(a))
    else:
        raise AssertionError("no step with X finishing while Y's pin holds detached pages")
    assert [x.req.request_id for x in a.scheduled].index("X") < [x.req.request_id for x in a.scheduled].index("Y")
    y_detached = [b for f, _, bs in sorted(ys[0].pin.stored) if f == 1 for b in bs]
    x_pages = list(s.kv.table("X", "roll"))
    s.update_from_output(a, full_acceptance(a))
    q = list(s.kv.free[1][0])
    assert s.requests["X"].finished
    assert max(q.index(b) for b in y_detached) < min(q.index(b) for b in x_pages)


def test_rule5_equal_arrivals_the_first_in_running_order_is_the_victim():
    s, _ = make_sched()
    a, b, c = req("b", arrival=1.0), req("a", arrival=1.0), req("c", arrival=0.0)
    for x in (a, b, c):
        x.partition = 0
        x.status = x.status.RUNNING
    s.running = [a, b, c]
    assert s._victim(c) is a                   # "b" runs first; not the larger id


def test_rule7_seeding_waves_per_dispatch_and_rule8_leases_in_dispatch_order():
    # one partition: C and D (8,000 tokens each) cannot share a dispatch; E (100) joins C's
    s = mini(partitions=1, k=7, chunk=8192, max_seq=16384, budget=32768, full_pages=1000, full_page=128,
             roll_pages=20000, roll_window=128, leases=True)
    for rid, n in (("C", 8000), ("D", 8000), ("E", 100)):
        s.add_request(r(rid, n, out=4))
    cmd = s.schedule()
    dispatches = plan(cmd, type("Dep", (), {"k": 7, "partitions": 1, "prefill_batch": 256,
                                            "prefill_requests_per_partition": 64})())
    assert [[it.request_id for it in d.items] for d in dispatches.prefill] == [["C", "E"], ["D"]]
    leases = {it.request_id: it.lease for it in cmd.prefill.items}
    assert leases == {"C": 63, "E": 62, "D": 61}          # tail capture order, not C, D, E
    # the runner seeds once per dispatch: C, then E (same group, same dispatch), then D
    assert [[it.request_id for it in w] for w in dispatches.seed_waves] == [["C"], ["E"], ["D"]]


def test_rule7_waves_do_not_span_dispatches():
    items = [PrefillItem(rid, (1,) * n, 0, n, {}, p) for rid, n, p in
             (("A", 100, 0), ("B", 100, 0), ("C", 8000, 1), ("D", 8000, 1))]
    dep = type("Dep", (), {"k": 7, "partitions": 2, "prefill_batch": 256, "prefill_requests_per_partition": 64})()
    cmd = type("Cmd", (), {"error": None, "prefill": PrefillBatch(tuple(items)), "step_id": 1,
                           "decode": type("D", (), {"items": ()})(), "decode_only": False, "new_requests": (),
                           "finished_ids": ()})()
    p = plan(cmd, dep)
    assert [[it.request_id for it in d.items] for d in p.prefill] == [["A", "B", "C"], ["D"]]
    # whole-step waves would be [A, C], [B, D]: per dispatch, D seeds on its own
    assert [[it.request_id for it in w] for w in p.seed_waves] == [["A", "C"], ["B"], ["D"]]


def test_rule9_the_scheduler_anchor_does_not_decide_the_fallback():
    s, _ = make_sched()
    s.add_request(req("a", plen=1010, out=12))
    while not s.requests["a"].outputs:
        step(s)
    n1 = s.schedule()
    s.advance_after_schedule(n1)
    n2 = s.schedule()                          # built before n1's result: its anchor counts n1's 7 reserved
    (it,) = n2.decode.items
    assert it.anchor + 7 >= 1024               # an anchor-based rule would fall back here
    committed = s.requests["a"].prompt_len + 1 + 1   # after n1 the runner has committed at most 1 more
    assert committed + 7 < 1024 and len(it.pending_drafts) == 7


def test_rule10_no_preemption_cap_by_default():
    assert SchedulerConfig(8192, 16, 128, 1024, 7).max_preemptions is None
    assert SimConfig(None).max_preemptions is None
    with pytest.raises(ValueError, match="max_preemptions"):
        SchedulerConfig(8192, 16, 128, 1024, 7, max_preemptions=0)


def _thrash(**kw):
    s = mini(partitions=1, full_pages=10, running=4, budget=64, chunk=16, **kw)
    for i in range(4):
        s.add_request(r(f"q{i}", 12, out=30, arrival=float(i)))
    return s


def _decisions(s, steps, decode_tokens=True):
    log = []

    class Exec:
        def execute(self, p):
            from twin.abi.batches import StepResult
            toks = {it.request_id: [5] for b in p.prefill for it in b.items if it.terminal}
            if p.decode is not None and decode_tokens:
                toks |= {it.request_id: [5] for it in p.decode.items}
            return StepResult(p.step_id, toks)

    def on_step(cmd, res):
        log.append([(x.req.request_id, x.start, x.num_new) for x in cmd.scheduled])

    dep = type("Dep", (), {"k": 0, "partitions": 1, "prefill_batch": 256, "prefill_requests_per_partition": 64})()
    run_sync(s, Exec(), dep, [], depth=2, on_step=on_step, max_steps=steps)
    return log


def test_rule10_livelock_detection_stops_and_reports_without_changing_decisions():
    # a runner that never returns a decode token: upstream would loop forever
    free = _thrash()
    full = _decisions(free, 200, decode_tokens=False)     # inside the default window: runs on
    assert len(full) == 200 and free.has_work and free.livelock() is None
    watched = _thrash(livelock_steps=20)
    short = _decisions(watched, 200, decode_tokens=False)
    lock = watched.livelock()
    assert lock is not None and lock["step"] - lock["since_step"] > 20
    assert 20 < len(short) < len(full) and short == full[:len(short)]   # same decisions up to the stop
    assert set(lock) == {"step", "since_step", "requests", "partitions", "preemptions"}
    assert _thrash().cfg.livelock_window == 4 * 4 + 256          # 64-token prompts in 16-token chunks


def test_rule10_preemption_thrash_is_not_a_livelock():
    s = _thrash(livelock_steps=20)
    _decisions(s, 2000)
    assert s.probe.preemptions and not s.has_work and s.livelock() is None
