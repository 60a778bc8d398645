"""Metrics, the tolerance policy as data, and the comparators."""
import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hw import metrics
from hw.compare import compare_pool, compare_tensor
from hw.tolerance import DEFAULT_TABLE, Policy, Tolerance
from twin.abi.errors import AbiError

finite32 = st.floats(-1e30, 1e30, allow_nan=False, allow_infinity=False).map(np.float32)


@settings(max_examples=60)
@given(finite32)
def test_ulp_distance_counts_grid_steps(x):
    x = np.float32(x)
    nxt = np.nextafter(x, np.float32(np.inf), dtype=np.float32)
    assert metrics.ulp_distance([x], [x], "f32")[0] == 0
    assert metrics.ulp_distance([x], [nxt], "f32")[0] == 1
    assert metrics.ulp_distance([nxt], [x], "f32")[0] == 1


def test_ulp_distance_bf16_and_signed_zero():
    one = np.float32(1.0)
    assert metrics.ulp_distance([one], [np.float32(1.0078125)], "bf16")[0] == 1      # bf16 step at 1.0
    assert metrics.ulp_distance([np.float32(-0.0)], [np.float32(0.0)], "f32")[0] == 0
    tiny = np.float32(ml_dtypes.finfo(ml_dtypes.bfloat16).smallest_subnormal)
    assert metrics.ulp_distance([-tiny], [tiny], "bf16")[0] == 2


@settings(max_examples=40)
@given(st.integers(0, 2**31 - 1), st.floats(0.1, 100))
def test_kl_is_zero_on_equal_rows_shift_invariant_and_positive_otherwise(seed, shift):
    rng = np.random.default_rng(seed)
    lg = rng.standard_normal((3, 50))
    assert metrics.kl_logits(lg, lg) == pytest.approx(0, abs=1e-12)
    assert metrics.kl_logits(lg + shift, lg) == pytest.approx(0, abs=1e-9)
    other = lg + rng.standard_normal(lg.shape)
    assert metrics.kl_logits(other, lg) > 0


def test_cosine_and_rel_l2():
    a = np.arange(1, 10, dtype=np.float32)
    assert metrics.cosine(a, 3 * a) == pytest.approx(1.0)
    assert metrics.rel_l2(a, a) == 0
    assert metrics.rel_l2(1.1 * a, a) == pytest.approx(0.1, rel=1e-6)
    assert metrics.cosine(a, -a) == pytest.approx(-1.0)


def test_policy_lookup_wildcards_and_errors():
    p = Policy()
    assert p.lookup("logits", "f32").max_kl is not None
    p2 = Policy({("*", "bf16", "*"): Tolerance(atol=1.0)})
    assert p2.lookup("anything", "bf16", "w8a8").atol == 1.0
    with pytest.raises(AbiError, match="tolerance key.*nope/f64/none"):
        p.lookup("nope", "f64")


def test_policy_is_data_round_trip_and_override(tmp_path):
    p = Policy()
    path = tmp_path / "policy.json"
    p.to_json(path)
    back = Policy.from_json(path, base=Policy({}))
    assert back.table == p.table
    path.write_text(json.dumps({"logits/f32/none": {"atol": 9.0}}))
    assert Policy.from_json(path).lookup("logits", "f32").atol == 9.0
    path.write_text(json.dumps({"logits/f32/none": {"atoll": 9.0}}))
    with pytest.raises(AbiError, match="atoll"):
        Policy.from_json(path)
    with pytest.raises(AbiError, match="bad_budget"):
        Tolerance(bad_budget=2.0)


def test_table_is_keyed_by_op_dtype_quant_and_covers_the_metrics():
    assert all(len(k) == 3 for k in DEFAULT_TABLE)
    fields = {f for t in DEFAULT_TABLE.values() for f, v in t.__dict__.items() if v not in (None, 0, 0.0, False)}
    assert {"atol", "rtol", "max_ulp", "bad_budget", "min_cosine", "max_rel_l2", "max_kl", "exact"} <= fields


TOL = Policy().lookup("matmul", "bf16")
KIND = ("matmul", "bf16", "none")


def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def test_compare_tensor_noise_passes_a_wrong_row_fails_and_is_blamed():
    rng = np.random.default_rng(0)
    e = _bf16(rng.standard_normal((40, 32)))
    noisy = _bf16(e * (1 + 2 ** -8 * rng.choice([-1, 0, 1], e.shape)))
    assert compare_tensor("x", noisy, e, TOL, KIND).passed
    bad = noisy.copy()
    bad[17] = _bf16(rng.standard_normal(32))
    f = compare_tensor("x", bad, e, TOL, KIND)
    assert not f.passed and f.bad_rows == [17]
    nan = noisy.copy()
    nan[3, 4] = np.nan
    f = compare_tensor("x", nan, e, TOL, KIND)
    assert not f.passed and any("NaN" in r for r in f.reasons)
    f = compare_tensor("x", e[:-1], e, TOL, KIND)
    assert not f.passed and "shape" in f.reasons[0]


def test_exact_and_unordered_comparisons():
    route = Policy().lookup("route", "i32")
    a = np.array([[1, 2], [3, 4]])
    assert compare_tensor("r", a[:, ::-1], a, route, ("route", "i32", "none")).passed
    f = compare_tensor("r", np.array([[1, 2], [3, 5]]), a, route, ("route", "i32", "none"))
    assert not f.passed and f.bad_rows == [1]
    idx = Policy().lookup("index", "i32")
    assert not compare_tensor("i", a[:, ::-1], a, idx, ("index", "i32", "none")).passed


@settings(max_examples=40)
@given(st.integers(0, 2**31 - 1), st.data())
def test_pool_rule_mapped_numeric_unmapped_bit_identical(seed, data):
    rng = np.random.default_rng(seed)
    before = _bf16(rng.standard_normal((6, 4, 8)))
    rows = before.reshape(-1, 8).shape[0]
    mapped = np.array(sorted(data.draw(st.sets(st.integers(0, rows - 1), min_size=1, max_size=rows - 1))))
    gold = before.copy().reshape(-1, 8)
    gold[mapped] = _bf16(rng.standard_normal((len(mapped), 8)))
    gold = gold.reshape(before.shape)
    dev = gold.copy()
    tol, kind = Policy().lookup("kv_pool", "bf16"), ("kv_pool", "bf16", "none")
    assert compare_pool("p", dev, gold, before, mapped, tol, kind).passed
    unmapped = np.setdiff1d(np.arange(rows), mapped)
    r = int(data.draw(st.sampled_from(unmapped.tolist())))
    flat = dev.reshape(-1, 8)
    flat[r, 0] = np.nextafter(flat[r, 0], np.float32(np.inf))      # one ULP, one element: still a write
    f = compare_pool("p", dev, gold, before, mapped, tol, kind)
    assert not f.passed and r in f.bad_rows and f.metrics["unmapped_modified_rows"] == 1
