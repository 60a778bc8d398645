"""One torch / BLAS thread for the sampled lockstep tests (golden and device share a process)."""
import pytest


@pytest.fixture(scope="module", autouse=True)
def _one_cpu_thread(one_cpu_thread):      # tests/conftest.py
    yield
