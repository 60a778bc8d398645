"""Shared helpers of the golden tests (a uniquely named module: tests/ is not a package)."""
import numpy as np
import pytest

from golden.numerics import Numerics

EXACT = Numerics("exact")
DEVICE = Numerics("device")


@pytest.fixture(scope="module", autouse=True)
def one_blas_thread():
    """Small GEMMs on a shared 2-core runner: one BLAS thread is ~8x faster than two spinning.  Autouse
    where a conftest imports it (tests/golden, tests/golden_jax): those directories' modules alone."""
    from golden.blas import single_threaded_blas
    with single_threaded_blas():
        yield


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
