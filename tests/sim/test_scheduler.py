"""The scheduler against serving-contract.md §4 and upstream's async-scheduler tests (§9.3)."""
from dataclasses import replace

import numpy as np
import pytest

from simtest import apply, make_sched, req, step
from twin.abi.batches import PLACEHOLDER_TOKEN
from twin.abi.batches import Finish, Status
from twin.sim.scheduler import SchedulerConfig, SchedulerProbe


def decode_ready(s, rids):
    """Run prefills until every request in `rids` has its first token."""
    for _ in range(50):
        if all(s.requests[r].outputs for r in rids):
            return
        step(s)
    raise AssertionError("prefill did not finish")


def test_k7_decode_costs_eight_budget_tokens():
    s, _ = make_sched()
    for i in range(3):
        s.add_request(req(f"r{i}", plen=8, out=50))
    decode_ready(s, ["r0", "r1", "r2"])
    s.cfg = replace(s.cfg, max_num_batched_tokens=16)
    cmd = s.schedule()
    assert len(cmd.decode.items) == 2 and cmd.num_tokens == 16
    assert all(x.spec == 7 for x in cmd.scheduled)


def test_k0_decode_costs_one():
    s, _ = make_sched(num_speculative_tokens=0)
    for i in range(3):
        s.add_request(req(f"r{i}", plen=8, out=50))
    decode_ready(s, ["r0", "r1", "r2"])
    s.cfg = replace(s.cfg, max_num_batched_tokens=16)
    cmd = s.schedule()
    assert len(cmd.decode.items) == 3 and cmd.num_tokens == 3
    assert all(it.pending_drafts == () for it in cmd.decode.items)


def test_chunked_prefill_follows_the_chunk_limit_and_only_the_last_chunk_samples():
    s, _ = make_sched()
    s.add_request(req("a", plen=300, out=5))
    sizes, terminal = [], []
    for _ in range(3):
        cmd = step(s)
        (it,) = cmd.prefill.items
        sizes.append(it.num_tokens)
        terminal.append(it.terminal)
    assert sizes == [128, 128, 44] and terminal == [False, False, True]
    assert len(s.requests["a"].outputs) == 1


def test_global_budget_is_shared_across_partitions():
    s, _ = make_sched(max_num_batched_tokens=200)
    for i in range(4):
        s.add_request(req(f"r{i}", plen=100, out=5))
    cmd = s.schedule()
    assert sum(it.num_tokens for it in cmd.prefill.items) == 200
    assert [it.num_tokens for it in cmd.prefill.items] == [100, 100]     # the budget, not the groups, binds


def test_head_of_line_blocking():
    s, _ = make_sched(slots=1)
    for i in range(4):
        s.add_request(req(f"big{i}", plen=1000, out=20))      # one max-length slot per partition
    step(s)
    s.add_request(req("huge", plen=1000, out=20))
    s.add_request(req("tiny", plen=10, out=2))
    cmd = s.schedule()
    assert not any(it.request_id in ("huge", "tiny") for it in cmd.prefill.items)
    assert [r.request_id for r in s.waiting] == ["huge", "tiny"]


def test_preemption_takes_the_latest_arrival_in_the_same_partition_first():
    class P(SchedulerProbe):
        def __init__(self):
            self.seen = []

        def preempted(self, r, by):
            self.seen.append((r.request_id, by.request_id, r.partition == by.partition))

    probe = P()
    s, _ = make_sched(slots=2, probe=probe, max_num_batched_tokens=8192)
    for i in range(12):                               # three per partition; rings for two at full length
        s.add_request(req(f"r{i}", plen=16, out=900, arrival=float(i)))
    for _ in range(200):
        step(s, default=8)
        if probe.seen:
            break
    victim, by, same = probe.seen[0]
    assert same
    others = [r for r in s.requests.values() if r.partition == s.requests[by].partition or r.request_id == victim]
    assert victim == max(others, key=lambda r: r.arrival).request_id
    v = s.requests[victim]
    assert v.status is Status.PREEMPTED and v.num_computed == 0 and v in list(s.waiting)[:len(probe.seen)]
    assert v.num_preemptions == 1 and s.kv.partition_of(victim) is None
    s.kv.check()


def test_eos_inside_a_multi_token_step_drops_the_rest():
    s, _ = make_sched()
    s.add_request(req("a", plen=20, out=50, script={3: 1}))
    decode_ready(s, ["a"])
    step(s, {"a": 8})
    r = s.requests["a"]
    assert r.finish is Finish.EOS and len(r.outputs) == 4 and r.outputs[-1] == 1
    assert r.dropped_tokens == 8 - 3


def test_length_limit_inside_a_multi_token_step():
    s, _ = make_sched()
    s.add_request(req("a", plen=20, out=4))
    decode_ready(s, ["a"])
    step(s, {"a": 8})
    r = s.requests["a"]
    assert r.finish is Finish.LENGTH and len(r.outputs) == 4 and r.dropped_tokens == 5


@pytest.mark.parametrize("mode", ["end", "token"])
def test_stop_string_inside_a_multi_token_step(mode):
    class P(SchedulerProbe):
        hits = []

        def stop_in_chunk(self, r, index, n):
            self.hits.append((r.request_id, index, n))

    probe = P()
    s, _ = make_sched(probe=probe, sched_kw={"stop_check": mode})
    s.add_request(req("a", plen=20, out=50, stop=((7, 8),), script={2: 7, 3: 8}))
    decode_ready(s, ["a"])
    step(s, {"a": 8})                             # outputs 1..8: the stop ends at output 4 of 9
    r = s.requests["a"]
    assert probe.hits == [("a", 4, 8)]
    if mode == "end":
        assert not r.finished and len(r.outputs) == 9        # upstream misses it and keeps going
    else:
        assert r.finish is Finish.STOP and r.outputs[-2:] == [7, 8] and r.dropped_tokens == 5


def test_stop_string_at_the_end_of_a_step_is_caught_in_both_modes():
    s, _ = make_sched()
    s.add_request(req("a", plen=20, out=50, stop=((7, 8),), script={1: 7, 2: 8}))
    decode_ready(s, ["a"])
    step(s, {"a": 2})
    assert s.requests["a"].finish is Finish.STOP


def test_terminal_prefill_barrier_blocks_only_that_request():
    s, _ = make_sched()
    s.add_request(req("a", plen=20, out=10))
    decode_ready(s, ["a"])
    s.add_request(req("b", plen=20, out=10))
    c1 = s.schedule()
    s.advance_after_schedule(c1)                       # b's terminal prefill is in flight
    assert s.requests["b"].terminal_prefill_in_flight
    c2 = s.schedule()
    s.advance_after_schedule(c2)
    assert [x.req.request_id for x in c2.scheduled] == ["a"]      # a keeps decoding, b waits
    assert c2.decode.items[0].last_token == PLACEHOLDER_TOKEN
    assert s.requests["a"].num_placeholders == 16                 # 1 + 7 per in-flight step
    apply(s, c1)
    assert not s.requests["b"].terminal_prefill_in_flight
    c3 = s.schedule()
    assert "b" in [x.req.request_id for x in c3.scheduled]


def test_stale_results_of_a_preempted_request_are_discarded():
    s, _ = make_sched()
    s.add_request(req("a", plen=20, out=30))
    decode_ready(s, ["a"])
    c1 = s.schedule()
    s.advance_after_schedule(c1)
    a = s.requests["a"]
    s._preempt(a, a, {})
    n = len(a.outputs)
    apply(s, c1, {"a": 8})
    assert len(a.outputs) == n and a.num_placeholders == 0 and a.status is Status.PREEMPTED
    s.kv.check()


def test_placeholders_reserve_one_plus_k_and_are_returned():
    s, _ = make_sched()
    s.add_request(req("a", plen=20, out=30))
    decode_ready(s, ["a"])
    a = s.requests["a"]
    c0 = a.num_computed
    cmd = s.schedule()
    s.advance_after_schedule(cmd)
    assert a.num_placeholders == 8 and a.num_computed == c0 + 8
    apply(s, cmd, {"a": 3})
    assert a.num_placeholders == 0 and a.num_computed == c0 + 3


def test_admission_rejects_with_a_reason_and_caps_the_length():
    s, _ = make_sched(max_model_len=1024)
    assert not s.add_request(req("long", plen=1024))
    assert s.requests["long"].finish is Finish.REJECTED and "max_seq_len" in s.requests["long"].finish_detail
    assert s.add_request(req("ok", plen=1000, out=100))
    assert s.requests["ok"].max_new_tokens == 24


def test_prefix_hit_at_admission_skips_the_cached_prompt():
    s, _ = make_sched(slots=4)
    prompt = np.random.default_rng(1).integers(2, 5000, 600)
    s.add_request(req("a", prompt=prompt, out=2))
    for _ in range(20):
        step(s)
    s.add_request(req("b", prompt=prompt, out=2))
    cmd = s.schedule()
    (it,) = [x for x in cmd.prefill.items if x.request_id == "b"]
    assert it.num_computed == 384 and s.requests["b"].cached_tokens == 384     # 600 - 128, aligned
    assert it.partition == s.requests["a"].partition or s.requests["a"].partition is None


def test_leases_start_at_63_and_come_back_after_finish():
    s, _ = make_sched()
    s.add_request(req("a", plen=20, out=1))
    cmd = s.schedule()
    assert cmd.prefill.items[0].lease == 63 and cmd.prefill.items[0].generation == 1
    s.advance_after_schedule(cmd)
    apply(s, cmd)
    assert s.requests["a"].finish is Finish.LENGTH
    assert s.schedule().scheduled == [] and "a" in s.leases.held     # no command sent: the worker still holds it
    s.add_request(req("b", plen=20, out=1))
    cmd = s.schedule()                    # the worker frees a's lease before b's reservation
    assert cmd.finished_ids == ("a",) and "a" not in s.leases.held
    assert cmd.prefill.items[0].lease == 63 and cmd.prefill.items[0].generation == 1


def test_config_errors_name_the_argument():
    with pytest.raises(ValueError, match="async_depth=3"):
        SchedulerConfig(8192, 16, 128, 1024, 7, async_depth=3)
    with pytest.raises(ValueError, match="stop_check"):
        SchedulerConfig(8192, 16, 128, 1024, 7, stop_check="middle")


def test_partition_overflow_exhausts_the_groups_leases():
    # serving-contract §10.2 item 1: with the other partitions page-full, short requests pile into
    # the one with room; past 64 live requests the worker's lease reservation fails
    s, _ = make_sched(slots=64, max_num_seqs=256)
    for p in (1, 2, 3):
        i = 0
        while True:
            try:
                s.kv.ensure(f"fill{p}.{i}", 1024, partition=p)
            except Exception:
                break
            i += 1
    for i in range(70):
        s.add_request(req(f"r{i}", plen=16, out=4))
    cmd = s.schedule()
    assert {it.partition for it in cmd.prefill.items} == {0}
    assert s.kv.load[0] == 70
    assert cmd.error == "drafter leases exhausted for TP group 0"
    assert sum(it.lease is not None for it in cmd.prefill.items) == 64
