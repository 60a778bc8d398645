"""The asynchronous device side's two helpers: records written on a thread of their own
(`hw.real.records.RecordThread`), a check started only once its record is on disk, a failed write
raised on the device side; and checker processes at the lowest CPU priority, one thread each."""
import os
import threading

import pytest

from hw.real.pool import CheckPool, LocalWorkers
from hw.real.records import RecordThread
from test_pool import Manual, _submit


class GatedRecorder:
    """Writes a record when the test opens the gate (or fails, with `error`)."""

    def __init__(self, error=None):
        self.gate, self.wrote, self.error = threading.Event(), [], error

    def write(self, c):
        self.gate.wait()
        if self.error is not None:
            raise self.error
        self.wrote.append(c["index"])


def _gated(n_checks, backlog=4):
    rec = GatedRecorder()
    writer = RecordThread(rec, depth=backlog)
    out = []
    pool = CheckPool(None, "run", Manual(1), backlog=backlog, policy="throttle", write=out.append, writer=writer)
    for i in range(n_checks):
        writer.put({"index": i})
        _submit(pool, i)
    return rec, writer, pool, out


def test_a_check_starts_only_once_its_record_is_on_disk():
    rec, writer, pool, out = _gated(3)
    pool.pump(block=False)
    assert pool.workers.started == [] and rec.wrote == []          # no record written: nothing to read yet
    rec.gate.set()
    writer.wait(3)
    pool.pump(block=False)
    assert pool.workers.started == [0]                             # the one worker takes the oldest
    pool.drain()
    writer.close()
    assert rec.wrote == [0, 1, 2] and [e["index"] for e in out] == [0, 1, 2]


def test_the_drain_waits_for_records_still_being_written():
    rec, writer, pool, out = _gated(2)
    threading.Timer(0.2, rec.gate.set).start()
    pool.drain()                                                   # nothing running: waits on the writer
    writer.close()
    assert [e["index"] for e in out] == [0, 1] and pool.stats()["skipped"] == []


def test_a_failed_write_is_raised_on_the_device_side():
    rec = GatedRecorder(error=OSError(28, "No space left on device"))
    writer = RecordThread(rec, depth=1)
    writer.put({"index": 0})
    rec.gate.set()
    with pytest.raises(OSError, match="No space left"):
        writer.wait(1)
    with pytest.raises(OSError, match="No space left"):
        writer.put({"index": 1})
    with pytest.raises(OSError, match="No space left"):
        writer.close()


def test_local_checkers_run_one_thread_at_the_lowest_priority(monkeypatch):
    torch = pytest.importorskip("torch")
    # the suite's own share of the cores would reach the worker (tests/conftest.py): it must set one itself
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    w = LocalWorkers(1)
    try:
        policy = w.result(w.start(os.sched_getscheduler, 0))
        threads = w.result(w.start(torch.get_num_threads))
    finally:
        w.close()
    assert policy == os.SCHED_IDLE and threads == 1
    assert os.sched_getscheduler(0) != os.SCHED_IDLE                # the device side keeps its own
