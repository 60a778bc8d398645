"""K25 markov_head (rank-r bigram logit bias) and K26 sequential Markov sampling with confidence.

Draft i = first argmax of base[i] + w1[prev] . w2^T, where base[i] is the drafter head hidden
through its own final norm and the target's LM head, and prev is the previous draft (the anchor
token for i = 0).  The chain is sequential: draft i+1 needs draft i.  The confidence logit is a
linear head over [head_hidden ; w1[prev]] (what the official V4.1 model returns); the device
program outputs its sigmoid, `confidence_probs`.  Acceptance never reads either (fixed 7-token chain).
"""
from __future__ import annotations

import numpy as np

from twin.abi.errors import AbiError

from ..kernels.rmsnorm import rms_norm
from .parallel import SINGLE


def markov_head(token_ids, markov_w1, markov_w2, *, nm):
    """-> markov_embed [T, r] (bf16 values), logits_bias [T, V] f32."""
    e = nm.asf(markov_w1[nm.xp.asarray(token_ids)])
    return e, e @ nm.asf(markov_w2).T


def first_argmax(scores, nm):
    return nm.xp.argmax(scores, axis=-1).astype(nm.xp.int64)


def confidence_probs(confidence_logit, nm):
    """The device program's confidence output: the sigmoid of the confidence logit."""
    return 1.0 / (1.0 + nm.xp.exp(-confidence_logit))


def dspark_markov(head_hidden, final_norm_weight, lm_head_weight, num_sampled, last_sampled, next_prefill_tokens,
                  markov_w1, markov_w2, confidence_head_weight, *, cfg, nm, par=SINGLE, owners=None):
    """head_hidden [B, 7, D] -> (draft_token_ids [B, 7] int64, confidence_logit [B, 7] f32).

    owners [B]: the rank holding each request's rows (rank emulation only)."""
    xp = nm.xp
    B, QW, D = head_hidden.shape
    if confidence_head_weight.shape[-1] != D + markov_w1.shape[1]:
        raise AbiError("confidence_head_weight", tuple(confidence_head_weight.shape),
                       f"[1, D + markov_rank] = [1, {D + markov_w1.shape[1]}]", where="dspark_markov")
    hn = rms_norm(head_hidden.reshape(B * QW, D), final_norm_weight, cfg=cfg, nm=nm)
    own = None if owners is None else np.repeat(np.asarray(owners), QW)
    base = par.vocab_logits(hn, lm_head_weight, nm=nm, owners=own).reshape(B, QW, -1)
    ns = np.asarray(num_sampled)
    prev = xp.where(xp.asarray(ns > 0), xp.asarray(last_sampled), xp.asarray(next_prefill_tokens)).astype(xp.int64)
    w = nm.asf(confidence_head_weight).reshape(-1)
    hh = nm.asf(head_hidden)
    drafts, conf = [], []
    for i in range(QW):
        e, bias = markov_head(prev, markov_w1, markov_w2, nm=nm)
        logit = hh[:, i] @ w[:D] + e @ w[D:]
        conf.append(logit)
        prev = first_argmax(base[:, i] + bias, nm)
        drafts.append(prev)
    return xp.stack(drafts, axis=1), xp.stack(conf, axis=1)
