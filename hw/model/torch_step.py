"""The device side of the reference step, in torch (cpu, cuda or npu), written independently of
the NumPy golden: same contract (BF16 rounding points, W8A8 experts, FP32 accumulation), torch's
own kernels and reduction orders.

`hooks` maps a site (layer, stage) to a function (value, taps so far) -> value applied to that
stage's value before it is used downstream: the fault injector's way into the middle of a step.
Every stage's value is returned as a tap, as a device dump of tagged intermediates would be.
"""
from __future__ import annotations

import numpy as np

from twin.abi.presets import CSA, HCA

from .spec import (CSA_STATE_PAGE, CSA_STATE_PAGES, DRAFTS, HCA_STATE_PAGE, HCA_STATE_PAGES, LEASE_BLOCKS,
                   PROGRAM_FUSED, PROGRAM_SEED, ROWS_PER_VERIFY, Geometry, draft_layer, target_layer)
from .weights import Weights

BLOCK = 32


class TorchStep:
    def __init__(self, geo: Geometry, weights: Weights, device):
        import torch

        self.torch, self.geo, self.cfg, self.device = torch, geo, geo.cfg, device
        self.w = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in weights.tensors.items()}

    # ---- numerics ------------------------------------------------------------------------------
    def bf16(self, x):
        return x.to(self.torch.bfloat16).to(self.torch.float32)

    def rms(self, x, w, eps):
        y = x * self.torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
        return y if w is None else y * w

    def q8(self, x):
        amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-4)
        sq = 127.0 / amax
        return self.torch.round(x * sq), 1.0 / sq

    def int_mm(self, a, w_t):
        # integer-valued operands: an f32 GEMM is exact while K * 127^2 < 2^24 (every small preset)
        if a.shape[-1] * 127 * 127 < (1 << 24):
            return a @ w_t.float()
        return (a.double() @ w_t.double()).float()

    def rope(self, x, pos, theta: float, R: int):
        t = self.torch
        inv = (theta ** (-t.arange(0, R, 2, dtype=t.float64, device=x.device) / R)).float()
        ang = pos.float()[..., None] * inv
        c, s = ang.cos(), ang.sin()
        while c.dim() < x.dim():
            c, s = c.unsqueeze(-2), s.unsqueeze(-2)
        e, o = x[..., -R::2], x[..., -R + 1::2]
        rot = t.stack((e * c - o * s, e * s + o * c), -1).flatten(-2)
        return t.cat((x[..., :-R], rot), -1)

    def attention(self, q, keys, valid, sink, scale):
        t = self.torch
        s = t.einsum("thd,tmd->thm", q, keys) * scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        m = t.maximum(s.amax(-1), sink[None, :])
        p = t.exp(s - m[..., None])
        den = p.sum(-1) + t.exp(sink[None, :] - m)
        return t.einsum("thm,tmd->thd", p, keys) / den[..., None]

    # ---- step ------------------------------------------------------------------------------------
    def run(self, program: str, a: dict, pools: dict, hooks: dict | None = None):
        """a: numpy args; pools: numpy pools.  Returns (outputs, new pools, taps) as numpy."""
        t = self.torch
        hooks = hooks or {}
        taps: dict = {}

        def tap(site, v):
            if site in hooks:
                v = hooks[site](v, taps)
            taps[site] = v
            return v

        A = {k: t.from_numpy(np.ascontiguousarray(v)).to(self.device) for k, v in a.items()}
        P = {k: t.from_numpy(np.array(v, np.float32)).to(self.device) for k, v in pools.items()}
        out: dict = {}
        with t.no_grad():
            if program == PROGRAM_SEED:
                self.ctx_write(P, A["target_hidden"], A["ctx_positions"].long(), A["ctx_req"].long(),
                               A["lease_block_table"].long(), tap)
                out["draft_tokens"] = self.draft(P, A["anchor"].long(), A["last_token"].long(),
                                                 A["lease_block_table"].long(), tap)
            else:
                hidden, logits, sampled = self.target(A, P, tap)
                out.update(logits=logits, sampled_ids=sampled, dspark_target_hidden=hidden)
                if program == PROGRAM_FUSED:
                    req = A["row_req"].long()
                    Q = int(req.max()) + 1
                    s = sampled.view(Q, ROWS_PER_VERIFY)
                    drafts = A["input_ids"].view(Q, ROWS_PER_VERIFY)[:, 1:]
                    acc = 1 + t.cumprod((s[:, :-1] == drafts).int(), 1).sum(1)
                    acc = tap(("head", "verify"), acc.int())
                    pub = tap(("head", "publish"), acc.clone())
                    rows = t.cat([q * ROWS_PER_VERIFY + t.arange(int(pub[q]), device=self.device) for q in range(Q)])
                    self.ctx_write(P, hidden[rows], A["position_ids"][rows].long(), req[rows],
                                   A["lease_block_table"].long(), tap)
                    pos0 = A["position_ids"].view(Q, ROWS_PER_VERIFY)[:, 0].long()
                    last = s[t.arange(Q), (acc - 1).long()].long()
                    out["accepted_counts"] = acc
                    out["draft_tokens"] = self.draft(P, pos0 + acc.long(), last, A["lease_block_table"].long(), tap)
        to_np = {k: v.cpu().numpy() for k, v in out.items()}
        for k in ("sampled_ids", "accepted_counts", "draft_tokens"):
            if k in to_np:
                to_np[k] = to_np[k].astype(np.int32)
        new_pools = {k: v.cpu().numpy().reshape(pools[k].shape) for k, v in P.items()}
        return to_np, new_pools, {k: v.cpu().numpy() for k, v in taps.items()}

    def target(self, A, P, tap):
        t, m, w, geo = self.torch, self.cfg, self.w, self.geo
        H, HD, R, eps = m.num_attention_heads, m.head_dim, m.qk_rope_head_dim, m.rms_norm_eps
        ids, pos, req = A["input_ids"].long(), A["position_ids"].long(), A["row_req"].long()
        T = ids.shape[0]
        x = w["embed_weight"][ids]
        kv_pool = P["kv_cache"].view(-1, HD)
        hidden = {}
        ci = {CSA: 0, HCA: 0}
        for l in range(m.num_hidden_layers):
            L, ratio = target_layer(l), m.target_ratios[l]
            h = tap((L, "attn_norm"), self.bf16(self.rms(x, w["attn_norm_w"][l], eps)))
            theta = m.rope_theta if ratio == 0 else m.compress_rope_theta
            q = self.bf16(h @ w["wq"][l]).view(T, H, HD)
            q = self.bf16(self.rope(self.rms(q, None, eps), pos[:, None], theta, R))
            kv = tap((L, "qkv"), self.bf16(self.rope(h @ w["wkv"][l], pos, theta, R)))
            base = l * geo.region_rows("kv_cache")
            sm = A["swa_slot_mapping"].long()
            kv = tap((L, "kv_write"), kv)
            kv_pool[base + sm[sm >= 0]] = kv[sm >= 0]
            si = A["swa_indices"].long()
            keys, valid = [kv_pool[base + si.clamp_min(0)]], [si >= 0]
            if ratio in (CSA, HCA):
                fam = "csa" if ratio == CSA else "hca"
                page, pages = (CSA_STATE_PAGE, CSA_STATE_PAGES) if ratio == CSA else (HCA_STATE_PAGE, HCA_STATE_PAGES)
                st = P[f"{fam}_compress_state"].view(-1, HD)
                sbase = ci[ratio] * geo.region_rows(f"{fam}_compress_state")
                ssm = A[f"{fam}_state_slot_mapping"].long()
                kv_s = tap((L, "compress_state"), kv)
                st[sbase + ssm[ssm >= 0]] = kv_s[ssm >= 0]
                cp = P[f"{fam}_cmp_kv"].view(-1, HD)
                cbase = ci[ratio] * geo.region_rows(f"{fam}_cmp_kv")
                csm = A[f"{fam}_cmp_slot_mapping"].long()
                rows = t.nonzero(csm >= 0).flatten()
                table = A[f"{fam}_state_block_table"].long()
                if len(rows):
                    src = pos[rows][:, None] - ratio + 1 + t.arange(ratio, device=self.device)[None, :]
                    slots = table[req[rows][:, None], (src // page) % pages] * page + src % page
                    back = rows[:, None] - (pos[rows][:, None] - src)
                    rr = back.clamp_min(0)
                    here = (back >= 0) & (req[rr] == req[rows][:, None]) & (pos[rr] == src)
                    mean = t.where(here[..., None], kv[rr], st[sbase + slots]).mean(1)
                    cmp_rows = self.bf16(mean + mean @ w["cmp_wgate"][l])
                else:
                    cmp_rows = t.zeros((0, HD), device=self.device)
                cmp_rows = tap((L, "compress"), cmp_rows)
                cp[cbase + csm[rows]] = cmp_rows
                ind = A[f"{fam}_cmp_indices"].long()
                keys.append(cp[cbase + ind.clamp_min(0)])
                valid.append(ind >= 0)
                ci[ratio] += 1
            o = tap((L, "attn"), self.bf16(self.attention(q, t.cat(keys, 1), t.cat(valid, 1), w["attn_sink"][l],
                                                          m.softmax_scale)))
            y = tap((L, "o_proj"), self.bf16(o.reshape(T, H * HD) @ w["wo"][l]))
            x = self.bf16(x + y)
            hn = tap((L, "ffn_norm"), self.bf16(self.rms(x, w["norm_w"][l], eps)))
            scores = t.sqrt(t.nn.functional.softplus(hn @ w["gate_w"][l].T))
            if l < m.num_hash_layers:
                route = w["tid2eid"][l][ids].long()
            else:
                biased = scores + w["gate_bias"][l]
                route = t.topk(biased, m.num_experts_per_tok, -1, sorted=True).indices
            route = tap((L, "route"), route.int()).long()
            wts = scores.gather(-1, route)
            wts = wts / wts.sum(-1, keepdim=True) * m.routed_scaling_factor
            e_out = tap((L, "experts"), self.experts(l, hn, route, wts))
            x = tap((L, "moe_out"), self.bf16(x + e_out))
            hidden[l] = x
        target_hidden = t.cat([hidden[i] for i in m.dspark_target_layer_ids], -1)
        hn = tap(("head", "final_norm"), self.bf16(self.rms(x, w["final_norm_w"], eps)))
        logits = tap(("head", "logits"), hn[A["logit_row_indices"].long()] @ w["lm_head_weight"].T)
        sampled = tap(("head", "sample"), logits.argmax(-1).int())
        return target_hidden, logits, sampled

    def expert(self, h, w1, s1, w3, s3, w2, s2):
        lim = self.cfg.swiglu_limit
        a, dq = self.q8(h)
        g = (self.int_mm(a, w1.T) * dq * s1).clamp(max=lim)
        u = (self.int_mm(a, w3.T) * dq * s3).clamp(-lim, lim)
        act = self.torch.nn.functional.silu(g) * u
        a2, dq2 = self.q8(act)
        return self.int_mm(a2, w2.T) * dq2 * s2

    def experts(self, l, hn, route, wts):
        w = self.w
        out = self.expert(hn, w["shared_w1"][l], w["shared_w1_scale"][l], w["shared_w3"][l], w["shared_w3_scale"][l],
                          w["shared_w2"][l], w["shared_w2_scale"][l])
        for e in self.torch.unique(route).tolist():
            tk = (route == e).nonzero()
            tt, kk = tk[:, 0], tk[:, 1]
            y = self.expert(hn[tt], w["routed_w1"][l, e], w["routed_w1_scale"][l, e], w["routed_w3"][l, e],
                            w["routed_w3_scale"][l, e], w["routed_w2"][l, e], w["routed_w2_scale"][l, e])
            out.index_add_(0, tt, y * wts[tt, kk][:, None])
        return self.bf16(out)

    def lease_slots(self, lease, reqs, positions):
        return lease[reqs, (positions // BLOCK) % LEASE_BLOCKS] * BLOCK + positions % BLOCK

    def ctx_write(self, P, hidden, positions, reqs, lease, tap):
        m, w, geo = self.cfg, self.w, self.geo
        flat = P["draft_kv"].view(-1, m.head_dim)
        slots = self.lease_slots(lease, reqs, positions)
        for d in range(m.dspark_num_layers):
            c = self.bf16(self.rope(self.rms(hidden, w["draft_ctx_norm_w"][d], m.rms_norm_eps) @ w["draft_wctx"][d],
                                    positions, m.rope_theta, m.qk_rope_head_dim))
            c = tap((draft_layer(d), "ctx_kv"), c)
            flat[d * geo.region_rows("draft_kv") + slots] = c

    def draft(self, P, anchors, last, lease, tap):
        t, m, w, geo = self.torch, self.cfg, self.w, self.geo
        H, HD, R, eps, W = m.num_attention_heads, m.head_dim, m.qk_rope_head_dim, m.rms_norm_eps, m.sliding_window
        Q, dev = anchors.shape[0], self.device
        toks = t.full((Q, DRAFTS), m.dspark_noise_token_id, dtype=t.long, device=dev)
        toks[:, 0] = last
        qpos = (anchors[:, None] + t.arange(DRAFTS, device=dev)[None, :]).reshape(-1)
        cpos = anchors[:, None] - W + t.arange(W, device=dev)[None, :]
        cvalid = cpos >= 0
        cslots = self.lease_slots(lease, t.arange(Q, device=dev)[:, None].expand(Q, W), cpos.clamp_min(0))
        flat = P["draft_kv"].view(-1, HD)
        h = w["embed_weight"][toks.reshape(-1)]
        causal = t.tril(t.ones((DRAFTS, DRAFTS), dtype=t.bool, device=dev))
        valid = t.cat([cvalid[:, None].expand(Q, DRAFTS, W), causal[None].expand(Q, DRAFTS, DRAFTS)], 2)
        for d in range(m.dspark_num_layers):
            D = draft_layer(d)
            hn = tap((D, "attn_norm"), self.bf16(self.rms(h, w["draft_attn_norm_w"][d], eps)))
            q = self.bf16(hn @ w["draft_wq"][d]).view(-1, H, HD)
            q = self.bf16(self.rope(self.rms(q, None, eps), qpos[:, None], m.rope_theta, R))
            kv = self.bf16(self.rope(hn @ w["draft_wkv"][d], qpos, m.rope_theta, R)).view(Q, DRAFTS, HD)
            kv = tap((D, "qkv"), kv)
            ctx = flat[d * geo.region_rows("draft_kv") + cslots]
            keys = t.cat([ctx[:, None].expand(Q, DRAFTS, W, HD), kv[:, None].expand(Q, DRAFTS, DRAFTS, HD)], 2)
            o = tap((D, "attn"), self.bf16(self.attention(q, keys.reshape(Q * DRAFTS, -1, HD),
                                                          valid.reshape(Q * DRAFTS, -1), w["draft_attn_sink"][d],
                                                          m.softmax_scale)))
            y = tap((D, "o_proj"), self.bf16(o.reshape(Q * DRAFTS, H * HD) @ w["draft_wo"][d]))
            h = self.bf16(h + y)
        hn = self.bf16(self.rms(h, w["final_norm_w"], eps))
        logits = tap(("markov", "logits"), (hn @ w["lm_head_weight"].T).view(Q, DRAFTS, -1))
        drafts = []
        prev = last
        for i in range(DRAFTS):
            li = logits[:, i] + w["markov_u"][prev] @ w["markov_v"]
            prev = li.argmax(-1)
            drafts.append(prev)
        return tap(("markov", "sample"), t.stack(drafts, 1).int())
