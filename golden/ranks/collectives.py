"""Row ownership and the group collectives of the emulation (serving-contract.md §1.4, K28).

Prefill: a group's packed stream of P rows is split rank-major into tp bands of P/tp rows; decode:
rank 4g + j owns its requests' rows.  All-gather returns every rank's rows concatenated rank-major,
which is the group's stream in its original order.
"""
from __future__ import annotations

import numpy as np

from twin.abi.errors import AbiError


def rank_bands(P: int, tp: int) -> list[np.ndarray]:
    """Row indices of each rank's band of a P-row group stream (P a multiple of tp)."""
    if P % tp:
        raise AbiError("P", P, f"a multiple of tp={tp} (synthetic padding rows fill the last band)",
                       where="rank_bands")
    L = P // tp
    return [np.arange(r * L, (r + 1) * L) for r in range(tp)]


def all_gather(parts):
    """K28: every rank receives the rank-major concatenation of the ranks' local rows."""
    return np.concatenate([np.asarray(p) for p in parts], axis=0)


def rows_by_rank(owners, ranks: int) -> list[np.ndarray]:
    owners = np.asarray(owners)
    if owners.size and (owners.min() < 0 or owners.max() >= ranks):
        raise AbiError("owner_rank", int(owners.max() if owners.max() >= ranks else owners.min()),
                       f"0..{ranks - 1}", where="rank emulation")
    return [np.nonzero(owners == r)[0] for r in range(ranks)]
