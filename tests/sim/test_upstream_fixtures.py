"""The twin's scheduler makes upstream's decisions: three of upstream's recorded runs replayed.

Each fixture (`tests/sim/data/upstream-scheduler/`, a copy of the shared fixtures; see its README)
is upstream pypto-serving's async grouped scheduler and grouped KV cache manager on a seeded
workload with a fake runner.  The twin runs the same settings, workload, fake runner and async
depth-2 loop, and every dispatched step's scheduled items (request, prefill/decode, computed
tokens, new tokens, partition), the used pages of every family in every partition after
scheduling and after applying, every admission (prefix-hit tokens, partition, cold fallback) and
every preemption (victim, the request that caused it) must equal upstream's for the whole run.
Integers only: nothing here is floating point.
"""
import pytest

import upstream_fixture as U


@pytest.mark.parametrize("run", U.RUNS)
def test_replays_upstream_decisions(run):
    fx = U.load(run)                      # a missing fixture is an error, not a skip
    steps, events = U.replay(fx)
    want = fx["decisions"]
    for got, up in zip(steps, want):
        for key in ("items", "used_after_sched", "used_after_apply"):
            assert got[key] == up[key], (run, up["step"], key)
    assert len(steps) == len(want) == fx["config"]["steps"]
    assert events == U.upstream_events(fx)


def test_fixtures_exercise_the_rules():
    """The runs are the hard cases: hits, cold fallbacks, preemptions, ties on arrival."""
    counts = {}
    for run in U.RUNS:
        ev = U.upstream_events(U.load(run))
        counts[run] = (sum(e[1] == "admit" and e[3] > 0 for e in ev), sum(e[1] == "preempt" for e in ev))
    assert all(h > 0 and p > 100 for h, p in counts.values()), counts
    burst = U.load("burst-seed21-n120")["workload"]
    assert len({w["arrival"] for w in burst}) == 1       # every preemption there breaks an arrival tie


def test_missing_fixture_fails_with_its_path(tmp_path, monkeypatch):
    monkeypatch.setattr(U, "FIXTURES", tmp_path)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        U.load("seed20-n200")
