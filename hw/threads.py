"""CPU thread limits: for small-preset runs, and for processes that share a machine.

A small preset's GEMMs are tiny: intra-op threads in torch and OpenBLAS's spinning workers only
contend with each other (the golden and the device run in one process) and stall badly on a shared
2-core runner.  `limit_cpu_threads` is called by the entry points (CLI, tests, benchmark), never
on import; `share_cores` by the test suite, for each of its worker processes.  OpenBLAS is reached
best-effort through the library numpy loaded (`golden.blas`); if it cannot be found nothing happens
(set OPENBLAS_NUM_THREADS=1 before starting Python instead).
"""
from __future__ import annotations

import os
import sys

from golden.blas import blas_threads


def limit_cpu_threads(n: int = 1) -> dict:
    """Limit torch's and OpenBLAS's threads to n; returns the previous counts, for `restore`."""
    prev = {"torch": None, "openblas": None}
    try:
        import torch

        prev["torch"] = torch.get_num_threads()
        torch.set_num_threads(n)
    except ModuleNotFoundError:
        pass
    prev["openblas"] = blas_threads(n)
    return prev


# XLA's CPU backend reads XLA_FLAGS when it starts; its only thread setting there is whether the
# Eigen intra-op pool exists (off: one compute thread).  XLA stops reading at the first token that is
# not a `--` flag, so nothing else may be written into the variable
XLA_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false"


def _count(var: str) -> int | None:
    try:
        return int(os.environ[var])
    except (KeyError, ValueError):
        return None


def share_cores(processes: int) -> int:
    """This process and every process it starts get 1/processes of the cores available to it (at
    least one) as torch, OpenBLAS and MKL threads, and one XLA compute thread where that share is
    one, wherever no variable says otherwise: for `processes` busy processes sharing a machine (e.g.
    test workers).  The environment reaches the children and, here, torch and XLA if they have not
    started; OpenBLAS, loaded with NumPy, is set here through its C API.  Returns the share."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    n = max(1, cores // max(1, processes))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(n))
    flags = os.environ.get("XLA_FLAGS", "")
    if n == 1 and "xla_cpu_multi_thread_eigen" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {XLA_ONE_THREAD}".strip()
    if (blas := _count("OPENBLAS_NUM_THREADS")) is not None:
        blas_threads(blas)
    if "torch" in sys.modules and (omp := _count("OMP_NUM_THREADS")) is not None:
        sys.modules["torch"].set_num_threads(omp)
    return n


def limit_xla_threads() -> None:
    """One XLA compute thread for JAX's CPU backend in this process: takes effect if no JAX
    computation has run here yet (the backend reads XLA_FLAGS when it starts).  An earlier setting
    of the Eigen pool is replaced, other flags kept."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not flags or flags[-1] != XLA_ONE_THREAD:
        kept = [f for f in flags if not f.startswith("--xla_cpu_multi_thread_eigen")]
        os.environ["XLA_FLAGS"] = " ".join([*kept, XLA_ONE_THREAD])


def restore(prev: dict) -> None:
    if prev.get("torch"):
        import torch

        torch.set_num_threads(prev["torch"])
    if prev.get("openblas"):
        blas_threads(prev["openblas"])
