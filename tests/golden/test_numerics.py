import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from golden.numerics import FP4, FP8, Numerics, block_round_trip, bf16_round
from twin.abi.errors import AbiError

DEVICE, EXACT, OFFICIAL = Numerics("device"), Numerics("exact"), Numerics("official")
finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)


def test_unknown_mode_names_argument():
    with pytest.raises(AbiError, match="mode='fast'.*device"):
        Numerics("fast")


@settings(max_examples=60)
@given(arrays(np.float32, (3, 17), elements=finite))
def test_q8_contract(x):
    xi, dq = DEVICE.q8(x)
    assert np.all(np.abs(xi) <= 127) and np.all(xi == np.round(xi))
    amax = np.maximum(np.abs(x).max(-1, keepdims=True), 1e-4)
    np.testing.assert_allclose(dq, amax / 127, rtol=1e-6)
    # dequantization error is at most half a step (plus f32 slack)
    assert np.all(np.abs(xi * dq - x) <= dq * 0.5 * (1 + 1e-5) + 1e-30)
    # the largest magnitude maps to +-127 unless the amax floor bites
    big = np.abs(x).max(-1) > 1e-4
    assert np.all(np.abs(xi).max(-1)[big] == 127)


def test_q8_rounds_half_to_even():
    x = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5]], np.float32)   # amax 127 -> scale 1
    xi, dq = DEVICE.q8(x)
    assert xi.tolist() == [[127, 0, 2, 2, -0, -2]] and dq[0, 0] == 1.0


def test_q8_amax_floor_and_exact_mode_passthrough():
    xi, dq = DEVICE.q8(np.zeros((1, 4)))
    assert np.all(xi == 0) and np.isclose(dq[0, 0], 1e-4 / 127)
    x = np.random.default_rng(0).standard_normal((2, 5))
    xe, one = EXACT.q8(x)
    assert np.array_equal(xe, x) and np.all(one == 1)


@settings(max_examples=60)
@given(arrays(np.float32, 64, elements=finite))
def test_bf16_is_round_to_nearest_even_on_the_bit_pattern(x):
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    np.testing.assert_array_equal(bf16_round(x), rounded)
    np.testing.assert_array_equal(DEVICE.bf16(x), rounded.astype(np.float64))
    assert np.array_equal(EXACT.bf16(x.astype(np.float64)), x.astype(np.float64))


def test_int_mm_is_exact_past_fp32_integer_range():
    rng = np.random.default_rng(1)
    a = rng.integers(-127, 128, (4, 16384)).astype(np.int8)
    b = rng.integers(-127, 128, (16384, 3)).astype(np.int8)
    exact = a.astype(np.int64) @ b.astype(np.int64)
    assert np.array_equal(DEVICE.int_mm(a, b), exact.astype(np.float64))
    a[:] = 127
    b[:] = 127
    assert DEVICE.int_mm(a, b)[0, 0] == 127 * 127 * 16384 > 2 ** 24


def test_w8a8_matches_integer_formulation():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    w = rng.integers(-127, 128, (64, 8)).astype(np.int8)
    s = rng.uniform(0.001, 0.01, 8).astype(np.float32)
    amax = np.abs(x).max(-1, keepdims=True)
    xi = np.rint(x * (np.float32(127) / amax))
    ref = (xi.astype(np.int64) @ w.astype(np.int64)) * (np.float32(1) / (np.float32(127) / amax)) * s
    np.testing.assert_allclose(DEVICE.w8a8(x, w, s), ref, rtol=1e-6)
    np.testing.assert_allclose(EXACT.w8a8(x, w, s), x.astype(np.float64) @ (w * s.astype(np.float64)), rtol=1e-12)


@pytest.mark.parametrize("fmt,fmax,block", [(FP8, 448.0, 128), (FP4, 6.0, 32)])
def test_block_round_trips_land_on_the_grid_with_power_of_two_scales(fmt, fmax, block):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 256)) * rng.uniform(0.01, 100, (3, 1))).astype(np.float32)
    y = block_round_trip(x, block, fmt, fmax)
    xb, yb = x.reshape(3, -1, block), y.reshape(3, -1, block)
    amax = np.abs(xb).max(-1, keepdims=True)
    scale = 2.0 ** np.ceil(np.log2(amax / fmax))
    q = yb / scale
    assert np.array_equal(q.astype(fmt).astype(np.float32), q)       # exactly representable
    assert np.all(np.abs(q) <= fmax)
    err = np.abs(yb - xb) / amax
    assert err.max() < (0.07 if fmt is FP8 else 0.4)
    with pytest.raises(AbiError, match="block"):
        block_round_trip(x[:, :100], block, fmt, fmax)


def test_official_mode_round_trips_only_in_official():
    x = np.random.default_rng(4).standard_normal((2, 256))
    assert np.array_equal(DEVICE.act(x), x) and np.array_equal(EXACT.fp4(x), x)
    assert not np.array_equal(OFFICIAL.act(x), x) and not np.array_equal(OFFICIAL.fp4(x), x)


def test_set_rows_is_functional_and_skips_negative_slots():
    pool = np.zeros((3, 2, 1, 4), ml_dtypes.bfloat16)
    new = DEVICE.set_rows(pool, np.array([5, -1, 0]), np.ones((3, 4)) * np.array([[1], [2], [3]]))
    assert np.all(np.asarray(pool, np.float32) == 0)
    flat = np.asarray(new, np.float32).reshape(6, 4)
    assert flat[5].tolist() == [1] * 4 and flat[0].tolist() == [3] * 4 and np.all(flat[1:5] == 0)


def test_a_recorder_with_operands_replays_the_same_gemm_calls_on_the_same_arrays(monkeypatch):
    """MatmulRecorder(operands=True).replay runs every recorded GEMM again by golden's own code on
    the very arrays the step passed (what golden_speed.py times as a step's GEMMs on their own operands)."""
    import golden.numerics as N

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 64))
    w = rng.integers(-127, 128, (32, 64), dtype=np.int8)          # [out, in], read as w.T: a routed expert's
    f = rng.standard_normal((64, 8))
    nm = Numerics("device")
    with N.MatmulRecorder(operands=True) as rec:
        nm.w8a8(x, w.T, np.ones(32))
        nm.mm(x, f)
    assert [k for k, _, _ in rec] == ["iT", "f"] and rec.operands[0][1] is not w and rec.operands[0][1].base is w
    seen = []
    real = N._int_mm_np
    monkeypatch.setattr(N, "_int_mm_np", lambda a, b: seen.append((a, b)) or real(a, b))
    rec.replay()
    assert len(seen) == 1 and seen[0][0] is rec.operands[0][0] and seen[0][1] is rec.operands[0][1]
    with pytest.raises(AbiError, match="operands"):
        N.MatmulRecorder().replay()
