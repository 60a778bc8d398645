"""`dspark-twin sweep` on a local Ray cluster: every point a Ray task, the tidy table, resume, an
existing cluster by --address; bad grid files exit 2 with one line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from twin.cli import main
from twin.sim import sweep

ROOT = Path(__file__).resolve().parents[2]
GRID = {"base": {"requests": 16, "max-model-len": 2048, "seed": 4},
        "grid": {"request-rate": [20, 80], "num-speculative-tokens": [0, 7]},
        "slo": {"ttft": 300, "tpot": 20}}


def write_grid(tmp_path, grid=GRID, name="grid.json"):
    p = tmp_path / name
    p.write_text(grid if isinstance(grid, str) else json.dumps(grid))
    return p


def test_sweep_runs_every_point_on_ray_and_resumes(ray_cluster, tmp_path, capsys):
    g = write_grid(tmp_path)
    assert main(["sweep", str(g), "--out", str(tmp_path / "s")]) == 0
    assert "4 points (0 already done, 4 run, 0 failed)" in capsys.readouterr().out
    t = pd.read_csv(tmp_path / "s" / "sweep.csv")
    assert len(t) == 4 and set(zip(t["request-rate"], t["num-speculative-tokens"])) == {(20, 0), (20, 7), (80, 0), (80, 7)}
    for c in ("request_throughput", "p99_ttft_ms", "p99_tpot_ms", "spec_decode_acceptance_length",
              "prefix_token_hit_rate", "preemptions", "slots_per_partition", "slo_attainment"):
        assert c in t
    assert t.loc[t["num-speculative-tokens"] == 0, "spec_decode_acceptance_length"].isna().all()
    assert (t.loc[t["num-speculative-tokens"] == 7, "spec_decode_acceptance_length"] > 1).all()
    # the Ray task ran the point's settings: a direct run of one point gives the same figures (the
    # same seed and settings make the same operations in the same order, so equal floats)
    row = t[(t["request-rate"] == 80) & (t["num-speculative-tokens"] == 7)].iloc[0]
    assert main(["simulate", "--requests", "16", "--max-model-len", "2048", "--seed", "4", "--request-rate", "80",
                 "-k", "7", "--goodput", "ttft:300", "tpot:20", "--out", str(tmp_path / "direct"),
                 "--no-plots", "--json"]) == 0
    capsys.readouterr()
    v = json.loads((tmp_path / "direct" / "vllm_result.json").read_text())
    assert row["request_throughput"] == v["request_throughput"] and row["p99_tpot_ms"] == v["p99_tpot_ms"]
    # SLO attainment counts the requests meeting both SLOs over all prompts: goodput x duration / prompts
    assert row["slo_attainment"] == pytest.approx(v["request_goodput"] * v["duration"] / v["num_prompts"], rel=1e-9)
    assert (tmp_path / "s" / "throughput_latency.png").stat().st_size > 0
    assert (tmp_path / "s" / "slo_attainment.png").stat().st_size > 0

    # resume: a point whose marker is gone runs again, the others are read back untouched
    pts = sorted((tmp_path / "s" / "points").iterdir())
    (pts[0] / "point.json").unlink()
    before = {p.name: (p / "vllm_result.json").stat().st_mtime_ns for p in pts[1:]}
    assert main(["sweep", str(g), "--out", str(tmp_path / "s"), "--no-plots"]) == 0
    assert "4 points (3 already done, 1 run, 0 failed)" in capsys.readouterr().out
    assert {p.name: (p / "vllm_result.json").stat().st_mtime_ns for p in pts[1:]} == before
    again = pd.read_csv(tmp_path / "s" / "sweep.csv")
    pd.testing.assert_frame_equal(again.sort_values("point").reset_index(drop=True),
                                  t.sort_values("point").reset_index(drop=True))


def test_sweep_on_an_existing_cluster_by_address(ray_cluster, tmp_path):
    g = write_grid(tmp_path, "base: {requests: 8, max-model-len: 2048}\ngrid: {max-concurrency: [1, 4]}\n",
                   name="grid.yaml")
    r = subprocess.run([sys.executable, "-m", "twin.cli", "sweep", str(g), "--address", ray_cluster,
                        "--out", str(tmp_path / "s"), "--json", "--no-plots"], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [x["max-concurrency"] for x in rows] == [1, 4]
    assert [x["max_concurrent_requests"] for x in rows] == [1, 4]     # the closed loop held
    assert "slo_attainment" not in rows[0]


@pytest.mark.parametrize("text, name, where", [
    ('{"grid": {"request-rate": [1, 2]}', "grid.json", "grid.json:1"),
    ('{"grid": {"request-rate": 8}}', "grid.json", "grid"),
    ('{"grid": {"request-rate": [8]}, "sweeps": 1}', "grid.json", "grid.json"),
    ('{"grid": {"request-rate": [8]}, "base": {"request-rate": 4}}', "grid.json", "base"),
    ('{"grid": {"out": ["x"]}}', "grid.json", "setting"),
    ('{"grid": {"request-rate": [8]}, "slo": {"ttfb": 3}}', "grid.json", "slo"),
    ('{"grid": {"no-such-flag": [1]}}', "grid.json", "point"),
    ('{"grid": {"request-rate": ["fast"]}}', "grid.json", "point"),
    ("grid: {request-rate: [1, 2]\n  oops: [", "grid.yaml", "grid.yaml:"),
])
def test_bad_grids_exit_2_with_one_line(tmp_path, capsys, text, name, where):
    g = write_grid(tmp_path, text, name=name)
    assert main(["sweep", str(g), "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and where in err and "allowed" in err and "Traceback" not in err
    assert not (tmp_path / "s").exists()                 # nothing ran


@pytest.mark.parametrize("name", ["grid.json", "grid.yaml"])
def test_unreadable_grids_exit_2_with_one_line(tmp_path, capsys, name):
    """A grid file is read by the inputs' one file rule: not UTF-8, a directory, or empty JSON is a
    one-line refusal naming GRID, never an internal error."""
    (tmp_path / name).write_bytes(b"\xff\xfe grid")
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "empty.json").write_text("  \n")
    for path, why in ((tmp_path / name, "UTF-8"), (tmp_path / "dir.json", "directory"),
                      (tmp_path / "empty.json", "empty")):
        assert main(["sweep", str(path), "--out", str(tmp_path / "s")]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"GRID='{path}'" in err and why in err and "Traceback" not in err
    assert not (tmp_path / "s").exists()


def test_grid_points_and_ids():
    pts = sweep.points({"base": {"requests": 8}, "grid": {"a": [1, 2], "b": ["x", "y", "z"]}, "slo": {}})
    assert len(pts) == 6 and all(p["requests"] == 8 for p in pts)
    ids = {sweep.point_id(p, {}) for p in pts}
    assert len(ids) == 6 and sweep.point_id(pts[0], {}) == sweep.point_id(dict(reversed(pts[0].items())), {})
    assert sweep.point_id(pts[0], {"ttft": 1}) != sweep.point_id(pts[0], {})


def test_ray_chatter_on_descriptor_1_goes_to_stderr_and_stdout_comes_back():
    # Ray's processes write warnings to file descriptor 1 beneath Python; sweep --json's stdout
    # must stay one JSON document, so the sweep points descriptor 1 at stderr while Ray runs
    code = ("import os, sys\nfrom twin.commands.sweep import ray_chatter_to_stderr\n"
            "print('before', flush=True)\nwith ray_chatter_to_stderr():\n"
            "    os.write(1, b'chatter\\n'); print('python too')\nprint('after')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["before", "after"]
    assert r.stderr.split() == ["chatter", "python", "too"]
