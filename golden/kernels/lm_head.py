"""K18 lm_head on selected rows and K19 greedy sampling (first maximum)."""
from __future__ import annotations

from twin.abi import constants as C


def lm_head(hidden_states, lm_head_weight, logit_row_indices, *, nm):
    """logits[i] = hidden[min(src, T-1)] . W^T for src >= 0, a zero row for src < 0."""
    xp = nm.xp
    src = xp.asarray(logit_row_indices)
    T = hidden_states.shape[0]
    h = nm.asf(hidden_states)[xp.clip(src, 0, T - 1)]
    logits = nm.mm(h, nm.asf(lm_head_weight).T)
    return xp.where((src >= 0)[:, None], nm.r32(logits), 0.0)


def greedy_sample(logits, *, nm, active=None):
    """First maximum per row -> [n] int32 (rows not active -> -1)."""
    xp = nm.xp
    ids = xp.argmax(logits, axis=-1).astype(xp.int32)
    return ids if active is None else xp.where(active, ids, -1)


def sampled_ids_pad(ids, *, nm):
    """The ABI's sampled_ids [n, SAMPLED_PAD]: column 0 the token, the rest 0."""
    xp = nm.xp
    return xp.concatenate([ids[:, None], xp.zeros((ids.shape[0], C.SAMPLED_IDS_PAD - 1), xp.int32)], axis=1)
