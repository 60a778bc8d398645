"""One CPU thread for torch and OpenBLAS in the hw tests (restored afterwards): the golden and the
device share a process and a small preset's GEMMs are tiny (see hw/threads.py).

The device side's GEMMs run in torch's own BLAS: .ci/run's OPENBLAS_* configuration changes only
the golden side (NumPy's OpenBLAS), and its thread count is set to one here whatever it says."""
import pytest


@pytest.fixture(scope="module", autouse=True)
def _one_cpu_thread(one_cpu_thread):      # tests/conftest.py
    yield
