"""Heap retention for NumPy-heavy processes (measurements, CI, notebooks): an explicit, process-wide
setting, like golden.blas.blas_threads.

A golden step makes thousands of temporaries of 128 KiB .. a few MiB.  glibc serves blocks that
large with mmap, or trims the freed top of the heap back to the OS, so nearly every temporary
arrives as fresh pages and pays their page faults (~15% of a SMALL decode step on NumPy; an
int GEMM's f64 widening ran ~2.5x slower from it).  `retain_heap()` raises glibc's mmap and trim
thresholds so that freed blocks are reused: the process keeps up to `trim_mib` of free heap.
Elsewhere than glibc it does nothing and returns None.
"""
from __future__ import annotations

import ctypes
import ctypes.util

from twin.abi.errors import AbiError

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3      # glibc mallopt parameters (malloc.h)
MAX_MMAP_MIB = 32                                # glibc's own ceiling for the mmap threshold


def retain_heap(mmap_mib: int = 32, trim_mib: int = 64) -> dict | None:
    """Blocks below `mmap_mib` come from the heap, and up to `trim_mib` of freed heap is kept.
    Returns the settings applied, or None where the C library has no mallopt (not glibc)."""
    if not 0 < mmap_mib <= MAX_MMAP_MIB:
        raise AbiError("mmap_mib", mmap_mib, f"1..{MAX_MMAP_MIB} MiB", where="retain_heap")
    if trim_mib < mmap_mib:
        raise AbiError("trim_mib", trim_mib, f">= mmap_mib ({mmap_mib})", where="retain_heap")
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    if not (mallopt(M_MMAP_THRESHOLD, mmap_mib << 20) and mallopt(M_TRIM_THRESHOLD, trim_mib << 20)):
        return None
    return {"mmap_threshold_mib": mmap_mib, "trim_threshold_mib": trim_mib}
