"""Ctrl-C during `simulate` or `lockstep`: one line, exit status 130, no traceback, no half-written
report file; lockstep resumes from what it kept, simulate says it starts again."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# Python leaves SIGINT ignored when it starts with it ignored (a shell's background job does):
# the child restores Ctrl-C's KeyboardInterrupt itself, after exec (no preexec_fn: forking a
# process that runs threads, JAX's here, and running Python before exec can deadlock)
CLI = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
       "sys.argv[0] = 'dspark-twin'; runpy.run_module('twin.cli', run_name='__main__')")


def interrupt_when(argv: list, ready, cwd: Path, *, wait_s: float = 120.0):
    """Run the CLI, send SIGINT (what Ctrl-C sends) once `ready()` holds; (status, stdout, stderr)."""
    p = subprocess.Popen([sys.executable, "-c", CLI, *argv], cwd=cwd, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + wait_s
    while not ready() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.poll() is None, p.communicate()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    return p.returncode, out, err


def test_ctrl_c_during_simulate(tmp_path):
    out = tmp_path / "o"
    started = []

    def ready():                 # --out is made just before the simulation starts; then let it run a little
        if out.exists() and not started:
            started.append(time.monotonic())
        return bool(started) and time.monotonic() - started[0] > 0.5

    # 4000 requests: tens of seconds of simulation, interrupted half a second in
    rc, stdout, err = interrupt_when(["simulate", "--requests", "4000", "--rate", "inf", "--no-plots",
                                      "--out", str(out)], ready, tmp_path)
    assert rc == 130 and "Traceback" not in err + stdout
    assert err.count("\n") == 1, err
    assert err.startswith("dspark-twin simulate: interrupted (Ctrl-C): no report was written to")
    assert "starts it from the beginning" in err
    assert list(out.iterdir()) == []            # no report file, whole or partial, and no temporary


def test_ctrl_c_during_lockstep_then_resume(tmp_path):
    run = tmp_path / "run"
    report = run / "report.jsonl"
    argv = ["lockstep", "--run-dir", str(run)]
    rc, stdout, err = interrupt_when(argv + ["--steps", "300"],
                                     lambda: report.exists() and report.read_text().count("\n") >= 3, tmp_path)
    assert rc == 130 and "Traceback" not in err + stdout
    assert err.count("\n") == 1, err
    assert err == f"dspark-twin lockstep: interrupted (Ctrl-C): {run} keeps every dispatch checked so far: " \
                  "rerun the same command to resume\n"
    assert not [p for p in run.rglob("*") if ".tmp" in p.name]
    kept = report.read_bytes().count(b"\n")
    assert kept >= 3
    r = subprocess.run([sys.executable, "-m", "twin.cli", *argv, "--steps", str(kept + 2)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())            # rich wraps long lines
    assert f"resuming {run}: {kept} dispatches already checked" in text
    assert f"PASS: {kept + 2} dispatches" in text
