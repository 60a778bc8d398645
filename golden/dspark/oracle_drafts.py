"""Drafts with a chosen acceptance: the reference continuation with one wrong token.

Synthetic Markov weights almost never guess right, so tests and benchmarks that need every
acceptance length replace the drafter's proposals (after it ran and wrote its caches) by the
known continuation of the sequence, wrong at index `wrong_at` (7: all seven right).  The target
still verifies every draft, so only the number of tokens a step commits changes, never which.
"""
from __future__ import annotations

import numpy as np

from twin.abi.constants import DSPARK_QUERY_WIDTH


def continuation_drafts(full, anchor: int, wrong_at: int, vocab: int, pad: int = 0) -> np.ndarray:
    """The 7 tokens of `full` after `anchor` (`pad` past its end), with the one at `wrong_at`
    replaced by its successor in the vocabulary."""
    out = np.array([full[anchor + 1 + t] if anchor + 1 + t < len(full) else pad
                    for t in range(DSPARK_QUERY_WIDTH)], np.int64)
    if wrong_at < DSPARK_QUERY_WIDTH:
        out[wrong_at] = (out[wrong_at] + 1) % vocab
    return out
