"""The decision log: off by default, and when on a complete account of every decision.

On upstream's recorded runs the log's items, admissions and preemptions are upstream's, and its
page ids add up: replaying every record's taken and freed pages per family and partition gives
exactly the used-page counts upstream recorded after each schedule and each apply.
"""
import dataclasses
import json

import pytest

import upstream_fixture as U
from simtest import make_dep
from twin.sim.acceptance import ForcedAcceptance
from twin.sim.run import SimConfig, simulate
from twin.sim.workload import LengthDist, WorkloadSpec, generate


@pytest.mark.parametrize("run", ["burst-seed21-n120"])
def test_log_matches_upstream_and_its_pages_add_up(run):
    fx = U.load(run)
    steps, events, log = U.replay(fx, log=True)
    sched = [r for r in log if r["kind"] == "schedule"]
    assert [[i[:5] for i in r["items"]] for r in sched] == [d["items"] for d in fx["decisions"]]
    assert [("admit", *h) for r in sched for h in r["hits"]] == [e[1:] for e in events if e[1] == "admit"]
    assert [("preempt", *p) for r in sched for p in r["preempted"]] == [e[1:] for e in events if e[1] == "preempt"]
    fams = list(fx["config"]["families"])
    parts = fx["config"]["partitions"]
    used = {f"{f}/{p}": 0 for f in fams for p in range(parts)}
    want = {d["step"]: d for d in fx["decisions"]}
    for r in log:
        for key, ids in r["taken"].items():
            used[key] += len(ids)
        for key, ids in r["freed"].items():
            used[key] -= len(ids)
        d = want[r["step"]]["used_after_sched" if r["kind"] == "schedule" else "used_after_apply"]
        assert {f"{f}/{p}": d[f][p] for f in fams for p in range(parts)} == used, (r["kind"], r["step"])
    # page by page: at every record boundary a page is either in use once or free
    net: dict = {}
    for r in log:
        for sign, key in ((1, "taken"), (-1, "freed")):
            for fam, ids in r[key].items():
                for b in ids:
                    net[(fam, b)] = net.get((fam, b), 0) + sign
        assert set(net.values()) <= {0, 1}, r["step"]
    assert sum(net.values()) == sum(used.values())


def tight():
    """Three slots per partition: constant preemption, prefix groups, stop strings, forced acceptance."""
    reqs = generate(WorkloadSpec(num_requests=160, arrival="poisson", rate=300,
                                 prompt=LengthDist("uniform", 300, 200, 16, 700),
                                 output=LengthDist("uniform", 120, 100, 4, 300), prefix_groups=3, prefix_len=384,
                                 prefix_fraction=0.5, eos_fraction=0.2, stop_fraction=0.1, seed=11))
    return SimConfig(make_dep(), reqs, slots=3, acceptance=ForcedAcceptance(5))


def test_off_by_default_and_written_when_on(tmp_path):
    cfg = tight()
    assert SimConfig(cfg.dep).decision_log is False
    off = simulate(cfg)
    assert off.decisions is None
    on_cfg = dataclasses.replace(tight(), decision_log=True)
    on = simulate(on_cfg)
    files = on.write(tmp_path, plots=False, trace=False)
    assert "decisions.jsonl" in files
    lines = [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert lines == on.decisions and len([r for r in lines if r["kind"] == "schedule"]) == on.summary["steps"]
    # keeping the log changes nothing the run decides
    assert off.requests.drop(columns=[c for c in off.requests if "wall" in c]).equals(
        on.requests.drop(columns=[c for c in on.requests if "wall" in c]))
    sched = [r for r in lines if r["kind"] == "schedule"]
    assert any(r["preempted"] for r in sched) and any(r["waves"] for r in sched) and any(r["leases"] for r in sched)
    assert any(r["finished"] for r in lines if r["kind"] == "apply")

