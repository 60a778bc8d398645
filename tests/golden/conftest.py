import pytest

from golden.numerics import Numerics


@pytest.fixture(params=["exact", "device"])
def nm(request):
    return Numerics(request.param)


@pytest.fixture(scope="module", autouse=True)
def _one_blas_thread():
    """Small GEMMs on a shared 2-core runner: one BLAS thread is ~8x faster than two spinning."""
    from golden.blas import single_threaded_blas
    with single_threaded_blas():
        yield
