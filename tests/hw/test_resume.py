"""A killed lockstep run resumes from its records to an identical report: no dispatch lost or repeated."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hw.runs import build_run
from killed_run import ROOT, env, kill_after

N = 24


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    build_run(d).run(N)
    return d


def _same(a: Path, b: Path):
    assert (a / "report.jsonl").read_bytes() == (b / "report.jsonl").read_bytes()
    assert (a / "summary.md").read_text() == (b / "summary.md").read_text()
    recs = [json.loads(x)["index"] for x in (b / "records" / "manifest.jsonl").read_text().splitlines()]
    assert recs == list(range(N))


def test_crash_between_record_and_report_line_resumes_identically(reference, tmp_path):
    lr = build_run(tmp_path)
    lr.crash_after = 13                  # dies after dispatch 13's record, before its report line
    with pytest.raises(KeyboardInterrupt):
        lr.run(N)
    assert len((tmp_path / "report.jsonl").read_text().splitlines()) == 13
    assert len((tmp_path / "records" / "manifest.jsonl").read_text().splitlines()) == 14
    build_run(tmp_path).run(N)           # a fresh process would do exactly this
    _same(reference, tmp_path)


def test_sigkilled_cli_run_resumes_identically(reference, tmp_path):
    cmd = [sys.executable, "-m", "twin.cli", "lockstep", "--golden", "reference", "--preset", "tiny", "--device", "cpu",
           "--steps", str(N), "--run-dir", str(tmp_path)]
    done = kill_after(cmd, tmp_path / "report.jsonl", 6, wait_s=90)
    assert 6 <= done < N
    out = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())      # rich wraps long paths: compare whitespace-normalised
    assert "resuming" in text and "dispatches already checked" in text
    assert "PASS" in out.stdout
    _same(reference, tmp_path)
