"""A TINY K=0 lockstep against the torch device with its 8 ranks split over two gloo processes,
launched both ways a user can (`dspark-twin lockstep --nproc 2`, and torchrun with two processes
per node), passes clean and is the one-process run: the same report (every dispatch's verdict,
findings and their metrics, re-syncs), the same scheduler counts, and the same records manifest
(each dispatch's lowered arguments, meta, device outputs and pool deltas by content digest).

Digest equality between the runs is what the device guarantees, not a pinned value: the split
device performs the one-process arithmetic in the same order on the same values
(`hw.torchdev.ranks`), every process on one torch thread as the one-process run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hw.launch import gloo_problem  # noqa: E402

if gloo_problem():
    pytest.skip(gloo_problem(), allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["lockstep", "--backend", "torch", "-k", "0", "--steps", "6", "--requests", "3", "--fresh"]


def _run(prefix, run_dir, extra=()):
    r = subprocess.run(prefix + ARGS + list(extra) + ["--run-dir", str(run_dir)], capture_output=True, text=True,
                       timeout=150,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _run_of(run_dir):
    s = json.loads((run_dir / "summary.json").read_text())
    return {"report": _lines(run_dir / "report.jsonl"), "manifest": _lines(run_dir / "records" / "manifest.jsonl"),
            "verdict": s["verdict"], "dispatches": s["dispatches"], "programs": s["programs"],
            "serving": s["config"]["serving"]}


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    d = tmp_path_factory.mktemp("one")
    _run([sys.executable, "-m", "twin.cli"], d)
    return _run_of(d)


def _same_run(one, split):
    assert one["verdict"] == "PASS" and one["dispatches"] == 6
    assert set(one["programs"]) == {"l3_prefill_fwd", "l3_decode_fwd"}
    assert [e["verdict"] for e in split["report"]] == ["pass"] * 6
    assert split == one


def test_nproc_2_is_the_one_process_run(one, tmp_path):
    r = _run([sys.executable, "-m", "twin.cli"], tmp_path, ["--nproc", "2"])
    assert "torch device: 8 ranks over 2 gloo processes, 0-3, 4-7" in r.stdout
    _same_run(one, _run_of(tmp_path))


def test_torchrun_two_processes_is_the_one_process_run(one, tmp_path):
    r = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
              "twin.cli"], tmp_path)
    assert "torch device: 8 ranks over 2 gloo processes, 0-3, 4-7" in r.stdout
    _same_run(one, _run_of(tmp_path))


def _refused(capsys, argv, named, allowed):
    from twin.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and allowed in err, err


def test_a_torchrun_world_that_does_not_divide_the_ranks_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    _refused(capsys, ARGS + ["--no-records"], "WORLD_SIZE=3", "dividing the lockstep deployment's 8 ranks")
    monkeypatch.setenv("WORLD_SIZE", "2")
    _refused(capsys, ARGS + ["--no-records", "--nproc", "2"], "--nproc=2", "1 under torchrun")
    _refused(capsys, ["lockstep", "-k", "0", "--steps", "2", "--no-records"], "WORLD_SIZE=2",
             "1 with --backend selfcheck")


def test_without_gloo_a_split_run_is_refused(monkeypatch, capsys):
    import hw.launch

    monkeypatch.setattr(hw.launch, "gloo_problem", lambda: "this torch has no gloo backend (torch.distributed)")
    _refused(capsys, ARGS + ["--no-records", "--nproc", "2"], "--nproc=2", "no gloo backend")
