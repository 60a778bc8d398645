"""One CPU thread for torch and OpenBLAS in the hw tests (restored afterwards): the golden and the
device share a process and a small preset's GEMMs are tiny (see hw/threads.py)."""
import pytest


@pytest.fixture(scope="module", autouse=True)
def _one_cpu_thread():
    from hw.threads import limit_cpu_threads, restore

    prev = limit_cpu_threads(1)
    yield
    restore(prev)
