import pytest

from golden.checkpoint import SyntheticCheckpoint
from golden.numerics import Numerics
from twin.abi.presets import SMALL, TINY


@pytest.fixture(scope="session")
def tiny_ckpt():
    return SyntheticCheckpoint(TINY, seed=0)


@pytest.fixture(scope="session")
def flash_ckpt():
    """FLASH-shaped weights, generated per (layer, expert) on first use and shared by the tests."""
    from twin.abi.presets import FLASH
    return SyntheticCheckpoint(FLASH, seed=0, cache_layers=2, cache_experts=64)


@pytest.fixture(scope="session")
def small_ckpt():
    return SyntheticCheckpoint(SMALL, seed=0)


@pytest.fixture(params=["exact", "device"])
def nm(request):
    return Numerics(request.param)



@pytest.fixture(scope="module", autouse=True)
def _one_blas_thread():
    """Small GEMMs on a shared 2-core runner: one BLAS thread is ~8x faster than two spinning."""
    from golden.blas import single_threaded_blas
    with single_threaded_blas():
        yield
