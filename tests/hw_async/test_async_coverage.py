"""Sampled checking on the asynchronous pool (`run_async` of a run built with coverage N): the device
never waits, each dispatch's planned sites and the head go to a worker as one check from the records,
and the report is the synchronous sampled run's, line for line, the drafter site's included (golden's
drafter stage re-run from the records)."""
import json

import pytest

pytest.importorskip("torch")

from twin.functional.parity import build_lockstep, check, run_case  # noqa: E402

N = 4
STEPS = 14          # prefill, seeding and fused K=7 dispatches on TINY: every program's sites at least once


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    ds, da = tmp_path_factory.mktemp("sync"), tmp_path_factory.mktemp("async")
    sync = build_lockstep(preset="tiny", k=7, max_new=16, coverage=N, run_dir=ds)
    ss = sync.run(STEPS)
    asy = build_lockstep(preset="tiny", k=7, max_new=16, coverage=N, run_dir=da)
    sa = asy.run_async(STEPS, workers=1, backlog=4)
    return (sync, ss, ds), (asy, sa, da)


def _drafter(x):
    return x[1] == "drafter"


def test_a_clean_async_sampled_run_passes_and_its_ledger_lists_every_planned_site(pair):
    _, (lr, s, d) = pair
    assert s["verdict"] == "PASS" and s["dispatches"] == STEPS
    ck = s["config"]["checking"]
    assert ck["workers"] == {"kind": "local", "n": 1} and ck["skipped"] == [] and ck["backlog_high_water"] <= 4
    assert [x["checked"] for x in ck["per_dispatch"]] == ["pass"] * STEPS
    plan = lr.checker.plan
    planned = set()
    for e in lr.entries:
        want = plan.plan(e["program"], e["coverage"]["nth"])
        assert [(e["program"], *x[:3]) for x in e["sites"]] == [tuple(w) for w in want]
        planned |= {(e["program"], w[1], str(w[2]), w[3]) for w in want}
        # the head is checked on every dispatch: the logits when a target forward ran, and the samples
        assert any(tuple(f["site"])[:1] == ("head",) for f in e["findings"]) or e["program"].startswith("l3_dspark")
    cov = json.loads((d / "summary.json").read_text())["coverage"]
    assert {tuple(r[:4]) for r in cov["last_checked"]} == planned
    assert {r[5] for r in cov["last_checked"]} == {"pass"}
    assert any(r[3] == "ctx_kv" for r in cov["last_checked"]), "no drafter site was planned"
    for program, c in cov["programs"].items():
        assert c["checked"] == sum(1 for r in cov["last_checked"] if r[0] == program)


def test_the_async_report_is_the_synchronous_sampled_runs_line_for_line(pair):
    (_, ss, ds), (_, sa, da) = pair
    sync = [json.loads(x) for x in (ds / "report.jsonl").read_text().splitlines()]
    asy = [json.loads(x) for x in (da / "report.jsonl").read_text().splitlines()]
    assert [e["index"] for e in asy] == [e["index"] for e in sync] == list(range(STEPS))
    drafting = 0
    for a, b in zip(sync, asy):
        # the same sub-layers, drafter stage and head from the same device arrays (the records hold the
        # live bytes), in the same order, on one BLAS thread each: the whole line is equal as bytes
        assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
        drafting += any(_drafter(x) for x in a["sites"])
    assert drafting, "the run planned no drafter site: its records-only check went untested"
    assert ss["coverage"]["programs"].keys() == sa["coverage"]["programs"].keys()


def test_the_unit_refuses_sites_outside_the_plan_and_runs_without_coverage(pair):
    from twin.abi.errors import AbiError

    _, (lr, _, d) = pair
    with pytest.raises(AbiError, match="sites"):
        check(d, 0, [("l3_decode_fwd", 0, 0, "nope")])
    with pytest.raises(AbiError, match="every"):
        build_lockstep(preset="tiny", coverage=N, run_dir=d.parent / "every").run_async(4, every=2)


# stale_draft_kv, uncommitted_publish: the drafter writes a stale or an uncommitted context row, found
# at the drafter site from the records alone (golden's drafter stage re-run on the rows its own
# acceptance gives)
@pytest.mark.parametrize("kind,layer", [("weight", 1), ("kv_row", 3), ("stale_draft_kv", 0),
                                        ("uncommitted_publish", 0)])
def test_a_persistent_fault_is_found_asynchronously_within_n_dispatches_of_its_program(kind, layer, tmp_path):
    r = run_case(kind, seed=0, at=5, layer=layer, persistent=True, coverage=N, horizon=5 + 3 * N, max_new=16,
                 workers=1, run_dir=tmp_path, mode="continuous")
    assert r["fired_at"] is not None, r
    assert not r["false_alarm"] and r["detected"], r
    assert r["program_latency"] <= N, r
    # reported with its dispatch index and the fault's (layer, stage)
    assert r["got"][0] >= r["fired_at"] and r["localized"], r


def test_sampled_checks_on_ray_tasks_are_the_local_workers_lines(pair, ray_cluster, tmp_path):
    from hw.real.pool import RayWorkers

    _, (_, _, da) = pair
    s = build_lockstep(preset="tiny", k=7, max_new=16, coverage=N, run_dir=tmp_path).run_async(
        STEPS, workers=RayWorkers(), backlog=4)
    assert s["config"]["checking"]["workers"] == {"kind": "ray", "n": 2} and s["verdict"] == "PASS"
    # the same device run, recorded to the same bytes, judged by the same unit on one BLAS thread
    # (hw.real.pool.in_worker) whichever process runs it: the lines are equal as bytes
    assert (tmp_path / "report.jsonl").read_text() == (da / "report.jsonl").read_text()
