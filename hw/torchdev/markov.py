"""K25 markov_head and K26 the sequential Markov sampler with its confidence head.

base[i] = the head hidden through the drafter's final norm (BF16) and the LM head (FP32); prev =
last_sampled when num_sampled > 0, else the prefill's next token; for i = 0..6: e = w1[prev],
confidence = sigmoid(h_i . w[:D] + e . w[D:]) (no bias), draft_i = first argmax of base[i] +
e . w2^T, prev = draft_i.  The chain is sequential: draft i + 1 needs draft i.
"""
from __future__ import annotations

import torch

from .head import greedy


def markov_chain(hidden, base, prev, w1, w2, conf_w):
    """hidden [B, QW, D] bf16 values, base [B, QW, V], prev [B] -> (drafts [B, QW], confidence [B, QW])."""
    B, QW, D = hidden.shape
    w = conf_w.reshape(-1)
    drafts, conf = [], []
    for i in range(QW):
        e = w1[prev]
        conf.append(torch.sigmoid(hidden[:, i] @ w[:D] + e @ w[D:]))
        prev = greedy(base[:, i] + e @ w2.T)
        drafts.append(prev)
    return torch.stack(drafts, dim=1), torch.stack(conf, dim=1)
