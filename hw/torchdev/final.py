"""The model head of the target programs: hc_head, final norm, LM head over the TP vocabulary
shards, greedy sampling, and the DSpark target-hidden capture."""
from __future__ import annotations

import torch

from twin.abi import constants as C

from .head import greedy, lm_head
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
    R, tp = dep.ranks, dep.topology.tp
    eps = cfg.rms_norm_eps
    hidden, normed, full, shard, sampled, target, x_out = [], [], [], [], [], [], []
    for r in range(R):
        h = hc_head(x_hc[r], a["hc_head_fn"][r], a["hc_head_scale"][r], a["hc_head_base"][r], rms_eps=eps,
                    hc_eps=cfg.hc_eps)
        hidden.append(h)
        normed.append(rms_norm(h, a["final_norm_w"][r], eps))
    for r in range(R):
        g0 = (r // tp) * tp
        src = torch.cat(normed[g0:g0 + tp]) if group_rows else normed[r]
        x_out.append(src)
        rows = a["logit_row_indices"][g0 if group_rows else r].long()
        lg = torch.cat([lm_head(src, a["lm_head_weight"][g0 + m], rows) for m in range(tp)], dim=-1)
        full.append(lg)
        vt = a["lm_head_weight"].shape[1]
        shard.append(lg[:, (r - g0) * vt:(r - g0 + 1) * vt])
        ids = torch.where(rows >= 0, greedy(lg), torch.full_like(rows, -1))
        pad = torch.zeros(rows.shape[0], C.SAMPLED_IDS_PAD, dtype=torch.int32, device=lg.device)
        pad[:, 0] = ids.to(torch.int32)
        sampled.append(pad)
        target.append(torch.cat([hc_head(taps[(l, "x_hc")][r], a["hc_head_fn"][r], a["hc_head_scale"][r],
                                         a["hc_head_base"][r], rms_eps=eps, hc_eps=cfg.hc_eps)
                                 for l in cfg.dspark_target_layer_ids], dim=-1))
    taps.put("head", "hidden", torch.stack(hidden))
    taps.put("head", "x_norm", torch.stack(normed))
    taps.put("head", "logits", torch.stack(full))
    return {"x_out": torch.stack(x_out), "logits": torch.stack(shard), "sampled_ids": torch.stack(sampled),
            "dspark_target_hidden": torch.stack(target)}, taps
