"""The project's tie rules for top-k selections (the indexer's compressed rows, MoE routing).

Golden's own order is deterministic: descending score, exact ties to the lower index (a stable
descending sort, as pypto-lib's kernels).  A reference or a device may break exact ties otherwise
(`torch.topk` leaves the order unspecified), so two selections over the same scores are
**equivalent** when they differ only among exactly tied scores: the same number of valid entries
(-1 pads) and the same multiset of selected scores.  A comparison that meets such a pair applies
one side's selection to both (`adopt_equivalent`) and records the rows it adopted; a pair that
differs in any score is a divergence, never adopted.

The indexer's near tie (`index_gaps`, `index_near_ties`): two sides' INT8 index scores legitimately
differ by percents (a one-LSB change of a token's query quantization), so a selection of other
compressed rows is a near tie when, under the checking side's own scores, the other side's weakest
selected row is within INDEX_TIE_TOL (relative to the largest |score| the checking side selects)
of its own weakest.  The lockstep applies it to a device's rows, the JAX path to NumPy's; a
difference beyond it is a divergence.  Both forms are vectorized over rows, for NumPy or JAX.
"""
from __future__ import annotations

import numpy as np

# the indexer's near-tie margin: a fraction of the largest |score| the checking side selects
INDEX_TIE_TOL = 0.1           # measured clean (carry=device, seeds 0-2, 63 dispatches each): max 0.048


def equivalent_rows(scores, a, b) -> np.ndarray:
    """[T] bool: row t of selections a, b [T, k] (indices into scores [T, C], -1 = none) selects
    the same count and the same sorted scores.  Entries beyond C, or repeated, make a row unequal."""
    s = np.asarray(scores, np.float64)
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.ndim != 2 or a.shape[0] != s.shape[0]:
        return np.zeros(len(s), bool)
    C = s.shape[1]
    out = np.zeros(len(s), bool)
    for t in range(len(s)):
        x, y = a[t][a[t] >= 0], b[t][b[t] >= 0]
        if x.size != y.size or (x.size and max(x.max(), y.max()) >= C):
            continue
        if np.unique(x).size != x.size or np.unique(y).size != y.size:
            continue
        out[t] = np.array_equal(np.sort(s[t, x]), np.sort(s[t, y]))
    return out


def adopt_equivalent(scores, mine, theirs):
    """-> (selection, adopted rows): `theirs` on every row that differs from `mine` and is
    equivalent to it, `mine` elsewhere (rows that differ in a score stay as they are)."""
    mine, theirs = np.asarray(mine), np.asarray(theirs)
    if mine.shape != theirs.shape:
        return mine, np.zeros(0, int)
    differ = (np.sort(mine, -1) != np.sort(theirs, -1)).any(-1)
    rows = np.flatnonzero(differ & equivalent_rows(scores, mine, theirs))
    out = mine.copy()
    out[rows] = theirs[rows]
    return out, rows


def index_gaps(scores, mine, theirs, xp=np):
    """[T]: per row where selection `theirs` picks other compressed rows than `mine` (both [T, k],
    -1 pads, indices into `scores` [T, C], the scores of `mine`'s side), the near-tie gap (mine's
    weakest selected score - theirs' weakest) / max(1, largest |score| mine selects); NaN where the
    two pick the same rows, or a different count of them, or none, or a row past C."""
    C = scores.shape[1]
    s = scores.astype(xp.float64) if xp is np else scores
    vm, vt = mine >= 0, theirs >= 0
    differ = xp.any(xp.sort(mine, axis=-1) != xp.sort(theirs, axis=-1), axis=-1)
    fits = xp.max(xp.where(vt, theirs, -1), axis=-1) < C
    comparable = differ & (vm.sum(-1) == vt.sum(-1)) & vt.any(-1) & fits
    sm = xp.take_along_axis(s, xp.clip(mine, 0, C - 1), axis=-1)
    st = xp.take_along_axis(s, xp.clip(theirs, 0, C - 1), axis=-1)
    big = xp.finfo(s.dtype).max       # no selected row: a finite stand-in (no inf - inf)
    weakest = lambda v, ok: xp.min(xp.where(ok, v, big), axis=-1)
    scale = xp.maximum(1.0, xp.max(xp.where(vm, xp.abs(sm), 0.0), axis=-1))
    return xp.where(comparable, (weakest(sm, vm) - weakest(st, vt)) / scale, xp.nan)


def index_near_ties(scores, mine, theirs, tol: float = INDEX_TIE_TOL, xp=np):
    """[T] bool: the rows where `theirs` picks other compressed rows than `mine` within the
    indexer's near-tie margin (`index_gaps` <= tol)."""
    return index_gaps(scores, mine, theirs, xp) <= tol
