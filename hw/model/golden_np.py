"""The golden side of the reference step, in NumPy: pure functions, pools passed in and returned.

Numerics follow the device contract: BF16 rounding points (ml_dtypes, nearest even), per-row INT8
activations for the experts (amax floor 1e-4, scale 127, round half to even) with an exact integer
accumulator, FP32 elsewhere.

Re-sync: where the device made a decision the golden could legitimately have made differently (a
routing or sampling near-tie), the golden adopts the device's choice and records it, so one small
numeric difference does not send the two down different token paths.  A choice that is not a
near-tie is kept as the golden's own and shows up as a divergence.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from twin.abi.presets import CSA, HCA

from .spec import (CSA_STATE_PAGE, CSA_STATE_PAGES, DRAFTS, HCA_STATE_PAGE, HCA_STATE_PAGES, LEASE_BLOCKS,
                   PROGRAM_FUSED, PROGRAM_SEED, ROWS_PER_VERIFY, Geometry, draft_layer, target_layer)
from .weights import Weights

BLOCK = 32
NEG = -1e30


def bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def rms(x, w, eps):
    x = np.asarray(x, np.float32)
    y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + np.float32(eps))
    return y if w is None else y * w


def q8(x):
    amax = np.maximum(np.abs(x).max(-1, keepdims=True), np.float32(1e-4))
    sq = np.float32(127.0) / amax
    return np.rint(x * sq), (np.float32(1.0) / sq).astype(np.float32)


def int_mm(a, w_t):
    return (a.astype(np.float64) @ w_t.astype(np.float64)).astype(np.float32)


def rope(x, pos, theta: float, rope_dims: int):
    """Interleaved RoPE on the last `rope_dims` of the last axis; pos broadcasts over leading axes."""
    inv = (theta ** (-np.arange(0, rope_dims, 2, dtype=np.float64) / rope_dims)).astype(np.float32)
    ang = np.asarray(pos, np.float32)[..., None] * inv
    c, s = np.cos(ang), np.sin(ang)
    while c.ndim < x.ndim:
        c, s = c[..., None, :], s[..., None, :]
    out = x.copy()
    e, o = x[..., -rope_dims::2], x[..., -rope_dims + 1::2]
    out[..., -rope_dims::2] = e * c - o * s
    out[..., -rope_dims + 1::2] = e * s + o * c
    return out


def attention(q, keys, valid, sink, scale):
    """q [T, H, HD]; keys [T, M, HD] (values = keys: one shared KV head); valid [T, M]; sink [H]."""
    s = np.einsum("thd,tmd->thm", q, keys) * np.float32(scale)
    s = np.where(valid[:, None, :], s, np.float32(NEG))
    m = np.maximum(s.max(-1), sink[None, :])
    p = np.exp(s - m[..., None]) * valid[:, None, :]
    den = p.sum(-1) + np.exp(sink[None, :] - m)
    return np.einsum("thm,tmd->thd", p, keys) / den[..., None]


def ring_slots(table_row, pos, page: int, pages: int):
    return table_row[(pos // page) % pages] * page + pos % page


@dataclass
class Resync:
    kind: str
    site: tuple[str, str]
    row: int
    golden: int
    device: int

    def to_dict(self) -> dict:
        return {"kind": self.kind, "site": list(self.site), "row": self.row, "golden": self.golden,
                "device": self.device}


@dataclass
class StepOut:
    outputs: dict
    state: dict
    taps: dict
    mapped: dict = field(default_factory=dict)      # pool -> flat rows this dispatch may write
    resyncs: list = field(default_factory=list)


class GoldenStep:
    """Runs one dispatch of the reference step.  `device_taps`, when given, are the device's
    decisions used for re-sync (route ids, sampled ids, drafts) within `tie_tol` of the golden's own."""

    def __init__(self, geo: Geometry, weights: Weights):
        self.geo, self.w, self.cfg = geo, weights, geo.cfg

    # ---- re-sync helpers ---------------------------------------------------------------------
    def _adopt_argmax(self, scores, mine, theirs, kind, site, resyncs, tol, row_of=lambda r: r, dev_scores=None):
        """Per row: keep mine unless theirs is a near-tie of the maximum: within `tol` (relative) or
        within twice the numeric error the device's own scores show on that row."""
        out = mine.copy()
        if theirs is None:
            return out
        theirs = np.asarray(theirs).reshape(mine.shape)
        for r in np.flatnonzero(mine != theirs):
            d = int(theirs[r])
            margin = tol * max(1.0, abs(scores[r].max()))
            if dev_scores is not None and dev_scores.shape == scores.shape and np.isfinite(dev_scores[r]).all():
                margin = max(margin, 2 * float(np.abs(dev_scores[r] - scores[r]).max()))
            if 0 <= d < scores.shape[-1] and scores[r, d] >= scores[r].max() - margin:
                out[r] = d
                resyncs.append(Resync(kind, site, int(row_of(r)), int(mine[r]), d))
        return out

    # ---- target forward ------------------------------------------------------------------------
    def target(self, a, pools, taps, dev, resyncs, tol, mapped):
        m, w, geo = self.cfg, self.w, self.geo
        H, HD, R, eps = m.num_attention_heads, m.head_dim, m.qk_rope_head_dim, m.rms_norm_eps
        ids, pos, req = a["input_ids"], a["position_ids"], a["row_req"]
        T = len(ids)
        x = w["embed_weight"][ids].astype(np.float32)
        kv_pool = pools["kv_cache"].reshape(-1, HD).copy()
        cmp_flat = {k: pools[k].reshape(-1, HD).copy() for k in ("csa_cmp_kv", "hca_cmp_kv",
                                                                   "csa_compress_state", "hca_compress_state")}
        hidden_taps = {}
        ci = {CSA: 0, HCA: 0}
        for l in range(m.num_hidden_layers):
            L, ratio = target_layer(l), m.target_ratios[l]
            h = bf16(rms(x, w["attn_norm_w"][l], eps))
            taps[(L, "attn_norm")] = h
            theta = m.rope_theta if ratio == 0 else m.compress_rope_theta
            q = bf16(rope(rms(bf16(h @ w["wq"][l]).reshape(T, H, HD), None, eps), pos[:, None], theta, R))
            kv = bf16(rope(h @ w["wkv"][l], pos, theta, R))
            taps[(L, "qkv")] = kv
            base = l * geo.region_rows("kv_cache")
            sm = a["swa_slot_mapping"]
            kv_pool[base + sm[sm >= 0]] = kv[sm >= 0]
            mapped.setdefault("kv_cache", []).append(base + sm[sm >= 0])
            taps[(L, "kv_write")] = kv
            keys = [kv_pool[base + np.maximum(a["swa_indices"], 0)]]
            valid = [a["swa_indices"] >= 0]
            if ratio in (CSA, HCA):
                fam = "csa" if ratio == CSA else "hca"
                page, pages = (CSA_STATE_PAGE, CSA_STATE_PAGES) if ratio == CSA else (HCA_STATE_PAGE, HCA_STATE_PAGES)
                st = cmp_flat[f"{fam}_compress_state"]
                sbase = ci[ratio] * geo.region_rows(f"{fam}_compress_state")
                ssm = a[f"{fam}_state_slot_mapping"]
                st[sbase + ssm[ssm >= 0]] = kv[ssm >= 0]
                mapped.setdefault(f"{fam}_compress_state", []).append(sbase + ssm[ssm >= 0])
                taps[(L, "compress_state")] = kv
                cp = cmp_flat[f"{fam}_cmp_kv"]
                cbase = ci[ratio] * geo.region_rows(f"{fam}_cmp_kv")
                csm = a[f"{fam}_cmp_slot_mapping"]
                rows = np.flatnonzero(csm >= 0)
                table = a[f"{fam}_state_block_table"]
                cmp_rows = np.zeros((len(rows), HD), np.float32)
                for j, t in enumerate(rows):
                    # sources inside this dispatch come from its own rows (a chunk longer than the ring
                    # only persists its tail), earlier ones from the ring
                    src = np.arange(pos[t] - ratio + 1, pos[t] + 1)
                    rr = np.maximum(t - (pos[t] - src), 0)
                    here = (t - (pos[t] - src) >= 0) & (req[rr] == req[t]) & (pos[rr] == src)
                    vals = np.where(here[:, None], kv[rr], st[sbase + ring_slots(table[req[t]], src, page, pages)])
                    mean = vals.mean(0)
                    cmp_rows[j] = bf16(mean + mean @ w["cmp_wgate"][l])
                cp[cbase + csm[rows]] = cmp_rows
                mapped.setdefault(f"{fam}_cmp_kv", []).append(cbase + csm[rows])
                taps[(L, "compress")] = cmp_rows
                ind = a[f"{fam}_cmp_indices"]
                keys.append(cp[cbase + np.maximum(ind, 0)])
                valid.append(ind >= 0)
                ci[ratio] += 1
            keys = np.concatenate(keys, 1)
            valid = np.concatenate(valid, 1)
            o = bf16(attention(q, keys, valid, w["attn_sink"][l], m.softmax_scale))
            taps[(L, "attn")] = o
            y = bf16(o.reshape(T, H * HD) @ w["wo"][l])
            taps[(L, "o_proj")] = y
            x = bf16(x + y)
            hn = bf16(rms(x, w["norm_w"][l], eps))
            taps[(L, "ffn_norm")] = hn
            route, weights = self._route(l, hn, ids, dev, resyncs, tol)
            taps[(L, "route")] = route
            e_out = self._experts(l, hn, route, weights)
            taps[(L, "experts")] = e_out
            x = bf16(x + e_out)
            taps[(L, "moe_out")] = x
            hidden_taps[l] = x
        pools = dict(pools)
        pools["kv_cache"] = kv_pool.reshape(pools["kv_cache"].shape)
        for k, v in cmp_flat.items():
            pools[k] = v.reshape(pools[k].shape)
        target_hidden = np.concatenate([hidden_taps[i] for i in m.dspark_target_layer_ids], -1)
        hn = bf16(rms(x, w["final_norm_w"], eps))
        taps[("head", "final_norm")] = hn
        rows = a["logit_row_indices"]
        logits = hn[rows] @ w["lm_head_weight"].T
        taps[("head", "logits")] = logits
        sampled = self._adopt_argmax(logits, logits.argmax(-1).astype(np.int32),
                                     None if dev is None else dev.get(("head", "sample")), "sample",
                                     ("head", "sample"), resyncs, tol["sample"],
                                     dev_scores=None if dev is None else dev.get(("head", "logits")))
        taps[("head", "sample")] = sampled
        return x, pools, target_hidden, logits, sampled

    def _gate_scores(self, l, x):
        """Layer l's unbiased router scores, sqrt(softplus(x W_gate^T))."""
        return np.sqrt(np.logaddexp(0, x @ self.w["gate_w"][l].T))

    def _route(self, l, hn, ids, dev, resyncs, tol):
        m, w = self.cfg, self.w
        K = m.num_experts_per_tok
        scores = self._gate_scores(l, hn).astype(np.float32)
        if l < m.num_hash_layers:
            route = w["tid2eid"][l][ids]
        else:
            biased = scores + w["gate_bias"][l]
            route = np.argsort(-biased, axis=-1, kind="stable")[:, :K].astype(np.int32)
            theirs = None if dev is None else dev.get((target_layer(l), "route"))
            hn_dev = None if dev is None else dev.get((target_layer(l), "ffn_norm"))
            if theirs is not None and theirs.shape == route.shape:
                for t in np.flatnonzero((np.sort(route, -1) != np.sort(theirs, -1)).any(-1)):
                    d = theirs[t]
                    kth = np.sort(biased[t])[-K]
                    tie = tol["route"] * max(1.0, abs(kth))
                    if hn_dev is not None and hn_dev.shape == hn.shape:
                        # the flip is explained if the gate input's observed error can move the scores that far
                        b_dev = self._gate_scores(l, hn_dev[t]) + w["gate_bias"][l]
                        tie = max(tie, 2 * float(np.abs(b_dev - biased[t]).max()))
                    if len(set(d.tolist())) == K and (d >= 0).all() and (d < m.n_routed_experts).all() \
                            and (biased[t, d] >= kth - tie).all():
                        resyncs.append(Resync("route", (target_layer(l), "route"), int(t), route[t].tolist(),
                                              d.tolist()))
                        route = route.copy()
                        route[t] = d
        wts = np.take_along_axis(scores, route, -1)
        wts = wts / wts.sum(-1, keepdims=True) * np.float32(m.routed_scaling_factor)
        return route, wts.astype(np.float32)

    def _expert(self, h, w1, s1, w3, s3, w2, s2):
        lim = np.float32(self.cfg.swiglu_limit)
        a, dq = q8(h)
        g = int_mm(a, w1.T) * dq * s1
        u = int_mm(a, w3.T) * dq * s3
        g = np.minimum(g, lim)
        u = np.clip(u, -lim, lim)
        act = g / (1 + np.exp(-g)) * u
        a2, dq2 = q8(act)
        return int_mm(a2, w2.T) * dq2 * s2

    def _experts(self, l, hn, route, wts):
        w = self.w
        out = self._expert(hn, w["shared_w1"][l], w["shared_w1_scale"][l], w["shared_w3"][l],
                           w["shared_w3_scale"][l], w["shared_w2"][l], w["shared_w2_scale"][l])
        for e in np.unique(route):
            t, k = np.nonzero(route == e)
            y = self._expert(hn[t], w["routed_w1"][l, e], w["routed_w1_scale"][l, e], w["routed_w3"][l, e],
                             w["routed_w3_scale"][l, e], w["routed_w2"][l, e], w["routed_w2_scale"][l, e])
            np.add.at(out, t, y * wts[t, k][:, None])
        return bf16(out)

    # ---- drafter --------------------------------------------------------------------------------
    def ctx_write(self, pools, hidden, positions, reqs, lease, taps, mapped):
        """Context rows (committed target hidden) into every drafter layer's leased pool region."""
        m, w, geo = self.cfg, self.w, self.geo
        HD, R, eps = m.head_dim, m.qk_rope_head_dim, m.rms_norm_eps
        flat = pools["draft_kv"].reshape(-1, HD).copy()
        slots = ring_slots_rows(lease, reqs, positions)
        for d in range(m.dspark_num_layers):
            c = bf16(rope(rms(hidden, w["draft_ctx_norm_w"][d], eps) @ w["draft_wctx"][d], positions,
                          m.rope_theta, R))
            base = d * geo.region_rows("draft_kv")
            flat[base + slots] = c
            mapped.setdefault("draft_kv", []).append(base + slots)
            taps[(draft_layer(d), "ctx_kv")] = c
        pools = dict(pools)
        pools["draft_kv"] = flat.reshape(pools["draft_kv"].shape)
        return pools

    def draft(self, pools, anchors, last, lease, taps, dev, resyncs, tol):
        """7 drafts per request from anchor (the position of `last`)."""
        m, w, geo = self.cfg, self.w, self.geo
        H, HD, R, eps, W = m.num_attention_heads, m.head_dim, m.qk_rope_head_dim, m.rms_norm_eps, m.sliding_window
        Q = len(anchors)
        toks = np.full((Q, DRAFTS), m.dspark_noise_token_id, np.int64)
        toks[:, 0] = last
        qpos = anchors[:, None] + np.arange(DRAFTS)[None, :]
        cpos = anchors[:, None] - W + np.arange(W)[None, :]                       # context window
        cvalid = cpos >= 0
        cslots = np.where(cvalid, ring_slots_rows(lease, np.repeat(np.arange(Q), W),
                                                  np.maximum(cpos, 0).ravel()).reshape(Q, W), 0)
        flat = pools["draft_kv"].reshape(-1, HD)
        h = w["embed_weight"][toks.ravel()].astype(np.float32)
        causal = np.tril(np.ones((DRAFTS, DRAFTS), bool))
        for d in range(m.dspark_num_layers):
            D = draft_layer(d)
            hn = bf16(rms(h, w["draft_attn_norm_w"][d], eps))
            taps[(D, "attn_norm")] = hn
            q = bf16(rope(rms(bf16(hn @ w["draft_wq"][d]).reshape(-1, H, HD), None, eps), qpos.ravel()[:, None],
                          m.rope_theta, R))
            kv = bf16(rope(hn @ w["draft_wkv"][d], qpos.ravel(), m.rope_theta, R)).reshape(Q, DRAFTS, HD)
            taps[(D, "qkv")] = kv
            base = d * geo.region_rows("draft_kv")
            ctx = flat[base + cslots]                                              # [Q, W, HD]
            keys = np.concatenate([np.repeat(ctx[:, None], DRAFTS, 1), np.repeat(kv[:, None], DRAFTS, 1)], 2)
            valid = np.concatenate([np.repeat(cvalid[:, None], DRAFTS, 1),
                                    np.broadcast_to(causal[None], (Q, DRAFTS, DRAFTS))], 2)
            o = bf16(attention(q, keys.reshape(Q * DRAFTS, -1, HD), valid.reshape(Q * DRAFTS, -1),
                               w["draft_attn_sink"][d], m.softmax_scale))
            taps[(D, "attn")] = o
            y = bf16(o.reshape(Q * DRAFTS, H * HD) @ w["draft_wo"][d])
            taps[(D, "o_proj")] = y
            h = bf16(h + y)
        hn = bf16(rms(h, w["final_norm_w"], eps))
        logits = (hn @ w["lm_head_weight"].T).reshape(Q, DRAFTS, -1)
        taps[("markov", "logits")] = logits
        theirs = None if dev is None else dev.get(("markov", "sample"))
        drafts = np.zeros((Q, DRAFTS), np.int32)
        prev = np.asarray(last, np.int64)
        for i in range(DRAFTS):
            bias_dev = w["markov_u"][prev] @ w["markov_v"]
            li = logits[:, i] + bias_dev
            mine = li.argmax(-1).astype(np.int32)
            th = None if theirs is None or theirs.shape != drafts.shape else theirs[:, i]
            dl = None if dev is None or ("markov", "logits") not in dev else dev[("markov", "logits")][:, i] + bias_dev
            got = self._adopt_argmax(li, mine, th, "draft", ("markov", "sample"), resyncs, tol["sample"],
                                     row_of=lambda r, i=i: r * DRAFTS + i, dev_scores=dl)
            drafts[:, i] = got
            prev = got.astype(np.int64)
        taps[("markov", "sample")] = drafts
        return drafts

    # ---- programs --------------------------------------------------------------------------------
    def run(self, program: str, a: dict, pools: dict, dev: dict | None = None, tol: dict | None = None) -> StepOut:
        tol = tol or {"sample": 2e-2, "route": 2e-2}
        taps: dict = {}
        resyncs: list = []
        mapped: dict = {}
        outputs: dict = {}
        if program == PROGRAM_SEED:
            pools = self.ctx_write(pools, a["target_hidden"], a["ctx_positions"], a["ctx_req"],
                                   a["lease_block_table"], taps, mapped)
            outputs["draft_tokens"] = self.draft(pools, a["anchor"], a["last_token"], a["lease_block_table"],
                                                 taps, dev, resyncs, tol)
        else:
            x, pools, hidden, logits, sampled = self.target(a, pools, taps, dev, resyncs, tol, mapped)
            outputs.update(logits=logits.astype(np.float32), sampled_ids=sampled,
                           dspark_target_hidden=hidden)
            if program == PROGRAM_FUSED:
                acc, anchors, last = self.verify(a, sampled, logits.argmax(-1).astype(np.int32), taps, resyncs)
                first = np.flatnonzero(np.r_[True, a["row_req"][1:] != a["row_req"][:-1]])
                rows = np.concatenate([first[q] + np.arange(acc[q]) for q in range(len(acc))])
                pools = self.ctx_write(pools, hidden[rows], a["position_ids"][rows], a["row_req"][rows],
                                       a["lease_block_table"], taps, mapped)
                outputs["accepted_counts"] = acc
                outputs["draft_tokens"] = self.draft(pools, anchors, last, a["lease_block_table"], taps, dev,
                                                     resyncs, tol)
        mapped = {k: np.concatenate(v) for k, v in mapped.items()}
        return StepOut(outputs, pools, taps, mapped, resyncs)

    def verify(self, a, sampled, own_sampled, taps, resyncs):
        """Greedy linear-chain acceptance per request: 1 + the matching prefix of the 7 drafts."""
        ids, req = a["input_ids"], a["row_req"]
        Q = int(req.max()) + 1
        s = sampled.reshape(Q, ROWS_PER_VERIFY)
        drafts = ids.reshape(Q, ROWS_PER_VERIFY)[:, 1:]
        acc = accept(s, drafts)
        # accepted counts follow the re-synced tokens; where that changed the golden's own count, the
        # adoption is recorded (a device count that disagrees with its own tokens is not adopted: it
        # is a verification fault and shows as a divergence)
        own = accept(own_sampled.reshape(Q, ROWS_PER_VERIFY), drafts)
        for q in np.flatnonzero(own != acc):
            resyncs.append(Resync("accepted", ("head", "verify"), int(q), int(own[q]), int(acc[q])))
        taps[("head", "verify")] = acc
        taps[("head", "publish")] = acc.copy()
        pos0 = a["position_ids"].reshape(Q, ROWS_PER_VERIFY)[:, 0]
        last = s[np.arange(Q), acc - 1]
        return acc, pos0 + acc, last


def accept(sampled, drafts):
    match = (sampled[:, :-1] == drafts).astype(np.int32)
    return (1 + np.cumprod(match, 1).sum(1)).astype(np.int32)


def ring_slots_rows(lease, reqs, positions):
    """Drafter context slots: the lease's blocks as a ring over positions."""
    reqs, positions = np.asarray(reqs), np.asarray(positions)
    return lease[reqs, (positions // BLOCK) % LEASE_BLOCKS] * BLOCK + positions % BLOCK
