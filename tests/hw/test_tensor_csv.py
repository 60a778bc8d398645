"""lockstep's msprobe-style tensors.csv: one row per compared tensor, golden and device statistics
that recompute from the arrays, the error metrics and verdict of report.jsonl."""
import csv
import json

import numpy as np
import pytest

from hw.compare import compare_tensor, tensor_stats
from hw.report import TENSOR_COLUMNS
from hw.tolerance import Tolerance
from twin.cli import main


def test_statistics_recompute_from_the_arrays():
    rng = np.random.default_rng(0)
    e = rng.standard_normal((6, 5))
    a = e + 1e-3 * rng.standard_normal((6, 5))
    a[2, 3] = np.nan                       # a non-finite device value: left out of its statistics
    f = compare_tensor("x", a, e, Tolerance(), ("activation", "f32", "none")).to_dict()
    assert f["shape"] == [6, 5]
    g, d = f["stats"]["golden"], f["stats"]["device"]
    # 6 significant digits, as report.jsonl rounds every metric
    assert g["max"] == pytest.approx(e.max(), rel=1e-5) and g["min"] == pytest.approx(e.min(), rel=1e-5)
    assert g["mean"] == pytest.approx(e.mean(), rel=1e-5) and g["l2"] == pytest.approx(np.linalg.norm(e), rel=1e-5)
    fin = a[np.isfinite(a)]
    assert d["mean"] == pytest.approx(fin.mean(), rel=1e-5) and d["l2"] == pytest.approx(np.linalg.norm(fin), rel=1e-5)
    assert not f["passed"]                 # the NaN is a mismatch
    assert tensor_stats(np.full(3, np.inf)) == {"max": None, "min": None, "mean": None, "l2": None}


def test_lockstep_writes_one_row_per_compared_tensor(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["lockstep", "--preset", "tiny", "--steps", "7", "--run-dir", str(run), "--fresh",
                 "--mode", "continuous", "--inject", "kv_row@5:1"]) == 1
    capsys.readouterr()
    entries = [json.loads(line) for line in (run / "report.jsonl").read_text().splitlines()]
    with open(run / "tensors.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert tuple(rows[0]) == TENSOR_COLUMNS
    assert len(rows) == sum(len(e["findings"]) for e in entries)
    flat = [(e, f) for e in entries for f in e["findings"]]
    for r, (e, f) in zip(rows, flat):
        assert int(r["dispatch"]) == e["index"] and r["tensor"] == f["name"] and r["pass"] == str(f["passed"])
        if "cosine" in f["metrics"]:
            assert float(r["cosine"]) == f["metrics"]["cosine"]
        assert r["shape"] and float(r["golden_l2"]) >= 0
    failing = [r for r in rows if r["pass"] == "False"]
    assert failing and {int(r["dispatch"]) for r in failing} == {e["index"] for e in entries if e["verdict"] == "fail"}
    assert any(r["layer"] == "1" and r["stage"] == "kv" for r in failing if r["dispatch"] == "5")
