"""benchmarks/sim_speed.py runs and prints what docs/simulation.md ("Speed") says it prints."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_prints_the_figures_as_json():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim_speed.py"), "--quick", "--no-baseline"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    runs = d["current"]["runs"]
    assert sorted(runs, key=int) == ["100", "1000"]
    for n, run in runs.items():
        assert run["completed"] + run["failed"] == int(n)          # every request accounted for
        for key in ("loop_sim_s_per_cpu_s", "process_sim_s_per_cpu_s", "loop_cpu_us_per_request_step"):
            assert run[key] > 0
        assert run["process_cpu_s"] >= run["loop_cpu_s"]              # the process includes the loop
    assert d["decision_log"]["same_run"] is True
