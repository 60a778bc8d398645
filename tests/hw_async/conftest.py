"""One CPU thread for torch and OpenBLAS in the asynchronous-checking tests, as in tests/hw: the
device side and the checks share this 2-core machine's cores."""
import pytest


@pytest.fixture(scope="module", autouse=True)
def _one_cpu_thread(one_cpu_thread):      # tests/conftest.py
    yield
