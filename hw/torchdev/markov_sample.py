"""`l3_distributed_markov_sample`: the standalone Markov sampler over each rank's drafter rows.

Rank r's B rows x 7 head hiddens go through the drafter's final norm and the group's vocabulary
shards (the rows are all-gathered; `logit_row_indices` names them, -1 a zero row), then the K26
chain per row.  draft_token_ids and confidence_probs are the rank's own rows.
"""
from __future__ import annotations

import torch

from .head import lm_head
from .markov import markov_chain
from .rmsnorm import rms_norm


def extents(dispatch) -> dict:
    return {"B": int(dispatch.args["head_hidden"].shape[1])}


def sample(a, cfg, dep, hidden_of, prefix: str = ""):
    """The Markov sampler of every rank: hidden_of(r) -> [B, QW, D]; weights under `prefix`."""
    R, tp = dep.ranks, dep.topology.tp
    w = lambda n: a[prefix + n]                # noqa: E731
    drafts, probs, logits = [], [], []
    for r in range(R):
        g0 = (r // tp) * tp
        h = hidden_of(r)
        B, QW, D = h.shape
        hn = rms_norm(h.reshape(B * QW, D), w("final_norm_weight")[r], cfg.rms_norm_eps)
        rows = a["logit_row_indices"][r][:B * QW].long() if "logit_row_indices" in a else \
            torch.arange(B * QW, device=h.device)
        base = torch.cat([lm_head(hn, a["lm_head_weight"][g0 + m], rows) for m in range(tp)], dim=-1)
        prev = torch.where(a["num_sampled"][r] > 0, a["last_sampled"][r], a["next_prefill_tokens"][r]).long()
        d, c = markov_chain(h, base.reshape(B, QW, -1), prev, w("markov_w1")[r], w("markov_w2")[r],
                            w("confidence_head_weight")[r])
        drafts.append(d.to(torch.int32))
        probs.append(c)
        logits.append(base)
    return torch.stack(drafts), torch.stack(probs), torch.stack(logits)


def run_markov(a, cfg, dep):
    drafts, probs, logits = sample(a, cfg, dep, lambda r: a["head_hidden"][r])
    taps = {("markov", "base_logits"): logits, ("markov", "draft_token_ids"): drafts,
            ("markov", "confidence_probs"): probs}
    return {"draft_token_ids": drafts, "confidence_probs": probs}, taps
