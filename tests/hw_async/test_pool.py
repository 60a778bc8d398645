"""Asynchronous checking (hw.real.pool): the backlog bound and its two policies, entries written in
dispatch order as results arrive, and a parity run whose device side never waits on the golden."""
import json

import pytest

from twin.abi.errors import AbiError
from hw.real.pool import CheckPool


class Manual:
    """Workers whose checks finish when the test says (or, when the pool blocks, the oldest first)."""

    kind = "manual"

    def __init__(self, n, ahead=1):
        self.n, self.ahead, self.started, self.finished, self.blocked = n, ahead, [], set(), 0

    def start(self, fn, run_dir, index, sites, policy):
        self.started.append(index)
        return index

    def wait(self, handles, block):
        if block:
            self.blocked += 1
            self.finished.add(min(handles))
        return [h for h in handles if h in self.finished]

    def result(self, h):
        return {"index": h, "program": "p", "verdict": "fail" if h == 3 else "pass"}

    def close(self):
        pass


def _pool(policy, n=1, backlog=2, ahead=1):
    w, out = Manual(n, ahead), []
    return CheckPool(None, "run", w, backlog=backlog, policy=policy, write=out.append), w, out


def _submit(pool, i):
    pool.status.append("pending")
    pool.programs.append("p")
    pool.submit(i)


def test_skip_oldest_drops_the_oldest_check_not_handed_over_and_counts_it():
    pool, w, out = _pool("skip-oldest")
    for i in range(5):
        _submit(pool, i)
    # 0 runs on the one worker; 1, 2 and 3 were each the oldest pending when the backlog (2) was full
    assert w.started == [0] and list(pool.pending) == [4] and w.blocked == 0
    assert pool.stats()["skipped"] == [1, 2, 3] and pool.high_water == 2
    pool.drain()
    assert [e["index"] for e in out] == [0, 4]
    assert [d["checked"] for d in pool.stats()["per_dispatch"]] == ["pass", "skipped", "skipped", "skipped", "pass"]


def test_skip_oldest_waits_when_every_unfinished_check_is_with_the_workers():
    pool, w, out = _pool("skip-oldest", n=2, backlog=2)
    for i in range(3):
        _submit(pool, i)
    assert w.blocked == 1 and pool.stats()["skipped"] == [] and w.started == [0, 1, 2]


def test_a_worker_is_handed_its_next_check_before_the_device_side_collects_the_last():
    # two per worker: the second waits at the worker, so it starts as soon as the first ends, not at
    # the device side's next call; the third is the oldest not handed over, the one skip-oldest drops
    pool, w, out = _pool("skip-oldest", n=1, backlog=3, ahead=2)
    for i in range(4):
        _submit(pool, i)
    assert w.started == [0, 1] and list(pool.pending) == [3] and pool.stats()["skipped"] == [2]
    w.finished.add(0)
    pool.pump(block=False)
    assert w.started == [0, 1, 3] and [e["index"] for e in out] == [0]


def test_throttle_with_two_per_worker_waits_only_when_both_are_unfinished():
    pool, w, out = _pool("throttle", n=1, backlog=2, ahead=2)
    for i in range(4):
        _submit(pool, i)
    # 0 and 1 handed over at once; 2 and 3 each waited for the oldest to finish
    assert w.started == [0, 1, 2, 3] and w.blocked == 2 and pool.stats()["skipped"] == []
    pool.drain()
    assert [e["index"] for e in out] == [0, 1, 2, 3]


def test_ray_workers_queue_a_second_task_only_where_they_are_every_cpu(ray_cluster):
    from hw.real.pool import RayWorkers

    every, one = RayWorkers(), RayWorkers(1)        # the test cluster has 2 CPUs
    assert (every.n, every.ahead) == (2, 2) and (one.n, one.ahead) == (1, 1)


def test_throttle_waits_for_a_check_and_skips_none():
    pool, w, out = _pool("throttle")
    for i in range(5):
        _submit(pool, i)
    assert w.blocked == 3 and pool.stats()["skipped"] == [] and pool.high_water == 2
    pool.drain()
    assert [e["index"] for e in out] == [0, 1, 2, 3, 4]
    assert pool.failed_at == 3 and pool.stats()["first_failure"] == 3


def test_entries_are_written_in_dispatch_order_as_results_arrive():
    pool, w, out = _pool("throttle", n=3, backlog=3)
    for i in range(3):
        _submit(pool, i)
    w.finished |= {1, 2}
    pool.pump(block=False)
    assert out == []                         # 1 and 2 wait for 0
    w.finished.add(0)
    pool.pump(block=False)
    assert [e["index"] for e in out] == [0, 1, 2]


@pytest.mark.parametrize("kw, name", [({"backlog": 0}, "backlog"), ({"policy": "drop"}, "backlog_policy"),
                                      ({"every": 0}, "every")])
def test_bad_pool_settings_are_refused(kw, name):
    with pytest.raises(AbiError, match=name):
        CheckPool(None, "run", Manual(1), **{"backlog": 2, "policy": "throttle", **kw})


# ---- a parity run checked on worker processes ------------------------------------------------------------
def test_an_async_run_checks_on_a_worker_process_and_reports_a_fault_by_its_index(tmp_path):
    pytest.importorskip("torch")
    from hw.real.faults import RealFault
    from twin.functional.parity import build_lockstep, check

    n = 9
    lr = build_lockstep(max_new=n, run_dir=tmp_path, mode="continuous", fault=RealFault("kv_row", at=5, layer=3))
    s = lr.run_async(n, workers=1, backlog=2, policy="throttle")
    ck = s["config"]["checking"]
    assert ck["workers"] == {"kind": "local", "n": 1} and ck["backlog_high_water"] <= 2 and ck["skipped"] == []
    assert [d["checked"] for d in ck["per_dispatch"]] == ["pass"] * 5 + ["fail"] + ["pass"] * 3
    lines = (tmp_path / "report.jsonl").read_text().splitlines()
    assert [json.loads(x)["index"] for x in lines] == list(range(n))
    # found asynchronously, reported with its dispatch index and localized from the recorded state
    fd = s["first_divergence"]
    assert (fd["dispatch"], fd["layer"], fd["stage"]) == (5, "3", "kv") and ck["first_failure"] == 5
    # each line is the unit's entry for its record, whichever worker ran it (same operations, same bytes)
    assert json.dumps(check(tmp_path, 6), sort_keys=True) == lines[6]
    with pytest.raises(AbiError, match="fresh run directory"):
        build_lockstep(max_new=n, run_dir=tmp_path).run_async(n)


def test_a_sampled_async_run_checks_every_nth_dispatch(tmp_path):
    pytest.importorskip("torch")
    from twin.functional.parity import build_lockstep

    s = build_lockstep(max_new=8, run_dir=tmp_path).run_async(8, workers=1, every=4)
    per = [d["checked"] for d in s["config"]["checking"]["per_dispatch"]]
    assert per == ["pass", "not sampled", "not sampled", "not sampled"] * 2 and s["dispatches"] == 2
    assert s["verdict"] == "PASS"


def test_the_cli_and_the_pool_share_one_default_backlog():
    """`--backlog` unset leaves the bound to the pool (hw.real.pool.BACKLOG), and its help names it."""
    import argparse

    from hw.real.pool import BACKLOG
    from twin.commands import lockstep

    p = argparse.ArgumentParser()
    lockstep.add_arguments(p)
    flag = next(a for a in p._actions if "--backlog" in a.option_strings)
    assert flag.default is None and f"default {BACKLOG})" in flag.help
    assert CheckPool(None, "run", Manual(1)).backlog == BACKLOG


@pytest.mark.parametrize("kw,arg", [({"backlog": 0}, "backlog"), ({"policy": "drop-all"}, "backlog_policy")])
def test_a_refused_async_run_leaves_no_writer_thread_or_worker_behind(tmp_path, kw, arg):
    pytest.importorskip("torch")
    import threading

    from hw.real.pool import LocalWorkers
    from twin.functional.parity import build_lockstep

    lr = build_lockstep(max_new=4, run_dir=tmp_path)
    workers = LocalWorkers(1)
    before = set(threading.enumerate())
    with pytest.raises(AbiError, match=arg):
        lr.run_async(4, workers=workers, **kw)
    assert not [t for t in set(threading.enumerate()) - before if t.name == "record-writer"]
    with pytest.raises(RuntimeError, match="shutdown"):     # the refused run closed its workers
        workers.start(len, ())
