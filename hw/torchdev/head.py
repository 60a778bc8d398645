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


def vocab_logits(ranks, tp: int, src, rows, weight):
    """The full-vocabulary logits of each held rank's entries over its TP group's shards.

    src / rows: [R] per-rank hidden rows and logit entries (inputs: every rank's); weight: the
    ranks' vocabulary shards.  Rank g0 + m computes shard m for every member of its group, the
    shards are gathered and concatenated in shard order -> [R] per-rank [n, V]: the same GEMMs
    on the same rows however the ranks are split."""
    src = ranks.gather(src)

    def shards(q):
        g0 = (q // tp) * tp
        return [lm_head(src[r], weight[q], rows[r]) for r in range(g0, g0 + tp)]
    pieces = ranks.gather(ranks.local(shards))

    def full(r):
        g0 = (r // tp) * tp
        return torch.cat([pieces[g0 + m][r - g0] for m in range(tp)], dim=-1)
    return ranks.local(full)


def greedy(logits):
    """Smallest index attaining the row maximum."""
    m = logits.amax(dim=-1, keepdim=True)
    j = torch.arange(logits.shape[-1], device=logits.device)
    return torch.where(logits == m, j, logits.shape[-1]).amin(dim=-1)
