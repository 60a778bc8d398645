"""The metadata builder's primitives (serving-contract.md §6.1), vectorised over positions.

Tables are int32 rows; slots are int64 and -1 where nothing is written or read.  Every function
is pure: ids and positions in, arrays out.
"""
from __future__ import annotations

import numpy as np

from .. import constants as C
from ..errors import AbiError


def _ids(ids, what: str) -> np.ndarray:
    a = np.asarray(ids, dtype=np.int64).reshape(-1)
    if a.size == 0 or (a < 0).any():
        raise AbiError("ids", list(a[:8]), "a non-empty list of non-negative block ids", where=what)
    return a


def ring_table(ids, depth: int) -> np.ndarray:
    """entry i = ids[i mod n]: a rolling family's ring spread over a frozen (or ring-period) depth."""
    a = _ids(ids, "ring_table")
    return a[np.arange(depth) % a.size].astype(np.int32)


def trailing_ring_table(ids, position: int, page: int, depth: int) -> np.ndarray:
    """Only the `depth` most recent logical pages ending at position // page are filled, at index
    logical mod depth, with ids[logical mod n]; the rest are -1 (the decode CSA transaction ring)."""
    a = _ids(ids, "trailing_ring_table")
    out = np.full(depth, -1, np.int32)
    last = int(position) // page
    logical = np.arange(max(0, last - depth + 1), last + 1)
    out[logical % depth] = a[logical % a.size]
    return out


def absolute_table(ids, depth: int) -> np.ndarray:
    """ids at [0, n) and -1 after: the full-history families."""
    a = _ids(ids, "absolute_table")
    if a.size > depth:
        raise AbiError("ids", a.size, f"at most {depth} pages (the frozen table depth)", where="absolute_table")
    out = np.full(depth, -1, np.int32)
    out[: a.size] = a
    return out


def paged_slot(pos, table, page: int) -> np.ndarray:
    """table[pos // page] * page + pos mod page; -1 beyond the depth, at -1 entries or pos < 0."""
    p = np.asarray(pos, dtype=np.int64)
    t = np.asarray(table)
    lp = p // page
    ok = (p >= 0) & (lp < t.shape[-1])
    entry = t[np.clip(lp, 0, t.shape[-1] - 1)].astype(np.int64)
    ok &= entry >= 0
    return np.where(ok, entry * page + p % page, -1)


def ring_slot(pos, ids, page: int) -> np.ndarray:
    """ids[(pos // page) mod n] * page + pos mod page; never -1 for pos >= 0."""
    a = _ids(ids, "ring_slot")
    p = np.asarray(pos, dtype=np.int64)
    return a[(p // page) % a.size] * page + p % page


def compressed_slot(pos, table, ratio: int, commit=None) -> np.ndarray:
    """Writes only at compression boundaries (pos+1) mod ratio == 0 (and where `commit` is true):
    storage row pos // ratio in pages of 128/ratio rows; -1 otherwise."""
    p = np.asarray(pos, dtype=np.int64)
    t = np.asarray(table)
    rpp = C.COMPRESSED_BLOCK_TOKENS // ratio
    row = p // ratio
    pg = row // rpp
    ok = (p >= 0) & ((p + 1) % ratio == 0) & (pg < t.shape[-1])
    if commit is not None:
        ok &= np.asarray(commit, dtype=bool)
    entry = t[np.clip(pg, 0, t.shape[-1] - 1)].astype(np.int64)
    ok &= entry >= 0
    return np.where(ok, entry * rpp + row % rpp, -1)


def state_slot(pos, table, page: int) -> np.ndarray:
    """The compressor-state slot: a paged slot with page 8 (HCA) or 2 (CSA)."""
    return paged_slot(pos, table, page)


def swa_window(pos, ori_ids, window: int = C.SLIDING_WINDOW, page: int = C.BLOCK_SIZE):
    """For a query at p the window is [max(0, p-window+1), p]: `window` columns of ori ring slots,
    oldest first, -1 beyond; len = p - start + 1.  Returns (indices int32 [n, window], lens int32)."""
    p = np.asarray(pos, dtype=np.int64).reshape(-1)
    start = np.maximum(0, p - window + 1)
    lens = p - start + 1
    q = start[:, None] + np.arange(window)[None, :]
    ok = np.arange(window)[None, :] < lens[:, None]
    idx = np.where(ok, ring_slot(np.where(ok, q, 0), ori_ids, page), -1)
    return idx.astype(np.int32), lens.astype(np.int32)


def rows_per_slot_page(family) -> int:
    """Storage rows per page of a family: what one block id stands for in a slot number."""
    return family.rows_per_page
