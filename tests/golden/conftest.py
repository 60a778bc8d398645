import pytest
from golden_testlib import one_blas_thread  # noqa: F401  (autouse: this directory's modules on one BLAS thread)

from golden.numerics import Numerics


@pytest.fixture(params=["exact", "device"])
def nm(request):
    return Numerics(request.param)

