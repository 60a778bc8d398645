"""The corrected replay's bookkeeping, on random workloads under memory pressure (cost model only:
the scheduler is the object under test)."""
import numpy as np
from hypothesis import given, settings, strategies as st

from twin.abi import deployment
from twin.functional import ReplayScheduler, conditional_rates
from twin.sim import ForcedAcceptance, SimConfig, simulate
from twin.abi.batches import Finish, Request, Sampling


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(60, 300), st.integers(8, 40), st.floats(0, 0.01)), min_size=3, max_size=8),
       st.integers(1, 8), st.integers(2, 3))
def test_replay_restores_each_request_and_keeps_its_budget(spec, accept, slots):
    dep = deployment("tiny", ep=8, max_model_len=512, long_prefill_token_threshold=64, max_num_seqs=8,
                     max_num_batched_tokens=256)
    rng = np.random.default_rng(len(spec))
    reqs = [Request(f"r{i}", rng.integers(2, 1000, L), Sampling(n), arrival=t) for i, (L, n, t) in enumerate(spec)]
    prompts = {r.request_id: r.prompt.copy() for r in reqs}
    res = simulate(SimConfig(dep, reqs, acceptance=ForcedAcceptance(accept), slots=slots, scheduler=ReplayScheduler))
    res.scheduler.check()
    res.scheduler.kv.check()
    locks = [e[3] for e in res.recorder.events if e[1] == "livelock"]
    for r in reqs:
        if r.finish is None:                  # only a run stopped at a (reported) preemption livelock
            assert locks and locks[0]["preemptions"] > 0, r
            continue
        assert np.array_equal(r.prompt, prompts[r.request_id]) and r.prompt_len == len(prompts[r.request_id])
        assert getattr(r, "fold", None) is None
        assert len(r.outputs) <= r.sampling.max_new_tokens
        if r.finish is Finish.LENGTH:
            assert len(r.outputs) == r.max_new_tokens == r.sampling.max_new_tokens


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=7, max_size=7))
def test_conditional_rates_multiply_back_to_a_chain(cond):
    u = np.cumprod(cond)                      # a linear chain's per-position acceptance
    back = conditional_rates(u.tolist())
    assert all(0 <= r <= 1 + 1e-12 for r in back)
    np.testing.assert_allclose(np.cumprod(back), u, atol=1e-12)
