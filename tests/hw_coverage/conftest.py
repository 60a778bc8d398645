"""One torch / BLAS thread for the sampled lockstep tests (golden and device share a process)."""
import pytest


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    from hw.threads import limit_cpu_threads, restore

    prev = limit_cpu_threads(1)
    yield
    restore(prev)
