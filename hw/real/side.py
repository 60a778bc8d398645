"""One side of a real-golden lockstep: golden's compositions, its weights and its mutable run.

`TapPar` is golden's single-rank `par` with the target forward tapped at every stage (golden's own
step keeps only the two stages the drafter needs); it remembers each forward's lowered `StepMeta`
and taps, which the lockstep compares and localizes against and whose slot mappings are the rows
a dispatch maps.  `Side` holds golden's served run state (`golden.dispatch.Served`): config +
weights (`golden.dspark.step.Golden`) apart from the run state (`golden.dspark.step.Run`), so a
re-sync replaces the run and nothing else.
"""
from __future__ import annotations

import copy

import numpy as np

from golden.compose import Taps, forward
from golden.kernels.indexer import lightning_indexer
from golden.kernels.moe import gate, moe_experts
from golden.ties import adopt_equivalent, equivalent_rows, index_gaps
from golden.dspark import step as S
from golden.dspark.parallel import SINGLE
from golden.dispatch import Served
from golden.dspark.state import DeviceState


class LayerTaps(Taps):
    """Taps that remember the layer of the last stage put (the MoE hook runs inside a layer)."""

    layer = None

    def put(self, layer, stage, value):
        self.layer = layer
        super().put(layer, stage, value)


class TapPar:
    """Single-rank `par` with full taps.  On the golden side, `route_from` (the device's taps of
    the same forward) re-syncs routing: where the device chose another expert set and that set is a
    near-tie under the golden's own biased scores (within `tie_tol` of the k-th best, relative), the
    golden adopts the device's experts (weights from its own unbiased scores) and records it."""

    name = "single+taps"

    def __init__(self, base=SINGLE):
        self.base = base
        self.calls: list = []          # (StepMeta, Taps, sampled) per target forward since the last clear
        self.route_from: dict | None = None
        self.tie_tol = 0.0             # a float, or layer -> float (the policy's depth-scaled margin)
        self.resyncs: list = []
        self.draft_routes: list = []   # expert indices of each drafter MoE call, in call order
        self.draft_from: list | None = None
        self.sample_from: list | None = None
        self.tie_samples = 0.0
        self.index_tie_tol = 0.0
        self.index_gaps: list = []     # measured: golden-score gap of each top-k row the device chose differently
        self.route_gaps: list = []     # measured: (layer, relative gap) of each routed row the device chose differently
        self.fault = None              # device side only: a hw.real.faults.RealFault that hooks the forward

    def reset(self) -> None:
        self.calls.clear()
        self.draft_routes = []

    def moe(self, x_mixed, lw, expert, input_ids, *, layer, cfg, nm, owners=None):
        """The drafter's MoE (golden's single-rank one), its routing recorded and, on the golden
        side, near-ties re-synced from the device's same call."""
        x_i8, x_scale, idx, wts = gate(x_mixed, lw["norm_w"], lw["gate_w"], lw["gate_bias"], lw.get("tid2eid"),
                                       input_ids, layer=layer, cfg=cfg, nm=nm)
        n = len(self.draft_routes)
        if self.draft_from is not None and n < len(self.draft_from) and layer >= cfg.num_hash_layers:
            idx, wts = self._tie_adopt(x_mixed, lw, idx, wts, self.draft_from[n], ("drafter", f"moe{n}", layer),
                                       cfg=cfg, nm=nm)
        self.draft_routes.append(np.asarray(idx))
        return moe_experts(x_i8, x_scale, idx, wts, expert, lw, cfg=cfg, nm=nm)

    def __getattr__(self, name):
        return getattr(self.base, name)

    def target_forward(self, ckpt, meta, caches, owners, *, cfg, nm, taps=None):
        full = LayerTaps()
        staged, f = meta, self.fault
        if f is not None and f.armed:
            # a device fault: the forward runs what the fault makes of the staged dispatch (positions,
            # tables), with its route and output hooks; the calls keep the staged meta
            meta = f.on_forward(meta, caches)
            out = forward(ckpt, meta, caches, cfg=cfg, nm=nm, taps=full, moe=f.moe_hook(full, ckpt, cfg=cfg))
            out = f.on_output(out, full)
        elif self.route_from is None:
            out = self.base.target_forward(ckpt, meta, caches, owners, cfg=cfg, nm=nm, taps=full)
        else:
            moe, indexer = self.resync_hooks(full, ckpt)
            out = forward(ckpt, meta, caches, cfg=cfg, nm=nm, taps=full, moe=moe, indexer=indexer)
        if self.sample_from is not None and len(self.calls) < len(self.sample_from):
            out.sampled = self._adopt_samples(full, out.sampled, self.sample_from[len(self.calls)])
        if taps is not None:
            for (layer, stage), v in full.items():
                taps.put(layer, stage, v)
        self.calls.append((staged, full, np.asarray(out.sampled)))
        return out

    def resync_hooks(self, taps: LayerTaps, ckpt):
        """(moe, indexer) for golden.compose that adopt the device's near-tie routes and indexer rows
        (`route_from`) layer by layer; `taps` are the forward's, whose `layer` names the layer."""
        def moe(x_i8, x_scale, idx, wts, expert, shared, *, cfg, nm):
            idx, wts = self._adopt_routes(taps, ckpt, None, idx, wts, cfg=cfg, nm=nm)
            return moe_experts(x_i8, x_scale, idx, wts, expert, shared, cfg=cfg, nm=nm)

        def indexer(*a, **kw):
            score, topk = lightning_indexer(*a, **kw)
            return score, self._adopt_topk(taps.layer, score, topk)
        return moe, indexer

    def _adopt_topk(self, layer, score, topk):
        """Indexer top-k: where the device selected other compressed rows within the indexer's
        near-tie margin under golden's scores (golden.ties.index_near_ties), adopt them."""
        dev = self.route_from.get((layer, "idx_topk"))
        topk = np.asarray(topk)
        if dev is None or np.shape(dev) != topk.shape:
            return topk
        dev, score = np.asarray(dev), np.asarray(score, np.float64)
        topk = self._exact_ties(score, topk, dev, [layer, "idx_topk"])
        gaps = index_gaps(score, topk, dev)
        self.index_gaps += gaps[~np.isnan(gaps)].tolist()
        tie = np.flatnonzero(gaps <= self.index_tie_tol).tolist()
        if not tie:
            return topk
        topk = topk.copy()
        topk[tie] = dev[tie]
        self.resyncs.append({"kind": "index", "site": [layer, "idx_topk"], "row": tie[0],
                             "golden": f"{len(tie)} near-tie rows", "device": tie[:8]})
        return topk

    def _exact_ties(self, scores, mine, dev, site):
        """The project's tie rule (golden.ties): rows whose selections differ only among exactly tied
        scores (golden's scores) are equal; the golden takes the device's choice, recorded as "tie"."""
        out, rows = adopt_equivalent(scores, mine, dev)
        if rows.size:
            self.resyncs.append({"kind": "tie", "site": list(site), "row": int(rows[0]),
                                 "golden": f"{rows.size} exactly tied rows", "device": rows[:8].tolist()})
        return out

    def _adopt_samples(self, taps, sampled, dev):
        """Greedy samples: where the device's token is within tie_tol (relative) of the golden's best
        logit, the golden takes the device's token (acceptance then runs on the same decision)."""
        sampled, dev = np.array(sampled), np.asarray(dev)
        logits = np.asarray(taps[("head", "logits")], np.float64)
        rows = np.flatnonzero(sampled != dev) if sampled.shape == dev.shape else []
        top = logits.max(-1)
        tie = [int(r) for r in rows if logits[r, dev[r]] >= top[r] - self.tie_samples * max(1.0, abs(top[r]))]
        if tie:
            sampled[tie] = dev[tie]
            self.resyncs.append({"kind": "sample", "site": ["head", "sample"], "row": tie[0],
                                 "golden": f"{len(tie)} near-tie rows", "device": tie[:8]})
        return sampled


    def _adopt_routes(self, taps, ckpt, meta, idx, wts, *, cfg, nm):
        layer = taps.layer
        dev = self.route_from.get((layer, "moe_indices"))
        if dev is None or layer < cfg.num_hash_layers:
            return idx, wts
        idx2, wts2 = self._tie_adopt(taps[(layer, "ffn_x_mixed")], ckpt.layer(layer), idx, wts, dev,
                                     (layer, "moe_indices"), cfg=cfg, nm=nm)
        if idx2 is not idx and not np.array_equal(idx2, idx):
            taps.put(layer, "moe_indices", idx2)
            taps.put(layer, "moe_weights", wts2)
        return idx2, wts2

    def _tie_adopt(self, x_mixed, lw, idx, wts, dev, site, *, cfg, nm):
        idx, dev = np.asarray(idx), np.asarray(dev)
        if idx.shape != dev.shape:
            return idx, wts
        same = (np.sort(idx, -1) == np.sort(dev, -1)).all(-1) & (idx != dev).any(-1)
        if same.any():
            # the same experts in another order (two near-equal scores swapped): the golden lists them in
            # the device's order, weights with them, so the ordered weights tap compares like for like
            idx, wts = np.array(idx), np.array(wts)
            for r in np.flatnonzero(same):
                perm = np.argsort(idx[r])[np.argsort(np.argsort(dev[r]))]
                idx[r], wts[r] = idx[r][perm], wts[r][perm]
        rows = np.flatnonzero((np.sort(idx, -1) != np.sort(dev, -1)).any(-1))
        if not rows.size:
            return idx, wts
        biased = self._biased(np.asarray(x_mixed)[rows], lw, cfg)       # of the rows that differ
        tied = equivalent_rows(biased, idx[rows], dev[rows])
        if tied.any():
            idx, wts = np.array(idx), np.array(wts)
            for j, r in zip(np.flatnonzero(tied), rows[tied]):
                d = dev[r].astype(np.int64)
                sel = biased[j, d] - np.asarray(lw["gate_bias"], np.float64)[d]
                idx[r] = dev[r]
                wts[r] = nm.r32(sel / sel.sum() * cfg.routed_scaling_factor)
            self.resyncs.append({"kind": "tie", "site": list(site[:2]), "row": int(rows[tied][0]),
                                 "golden": f"{int(tied.sum())} exactly tied rows", "device": rows[tied][:8].tolist()})
            rows, biased = rows[~tied], biased[~tied]
            if not rows.size:
                return idx, wts
        # near-ties: the self-check device's FP32 sums legitimately move the scores, within a margin
        score = biased - np.asarray(lw["gate_bias"], np.float64)
        kth = np.sort(biased, -1)[:, -cfg.num_experts_per_tok]
        chosen = np.take_along_axis(biased, dev[rows].astype(np.int64), -1).min(-1)
        scale = np.maximum(1.0, np.abs(biased).max(-1))
        layer = site[0] if isinstance(site[0], int) else layer_of_draft(site, cfg)
        self.route_gaps += [(layer, float(g)) for g in (kth - chosen) / scale]
        tol = self.tie_tol(layer) if callable(self.tie_tol) else self.tie_tol
        tie = chosen >= kth - tol * scale
        if not tie.any():
            return idx, wts
        idx, wts = np.array(idx), np.array(wts)
        for r, s_row, d_row in zip(rows[tie], score[tie], dev[rows[tie]]):
            sel = s_row[d_row.astype(np.int64)]
            idx[r] = d_row
            wts[r] = nm.r32(sel / sel.sum() * cfg.routed_scaling_factor)
        self.resyncs.append({"kind": "route", "site": list(site[:2]), "row": int(rows[tie][0]),
                             "golden": f"{int(tie.sum())} near-tie rows", "device": rows[tie][:8].tolist()})
        return idx, wts


    @staticmethod
    def _biased(x_mixed, lw, cfg):
        """The router's biased scores in float64 (sqrt-softplus of the normed gate logits, plus bias)."""
        x = np.asarray(x_mixed, np.float64)
        inv_rms = 1.0 / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps)
        logits = inv_rms * ((x * np.asarray(lw["norm_w"], np.float64)) @ np.asarray(lw["gate_w"], np.float64).T)
        return np.sqrt(np.maximum(logits, 0) + np.log1p(np.exp(-np.abs(logits)))) + np.asarray(lw["gate_bias"],
                                                                                                 np.float64)


def layer_of_draft(site, cfg) -> int:
    """A drafter MoE call's depth: the target layer id its routing carries (sites ("drafter", "moeN", id))."""
    return int(site[2]) if len(site) > 2 else cfg.num_hidden_layers


class Side:
    """One side of the lockstep: golden's served run state (`golden.dispatch.Served`) over golden's
    compositions with a tapped `par`; `g` (config, weights, numerics) and `run` (what a dispatch
    mutates) are the served run's."""

    def __init__(self, name: str, cfg, ckpt, dckpt, nm, ctx):
        self.name = name
        self.par = TapPar()
        g = S.Golden(cfg, ckpt, dckpt, nm, max_model_len=ctx.deployment.limits.max_model_len,
                     groups=ctx.deployment.partitions, par=self.par)
        self.served = Served(g, ctx)

    @property
    def g(self) -> S.Golden:
        return self.served.g

    @property
    def run(self) -> S.Run:
        return self.served.run

    @run.setter
    def run(self, run: S.Run) -> None:
        self.served.run = run
        self.served.seqs = {s.req.request_id: s for s in run.seqs}

    def seq(self, rid: str) -> S.Seq:
        return self.served.seqs[rid]

    def adopt(self, run: S.Run) -> None:
        """Re-sync: take the other side's run state (a copy) as this side's."""
        self.run = copy.deepcopy(run)


# each pool's policy kind and the stage a failure in it is localized to
POOL_KIND = {"kv_cache": ("kv_pool", "bf16", "none"), "hca_cmp_kv": ("kv_pool", "bf16", "none"),
             "csa_cmp_kv": ("kv_pool", "bf16", "none"), "idx_kv_cache": ("kv_pool", "bf16", "none"),
             "idx_kv_scale": ("state", "f32", "none"), "hca_compress_state": ("state", "f32", "none"),
             "csa_compress_state": ("state", "f32", "none"), "csa_inner_compress_state": ("state", "f32", "none")}
POOL_STAGE = {"kv_cache": "kv", "hca_cmp_kv": "cmp_kv", "csa_cmp_kv": "cmp_kv", "idx_kv_cache": "cmp_kv",
              "idx_kv_scale": "cmp_kv", "hca_compress_state": "cmp_kv", "csa_compress_state": "cmp_kv",
              "csa_inner_compress_state": "cmp_kv"}
# the golden slot key (golden.staging.SLOTS) that writes each pool
POOL_SLOTS = {"kv_cache": "ori", "hca_compress_state": "hca_state", "csa_compress_state": "csa_state",
              "csa_inner_compress_state": "csa_inner_state", "hca_cmp_kv": "hca_cmp", "csa_cmp_kv": "csa_cmp",
              "idx_kv_cache": "csa_idx", "idx_kv_scale": "csa_idx"}


def mapped_rows(calls) -> dict:
    """pool -> flat rows the dispatch's target forwards write (every slot >= 0 of its family)."""
    out = {}
    for pool, key in POOL_SLOTS.items():
        rows = [m.slots[key][m.slots[key] >= 0] for m, *_ in calls]
        out[pool] = np.unique(np.concatenate(rows)) if rows else np.zeros(0, np.int64)
    return out


# ---- a side's state as named arrays (what a backend receives and returns, what records store) ------
def side_state(side) -> dict:
    """'LAYER/POOL' target pools, 'draft/GROUP' drafter pools, 'dspark/tokens|meta' the K=7 state."""
    run = side.run
    out = {f"{layer}/{pool}": a for layer, pools in enumerate(run.caches) for pool, a in pools.items()}
    if run.pools is not None:
        out.update({f"draft/{g}": a for g, a in enumerate(run.pools)})
    if run.state is not None:
        out["dspark/tokens"], out["dspark/meta"] = run.state.tokens, run.state.meta
    return out


def install_state(side, arrays: dict) -> None:
    run = side.run
    run.caches = [{pool: arrays[f"{layer}/{pool}"] for pool in pools} for layer, pools in enumerate(run.caches)]
    if run.pools is not None:
        run.pools = [arrays[f"draft/{g}"] for g in range(len(run.pools))]
    if run.state is not None:
        run.state = DeviceState(arrays["dspark/tokens"], arrays["dspark/meta"], run.state.noise_token)
