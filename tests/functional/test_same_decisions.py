"""One scheduler: the same workload under the cost-model executor, forced to golden's accepted
lengths request by request and step by step, makes exactly the golden run's decisions."""
import pytest

from twin.functional import Recording, ReplayExecutor, scheduler_for
from twin.sim import SimConfig, simulate

from functional_workload import SLOTS, make_dep, make_requests


def _cost_run(golden_run, recompute):
    holder = {}

    def factory(cost, slots):
        holder["ex"] = ReplayExecutor(cost, golden_run.accepted)
        holder["rec"] = Recording(holder["ex"])
        return holder["rec"]

    sim = simulate(SimConfig(make_dep(), make_requests(), slots=SLOTS, executor=factory,
                             scheduler=scheduler_for(recompute)))
    return sim, holder


@pytest.mark.parametrize("recompute", ["prompt", "replay"])
def test_cost_model_at_golden_lengths_makes_the_same_decisions(recompute, upstream_run, replay_run):
    golden_run = upstream_run if recompute == "prompt" else replay_run
    sim, h = _cost_run(golden_run, recompute)
    assert h["ex"].missing == []
    a, b = golden_run.schedule, h["rec"].schedule
    for i, (x, y) in enumerate(zip(a, b)):
        assert x == y, f"step {x[0]}: golden {x} != cost model {y}"
    assert len(a) == len(b)
    cols = ["step", "n_prefill", "n_decode", "tokens", "waiting", "running", "live_p0", "live_p1"]
    assert golden_run.sim.steps[cols].equals(sim.steps[cols])
    # same decisions, same committed lengths: only the token values differ
    g = golden_run.sim.requests.set_index("request_id")
    c = sim.requests.set_index("request_id")
    for col in ("output_len", "cached_tokens", "preemptions", "chunks", "finish"):
        assert (g[col] == c[col]).all(), col
    assert golden_run.sim.summary["acceptance"]["histogram"] == sim.summary["acceptance"]["histogram"]


def test_different_lengths_make_different_decisions(upstream_run):
    """The comparison can fail: one verify shortened by a token changes what follows."""
    acc = {s: dict(v) for s, v in upstream_run.accepted.items()}
    step = next(s for s, v in sorted(acc.items()) if v and max(v.values()) > 1)
    rid = next(r for r, c in acc[step].items() if c > 1)
    acc[step][rid] -= 1
    holder = {}

    def factory(cost, slots):
        holder["rec"] = Recording(ReplayExecutor(cost, acc))
        return holder["rec"]

    simulate(SimConfig(make_dep(), make_requests(), slots=SLOTS, executor=factory))
    a, b = upstream_run.schedule, holder["rec"].schedule
    first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert a[first][0] > step                       # decided after the shortened verify, not before
    assert a[:first] == b[:first]


def test_golden_run_reports_the_cost_models_dispatch_times(upstream_run):
    """The golden executor times its dispatches with the cost-model executor's timing: at the same
    decisions, every dispatch takes the same virtual seconds with the same parts (a decode timed at the
    contexts its requests enter the verify with, not the ones it leaves them at)."""
    sim, _ = _cost_run(upstream_run, "prompt")
    cols = ["step", "kind", "seconds", "requests_per_group", "tokens_per_group", "t_dense", "t_attention", "t_moe",
            "t_comm", "t_overhead"]
    for kind in ("prefill", "seed", "decode"):
        g = upstream_run.sim.dispatches.query("kind == @kind")[cols].reset_index(drop=True)
        c = sim.dispatches.query("kind == @kind")[cols].reset_index(drop=True)
        assert len(g) > 0 and g.equals(c), kind
