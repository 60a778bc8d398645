"""CPU thread limits: for small-preset runs, and for processes that share a machine.

A small preset's GEMMs are tiny: intra-op threads in torch and OpenBLAS's spinning workers only
contend with each other (the golden and the device run in one process) and stall badly on a shared
2-core runner.  `limit_cpu_threads` is called by the entry points (CLI, tests, benchmark), never
on import; `share_cores` by the test suite, for each of its worker processes.  OpenBLAS is reached best-effort through the library numpy loaded (`golden.blas`); if it
cannot be found nothing happens (set OPENBLAS_NUM_THREADS=1 before starting Python instead).
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


def xla_thread_flags(n: int) -> str:
    """The XLA_FLAGS that give JAX's CPU backend n compute threads (read when the backend starts);
    with one, no Eigen thread pool at all."""
    return f"--xla_cpu_multi_thread_eigen={'false' if n == 1 else 'true'} intra_op_parallelism_threads={n}"


XLA_ONE_THREAD = xla_thread_flags(1)


def share_cores(processes: int) -> int:
    """This process and every process it starts get 1/processes of the cores available to it (at
    least one) as torch, OpenBLAS, MKL and XLA threads, where no variable says otherwise: for
    `processes` busy processes sharing a machine (e.g. test workers).  The environment reaches the
    children and, here, torch and XLA if they have not started; OpenBLAS, loaded with NumPy, is set
    here through its C API.  Returns the thread count."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    n = max(1, cores // max(1, processes))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(n))
    if "intra_op_parallelism_threads" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_thread_flags(n)}".strip()
    blas_threads(int(os.environ["OPENBLAS_NUM_THREADS"]))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return n


def limit_xla_threads() -> None:
    """One XLA compute thread for JAX's CPU backend in this process: takes effect if no JAX
    computation has run here yet (the backend reads XLA_FLAGS when it starts)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if XLA_ONE_THREAD not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {XLA_ONE_THREAD}".strip()


def restore(prev: dict) -> None:
    if prev.get("torch"):
        import torch

        torch.set_num_threads(prev["torch"])
    if prev.get("openblas"):
        blas_threads(prev["openblas"])
