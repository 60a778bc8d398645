"""K18 lm_head over vocabulary shards and K19 greedy sampling (first maximum)."""
from __future__ import annotations

import torch

from .numerics import mm


def lm_head(hidden, weight, rows):
    """hidden [T, D] bf16 values; weight [V_shard, D]; rows [n] (-1: a zero row) -> [n, V_shard]."""
    ok = rows >= 0
    src = torch.clamp(torch.where(ok, rows, 0), max=hidden.shape[0] - 1).long()
    logits = mm(hidden[src], weight.T)
    return torch.where(ok[:, None], logits, torch.zeros((), device=logits.device))


def greedy(logits):
    """Smallest index attaining the row maximum."""
    m = logits.amax(dim=-1, keepdim=True)
    j = torch.arange(logits.shape[-1], device=logits.device)
    return torch.where(logits == m, j, logits.shape[-1]).amin(dim=-1)
