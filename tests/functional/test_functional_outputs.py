"""The functional twin's must-show: the simulator's scheduler drives golden with real tokens, and
every request's output equals an independent sequential greedy generation of its prompt; upstream's
prompt-only re-prefill after a preemption diverges exactly as predicted, the corrected replay does not."""
import json

from twin.functional import first_difference

from functional_workload import PREFIX, make_requests


def _differ(outputs, reference) -> str:
    d = first_difference(outputs, reference)
    if d is None:
        return ""
    rid, pos, got, want = d
    return f"request {rid} differs first at output position {pos}: got {got}, oracle {want}"


def _preemptions(run) -> dict:
    """request id -> cumulative output counts at each preemption that dropped generated tokens."""
    out: dict = {}
    for _, kind, rid, detail in run.sim.recorder.events:
        if kind == "preempt" and detail["outputs"] > 0:
            out.setdefault(rid, []).append(detail["outputs"])
    return out


def test_the_workload_exercises_what_it_must(replay_run):
    res = replay_run
    req = res.sim.requests.set_index("request_id")
    prompts = {r.request_id: r.prompt_len for r in make_requests()}
    # prefix-cache hit: 128-aligned, leaving at least the 128-token replay window to prefill
    hits = req[req.cached_tokens > 0]
    assert len(hits) >= 1
    for rid, row in hits.iterrows():
        assert row.cached_tokens % 128 == 0 and row.cached_tokens <= prompts[rid] - 128 and row.cached_tokens <= PREFIX
    pre = [b for step in res.schedule for b in step[1]]
    assert any(len(b) >= 2 for b in pre), "no packed prefill dispatch"
    assert any(not term and n == 64 for b in pre for _, _, n, term in b), "no chunked (non-terminal) prefill"
    counts = [c for step in res.accepted.values() for c in step.values()]
    assert max(counts) == 8 and min(counts) == 1 and len(set(counts)) >= 6, sorted(set(counts))
    assert _preemptions(res), "no preemption of a request with outputs (memory pressure)"
    assert res.executor.dispatches >= len(res.schedule)          # every step lowered and validated


def test_every_output_equals_the_sequential_greedy_oracle_with_corrected_replay(replay_run, oracle):
    res = replay_run
    assert not _differ(res.tokens, oracle), _differ(res.tokens, oracle)
    assert all(len(res.tokens[r]) == len(oracle[r]) for r in oracle)
    assert (res.sim.requests.finish == "length").all()


def test_upstream_prompt_only_reprefill_diverges_as_predicted(upstream_run, oracle):
    res = upstream_run
    cuts = _preemptions(res)
    assert cuts, "the workload must preempt a request after it generated tokens"
    flagged = res.sim.risks[res.sim.risks.risk == "preempt_with_outputs"]
    assert set(flagged.request) == set(cuts)                       # the risk report names each one
    # unaffected requests still equal the oracle
    clean = {r: v for r, v in oracle.items() if r not in cuts}
    assert not _differ({r: res.tokens[r] for r in clean}, clean), _differ(res.tokens, clean)
    # each affected one restarts from its prompt at every preemption: its generated tokens left the
    # context, so the oracle's continuation begins again after them
    for rid, at in cuts.items():
        ref, n = oracle[rid], len(res.tokens[rid])
        bounds = [0, *at, n]
        predicted = [t for a, b in zip(bounds, bounds[1:]) for t in ref[:b - a]]
        assert res.tokens[rid] == predicted, rid
        assert res.tokens[rid] != ref[:n]
    rid, pos, _, _ = first_difference(res.tokens, oracle)
    assert rid in cuts and pos == min(cuts[rid])


def test_both_recompute_modes_make_the_same_first_decisions(upstream_run, replay_run):
    """Until the first preemption with outputs, the two modes are the same run."""
    first = min(t for t, kind, _, d in upstream_run.sim.recorder.events if kind == "preempt" and d["outputs"])
    steps = upstream_run.sim.steps
    n = int((steps.t < first).sum())
    assert n > 3
    assert upstream_run.schedule[:n] == replay_run.schedule[:n]


def test_k0_split_decode_equals_the_oracle_with_corrected_replay(golden, oracle):
    """K=0: the split decode at the staged anchor, the worker's placeholder substitution."""
    from twin.abi import deployment
    from twin.functional import functional_simulate
    from functional_workload import SLOTS
    dep = deployment("tiny", ep=8, max_model_len=512, long_prefill_token_threshold=64, max_num_seqs=6,
                     max_num_batched_tokens=256, num_speculative_tokens=0)
    res = functional_simulate(dep, make_requests(), golden, slots=SLOTS, recompute="replay")
    assert res.sim.summary["preemptions"] > 0
    assert not _differ(res.tokens, oracle), _differ(res.tokens, oracle)


def test_a_functional_result_writes_the_tokens_it_holds(upstream_run, tmp_path):
    """The report's tokens.jsonl is the scheduler's committed outputs, the run's `tokens`; its
    acceptance.json is the run's acceptance vector."""
    files = upstream_run.write(tmp_path, plots=False)
    assert {"summary.json", "tokens.jsonl", "acceptance.json"} <= set(files)
    rows = [json.loads(x) for x in (tmp_path / "tokens.jsonl").read_text().splitlines()]
    assert {r["id"]: r["tokens"] for r in rows} == upstream_run.tokens
    assert json.loads((tmp_path / "acceptance.json").read_text()) == upstream_run.acceptance
