"""`dspark-twin lockstep`: progress, verdict, exit codes, clear errors; the benchmark prints JSON."""
import json
import subprocess
import sys

from killed_run import ROOT
from twin.cli import main


REF = ["lockstep", "--golden", "reference"]


def test_lockstep_command_prints_the_verdict(tmp_path, capsys):
    rc = main([*REF, "--preset", "tiny", "--device", "cpu", "--steps", "8", "--run-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS: 8 dispatches" in out and "summary.md" in out
    assert (tmp_path / "summary.html").exists()


def test_lockstep_command_reports_an_injected_fault(tmp_path, capsys):
    rc = main([*REF, "--steps", "12", "--run-dir", str(tmp_path), "--inject", "ring_alias@3"])
    out = capsys.readouterr().out.replace("\n", " ")
    assert rc == 1 and "FAIL" in out and "first divergence" in out and "compress_state" in out


def test_lockstep_command_errors_name_what_is_allowed(tmp_path, capsys):
    for golden in ("real", "reference"):
        assert main(["lockstep", "--golden", golden, "--preset", "flash", "--steps", "2",
                     "--run-dir", str(tmp_path / golden / "a")]) == 2
        assert "preset='flash'" in capsys.readouterr().err
    assert main([*REF, "--inject", "melted@2", "--run-dir", str(tmp_path / "b")]) == 2
    assert "fault='melted'" in capsys.readouterr().err
    assert main([*REF, "--device", "tpu", "--run-dir", str(tmp_path / "c")]) == 2
    assert "device='tpu'" in capsys.readouterr().err


def test_overhead_benchmark_prints_a_ratio_as_json():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lockstep_overhead.py"), "--dispatches", "6",
                          "--repeats", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    # both runs served the same workload to the same number of dispatches; the lockstep does strictly more
    assert d["verdict"] == "PASS" and d["dispatches"] == d["device_only_dispatches"] == 6
    assert d["ratio"] == d["ratio_wall"] > 1 and d["target_ratio"] == 2.0
    assert d["cpu_s"]["lockstep"] > d["cpu_s"]["device_only"] > 0 and d["wall_s"]["device_only"] > 0
    assert d["backend"].startswith("selfcheck:")
