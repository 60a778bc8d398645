"""A parity run goes through the one scheduler: on a workload with a shared prefix, a long prompt
near max_model_len and a page budget too tight for every request at once, the lockstep checks
every dispatch the scheduler issues (prefix-cache hits, chunked and packed prefill, preemption and
re-prefill, lease reuse, seeding waves, the K=7 fallback) and passes on cpu."""
import numpy as np
import pytest

pytest.importorskip("torch")

from twin.abi.presets import get_preset  # noqa: E402
from twin.functional.parity import build_lockstep  # noqa: E402
from twin.abi.batches import Request, Sampling  # noqa: E402

PREFIX = 256


def workload():
    """r0, r2, r3 share a 256-token prefix (r2, r3 arrive after r0 published it); r1's 490-token prompt
    plus 22 new tokens reaches max_model_len = 512, so its last verifies have no room for drafts."""
    V = get_preset("tiny").vocab_size
    rng = np.random.default_rng(5)
    shared = rng.integers(2, V, PREFIX)
    spec = [(20, 8, 0.0, True), (490, 22, 0.0, False), (30, 8, 0.02, True), (10, 8, 0.04, True), (150, 8, 0.0, False)]
    reqs = []
    for i, (body, n, t, pre) in enumerate(spec):
        b = rng.integers(2, V, body)
        reqs.append(Request(f"r{i}", np.concatenate([shared, b]) if pre else b, Sampling(n, ignore_eos=True), arrival=t))
    return reqs


@pytest.fixture(scope="module")
def tight():
    lr = build_lockstep(requests=workload(), total_kv_pages=24, mode="continuous")
    return lr, lr.run(400)


def test_a_tight_shared_prefix_run_exercises_the_scheduler_and_passes(tight):
    lr, s = tight
    assert s["verdict"] == "PASS" and s["failed_dispatches"] == 0, s["first_divergence"]
    sv = s["config"]["serving"]
    assert lr.slots == 3                                  # 24 pages admit 3 slots per partition: too few at once
    assert sv["prefix_hit_requests"] >= 1 and sv["prefix_hit_tokens"] >= 128     # 128-token aligned hits
    assert sv["preemptions"] >= 1 and sv["leases_reused"] >= 1
    assert sv["fallback_steps"] >= 1 and sv["fallback_rows"] == sv["fallback_steps"]
    assert sv["packed_prefills"] >= 1 and sv["prefill_chunks"] >= 1 and sv["seeding_waves"] >= 1
    # every dispatch the executor lowered was checked, of every program the K=7 path has
    assert sv["dispatches"] == s["dispatches"] == len(lr.entries)
    assert set(s["programs"]) == {"l3_prefill_fwd", "l3_dspark_draft_step_device_state", "l3_decode_fwd_dspark"}
    # the scheduler committed the device's tokens: every request ran to its budget
    req = {r.request_id: r for r in lr.sim.requests}
    assert all(len(r.outputs) == r.sampling.max_new_tokens for r in req.values())

