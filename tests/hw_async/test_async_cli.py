"""`dspark-twin lockstep --async` and `--ray` from the command line: Ray is imported only when
asked for, and a Ray that is not installed is one line with exit status 2."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _py(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)


def test_the_cli_does_not_import_ray():
    r = _py("import sys, twin.cli, hw.real.pool, twin.functional.parity\nprint('ray' in sys.modules)")
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_ray_not_installed_is_one_line_exit_2(tmp_path):
    # sys.modules["ray"] = None makes `import ray` raise ImportError, as on a machine without it
    r = _py("import sys\nsys.modules['ray'] = None\nfrom twin.cli import main\n"
            f"sys.exit(main(['lockstep', '--steps', '2', '--ray', 'auto', '--run-dir', {str(tmp_path / 'r')!r}]))")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--ray='auto'" in lines[0] and "pip install -e '.[ray]'" in lines[0]


def test_an_async_cli_run_reports_its_checks_and_refuses_to_resume(tmp_path, capsys):
    pytest.importorskip("torch")
    from twin.cli import main

    d = str(tmp_path / "run")
    assert main(["lockstep", "--steps", "6", "--run-dir", d, "--check-workers", "1", "--backlog", "2",
                 "--backlog-policy", "skip-oldest"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "on 1 local worker(s): backlog high-water" in out and "(skip-oldest)" in out
    assert main(["lockstep", "--steps", "6", "--run-dir", d, "--async"]) == 2
    assert "an asynchronous run does not resume" in capsys.readouterr().err
    # the offline replay re-judges every record and holds each report line to it
    assert main(["lockstep", "--replay", d]) == 0


def test_an_async_sampled_cli_run_reports_coverage_replays_and_localizes_a_fault(tmp_path, capsys):
    pytest.importorskip("torch")
    import json

    from twin.cli import main

    d = str(tmp_path / "run")
    assert main(["lockstep", "--steps", "10", "--async", "--coverage", "4", "--run-dir", d]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "checked 10 of 10 dispatches on 1 local worker(s)" in out
    assert "every site at least once every 4 dispatches" in out and "unchecked" not in out
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["coverage"]["n"] == 4 and s["config"]["checking"]["skipped"] == []
    # each line the unit wrote is what the replay re-judges it to
    assert main(["lockstep", "--replay", d]) == 0
    assert "10 identical to the report" in " ".join(capsys.readouterr().out.split())
    # a kv-row fault in layer 3 at dispatch 5, whose planned sites (plan seed 0) hold group 1's layer-3 kv:
    # found by a worker, reported by its dispatch index and site
    rc = main(["lockstep", "--steps", "14", "--async", "--coverage", "4", "--mode", "continuous",
               "--run-dir", str(tmp_path / "bad"), "--inject", "kv_row@5:3"])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 1 and "first divergence: dispatch 5" in out and "layer 3, stage kv" in out, out
