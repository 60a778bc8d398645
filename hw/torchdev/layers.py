"""One target layer across the ranks of a deployment: the attention sub-layer (hc_pre, rms_norm,
qkv, the layer's compressors and indexer, the window KV write, sparse attention, TP o_proj,
hc_post) and the MoE sub-layer (hc_pre, gate, EP experts, combine, hc_post), per K13 / K17.

Rows: each rank owns `local` rows; a TP group's stream is its ranks' rows, rank-major.  What the
device does group-wide (the KV and compressor writes, whose slot mappings are group-level) each
rank does on its own pool replica from the all-gathered group rows; o_proj is a per-rank partial
over the rank's local head groups, reduce-scattered in rank order.  Only the ranks this process
holds are computed (`a.ranks.mine`); the residual stream `x_hc` is an [R] list (None for another
process's rank) and every cross-rank read is a `Ranks.gather` (`hw.torchdev.ranks`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .attention import sparse_attention
from .compressor import indexer_compressor, main_compressor
from .hyper import hc_post, hc_pre
from .indexer import lightning_indexer
from .moe import gate, moe
from .numerics import bf16
from .o_proj import o_partial, pack
from .paged import flat, set_rows, table_slot
from .qkv import qkv_proj_rope
from .rmsnorm import rms_norm

WEIGHTS = ("hc_attn_fn", "hc_attn_scale", "hc_attn_base", "attn_norm_w", "wq_a", "wq_b", "wq_b_scale", "wkv",
           "gamma_cq", "gamma_ckv", "attn_sink", "wo_a", "wo_b", "wo_b_scale", "hc_ffn_fn", "hc_ffn_scale",
           "hc_ffn_base", "gate_w", "gate_bias", "tid2eid")
CSA_WEIGHTS = ("csa_cmp_wkv", "csa_cmp_wgate", "csa_cmp_ape", "csa_cmp_norm_w", "csa_idx_wq_b", "csa_idx_wq_b_scale",
               "csa_weights_proj", "csa_hadamard_idx", "csa_inner_wkv", "csa_inner_wgate", "csa_inner_ape",
               "csa_inner_norm_w")
HCA_WEIGHTS = ("hca_cmp_wkv", "hca_cmp_wgate", "hca_cmp_ape", "hca_cmp_norm_w")
EXPERT_NAMES = ("routed_w1", "routed_w1_scale", "routed_w3", "routed_w3_scale", "routed_w2", "routed_w2_scale")
SHARED_NAMES = ("shared_w1", "shared_w1_scale", "shared_w3", "shared_w3_scale", "shared_w2", "shared_w2_scale")


class Taps(dict):
    """(layer, stage) -> [ranks held, rows, ...] in golden's stage names, so a divergence localizes.
    `put` takes a stacked tensor or an [R] per-rank list (stacked over the ranks held)."""

    def __init__(self, ranks):
        super().__init__()
        self.ranks = ranks

    def put(self, layer, stage, value):
        self[(layer, stage)] = self.ranks.stack(value) if isinstance(value, list) else value


@dataclass
class GroupRows:
    """Per rank r: the group stream rows the compressors run on and how to address them."""

    pos: list                      # [R] group-row positions
    first: list                    # [R] each group row's request first position
    csa_state_tables: list = field(default_factory=list)
    inner_state_tables: list = field(default_factory=list)
    hca_state_tables: list = field(default_factory=list)
    csa_cmp_cos: list = field(default_factory=list)
    csa_cmp_sin: list = field(default_factory=list)
    hca_cmp_cos: list = field(default_factory=list)
    hca_cmp_sin: list = field(default_factory=list)
    slots: dict = field(default_factory=dict)   # name -> [R] group-row slot mappings
    hca_missing_zero: bool = False              # prefill's ratio-128 rule for an unmapped old row


@dataclass
class LocalRows:
    """Per rank r: the rank's own rows (queries, indexer, attention, MoE)."""

    pos: list
    input_ids: list
    num_tokens: torch.Tensor
    swa_cos: list
    swa_sin: list
    cmp_cos: list
    cmp_sin: list
    windows: dict                  # kind -> ([R] indices, [R] lens)
    req_tables: Callable           # (r, table name) -> [rows, width] each row's request table row
    kv_seq_lens: Callable          # (r, kind) -> [rows] each row's request kv_seq_len
    csa_cap: int
    hca_cap: int


def _w(a, names, layer: int, r: int):
    return {n: a.layer(n, layer)[r] for n in names if n in a}


def attention_sublayer(a, cfg, dep, layer: int, x_hc, G: GroupRows, L: LocalRows, taps: Taps, *, bands):
    """x_hc [R] per-rank [T, HC, D] -> x_hc after the attention sub-layer (pools written in place)."""
    ranks, tp = a.ranks, dep.topology.tp
    kind = cfg.layer_kind(layer)
    ci = cfg.csa_layers.index(layer) if kind == "csa" else None
    hi = cfg.hca_layers.index(layer) if kind == "hca" else None
    eps, rd = cfg.rms_norm_eps, cfg.qk_rope_head_dim
    outs = {k: [None] * ranks.R for k in ("x_mixed", "post", "comb", "x_n", "q", "kv", "qr", "qr_scale")}
    for r in ranks.mine:
        w = _w(a, WEIGHTS, layer, r)
        xm, post, comb = hc_pre(x_hc[r], w["hc_attn_fn"], w["hc_attn_scale"], w["hc_attn_base"], hc=cfg.hc_mult,
                                rms_eps=eps, hc_eps=cfg.hc_eps, iters=cfg.hc_sinkhorn_iters)
        x_n = rms_norm(xm, w["attn_norm_w"], eps)
        cos, sin = (L.swa_cos[r], L.swa_sin[r]) if kind == "swa" else (L.cmp_cos[r], L.cmp_sin[r])
        q, kv, qr, qrs = qkv_proj_rope(x_n, w, cos, sin, heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                                       rope_dims=rd, eps=eps)
        for k, v in zip(outs, (xm, post, comb, x_n, q, kv, qr, qrs)):
            outs[k][r] = v
    taps.put(layer, "attn_in", x_hc)
    for k in ("x_mixed", "q", "kv"):
        taps.put(layer, k, outs[k])
    taps.put(layer, "x_norm", outs["x_n"])
    x_n_all, kv_all = ranks.gather(outs["x_n"], outs["kv"])        # the group stream rows
    o_all, topk_all = [None] * ranks.R, [None] * ranks.R
    for r in ranks.mine:
        g0 = (r // tp) * tp
        x_g = bands(x_n_all, g0)
        kv_g = bands(kv_all, g0)
        w = _w(a, WEIGHTS, layer, r)
        cmp_flat = cmp_slots = None
        win = "swa"
        if kind == "csa":
            win = "csa"
            wc = _w(a, CSA_WEIGHTS, ci, r)
            state = flat(a.layer("csa_compress_state", ci)[r])
            cmp_pool = a.layer("csa_cmp_kv", ci)[r]
            main_compressor(x_g, G.pos[r], G.first[r], wc, "csa_cmp_", state, G.csa_state_tables[r],
                            G.slots["csa_state"][r], flat(cmp_pool), G.slots["csa_cmp"][r], G.csa_cmp_cos[r],
                            G.csa_cmp_sin[r], ratio=4, page=2, rope_dims=rd, eps=eps)
            idx_pool, idx_scale = a.layer(_n(a, "idx_kv_cache"), ci)[r], a.layer(_n(a, "idx_kv_scale"), ci)[r]
            indexer_compressor(x_g, G.pos[r], G.first[r], wc, flat(a.layer("csa_inner_compress_state", ci)[r]),
                               G.inner_state_tables[r], G.slots["csa_inner_state"][r], flat(idx_pool),
                               flat(idx_scale), G.slots["csa_idx"][r], G.csa_cmp_cos[r], G.csa_cmp_sin[r], page=2,
                               rope_dims=rd, eps=eps)
            _, topk = lightning_indexer(outs["x_n"][r], outs["qr"][r], outs["qr_scale"][r], wc, L.cmp_cos[r],
                                        L.cmp_sin[r], idx_pool, idx_scale, L.req_tables(r, "idx"), L.pos[r],
                                        L.kv_seq_lens(r, "csa") // 4, heads=cfg.index_n_heads,
                                        head_dim=cfg.index_head_dim, rope_dims=rd, topk=cfg.index_topk,
                                        cap=L.csa_cap)
            topk_all[r] = topk
            rows = torch.where((topk >= 0) & (topk < ((L.pos[r] + 1) // 4)[:, None]), topk, -1).long()
            cmp_flat = flat(cmp_pool)
            cmp_slots = table_slot(L.req_tables(r, "csa_cmp"), rows, cmp_pool.shape[1])
        elif kind == "hca":
            win = "hca"
            wh = _w(a, HCA_WEIGHTS, hi, r)
            cmp_pool = a.layer("hca_cmp_kv", hi)[r]
            main_compressor(x_g, G.pos[r], G.first[r], wh, "hca_cmp_", flat(a.layer("hca_compress_state", hi)[r]),
                            G.hca_state_tables[r], G.slots["hca_state"][r], flat(cmp_pool), G.slots["hca_cmp"][r],
                            G.hca_cmp_cos[r], G.hca_cmp_sin[r], ratio=128, page=8, rope_dims=rd, eps=eps,
                            missing_zero=G.hca_missing_zero)
            p = L.pos[r]
            n_c = torch.minimum(torch.minimum((p + 1) // 128, L.kv_seq_lens(r, "hca") // 128),
                                torch.full_like(p, L.hca_cap))
            n_max = int(n_c.max()) if n_c.numel() else 0
            j = torch.arange(n_max, device=p.device)[None, :]
            rows = torch.where(j < n_c[:, None], j, -1).long()
            cmp_flat = flat(cmp_pool)
            cmp_slots = table_slot(L.req_tables(r, "hca_cmp"), rows, cmp_pool.shape[1])
        kv_pool = flat(a.layer(_n(a, "kv_cache"), layer)[r])
        set_rows(kv_pool, G.slots[f"{win}_ori"][r], kv_g.reshape(kv_g.shape[0], 1, -1))
        idx, lens = L.windows[win][0][r], L.windows[win][1][r]
        valid = (torch.arange(idx.shape[1], device=idx.device)[None, :] < lens[:, None]) & (idx >= 0)
        cos, sin = (L.swa_cos[r], L.swa_sin[r]) if kind == "swa" else (L.cmp_cos[r], L.cmp_sin[r])
        o = sparse_attention(outs["q"][r], kv_pool.reshape(kv_pool.shape[0], -1), idx.long(), valid,
                             w["attn_sink"], cos, sin, scale=cfg.head_dim ** -0.5, rope_dims=rd,
                             cmp_flat=None if cmp_flat is None else cmp_flat.reshape(cmp_flat.shape[0], -1),
                             cmp_slots=cmp_slots)
        o_all[r] = o
    taps.put(layer, "attn", o_all)
    if kind == "csa":
        taps.put(layer, "idx_topk", topk_all)
    attn_out = tp_o_proj(a, cfg, dep, layer, o_all, bands)
    taps.put(layer, "attn_out", attn_out)
    x_hc = ranks.local(lambda r: hc_post(attn_out[r], x_hc[r], outs["post"][r], outs["comb"][r]))
    taps.put(layer, "attn_x_hc", x_hc)
    return x_hc


def _n(a, name):
    """The pool argument's name in this program (decode names the ori pool raw_kv_pool and the
    index pools csa_idx_*)."""
    for cand in (name, {"kv_cache": "raw_kv_pool"}.get(name, name), "csa_" + name):
        if cand in a:
            return cand
    raise KeyError(name)


def tp_o_proj(a, cfg, dep, layer: int, o_all, bands):
    """Each rank's partial over its local head groups for every group row, summed over the
    group's ranks in rank order for each rank's own rows, BF16 once -> [R] per-rank [T, D].
    The reduce-scatter is a gather of the attention rows and of the partials, then the sum in
    rank order: the same additions in the same order however the ranks are split."""
    ranks, tp = a.ranks, dep.topology.tp
    lg = cfg.o_groups // tp
    o_all = ranks.gather(o_all)

    def partial(r):
        g0, m = (r // tp) * tp, r % tp
        o_g = pack(bands(o_all, g0), cfg.o_groups)                # [G, group rows, GI]
        return o_partial(o_g[m * lg:(m + 1) * lg], a.layer("wo_a", layer)[r], a.layer("wo_b", layer)[r],
                         a.layer("wo_b_scale", layer)[r])
    parts = ranks.gather(ranks.local(partial))

    def reduced(r):
        g0, m = (r // tp) * tp, r % tp
        T = o_all[r].shape[0]
        acc = None
        for part in parts[g0:g0 + tp]:
            band = part[m * T:(m + 1) * T]
            acc = band if acc is None else acc + band
        return bf16(acc)
    return ranks.local(reduced)


def moe_sublayer(a, cfg, dep, layer: int, x_hc, L: LocalRows, taps: Taps, *, route_layer=None, norm="norm_w",
                 tap=None):
    """layer: the index in the weights' stack; route_layer: the layer id routing reads (hash below
    num_hash_layers; the draft layers route as target layers 40..42); tap: the taps' layer key."""
    ranks = a.ranks
    eps = cfg.rms_norm_eps
    route_layer = layer if route_layer is None else route_layer
    tap = layer if tap is None else tap
    parts = {k: [None] * ranks.R for k in ("x_mixed", "post", "comb", "x_i8", "scale", "idx", "wts")}
    for r in ranks.mine:
        w = _w(a, WEIGHTS + (norm,), layer, r)
        xm, post, comb = hc_pre(x_hc[r], w["hc_ffn_fn"], w["hc_ffn_scale"], w["hc_ffn_base"], hc=cfg.hc_mult,
                                rms_eps=eps, hc_eps=cfg.hc_eps, iters=cfg.hc_sinkhorn_iters)
        x_i8, sc, idx, wts = gate(xm, w[norm], w["gate_w"], w["gate_bias"], w["tid2eid"], L.input_ids[r],
                                  int(L.num_tokens[r]), hash_layer=route_layer < cfg.num_hash_layers,
                                  topk=cfg.num_experts_per_tok, scaling=cfg.routed_scaling_factor, eps=eps)
        for k, v in zip(parts, (xm, post, comb, x_i8, sc, idx, wts)):
            parts[k][r] = v
    taps.put(tap, "ffn_x_mixed", parts["x_mixed"])
    taps.put(tap, "moe_indices", parts["idx"])
    taps.put(tap, "moe_weights", parts["wts"])
    n_local = dep.topology.experts_per_rank(cfg)
    ffn = moe(ranks, parts["x_i8"], parts["scale"], parts["idx"], parts["wts"], L.num_tokens,
              lambda dst: {n: a.layer(n, layer)[dst] for n in EXPERT_NAMES},
              lambda src: {n: a.layer(n, layer)[src] for n in SHARED_NAMES},
              n_local=n_local, limit=cfg.swiglu_limit)
    taps.put(tap, "ffn_out", ffn)
    x_hc = ranks.local(lambda r: hc_post(ffn[r], x_hc[r], parts["post"][r], parts["comb"][r]))
    taps.put(tap, "x_hc", x_hc)
    return x_hc
