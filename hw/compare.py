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

    def to_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "site": list(self.site) if self.site else None,
                "kind": "/".join(self.kind), "points": self.points, "bad_points": self.bad_points,
                "bad_rows": self.bad_rows[:8], "reasons": self.reasons,
                "metrics": {k: _round(v) for k, v in self.metrics.items()}}


def _round(v):
    if isinstance(v, float):
        return float(f"{v:.6g}") if np.isfinite(v) else str(v)
    return v


def _point_masks(a, e, tol: Tolerance, dtype: str):
    a64, e64 = np.asarray(a, np.float64), np.asarray(e, np.float64)
    with np.errstate(invalid="ignore"):
        diff = np.abs(a64 - e64)
        outside = diff > tol.atol + tol.rtol * np.abs(e64)
        if tol.max_ulp:
            outside &= metrics.ulp_distance(a64, e64, dtype) > tol.max_ulp
        hard = diff > tol.hard_atol + tol.hard_rtol * np.abs(e64)
    nonfinite = ~np.isfinite(a64) | ~np.isfinite(e64)
    both_same = (np.isnan(a64) & np.isnan(e64)) | ((a64 == e64) & nonfinite)
    bad_nf = nonfinite & ~both_same
    return (outside & ~nonfinite) | bad_nf, (hard & ~nonfinite) | bad_nf


def compare_tensor(name: str, actual, expected, tol: Tolerance, kind: tuple[str, str, str]) -> Finding:
    a, e = np.asarray(actual), np.asarray(expected)
    f = Finding(name, True, kind, points=int(e.size))
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
    rows2 = (bad | hard).reshape(e.shape[0], -1) if e.ndim else np.atleast_2d(bad | hard)
    f.bad_rows = np.flatnonzero(rows2.any(-1)).tolist()
    _gate(f, tol, int(hard.sum()), _wrong_rows(bad.reshape(rows2.shape), tol))
    return f


def _wrong_rows(bad2d, tol: Tolerance) -> int:
    """Rows whose own bad fraction exceeds the row budget: structural errors, never noise."""
    if tol.row_budget >= 1 or not bad2d.size:
        return 0
    return int((bad2d.mean(-1) > tol.row_budget).sum())


def _gate(f: Finding, tol: Tolerance, hard_points: int, wrong_rows: int = 0) -> None:
    m = f.metrics
    if m.get("nonfinite_mismatch"):
        f.reasons.append(f"{m['nonfinite_mismatch']} NaN/Inf mismatches")
    if hard_points:
        f.reasons.append(f"{hard_points} points beyond the single-point cap")
    if wrong_rows:
        f.reasons.append(f"{wrong_rows} rows with more than {tol.row_budget:g} of their points bad")
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
        wrong = _wrong_rows(bad, tol)
        bad_rows = np.flatnonzero(mapped)[(bad | hard).any(-1)].tolist()
    f.bad_rows = sorted(bad_rows + np.flatnonzero(moved).tolist())
    _gate(f, tol, hard_points, wrong)
    if moved.any():
        f.reasons.append(f"{int(moved.sum())} unmapped rows modified (first {np.flatnonzero(moved)[:4].tolist()})")
        f.passed = False
    return f
