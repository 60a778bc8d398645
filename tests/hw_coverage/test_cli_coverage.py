"""`dspark-twin lockstep --coverage N`: a sampled run says so, resumes to the same report, replays
offline to the same report, and its run.json carries the N this checker would keep up at."""
import json

from hw.real.faults import REAL_KINDS
from twin.cli import main


def test_sampled_lockstep_command_reports_coverage_resumes_and_replays(tmp_path, capsys):
    d = tmp_path / "run"
    rc = main(["lockstep", "--steps", "5", "--coverage", "4", "--run-dir", str(d)])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0 and "PASS: 5 dispatches" in out and "every site at least once every 4 dispatches" in out
    # a second call on the same directory resumes: 3 more dispatches, the first 5 lines unchanged
    first = (d / "report.jsonl").read_text()
    assert main(["lockstep", "--steps", "8", "--coverage", "4", "--run-dir", str(d)]) == 0
    report = (d / "report.jsonl").read_text()
    assert report.startswith(first) and len(report.splitlines()) == 8
    s = json.loads((d / "summary.json").read_text())
    assert s["config"]["coverage"]["n"] == 4 and s["coverage"]["last_checked"]
    tp = json.loads((d / "run.json").read_text())["coverage_throughput"]
    assert tp["n"] >= 1 and tp["sites_per_s"] > 0 and tp["dispatches_per_s"] > 0
    capsys.readouterr()
    # the offline replay re-judges every recorded dispatch with the same plan to the same lines
    assert main(["lockstep", "--replay", "--run-dir", str(d)]) == 0
    assert "8 identical to the report" in " ".join(capsys.readouterr().out.split())


def test_a_sampled_run_catches_an_injected_fault_at_the_cli(tmp_path, capsys):
    assert "kv_row" in REAL_KINDS
    # at coverage 1 every site is checked: dispatch 5's corrupted kv row is found at once
    rc = main(["lockstep", "--steps", "8", "--coverage", "1", "--run-dir", str(tmp_path), "--inject", "kv_row@5:3"])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 1 and "first divergence: dispatch 5" in out and "layer 3, stage kv" in out
