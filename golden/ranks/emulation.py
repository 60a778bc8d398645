"""`RankEmulation`: the drop-in `par` object that runs a composition as the ranks of the deployment.

Row-local stages run once per rank on the rows it owns (a band of the prefill stream, or its
requests' rows) and are all-gathered rank-major; the grouped o_proj is TP-sharded inside each TP
group; the MoE is EP-dispatched over all ranks; the vocab-wide heads are TP-sharded over vocab.
With reduction "ordered" every result is bitwise the single-rank one in exact mode; "partial_sums"
reduces the o_proj as the device's reduce-scatter does (within tolerance).
"""
from __future__ import annotations

import numpy as np

from twin.abi.errors import AbiError

from .collectives import rows_by_rank
from .ep import ep_moe, tiled
from .layout import RankLayout
from .tp import REDUCTIONS, lm_head_tp, o_proj_tp


class RankEmulation:
    def __init__(self, layout: RankLayout, reduction: str = "ordered"):
        if reduction not in REDUCTIONS:
            raise AbiError("reduction", reduction, f"one of {REDUCTIONS}", where="RankEmulation")
        self.layout, self.reduction = layout, reduction
        self.name = f"ranks{layout.ranks}"
        self.trace: list = []          # (stage, rank, rows) per rank-local call, for inspection

    def _owners(self, owners, T):
        if owners is None:
            raise AbiError("owners", None, f"an owner rank per row ({T} rows)", where="rank emulation")
        owners = np.asarray(owners)
        if owners.shape != (T,):
            raise AbiError("owners", owners.shape, f"[{T}] (one owner rank per row)", where="rank emulation")
        return owners

    def map_rows(self, fn, owners, *, nm):
        owners = self._owners(owners, len(owners))
        parts, order = [], []
        for r, idx in enumerate(rows_by_rank(owners, self.layout.ranks)):
            if idx.size:
                parts.append(tiled(fn, idx, len(owners)))
                order.append(idx)
                self.trace.append(("rows", r, idx.size))
        order = np.concatenate(order)
        inv = np.empty_like(order)
        inv[order] = np.arange(order.size)
        # the all-gather: rank-major concatenation, then each row back at its place in the stream
        return tuple(nm.xp.concatenate([p[j] for p in parts], axis=0)[inv] for j in range(len(parts[0])))

    def _by_group(self, owners):
        groups = np.asarray(owners) // self.layout.tp
        return [(g, np.nonzero(groups == g)[0]) for g in range(self.layout.groups) if np.any(groups == g)]

    def target_forward(self, ckpt, meta, caches, owners, *, cfg, nm, taps=None):
        from .target import forward_ranks
        return forward_ranks(ckpt, meta, caches, owners, self, cfg=cfg, nm=nm, taps=taps)

    def o_proj(self, o_packed, lw, *, cfg, nm, owners=None):
        owners = self._owners(owners, o_packed.shape[1])
        out = [None] * o_packed.shape[1]
        res = {}
        for g, idx in self._by_group(owners):
            (y,) = tiled(lambda i: (o_proj_tp(o_packed[:, i], lw["wo_a"], lw["wo_b"], lw["wo_b_scale"],
                                              self.layout, nm=nm, reduction=self.reduction),), idx, len(owners))
            res[g] = (idx, y)
        out = nm.xp.zeros((o_packed.shape[1], cfg.hidden_size), nm.f)
        for idx, y in res.values():
            out[idx] = y
        return out

    def moe(self, x_mixed, lw, expert, input_ids, *, layer, cfg, nm, owners=None):
        owners = self._owners(owners, x_mixed.shape[0])
        return ep_moe(x_mixed, lw, expert, input_ids, owners, self.layout, layer=layer, cfg=cfg, nm=nm)

    def vocab_logits(self, h, lm_head_weight, *, nm, owners=None):
        owners = self._owners(owners, h.shape[0])
        out = nm.xp.zeros((h.shape[0], lm_head_weight.shape[0]), nm.f)
        for g, idx in self._by_group(owners):
            (y,) = tiled(lambda i: (lm_head_tp(h[i], lm_head_weight, self.layout, nm=nm),), idx, len(owners))
            out[idx] = y
        return out
