"""The decision log: off by default, and when on a complete account of every decision.

On upstream's recorded runs the log's items, admissions and preemptions are upstream's, and its
page ids add up: replaying every record's taken and freed pages per family and partition gives
exactly the used-page counts upstream recorded after each schedule and each apply.
"""
import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import upstream_fixture as U
from simtest import make_dep
from twin.sim.acceptance import ForcedAcceptance
from twin.sim.decisions import DecisionLog
from twin.sim.run import SimConfig, build, simulate
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



class UsedAtClose(DecisionLog):
    """The log, plus the block manager's used pages per family and partition at the moment each
    record is closed (the state the record's page moves must replay to)."""

    def __init__(self, scheduler):
        super().__init__(scheduler)
        self.used: list[dict] = []

    def _close(self):
        if self._open is not None:
            kv = self.kv
            self.used.append({f"{n}/{p}": kv.used_pages(p)[n] for n in kv.names for p in range(kv.partitions)})
        super()._close()


def replay_used(records, names, partitions):
    """Used pages per "family/partition" after each record, from its taken and freed ids alone,
    checking page by page that at every record's end each id is in use once or free (within a
    record a page may be freed and taken again)."""
    net = {f"{n}/{p}": {} for n in names for p in range(partitions)}
    out = []
    for r in records:
        for sign, moved in ((1, r["taken"]), (-1, r["freed"])):
            for key, ids in moved.items():
                d = net[key]
                for b in ids:
                    d[b] = d.get(b, 0) + sign
        assert all(set(d.values()) <= {0, 1} for d in net.values()), (r["kind"], r["step"])
        out.append({k: sum(d.values()) for k, d in net.items()})
    return out


def engine_run(cfg):
    env, eng, sched, rec, slots = build(cfg)
    log = UsedAtClose(sched)
    eng.submit(cfg.requests)
    env.run(until=eng.done)
    return log.done(), log.used, sched.kv


def test_page_ids_replay_to_every_records_used_pages_through_worker_errors():
    # the speed benchmark's shape at 64 slots: preemptions, and a partition's 65th request
    # exhausting its drafter leases (the worker error aborts the in-flight batches)
    dep = make_dep(max_num_seqs=256)
    reqs = generate(WorkloadSpec(num_requests=320, arrival="burst", prompt=LengthDist("uniform", 192, 128, 64, 320),
                                 output=LengthDist("uniform", 320, 160, 160, 400), eos_fraction=0.2, seed=5))
    records, used, kv = engine_run(SimConfig(dep, reqs, slots=64))
    kinds = {r["kind"] for r in records}
    assert {"schedule", "apply", "error"} <= kinds
    assert any(r["preempted"] for r in records if r["kind"] == "schedule")
    assert any(r["freed"] for r in records if r["kind"] == "error")     # the aborted requests' pages
    assert replay_used(records, kv.names, kv.partitions) == used
    assert used[-1] == {f"{n}/{p}": 0 for n in kv.names for p in range(kv.partitions)}   # all drained


@given(n=st.integers(4, 60), mean=st.integers(60, 700), out=st.integers(2, 300), groups=st.integers(0, 2),
       slots=st.integers(1, 4), depth=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
@settings(max_examples=10, deadline=None)
def test_page_ids_replay_on_random_workloads(n, mean, out, groups, slots, depth, seed):
    reqs = generate(WorkloadSpec(num_requests=n, arrival="burst", prompt=LengthDist("uniform", mean, mean // 2, 16, 900),
                                 output=LengthDist("uniform", out, out // 2, 1, 400), prefix_groups=groups,
                                 prefix_len=256, prefix_fraction=0.7 if groups else 0.0, eos_fraction=0.2,
                                 stop_fraction=0.1, seed=seed))
    records, used, kv = engine_run(SimConfig(make_dep(), reqs, slots=slots, async_depth=depth))
    assert replay_used(records, kv.names, kv.partitions) == used
    sched = [r for r in records if r["kind"] == "schedule"]
    for r in sched:                                   # every field of a schedule record is there
        assert set(r) == {"kind", "step", "items", "hits", "preempted", "finished", "leases", "waves",
                          "taken", "freed"}
        assert all(len(i) == 6 and i[1] in "PD" and i[5] >= i[3] >= 1 for i in r["items"])
