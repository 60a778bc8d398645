"""CPU thread limits for small-preset runs.

A small preset's GEMMs are tiny: intra-op threads in torch and OpenBLAS's spinning workers only
contend with each other (the golden and the device run in one process) and stall badly on a shared
2-core runner.  `limit_cpu_threads` is called by the entry points (CLI, tests, benchmark), never
on import.  OpenBLAS is reached best-effort through the library numpy loaded (`golden.blas`); if it
cannot be found nothing happens (set OPENBLAS_NUM_THREADS=1 before starting Python instead).
"""
from __future__ import annotations

import os

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


# XLA's CPU backend reads these when it starts: one intra-op thread, no Eigen thread pool
XLA_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


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
