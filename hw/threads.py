"""CPU thread limits for small-preset runs.

A small preset's GEMMs are tiny: intra-op threads in torch and OpenBLAS's spinning workers only
contend with each other (the golden and the device run in one process) and stall badly on a shared
2-core runner.  `limit_cpu_threads` is called by the entry points (CLI, tests, benchmark), never
on import.  OpenBLAS is reached best-effort through the library numpy loaded; if it cannot be
found nothing happens (set OPENBLAS_NUM_THREADS=1 before starting Python instead).
"""
from __future__ import annotations

import ctypes
import glob
import os


def _openblas():
    """(set, get) of the OpenBLAS numpy loaded, or None."""
    import numpy

    libdir = os.path.join(os.path.dirname(numpy.__file__), os.pardir, "numpy.libs")
    for path in glob.glob(os.path.join(libdir, "*openblas*")):
        lib = ctypes.CDLL(path)
        for prefix, suffix in (("scipy_openblas", "64_"), ("openblas", "64_"), ("openblas", "")):
            fset = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
            fget = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
            if fset is not None and fget is not None:
                cint = ctypes.c_longlong if suffix else ctypes.c_int
                fget.restype = cint
                return (lambda k: fset(cint(k))), (lambda: int(fget()))
    return None


def limit_cpu_threads(n: int = 1) -> dict:
    """Limit torch's and OpenBLAS's threads to n; returns the previous counts, for `restore`."""
    prev = {"torch": None, "openblas": None}
    try:
        import torch

        prev["torch"] = torch.get_num_threads()
        torch.set_num_threads(n)
    except ModuleNotFoundError:
        pass
    try:
        blas = _openblas()
        if blas is not None:
            prev["openblas"] = blas[1]()
            blas[0](n)
    except OSError:
        pass
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
        blas = _openblas()
        if blas is not None:
            blas[0](prev["openblas"])
