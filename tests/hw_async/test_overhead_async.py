"""benchmarks/lockstep_overhead.py --mode async: the sampled asynchronous lockstep against the
device-only run of the same workload, with its backlog and skipped checks, as JSON."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_async_overhead_benchmark_reports_its_ratio_backlog_and_skips():
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lockstep_overhead.py"), "--dispatches", "8",
                          "--rounds", "1", "--mode", "async", "--check-every", "4"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["mode"] == "async" and d["target_ratio"] == 1.2
    assert d["dispatches"] == d["device_only_dispatches"] == 8
    a = d["async"]
    # dispatches 0 and 4 sampled, both checked under throttle (nothing skipped), at most 2 pending
    assert (a["submitted"], a["checked"], a["skipped"]) == (2, 2, 0) and 1 <= a["backlog_high_water"] <= 2
    assert a["workers"] == {"kind": "local", "n": 1} and d["verdict"] == "PASS"
    assert 0 < a["device_side_s"] <= d["wall_s"]["lockstep"]
    assert d["meets_target"] == (d["ratio"] <= d["target_ratio"])


def _bench(*args):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lockstep_overhead.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_the_sampled_async_benchmark_checks_every_dispatchs_planned_sites():
    pytest.importorskip("torch")
    out = _bench("--dispatches", "8", "--rounds", "2", "--mode", "async", "--coverage", "4", "--backlog", "2",
                 "--backlog-policy", "skip-oldest")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    a = d["async"]
    assert a["coverage"] == 4 and a["check_every"] == 1 and d["verdict"] == "PASS"
    # every dispatch submitted; each either checked or skipped (counted), the backlog never over 2
    assert a["submitted"] == 8 and a["checked"] + a["skipped"] == 8 and a["backlog_high_water"] <= 2
    assert sum(c["checked"] for c in a["sites"].values()) > 0
    # the asynchronous figures are one round's: the lower median of two, the faster lockstep
    r0 = min(d["rounds"], key=lambda r: r["lockstep"]["wall_s"])
    assert a["backlog_high_water"] == r0["backlog_high_water"] and a["device_waited_s"] == r0["device_waited_s"]
    assert 0 <= a["record_s"] <= a["device_side_s"] <= r0["lockstep"]["wall_s"] and a["checker_cpu_s"] > 0
    # the writer's CPU is within its wall time; the device thread's CPU within the process's
    assert 0 < a["record_thread_cpu_s"] <= a["record_thread_s"] + 0.01
    assert 0 < a["device_thread_cpu_s"] <= r0["lockstep"]["cpu_s"] + 0.01
    if a["device_thread_preempted_s"] is not None:
        # the device thread's sleeps hold at least its measured waits (their own few CPU instants aside)
        assert a["device_thread_preempted_s"] >= 0 and a["device_thread_gil_s"] >= -0.25
    # two rounds, ABBA: each a device-only and a lockstep run; the figures are the medians of the rounds'
    rounds = d["rounds"]
    assert [r["order"] for r in rounds] == ["AB", "BA"] and d["rounds_run"] == 2
    for k in ("wall_s", "cpu_s"):
        for side in ("device_only", "lockstep"):
            # a median of two is their mean (of the 4-decimal figures, rounded again: 1e-4)
            assert abs(d[k][side] - sum(r[side][k] for r in rounds) / 2) <= 1e-4
    assert abs(d["ratio_wall"] - d["wall_s"]["lockstep"] / d["wall_s"]["device_only"]) <= 1e-3
    assert abs(d["ratio_cpu"] - d["cpu_s"]["lockstep"] / d["cpu_s"]["device_only"]) <= 1e-3
    for r in rounds:
        assert abs(r["ratio_wall"] - r["lockstep"]["wall_s"] / r["device_only"]["wall_s"]) <= 1e-3
        assert r["checked"] + r["skipped"] == 8 and r["backlog_high_water"] <= 2 and r["device_waited_s"] >= 0
    assert len(d["load_average"]["start"]) == len(d["load_average"]["end"]) == 3


def test_the_benchmark_refuses_check_every_with_coverage():
    out = _bench("--mode", "async", "--coverage", "4", "--check-every", "2")
    assert out.returncode == 2 and "--check-every=2" in out.stderr and "unset with --coverage" in out.stderr


def test_the_benchmark_refuses_no_rounds():
    out = _bench("--rounds", "0")
    assert out.returncode == 2 and "--rounds=0" in out.stderr and ">= 1" in out.stderr
