"""A long-lived checking process (a notebook, a pool or Ray worker) keeps what it built from a
recorded run, its golden, coverage plan and records reader, across checks.  A run rewritten at the
same path with other arguments (--fresh) is judged with its own: the weights of its seed, the plan
of its K and N."""
import json
import shutil

import pytest

pytest.importorskip("torch")

from twin.functional.parity import build_lockstep, check, recorded_plan  # noqa: E402


def test_a_run_rewritten_at_the_same_path_is_checked_with_its_own_config(tmp_path):
    d = tmp_path / "run"
    for seed, k, n in ((0, 7, 4), (1, 0, 2)):
        if d.exists():
            shutil.rmtree(d)                   # what --fresh does
        s = build_lockstep(max_new=2, run_dir=d, coverage=n, seed=seed, k=k).run(1)
        assert s["verdict"] == "PASS"
        plan = recorded_plan(d)
        assert plan.n == n and ("l3_decode_fwd_dspark" in plan.sites) == (k == 7)
        line = (d / "report.jsonl").read_text().splitlines()[0]
        e = json.loads(line)
        assert e["sites"], e                 # the prefill's planned sites: golden's weights are read
        # the report line and this check come from the same operations on the same recorded arrays
        # (the unit of work re-judges the dispatch as the live run did), so they are compared as bytes;
        # a golden built from the first run's seed judges the second run's prefill failed
        got = check(d, 0, sites=[(e["program"], *x[:3]) for x in e["sites"]])
        assert json.dumps(got, sort_keys=True) == line
