"""`--coverage auto`: the first CALIBRATION dispatches check every site and measure the checker's and
the device's rates, N is then `choose_n`'s for those rates and fixed; the plan's guarantee (every
site at least once every N dispatches of its program) holds across the switch, and the report says
what was chosen, from what, and whether the checker kept up."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from hw.real.coverage import CALIBRATION, CoveragePlan, check_coverage, choose_n
from twin.abi.errors import AbiError

pytest.importorskip("torch")


def _windows_cover(lines_by_program, sites_of, n):
    """Every n consecutive dispatches of a program checked each of its sites (lines: site tuples)."""
    for program, lines in lines_by_program.items():
        want = set(sites_of[program])
        for start in range(len(lines) - n + 1):
            seen = set().union(*lines[start:start + n])
            assert seen == want, (program, start, len(want - seen))


@settings(max_examples=60, deadline=None)
@given(sites=st.integers(1, 60), n=st.integers(1, 12), full=st.integers(0, 6), total=st.integers(1, 40),
       seed=st.integers(0, 3))
def test_the_guarantee_holds_across_the_calibration_switch(sites, n, full, total, seed):
    # dispatches 0..full-1 check every site, then slot nth mod N: any N consecutive dispatches hold a
    # calibration dispatch (all sites) or all N slots
    s = {"p": tuple(("p", 0, i, "q") for i in range(sites))}
    plan = CoveragePlan(s, n, seed, {"p": full})
    lines = [set(plan.plan("p", k)) for k in range(total)]
    assert all(lines[k] == set(s["p"]) for k in range(min(full, total)))
    _windows_cover({"p": lines}, s, n)
    assert all(len(x) <= -(-sites // n) for x in lines[full:])


@pytest.mark.parametrize("bad", ["half", "AUTO", "", 0, -1, 2.5, True])
def test_a_coverage_setting_is_an_integer_or_auto(bad):
    with pytest.raises(AbiError, match="coverage"):
        check_coverage(bad)
    assert check_coverage("auto") == "auto" and check_coverage(3) == 3 and check_coverage(None) is None


@pytest.mark.parametrize("rate", [1e9, 40.0, 1.0])
def test_the_chosen_n_is_choose_ns_for_the_measured_rates(rate, tmp_path, monkeypatch):
    from hw.real.lockstep import RealLockstep
    from twin.functional.parity import build_lockstep

    # the checker's rate injected (sites, seconds, workers); the device's is the run's own
    monkeypatch.setattr(RealLockstep, "checker_rate", lambda self: (int(rate * 1000), 1000.0, 1))
    lr = build_lockstep(preset="tiny", k=7, max_new=16, coverage="auto", run_dir=tmp_path)
    s = lr.run(CALIBRATION + 10)
    assert s["verdict"] == "PASS"
    choice = json.loads((tmp_path / "records" / "coverage.json").read_text())
    t = choice["rates"]["measured"]
    S = max(len(x) for x in lr.checker.plan.sites.values())
    want = choose_n(S, rate, t["dispatches"] / t["device_s"])["n"]
    assert choice["n"] == want == s["config"]["coverage"]["n"] and choice["chosen_at"] == CALIBRATION
    if rate == 1e9:
        assert want == 1            # a checker far faster than the device checks everything
    by_prog, lines = {}, {}
    for e in lr.entries:
        lines.setdefault(e["program"], []).append({(e["program"], *x[:3]) for x in e["sites"]})
        # the calibration dispatches checked every site of their program
        if e["index"] < CALIBRATION:
            assert len(e["sites"]) == len(lr.checker.plan.sites[e["program"]])
        else:
            assert len(e["sites"]) <= -(-len(lr.checker.plan.sites[e["program"]]) // want)
        by_prog[e["program"]] = by_prog.get(e["program"], 0) + (e["index"] < CALIBRATION)
    assert choice["full_until"] == {p: c for p, c in by_prog.items() if c}
    sites_of = {p: [tuple(x) for x in v] for p, v in lr.checker.plan.sites.items()}
    _windows_cover(lines, sites_of, want)
    run = json.loads((tmp_path / "run.json").read_text())["coverage_auto"]
    assert run["n"] == want and run["guarantee_holds"] and "every site at least once every" in run["guarantee"]


def test_coverage_auto_at_the_cli_reports_resumes_and_replays(tmp_path, capsys):
    from twin.cli import main

    d = tmp_path / "run"
    assert main(["lockstep", "--steps", "12", "--coverage", "auto", "--run-dir", str(d)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    choice = json.loads((d / "records" / "coverage.json").read_text())
    n = choice["n"]
    assert f"coverage auto: N = {n}, chosen at dispatch {CALIBRATION}" in out
    assert f"every site at least once every {n} dispatches of its program" in out
    r = choice["rates"]
    assert r["sites_per_s"] > 0 and r["dispatches_per_s"] > 0 and r["workers"] == 1
    assert n == choose_n(r["sites"], r["sites_per_s"], r["dispatches_per_s"])["n"]
    run = json.loads((d / "run.json").read_text())["coverage_auto"]
    assert run["n"] == n and isinstance(run["kept_up"], bool) and run["run"]["dispatches_per_s"] > 0
    # the ledger: every site checked within N dispatches of its program
    lines = {}
    for e in map(json.loads, (d / "report.jsonl").read_text().splitlines()):
        lines.setdefault(e["program"], []).append({(e["program"], x[0], x[1], x[2]) for x in e["sites"]})
    from twin.functional.parity import recorded_plan

    sites_of = {p: [tuple(x) for x in v] for p, v in recorded_plan(d).sites.items()}
    _windows_cover(lines, sites_of, n)
    # a resume keeps the chosen N (read back, not re-measured) and extends the report
    first = (d / "report.jsonl").read_text()
    assert main(["lockstep", "--steps", "15", "--coverage", "auto", "--run-dir", str(d)]) == 0
    assert (d / "report.jsonl").read_text().startswith(first)
    assert json.loads((d / "summary.json").read_text())["coverage"]["n"] == n
    capsys.readouterr()
    # the offline replay applies the recorded choice: the same lines
    assert main(["lockstep", "--replay", str(d)]) == 0
    assert "15 identical to the report" in " ".join(capsys.readouterr().out.split())


def test_coverage_auto_on_the_pool_measures_the_workers(tmp_path, capsys):
    from twin.cli import main

    d = tmp_path / "run"
    assert main(["lockstep", "--steps", "10", "--async", "--coverage", "auto", "--run-dir", str(d)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    run = json.loads((d / "run.json").read_text())["coverage_auto"]
    assert f"coverage auto: N = {run['n']}" in out and "on each of 1 worker(s)" in out
    c = run["calibration"]
    # the workers' own seconds in the calibration's site checks: every target site of its 4 dispatches
    assert c["measured"]["site_checks"] > 0 and c["measured"]["check_s"] > 0 and c["calibration_wait_s"] >= 0
    assert run["skipped"] == 0 and run["guarantee_holds"] and "device_waited_s" in run
    s = json.loads((d / "summary.json").read_text())
    assert s["config"]["checking"]["skipped"] == [] and s["coverage"]["n"] == run["n"]
