"""The project's one tie rule for top-k selections (the indexer's compressed rows, MoE routing).

Golden's own order is deterministic: descending score, exact ties to the lower index (a stable
descending sort, as pypto-lib's kernels).  A reference or a device may break exact ties otherwise
(`torch.topk` leaves the order unspecified), so two selections over the same scores are
**equivalent** when they differ only among exactly tied scores: the same number of valid entries
(-1 pads) and the same multiset of selected scores.  A comparison that meets such a pair applies
one side's selection to both (`adopt_equivalent`) and records the rows it adopted; a pair that
differs in any score is a divergence, never adopted.
"""
from __future__ import annotations

import numpy as np


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
