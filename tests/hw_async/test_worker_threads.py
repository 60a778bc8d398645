"""A local checker worker is one core's worth of checking whichever golden it runs: one torch, one
OpenBLAS and one XLA compute thread (`hw.real.pool.in_worker`), the XLA limit set in the worker
before any JAX computation there, and not in the process that started it."""
import json
import os
import subprocess
import sys
from pathlib import Path

from hw.real.pool import LocalWorkers
from hw.threads import XLA_ONE_THREAD

ROOT = Path(__file__).resolve().parents[2]


def test_a_local_worker_runs_its_checks_with_one_xla_thread(monkeypatch):
    # the suite gives its own processes their share of the cores (tests/conftest.py): without that
    # setting inherited, the worker has to set the limit itself
    monkeypatch.delenv("XLA_FLAGS", raising=False)
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


def _shared(env, processes):
    code = ("import json, os; from hw.threads import share_cores; import torch; "
            f"n = share_cores({processes}); from golden.blas import blas_threads; "
            "print(json.dumps([n, torch.get_num_threads(), blas_threads(1), os.environ.get('XLA_FLAGS'), "
            "os.environ['OMP_NUM_THREADS']]))")
    keep = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                             "MKL_NUM_THREADS", "XLA_FLAGS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**keep, **env},
                         cwd=ROOT, check=True)
    return json.loads(out.stdout)


def test_processes_sharing_the_cores_get_their_share_of_threads_in_every_library():
    cores = len(os.sched_getaffinity(0))
    n, torch_n, blas_n, xla, omp = _shared({}, cores)          # as many processes as cores: one each
    assert (n, torch_n, blas_n, omp) == (1, 1, 1, "1") and xla == XLA_ONE_THREAD
    # alone: every core, and XLA's own default (XLA_FLAGS has no thread count but the pool's on/off)
    n, torch_n, blas_n, xla, _ = _shared({}, 1)
    assert n == torch_n == blas_n == cores and (xla is None if cores > 1 else xla == XLA_ONE_THREAD)
    # a variable set before the run wins, and other XLA flags are kept, every token a flag (XLA stops
    # reading the variable at the first token that is not one)
    n, torch_n, blas_n, xla, _ = _shared({"OPENBLAS_NUM_THREADS": "3", "XLA_FLAGS": "--xla_dump_to=/tmp/x"}, cores)
    assert (n, torch_n, blas_n) == (1, 1, 3) and xla == f"--xla_dump_to=/tmp/x {XLA_ONE_THREAD}"
    assert all(t.startswith("--") for t in xla.split())
    # an unreadable count is left to the library, not a crash
    n, _, _, _, omp = _shared({"OMP_NUM_THREADS": "4,2"}, cores)
    assert n == 1 and omp == "4,2"


def test_the_xla_limit_replaces_an_earlier_pool_setting(monkeypatch):
    from hw.threads import limit_xla_threads

    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true --xla_dump_to=/tmp/x")
    limit_xla_threads()
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {XLA_ONE_THREAD}"
