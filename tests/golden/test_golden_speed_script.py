"""benchmarks/golden_speed.py keeps running: a short NumPy-only run prints its ratios as JSON, and a
bad --requests is refused by name."""
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "golden_speed.py")
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=ENV)


def test_small_decode_prints_its_step_against_its_gemms():
    out = _run("--skip-flash", "--skip-jax", "--reps", "1", "--requests", "2")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)["small_decode"]
    assert d["requests"] == 2 and d["rows_per_request"] == 8 and d["gemm_calls"] > 0
    for k in ("numpy_step_s", "gemms_alone_s", "step_over_gemms", "step_over_gemms_cpu", "gemms_on_own_operands_cpu_s",
              "step_over_gemms_on_own_operands_cpu"):
        assert math.isfinite(d[k]) and d[k] > 0, k
    assert "jax_speedup" not in d and d["target_step_over_gemms"] == 2.0 and d["target_figure"] in d


def test_requests_below_one_is_refused_by_name():
    out = _run("--skip-flash", "--skip-jax", "--requests", "0")
    assert out.returncode == 2 and "--requests: 0" in out.stderr and "at least 1" in out.stderr


def test_prefix_below_one_is_refused_by_name():
    out = _run("--skip-flash", "--skip-jax", "--prefix", "0")
    assert out.returncode == 2 and "--prefix: 0" in out.stderr and "at least 1" in out.stderr


def test_flash_requests_below_one_is_refused_by_name():
    out = _run("--skip-jax", "--flash-requests", "0")
    assert out.returncode == 2 and "--flash-requests: 0" in out.stderr and "at least 1" in out.stderr


def test_flash_requests_must_be_integers():
    out = _run("--skip-small", "--flash-requests", "64,x")
    assert out.returncode == 2 and "--flash-requests: '64,x'" in out.stderr and "comma-separated integers" in out.stderr
    out = _run("--skip-small", "--flash-requests", "64,0")
    assert out.returncode == 2 and "--flash-requests: 0" in out.stderr
