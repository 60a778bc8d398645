"""Shared helpers of the golden tests (a uniquely named module: tests/ is not a package)."""
import numpy as np

from golden.numerics import Numerics

EXACT = Numerics("exact")
DEVICE = Numerics("device")


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
