"""How closely two exact-mode (float64) golden results must agree when they took different paths.

Exact mode runs float64 GEMMs on float64 operands, so a product rounds and BLAS sums a row in an
order that depends on where the row sits in the GEMM (OpenBLAS's remainder tiles, its thread
split): the 16-rank emulation, which packs rows per rank, and the single-rank golden agree to
rounding, not bit for bit (golden.numerics, Accumulation).  A reordered float64 sum of K terms
differs by at most ~K * 2^-53 of the terms' magnitude: 4.5e-13 at K = 4096, the widest reduction
of the small presets and of the FLASH layers the tests run, and the layers after it carry that
error forward without amplifying it much (no quantization in exact mode).  So the bound is
1e-12 of each value, with a floor of 1e-12 of the array's largest magnitude for values that are
small through cancellation.  Token-level results (sampled tokens, accepted counts, routing) are
compared exactly: a flip would need scores tied to ~1e-15.
"""
import numpy as np

EXACT_RTOL = 1e-12


def assert_exact_close(actual, desired, *, rtol: float = EXACT_RTOL, what: str = ""):
    a, d = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    assert a.shape == d.shape, f"{what}: shape {a.shape} != {d.shape}"
    scale = float(np.abs(d).max()) if d.size else 0.0
    np.testing.assert_allclose(a, d, rtol=rtol, atol=rtol * scale, err_msg=what)
