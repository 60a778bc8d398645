"""BLAS thread control for measurements and CI.

On a loaded 2-core machine a multi-threaded OpenBLAS spins against other processes and small
GEMMs run ~8x slower; golden's work is many small GEMMs.  `blas_threads(n)` sets NumPy's bundled
OpenBLAS thread count through its C API (no new dependency) and returns the previous count, or
None where the library is not found (then nothing changes)."""
from __future__ import annotations

import ctypes
import glob
import os
from contextlib import contextmanager

import numpy as np

_SET = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads")
_GET = ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads")


def _lib():
    libdir = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in glob.glob(os.path.join(libdir, "*openblas*.so*")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for s, g in zip(_SET, _GET):
            if hasattr(lib, s) and hasattr(lib, g):
                setter, getter = getattr(lib, s), getattr(lib, g)
                # void set(int), int get(void): stated, so ctypes converts exactly these
                setter.argtypes, setter.restype = [ctypes.c_int], None
                getter.argtypes, getter.restype = [], ctypes.c_int
                return setter, getter
    return None


def blas_threads(n: int) -> int | None:
    fns = _lib()
    if fns is None:
        return None
    setter, getter = fns
    old = int(getter())
    setter(int(n))
    return old


@contextmanager
def single_threaded_blas():
    old = blas_threads(1)
    try:
        yield
    finally:
        if old is not None:
            blas_threads(old)
