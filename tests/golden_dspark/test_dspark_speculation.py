"""Speculation changes speed, never the output: K=7 against K=0 on a mixed workload in both numerics
modes, and no read of a stale row after any pattern of rejections (hypothesis), checked by poisoning
every stale row and by comparing the caches with a from-scratch K=0 recompute."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from twin.abi import TINY, constants as C
from twin.abi.errors import AbiError
from golden.checkpoint import SyntheticCheckpoint
from golden.dspark import step as S
from golden.dspark.weights import DrafterCheckpoint

from dspark_spec_helpers import (SENTINEL, compare_drafter_context, compare_readable, drafter_read_checker,
                                 oracle_policy, poison_stale_rows, poison_unwritten_rows)

CFG = TINY
CK, DK = SyntheticCheckpoint(CFG, 0), DrafterCheckpoint(CFG, 0)


def requests(spec, seed=1):
    rng = np.random.default_rng(seed)
    return [S.Prompt(f"r{i}", tuple(int(t) for t in rng.integers(0, CFG.vocab_size, L)), n)
            for i, (L, n) in enumerate(spec)]


# prompt lengths cross the 128-token window and a ratio-128 boundary; r3 reaches the position ceiling
# and falls back; r4's first verify window never fits (170 + 7 >= 176): it never speculates.
MIXED = [(5, 40), (30, 60), (120, 40), (150, 26), (170, 6)]
LIMIT = 176


@pytest.mark.parametrize("mode", ["exact", "device"])
def test_k7_is_token_identical_to_k0_on_a_mixed_workload(mode):
    reqs = requests(MIXED)
    g = S.Golden(CFG, CK, DK, nm=mode, max_model_len=LIMIT, groups=2)
    ref = S.generate(g, reqs, k=0)
    out0 = S.outputs(ref)
    seqs = {r.request_id: list(r.prompt) + out0[r.request_id] for r in reqs}
    # r0, r2, r3 get drafts that are right up to a chosen index (every acceptance length 1..8 occurs);
    # r1 and r4 keep the Markov drafter's own drafts
    pats = {"r0": [7, 3, 0, 5, 1, 6, 2, 4], "r2": [2, 7, 7, 0, 4], "r3": [5, 1]}
    run = S.generate(g, reqs, k=7, draft_policy=oracle_policy(seqs, pats, CFG.vocab_size),
                     on_step=poison_stale_rows, on_start=poison_unwritten_rows)
    out7 = S.outputs(run)
    for r in reqs:
        assert out7[r.request_id] == out0[r.request_id], r.request_id
        assert len(out7[r.request_id]) == r.max_new_tokens
    s = run.counters.summary()
    per = run.counters.per_request
    assert per["r4"]["fallback_steps"] == per["r4"]["verify_steps"] > 0 and per["r4"]["proposed"] == 0
    assert 0 < per["r3"]["fallback_steps"] < per["r3"]["verify_steps"]           # speculated, then fell back
    assert per["r0"]["accepted"] / per["r0"]["verify_steps"] > 3                  # long acceptances happened
    assert s["acceptance_per_position"][6] > 0 and s["fallback_steps"] >= per["r4"]["verify_steps"]
    assert per["r0"]["verify_steps"] < 39                                      # fewer steps than tokens
    # counted before truncation: every committed token after the prefill's first one
    assert s["accepted_tokens"] == sum(len(q.generated) - 1 for q in run.seqs)
    assert s["proposed_drafts"] == 7 * (s["verify_steps"] - s["fallback_steps"])
    assert s["matched_drafts"] == s["accepted_tokens"] - s["verify_steps"]
    np.testing.assert_allclose(s["mean_accepted_length"], s["accepted_tokens"] / s["verify_steps"])
    pos = np.array(s["acceptance_per_position"])
    assert (np.diff(pos) <= 0).all()                                              # a chain: j accepted => j-1 accepted


@pytest.mark.parametrize("mode", ["exact", "device"])
@settings(max_examples=4, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 40)), min_size=1, max_size=3),
       st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=6), min_size=3, max_size=3),
       st.sampled_from([None, 13]), st.sampled_from(["device", "v4.1"]))
def test_no_read_sees_a_stale_row(mode, spec, patterns, chunk, drafter):
    limit = 80
    spec = [(L, min(n, limit - L)) for L, n in spec]
    reqs = requests(spec, seed=len(spec) + spec[0][0])
    g = S.Golden(CFG, CK, DK, nm=mode, max_model_len=limit, groups=2, drafter=drafter)
    far = {r.request_id: min(len(r.prompt) + r.max_new_tokens + 7, limit) for r in reqs}
    ref = S.generate(g, reqs, k=0, chunk=chunk, until_anchor=far, log_hidden=True)
    seqs = {q.req.request_id: list(q.req.prompt) + q.generated for q in ref.seqs}
    pats = {r.request_id: patterns[i] for i, r in enumerate(reqs)}
    log: dict = {}
    hook = drafter_read_checker(ref.hidden_log, log)
    run = S.generate(g, reqs, k=7, chunk=chunk, draft_policy=oracle_policy(seqs, pats, CFG.vocab_size, log),
                     on_step=hook, on_start=poison_unwritten_rows)
    out0 = {k: v[: len(v)] for k, v in S.outputs(ref).items()}
    for q7, q0 in zip(run.seqs, ref.seqs):
        assert q7.generated[: q7.budget] == q0.generated[: q7.budget]
        assert compare_readable(CFG, run, ref, q7, q0, exact=g.nm.exact) > 0
        if q7.draft_anchor is not None:
            assert compare_drafter_context(g, run, q7, ref.hidden_log[q7.req.request_id]) > 0
    assert out0
    assert hook.checked["n"] >= sum(q.draft_anchor is not None and q.draft_anchor > len(q.req.prompt) - 1
                                    for q in run.seqs)


def test_seeding_waves_take_the_wth_request_of_every_group():
    seqs = [S.Seq(S.Prompt(f"r{i}", (1,), 1), i, g) for i, g in enumerate([0, 1, 0, 0, 2, 1])]
    waves = S.seeding_waves(seqs)
    assert [[s.req.request_id for s in w] for w in waves] == [["r0", "r1", "r4"], ["r2", "r5"], ["r3"]]
    for w in waves:
        assert len({s.group for s in w}) == len(w)


def test_leases_pop_the_last_free_entry_and_exhaust_with_a_clear_error():
    reqs = requests([(3, 1)] * 2)
    g = S.Golden(CFG, CK, DK, nm="exact", max_model_len=64)
    run = S.new_run(g, reqs, k=7)
    S.reserve_lease(run, run.seqs[0])
    S.reserve_lease(run, run.seqs[1])
    assert (run.seqs[0].lease, run.seqs[1].lease) == (63, 62)
    assert run.seqs[0].generation == 1
    run.free_leases[0] = []
    with pytest.raises(AbiError, match="drafter leases exhausted for TP group 0"):
        S.reserve_lease(run, S.Seq(reqs[0], 0, 0))


def test_bad_runs_are_rejected():
    g = S.Golden(CFG, CK, DK, nm="exact", max_model_len=64)
    with pytest.raises(AbiError, match="max_new_tokens"):
        S.new_run(g, requests([(60, 10)]), k=7)
    with pytest.raises(AbiError, match="k="):
        S.new_run(g, requests([(6, 1)]), k=3)
    with pytest.raises(AbiError, match="prompt"):
        S.new_run(g, [S.Prompt("x", (CFG.vocab_size,), 1)], k=0)
    with pytest.raises(AbiError, match="dckpt"):
        S.new_run(S.Golden(CFG, CK, None, nm="exact", max_model_len=64), requests([(6, 1)]), k=7)
    with pytest.raises(AbiError, match="max_model_len"):
        S.Golden(CFG, CK, DK, max_model_len=CFG.max_position_embeddings + 1)


def test_all_eight_verify_rows_publish_eagerly_and_heal():
    """One request, drafts right up to index 2: the step commits 3 tokens, but all 8 verify rows
    were written (no rollback); the next step rewrites the 5 stale positions before reading them."""
    reqs = requests([(20, 12)], seed=7)
    g = S.Golden(CFG, CK, DK, nm="exact", max_model_len=64)
    ref = S.generate(g, reqs, k=0)
    seq = list(reqs[0].prompt) + S.outputs(ref)["r0"]
    run = S.new_run(g, reqs, k=7)
    poison_unwritten_rows(g, run)
    S.prefill_and_seed(g, run, k=7)
    s = run.seqs[0]
    a = s.anchor
    policy = oracle_policy({"r0": seq}, {"r0": [2]}, CFG.vocab_size)
    run.state = S.commit_drafts(run.state, [s.ref], [policy(s, np.zeros(7, np.int64))])
    acc = S.fused_step(g, run, [s], draft_policy=policy)
    assert acc.counts[0] == 3 and s.anchor == a + 3
    ids = run.blocks[0]["ori"]
    slots = [ids[(p // 32) % len(ids)] * 32 + p % 32 for p in range(a, a + 8)]
    for layer in range(CFG.num_hidden_layers):
        rows = np.asarray(run.caches[layer]["kv_cache"]).reshape(-1, CFG.head_dim)[slots]
        assert np.abs(rows).max() < SENTINEL / 2                  # every verify row was published
    S.fused_step(g, run, [s], draft_policy=policy)
    assert s.generated[:12] == S.outputs(ref)["r0"][: len(s.generated[:12])]


def test_drafter_batch_geometry_pads_with_filler_rows_that_change_nothing():
    reqs = requests([(9, 7), (14, 6), (5, 8)], seed=3)
    runs = []
    for pad in (False, True):
        g = S.Golden(CFG, CK, DK, nm="exact", max_model_len=40, groups=1, pad_drafter_batch=pad)
        runs.append(S.generate(g, reqs, k=7))
    a, b = runs
    assert S.outputs(a) == S.outputs(b) and a.counters.summary() == b.counters.summary()
    np.testing.assert_array_equal(a.state.tokens, b.state.tokens)
    np.testing.assert_allclose(np.asarray(b.pools[0]), np.asarray(a.pools[0]), rtol=1e-12, atol=1e-12)
    assert not np.asarray(b.pools[0])[:, C.DRAFTER_FILLER_BLOCK_BASE:].any()      # the filler stays zero
    rows = S.pad_rows([S.DraftRow(63, 5, 1, (5,), owner_rank=3)] * 5, 0, 4)
    assert len(rows) == 4 * 8 and sum(r.lease is None for r in rows) == 27          # B = 8 on every rank
