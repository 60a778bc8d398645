"""Start a lockstep CLI run, SIGKILL it once its report has some lines (the resume tests)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def kill_after(cmd: list, report: Path, lines: int, *, wait_s: float) -> int:
    """Run `cmd`, SIGKILL it when `report` holds `lines` lines; the number of lines it had written."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and p.poll() is None:
        if report.exists() and report.read_text().count("\n") >= lines:
            break
        time.sleep(0.02)
    assert p.poll() is None, p.stderr.read().decode()
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    return report.read_text().count("\n")
