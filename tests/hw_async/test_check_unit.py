"""The checker's unit of work: a recorded dispatch re-judged from the records alone.  Its entry is
the live run's report line whichever other dispatches are checked with it, and in whatever order;
the offline replay on Ray equals the serial replay byte for byte."""
import json
import random

import pytest

pytest.importorskip("torch")

from twin.abi.errors import AbiError  # noqa: E402
from twin.functional.parity import build_lockstep, check, check_dispatches, replay_records  # noqa: E402

N = 12                    # prefill, seeding and fused K=7 dispatches (TINY)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    d = tmp_path_factory.mktemp("unit-rec")
    s = build_lockstep(max_new=N, run_dir=d).run(N)
    assert s["verdict"] == "PASS" and s["dispatches"] == N
    assert {"l3_prefill_fwd", "l3_dspark_draft_step_device_state", "l3_decode_fwd_dspark"} <= set(s["programs"])
    return d


def _lines(d):
    return (d / "report.jsonl").read_text().splitlines()


def _dump(entries):
    return [json.dumps(e, sort_keys=True) for e in entries]


def test_a_dispatch_checked_alone_is_its_report_line_in_any_order(recorded):
    # the report's lines and these entries come from the same operations on the same arrays (the
    # records hold the bytes each side started from), so they are compared as bytes
    lines = _lines(recorded)
    order = list(range(N))
    random.Random(0).shuffle(order)
    for i in order[:4]:
        assert json.dumps(check(recorded, i), sort_keys=True) == lines[i], i
    # a chosen set in one pass: each entry as if checked alone (a check that left golden's state
    # behind for the next one would move the later entry's resyncs)
    picked = sorted(order[4:8])
    assert _dump(check_dispatches(recorded, [picked[2], picked[0], picked[3], picked[1]])) == [lines[i] for i in picked]


def test_a_check_names_what_it_cannot_do(recorded):
    with pytest.raises(AbiError, match="index"):
        check(recorded, N)
    with pytest.raises(AbiError, match="sites"):
        check(recorded, 0, sites=[("head", "logits")])


def test_replay_on_ray_equals_the_serial_replay_byte_for_byte(recorded, ray_cluster, capsys):
    from hw.real.pool import RayWorkers
    from twin.cli import main

    # the tasks' golden makes the serial replay's operations in the same order on the same records,
    # with one BLAS thread (hw.real.pool.in_worker) as this process has: compared as bytes
    serial = _dump(replay_records(recorded))
    assert serial == _lines(recorded)
    workers = RayWorkers()
    assert workers.n == 2                                  # two chunks, the second re-driven past the first
    assert _dump(replay_records(recorded, workers=workers)) == serial
    assert main(["lockstep", "--replay", str(recorded), "--ray", "auto"]) == 0
    assert f"offline on Ray: 0 failed, {N} identical to the report" in " ".join(capsys.readouterr().out.split())


def test_an_async_run_checks_on_ray_tasks(recorded, ray_cluster, tmp_path):
    from hw.real.pool import RayWorkers

    s = build_lockstep(max_new=N, run_dir=tmp_path).run_async(6, workers=RayWorkers(), backlog=2)
    ck = s["config"]["checking"]
    assert ck["workers"] == {"kind": "ray", "n": 2} and ck["checked"] == 6 and ck["backlog_high_water"] <= 2
    # the same workload as the recorded run: the findings of each dispatch are the synchronous run's
    # (the re-syncs before a dispatch differ: golden starts from the device's recorded decisions)
    sync = [json.loads(x) for x in _lines(recorded)[:6]]
    got = [json.loads(x) for x in (tmp_path / "report.jsonl").read_text().splitlines()]
    assert [e["index"] for e in got] == list(range(6))
    assert [e["findings"] for e in got] == [e["findings"] for e in sync]
