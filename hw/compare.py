"""Comparators: one device tensor against its golden under a `Tolerance`, and paged pools under
the mapped/unmapped rule (kernel-math.md §2 `mapped_pool_ratio_allclose`): rows the dispatch maps
are compared numerically, every other row must be bit-identical to its value before the dispatch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import metrics
from .tolerance import Tolerance


@dataclass
class Finding:
    name: str
    passed: bool
    kind: tuple[str, str, str]
    metrics: dict = field(default_factory=dict)
    reasons: list = field(default_factory=list)
    points: int = 0
    bad_points: int = 0
    bad_rows: list = field(default_factory=list)      # flat rows (pools) or leading-axis rows (tensors)
    site: tuple[str, str] | None = None
    shape: list | None = None
    stats: dict = field(default_factory=dict)         # {"golden": {...}, "device": {...}}: max, min, mean, l2

    def to_dict(self) -> dict:
        d = {"name": self.name, "passed": self.passed, "site": list(self.site) if self.site else None,
             "kind": "/".join(self.kind), "points": self.points, "bad_points": self.bad_points,
             "bad_rows": self.bad_rows[:8], "reasons": self.reasons,
             "metrics": {k: _round(v) for k, v in self.metrics.items()}}
        if self.shape is not None:
            d["shape"] = self.shape
            d["stats"] = {side: {k: _round(v) for k, v in st.items()} for side, st in self.stats.items()}
        return d


def tensor_stats(x) -> dict:
    """max / min / mean / L2 norm over the finite values (msprobe's per-tensor statistics)."""
    x = np.asarray(x, np.float64).ravel()
    x = x[np.isfinite(x)]
    if not x.size:
        return {"max": None, "min": None, "mean": None, "l2": None}
    return {"max": float(x.max()), "min": float(x.min()), "mean": float(x.mean()), "l2": float(np.sqrt(np.dot(x, x)))}


def _round(v):
    if isinstance(v, float):
        return float(f"{v:.6g}") if np.isfinite(v) else str(v)
    return v


def _point_masks(a, e, tol: Tolerance, dtype: str):
    a64, e64 = np.asarray(a, np.float64), np.asarray(e, np.float64)
    with np.errstate(invalid="ignore"):
        fin = e64[np.isfinite(e64)]
        rms = float(np.sqrt(np.mean(fin * fin))) if fin.size else 0.0
        diff = np.abs(a64 - e64)
        outside = diff > tol.atol + tol.atol_rms * rms + tol.rtol * np.abs(e64)
        if tol.max_ulp:
            outside &= metrics.ulp_distance(a64, e64, dtype) > tol.max_ulp
        hard = diff > tol.hard_atol + tol.hard_atol_rms * rms + tol.hard_rtol * np.abs(e64)
    nonfinite = ~np.isfinite(a64) | ~np.isfinite(e64)
    both_same = (np.isnan(a64) & np.isnan(e64)) | ((a64 == e64) & nonfinite)
    bad_nf = nonfinite & ~both_same
    return (outside & ~nonfinite) | bad_nf, (hard & ~nonfinite) | bad_nf


def compare_tensor(name: str, actual, expected, tol: Tolerance, kind: tuple[str, str, str]) -> Finding:
    with np.errstate(all="ignore"):          # NaN/Inf are judged explicitly, not warned about
        return _compare_tensor(name, actual, expected, tol, kind)


def _compare_tensor(name, actual, expected, tol, kind) -> Finding:
    a, e = np.asarray(actual), np.asarray(expected)
    f = Finding(name, True, kind, points=int(e.size), shape=list(e.shape),
                stats={"golden": tensor_stats(e), "device": tensor_stats(a)})
    if a.shape != e.shape:
        f.passed = False
        f.reasons.append(f"shape {list(a.shape)} != golden {list(e.shape)}")
        return f
    if tol.exact:
        aa, ee = (np.sort(a, -1), np.sort(e, -1)) if tol.unordered and a.ndim else (a, e)
        bad = aa != ee
        f.bad_points = int(bad.sum())
        if f.bad_points:
            f.passed = False
            f.reasons.append(f"{f.bad_points} of {f.points} values differ (exact)")
            f.bad_rows = np.flatnonzero(bad.reshape(bad.shape[0], -1).any(-1)).tolist() if bad.ndim else [0]
        f.metrics = {"mismatches": f.bad_points}
        return f
    dtype = kind[1]
    f.metrics = metrics.summary(a, e, dtype, logits=tol.max_kl is not None)
    if not e.size:
        return f
    bad, hard = _point_masks(a, e, tol, dtype)
    f.bad_points = int(bad.sum())
    shape2 = (e.shape[0], -1) if e.ndim else (1, -1)
    bad2, hard2 = bad.reshape(shape2), hard.reshape(shape2)
    wrong = _wrong_rows(a.reshape(bad2.shape), e.reshape(bad2.shape), tol, f.metrics)
    f.bad_rows = _blame(np.arange(bad2.shape[0]), bad2, hard2, wrong)
    _gate(f, tol, int(hard.sum()), len(wrong))
    return f


def _blame(row_ids, bad2, hard2, wrong) -> list[int]:
    """Rows to blame: structurally wrong rows (single-point cap, row gate) if any, else rows with bad points."""
    strong = set(row_ids[hard2.any(-1)].tolist()) | set(row_ids[wrong].tolist()) if len(row_ids) else set()
    return sorted(strong) if strong else row_ids[bad2.any(-1)].tolist()


def _wrong_rows(a2d, e2d, tol: Tolerance, m: dict) -> list[int]:
    """Rows whose own rel-L2 exceeds the row gate: a stale, misplaced or mis-rotated row is a
    structural error however small a fraction of the tensor it is."""
    a2d, e2d = np.asarray(a2d, np.float64), np.asarray(e2d, np.float64)
    if not e2d.size:
        return []
    with np.errstate(invalid="ignore", over="ignore"):
        num = np.sqrt(np.sum((a2d - e2d) ** 2, -1))
        den = np.sqrt(np.sum(e2d ** 2, -1))
        rr = np.where(den > 0, num / np.maximum(den, 1e-30), np.where(num > 0, np.inf, 0.0))
    rr = np.where(np.isnan(rr), np.inf, rr)
    m["max_row_rel_l2"] = float(rr.max())
    if tol.max_row_rel_l2 is None:
        return []
    return np.flatnonzero(rr > tol.max_row_rel_l2).tolist()


def _gate(f: Finding, tol: Tolerance, hard_points: int, wrong_rows: int = 0) -> None:
    m = f.metrics
    if m.get("nonfinite_mismatch"):
        f.reasons.append(f"{m['nonfinite_mismatch']} NaN/Inf mismatches")
    if hard_points:
        f.reasons.append(f"{hard_points} points beyond the single-point cap")
    if wrong_rows:
        f.reasons.append(f"{wrong_rows} rows with rel-L2 above {tol.max_row_rel_l2:g}")
    if f.points and f.bad_points > tol.bad_budget * f.points:
        f.reasons.append(f"{f.bad_points}/{f.points} bad points > budget {tol.bad_budget:g}")
    if tol.min_cosine is not None and m.get("cosine", 1.0) < tol.min_cosine:
        f.reasons.append(f"cosine {m['cosine']:.6f} < {tol.min_cosine}")
    if tol.max_rel_l2 is not None and m.get("rel_l2", 0.0) > tol.max_rel_l2:
        f.reasons.append(f"rel-L2 {m['rel_l2']:.3g} > {tol.max_rel_l2}")
    if tol.max_kl is not None and m.get("kl", 0.0) > tol.max_kl:
        f.reasons.append(f"KL {m['kl']:.3g} > {tol.max_kl}")
    f.passed = not f.reasons


def compare_pool(name: str, actual, expected, before, mapped_rows, tol: Tolerance,
                 kind: tuple[str, str, str]) -> Finding:
    """Pools as [rows, ...] after flattening pages: mapped rows numeric, unmapped rows bit-identical."""
    with np.errstate(all="ignore"):
        return _compare_pool(name, actual, expected, before, mapped_rows, tol, kind)


def _compare_pool(name, actual, expected, before, mapped_rows, tol, kind) -> Finding:
    a, e, b = (np.asarray(x) for x in (actual, expected, before))
    f = Finding(name, True, kind)
    if not (a.shape == e.shape == b.shape):
        f.passed = False
        f.reasons.append(f"shape {list(a.shape)} != golden {list(e.shape)} / before {list(b.shape)}")
        return f
    row = a.shape[-1]
    a2, e2, b2 = a.reshape(-1, row), e.reshape(-1, row), b.reshape(-1, row)
    mapped = np.zeros(a2.shape[0], bool)
    mapped[np.asarray(mapped_rows, np.int64)] = True
    am, em = a2[mapped], e2[mapped]
    f.points = int(em.size)
    # the pool's statistics over the rows this dispatch maps (the rest must be unchanged bytes)
    f.shape, f.stats = list(em.shape), {"golden": tensor_stats(em), "device": tensor_stats(am)}
    f.metrics = metrics.summary(am, em, kind[1]) if em.size else {}
    moved = ~mapped & (a2.view(np.uint8).reshape(a2.shape[0], -1) != b2.view(np.uint8).reshape(b2.shape[0], -1)).any(-1)
    f.metrics["unmapped_modified_rows"] = int(moved.sum())
    f.metrics["mapped_rows"] = int(mapped.sum())
    bad_rows = []
    hard_points = wrong = 0
    if em.size:
        bad, hard = _point_masks(am, em, tol, kind[1])
        f.bad_points = int(bad.sum())
        hard_points = int(hard.sum())
        wrong = _wrong_rows(am, em, tol, f.metrics)
        bad_rows = _blame(np.flatnonzero(mapped), bad, hard, wrong)
        wrong = len(wrong)
    f.bad_rows = sorted(set(bad_rows) | set(np.flatnonzero(moved).tolist()))
    _gate(f, tol, hard_points, wrong)
    if moved.any():
        f.reasons.append(f"{int(moved.sum())} unmapped rows modified (first {np.flatnonzero(moved)[:4].tolist()})")
        f.passed = False
    return f
