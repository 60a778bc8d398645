"""`l3_distributed_markov_sample`: the standalone Markov sampler over each rank's drafter rows.

Rank r's B rows x 7 head hiddens go through the drafter's final norm and the group's vocabulary
shards (the rows are all-gathered; `logit_row_indices` names them, -1 a zero row), then the K26
chain per row.  draft_token_ids and confidence_probs are the rank's own rows.
"""
from __future__ import annotations

import torch

from twin.abi import constants as C

from .head import vocab_logits
from .markov import markov_chain
from .rmsnorm import rms_norm

QW = C.DSPARK_QUERY_WIDTH


def extents(dispatch) -> dict:
    return {"B": int(dispatch.args["head_hidden"].shape[1])}


def sample(a, cfg, dep, hidden_of, prefix: str = ""):
    """The Markov sampler of every held rank: hidden_of(r) -> [B, QW, D]; weights under `prefix`.
    -> (drafts, probs, base logits) stacked over the ranks held."""
    ranks, tp = a.ranks, dep.topology.tp
    w = lambda n: a[prefix + n]                # noqa: E731
    h = ranks.local(hidden_of)
    hn = ranks.local(lambda r: rms_norm(h[r].reshape(-1, h[r].shape[-1]), w("final_norm_weight")[r], cfg.rms_norm_eps))
    n = a["num_sampled"].shape[1] * QW
    rows = [a["logit_row_indices"][r][:n].long() if "logit_row_indices" in a else torch.arange(n, device=a.device)
            for r in range(ranks.R)]
    base = vocab_logits(ranks, tp, hn, rows, a["lm_head_weight"])

    def chain(r):
        B = h[r].shape[0]
        prev = torch.where(a["num_sampled"][r] > 0, a["last_sampled"][r], a["next_prefill_tokens"][r]).long()
        d, c = markov_chain(h[r], base[r].reshape(B, QW, -1), prev, w("markov_w1")[r], w("markov_w2")[r],
                            w("confidence_head_weight")[r])
        return d.to(torch.int32), c
    out = [chain(r) for r in ranks.mine]
    return torch.stack([d for d, _ in out]), torch.stack([c for _, c in out]), ranks.stack(base)


def run_markov(a, cfg, dep):
    drafts, probs, logits = sample(a, cfg, dep, lambda r: a["head_hidden"][r])
    taps = {("markov", "base_logits"): logits, ("markov", "draft_token_ids"): drafts,
            ("markov", "confidence_probs"): probs}
    return {"draft_token_ids": drafts, "confidence_probs": probs}, taps
