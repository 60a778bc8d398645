"""A local checker worker is one core's worth of checking whichever golden it runs: one torch, one
OpenBLAS and one XLA compute thread (`hw.real.pool.in_worker`), the XLA limit set in the worker
before any JAX computation there, and not in the process that started it."""
import os

from hw.real.pool import LocalWorkers
from hw.threads import XLA_ONE_THREAD


def test_a_local_worker_runs_its_checks_with_one_xla_thread():
    before = os.environ.get("XLA_FLAGS")
    w = LocalWorkers(1)
    try:
        # os.getenv pickles by reference: it reads the worker's own environment
        h = w.start(os.getenv, "XLA_FLAGS")
        got = w.result(h)
    finally:
        w.close()
    assert got is not None and XLA_ONE_THREAD in got
    assert os.environ.get("XLA_FLAGS") == before


def test_the_xla_limit_keeps_other_flags_and_is_set_once(monkeypatch):
    from hw.threads import limit_xla_threads

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    limit_xla_threads()
    limit_xla_threads()
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {XLA_ONE_THREAD}"
