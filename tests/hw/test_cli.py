"""`dspark-twin lockstep`: progress, verdict, exit codes, clear errors; the benchmark prints JSON."""
import json
import subprocess
import sys

from killed_run import ROOT
from twin.cli import main


def test_lockstep_command_prints_the_verdict(tmp_path, capsys):
    rc = main(["lockstep", "--preset", "tiny", "--device", "cpu", "--steps", "6", "--run-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS: 6 dispatches" in out and "summary.md" in out
    assert (tmp_path / "summary.html").exists()


def test_lockstep_command_reports_an_injected_fault(tmp_path, capsys):
    rc = main(["lockstep", "--steps", "8", "--run-dir", str(tmp_path), "--inject", "kv_row@5:3"])
    out = " ".join(capsys.readouterr().out.split())      # rich wraps long lines
    assert rc == 1 and "FAIL" in out and "first divergence: dispatch 5" in out and "layer 3, stage kv" in out


def test_lockstep_command_errors_name_what_is_allowed(tmp_path, capsys):
    assert main(["lockstep", "--preset", "flash", "--steps", "2", "--run-dir", str(tmp_path / "a")]) == 2
    assert "preset='flash'" in capsys.readouterr().err
    assert main(["lockstep", "--inject", "melted@2", "--run-dir", str(tmp_path / "b")]) == 2
    assert "kind='melted'" in capsys.readouterr().err
    assert main(["lockstep", "--device", "tpu", "--run-dir", str(tmp_path / "c")]) == 2
    assert "device='tpu'" in capsys.readouterr().err


def test_overhead_benchmark_prints_a_ratio_as_json():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lockstep_overhead.py"), "--dispatches", "6",
                          "--rounds", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    # both runs served the same workload to the same number of dispatches
    assert d["dispatches"] == d["device_only_dispatches"] == 6
    assert d["ratio"] == d["ratio_wall"] and d["target_ratio"] == 2.0
    assert d["verdict"] == "PASS"                     # the parity run's own verdict
    # whether the target is met is the measured ratio, whatever this machine's load made it
    assert d["meets_target"] == (d["ratio"] <= d["target_ratio"])
    assert all(d[k][side] > 0 for k in ("cpu_s", "wall_s") for side in ("device_only", "lockstep"))
    assert d["backend"].startswith("selfcheck:")
