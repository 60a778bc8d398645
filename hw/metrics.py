"""Error metrics between a device tensor and its golden: measurements, never gates.

max abs and rel error, rel-L2, cosine, ULP distance in the storage dtype, the fraction of points
outside an element tolerance, and KL(golden || device) of the softmax for logits.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

_ULP_DTYPE = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def max_abs(a, e) -> float:
    d = np.abs(_f64(a) - _f64(e))
    return float(d.max()) if d.size else 0.0


def max_rel(a, e, floor: float = 2.0 ** -14) -> float:
    a, e = _f64(a), _f64(e)
    if not a.size:
        return 0.0
    return float((np.abs(a - e) / np.maximum(np.abs(e), floor)).max())


def rel_l2(a, e) -> float:
    a, e = _f64(a), _f64(e)
    den = np.linalg.norm(e)
    num = np.linalg.norm(a - e)
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return float(num / den)


def cosine(a, e) -> float:
    a, e = _f64(a).ravel(), _f64(e).ravel()
    na, ne = np.linalg.norm(a), np.linalg.norm(e)
    if na == 0 and ne == 0:
        return 1.0
    if na == 0 or ne == 0:
        return 0.0
    return float(np.dot(a, e) / (na * ne))


def ulp_distance(a, e, dtype: str) -> np.ndarray:
    """Units in the last place between a and e once both are rounded to `dtype` (bf16/f16/f32):
    the distance of their positions on that dtype's ordered grid."""
    dt = _ULP_DTYPE.get(dtype)
    if dt is None:
        return np.zeros(np.shape(a), np.int64)
    bits = {2: np.int16, 4: np.int32}[np.dtype(dt).itemsize]

    int_min = -(1 << (8 * np.dtype(bits).itemsize - 1))

    def ordinal(x):
        # sign-magnitude bit patterns mapped onto one ordered integer line (-0 and +0 coincide)
        i = np.asarray(x, np.float32).astype(dt).view(bits).astype(np.int64)
        return np.where(i < 0, int_min - i, i)

    return np.abs(ordinal(a) - ordinal(e))


def kl_logits(device_logits, golden_logits) -> float:
    """Mean over rows of KL(softmax(golden) || softmax(device)), in nats."""
    a, e = _f64(device_logits), _f64(golden_logits)
    if not a.size:
        return 0.0
    a = a.reshape(-1, a.shape[-1])
    e = e.reshape(-1, e.shape[-1])
    la = a - a.max(-1, keepdims=True)
    la -= np.log(np.exp(la).sum(-1, keepdims=True))
    le = e - e.max(-1, keepdims=True)
    le -= np.log(np.exp(le).sum(-1, keepdims=True))
    return float(np.mean(np.sum(np.exp(le) * (le - la), -1)))


def nonfinite_mismatch(a, e) -> int:
    """Points where one side is NaN/Inf and the other is not, or both are but differ."""
    a, e = _f64(a), _f64(e)
    fa, fe = np.isfinite(a), np.isfinite(e)
    both_nan = np.isnan(a) & np.isnan(e)
    same_inf = np.isinf(a) & np.isinf(e) & (a == e)
    return int(np.sum((fa != fe) | (~fa & ~fe & ~both_nan & ~same_inf)))


def summary(a, e, dtype: str, *, logits: bool = False) -> dict:
    a64, e64 = _f64(a), _f64(e)
    fin = np.isfinite(a64) & np.isfinite(e64)
    af, ef = a64[fin], e64[fin]
    ulp = ulp_distance(af, ef, dtype)
    out = {
        "max_abs": max_abs(af, ef), "max_rel": max_rel(af, ef), "rel_l2": rel_l2(af, ef), "cosine": cosine(af, ef),
        "max_ulp": int(ulp.max()) if ulp.size else 0, "nonfinite_mismatch": nonfinite_mismatch(a64, e64),
    }
    if logits:
        out["kl"] = kl_logits(a64, e64)
    return out
