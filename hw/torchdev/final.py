"""The model head of the target programs: hc_head, final norm, LM head over the TP vocabulary
shards, greedy sampling, and the DSpark target-hidden capture."""
from __future__ import annotations

import torch

from twin.abi import constants as C

from .head import greedy, vocab_logits
from .hyper import hc_head
from .rmsnorm import rms_norm


def final(a, cfg, dep, x_hc, taps, *, group_rows: bool):
    """hc_head -> final rms_norm -> the group's vocabulary shards -> greedy; the K21 target hidden
    (hc_head of the target layers' outputs).

    Logit entries: each rank's own `logit_row_indices` into its own rows (decode), or, with
    `group_rows`, the group leader's into the group stream (prefill: the rows are all-gathered).
    logits[r] is vocabulary shard r mod TP of those entries; the full-vocabulary rows are the
    ("head", "logits") tap; sampled_ids (first maximum over the whole vocabulary, -1 for an entry
    of -1) is written on every rank of the group.  x_out is the final-norm output of the rank's
    rows (the group's rows on every rank with `group_rows`)."""
    ranks, tp = a.ranks, dep.topology.tp
    eps = cfg.rms_norm_eps
    hidden = ranks.local(lambda r: hc_head(x_hc[r], a["hc_head_fn"][r], a["hc_head_scale"][r], a["hc_head_base"][r],
                                           rms_eps=eps, hc_eps=cfg.hc_eps))
    normed = ranks.local(lambda r: rms_norm(hidden[r], a["final_norm_w"][r], eps))
    if group_rows:
        all_normed = ranks.gather(normed)
        src = [torch.cat(all_normed[(r // tp) * tp:(r // tp) * tp + tp]) for r in range(ranks.R)]
    else:
        src = normed
    rows = [a["logit_row_indices"][(r // tp) * tp if group_rows else r].long() for r in range(ranks.R)]
    full = vocab_logits(ranks, tp, src, rows, a["lm_head_weight"])
    vt = a["lm_head_weight"].shape[1]

    def sampled(r):
        ids = torch.where(rows[r] >= 0, greedy(full[r]), torch.full_like(rows[r], -1))
        pad = torch.zeros(rows[r].shape[0], C.SAMPLED_IDS_PAD, dtype=torch.int32, device=full[r].device)
        pad[:, 0] = ids.to(torch.int32)
        return pad

    def target(r):
        return torch.cat([hc_head(ranks.of(taps[(l, "x_hc")], r), a["hc_head_fn"][r], a["hc_head_scale"][r],
                                  a["hc_head_base"][r], rms_eps=eps, hc_eps=cfg.hc_eps)
                          for l in cfg.dspark_target_layer_ids], dim=-1)
    shard = ranks.local(lambda r: full[r][:, (r % tp) * vt:(r % tp + 1) * vt])
    taps.put("head", "hidden", hidden)
    taps.put("head", "x_norm", normed)
    taps.put("head", "logits", full)
    return {"x_out": ranks.stack(src), "logits": ranks.stack(shard), "sampled_ids": ranks.stack(ranks.local(sampled)),
            "dspark_target_hidden": ranks.stack(ranks.local(target))}, taps
