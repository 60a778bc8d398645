"""The target forward (prefill and decode) as the ranks of the deployment run it.

Per layer, for the rows of each TP group's stream:
  * each rank computes hc_pre, the attention norm and its query rows for the rows it owns (its
    rank-major band of the prefill stream, or its decode requests' rows);
  * the attn-normed rows are all-gathered (K28), so every rank of the group builds the KV, the
    compressor states, the compressed rows and the indexer cache of the whole stream into its own
    replica of the pools (identical work: the emulation keeps one replica per group);
  * each rank runs the indexer and sparse attention for its own query rows;
  * the grouped o_proj is TP-sharded (2 of 8 groups per rank) and reduced;
  * the MoE is EP16-dispatched; the LM head is vocab/4-sharded with the all-to-all back.
The kernels are golden.kernels'; the layer order is golden.compose's (K13, K17, §5), which the tests
hold this composition to: bitwise in exact mode.
"""
from __future__ import annotations

import numpy as np

from twin.abi.errors import AbiError

from ..compose import ForwardOut, _check_contiguous, _tap, csa_compress, device_meta, hca_compress, rope_inputs
from ..kernels.embedding import lookup_embedding
from ..kernels.hyper_connections import hc_head, hc_post, hc_pre
from ..kernels.indexer import PREFILL_SCORE_CAP, lightning_indexer
from ..kernels.lm_head import greedy_sample
from ..kernels.o_proj import pack_groups
from ..kernels.qkv_proj_rope import qkv_proj_rope
from ..kernels.rmsnorm import rms_norm
from ..kernels.sparse_attention import csa_rows, sparse_attention
from ..numerics import numerics
from ..paged import PREFILL


def cp_owners(meta, partition_of_request, tp: int) -> np.ndarray:
    """Prefill: each partition's packed rows split rank-major into tp bands of ceil(P/tp) rows."""
    req = np.asarray(meta.req)
    part = np.asarray([partition_of_request[int(r)] for r in req], np.int64)
    owners = np.zeros(req.shape[0], np.int64)
    for g in np.unique(part):
        rows = np.nonzero(part == g)[0]
        band = max(-(-rows.size // tp), 1)
        owners[rows] = g * tp + np.arange(rows.size) // band
    return owners


def attention_sublayer_ranks(x_hc, layer, w, pools, m, rope, owners, par, *, cfg, nm, form, taps=None):
    xp = nm.xp
    ratio = cfg.compress_ratios[layer]
    pools = dict(pools)
    _tap(taps, layer, "attn_in", x_hc)
    cos, sin = rope["swa"] if ratio == 0 else rope["compressed"]

    def local_q(i):       # each rank: its own rows' pre-mix, norm and query
        x_mixed, post, comb = hc_pre(x_hc[i], w["hc_attn_fn"], w["hc_attn_scale"], w["hc_attn_base"], cfg=cfg, nm=nm)
        x_n = rms_norm(x_mixed, w["attn_norm_w"], cfg=cfg, nm=nm)
        q, kv, qr, qr_scale = qkv_proj_rope(x_n, w["wq_a"], w["wq_b"], w["wq_b_scale"], w["wkv"], w["gamma_cq"],
                                            w["gamma_ckv"], cos[i], sin[i], cfg=cfg, nm=nm)
        return x_n, post, comb, q, kv, qr, qr_scale

    # all-gathered: x_n and kv of the whole stream are on every rank of the group
    x_n, post, comb, q, kv, qr, qr_scale = par.map_rows(local_q, owners, nm=nm)
    pos, req, first = m["position_ids"], m["req"], m["first_pos"]
    cmp, topk = {}, None
    if ratio == 4:
        csa_compress(x_n, pos, req, first, w, pools, m, rope, cfg=cfg, nm=nm)
        cap = PREFILL_SCORE_CAP if form == PREFILL else cfg.max_position_embeddings // 4
        lens = m["kv_seq_lens"] // 4
        visible = xp.minimum(xp.minimum(lens[req], (pos + 1) // 4), cap)
        n_cand = m.get("n_idx_candidates") or max(int(visible.max()) if pos.shape[0] else 1, 1)

        def local_topk(i):  # each rank scores its own query rows against the replicated cache
            _, t = lightning_indexer(x_n[i], qr[i], qr_scale[i], w["csa_idx_wq_b"], w["csa_idx_wq_b_scale"],
                                     w["csa_weights_proj"], w["csa_hadamard_idx"], cos[i], sin[i],
                                     pools["idx_kv_cache"], pools["idx_kv_scale"], m["idx_block_table"], req[i],
                                     pos[i], lens, cfg=cfg, nm=nm, cap=cap, n_candidates=n_cand)
            return (t,)

        (topk,) = par.map_rows(local_topk, owners, nm=nm)
        cmp = dict(cmp_kv=pools["csa_cmp_kv"], cmp_rows=csa_rows(topk, pos, nm=nm),
                   cmp_block_table=m["csa_cmp_block_table"])
    elif ratio == 128:
        _, cmp = hca_compress(x_n, pos, req, first, w, pools, m, rope, cfg=cfg, nm=nm, form=form)
    if taps is not None and topk is not None:
        _tap(taps, layer, "idx_topk", topk)
    pools["kv_cache"] = nm.set_rows(pools["kv_cache"], m["ori_slot_mapping"], nm.store_bf16(kv))

    def local_attn(i):
        extra = {}
        if cmp:
            extra = dict(cmp_kv=cmp["cmp_kv"], cmp_rows=cmp["cmp_rows"][i], cmp_block_table=cmp["cmp_block_table"],
                         req=req[i])
        return (sparse_attention(q[i], pools["kv_cache"], m["swa_indices"][i], m["swa_lens"][i], w["attn_sink"],
                                 cos[i], sin[i], cfg=cfg, nm=nm, **extra),)

    (o,) = par.map_rows(local_attn, owners, nm=nm)
    _tap(taps, layer, "attn", o)
    attn_out = par.o_proj(pack_groups(o, cfg=cfg), w, cfg=cfg, nm=nm, owners=owners)
    _tap(taps, layer, "attn_out", attn_out)
    x_hc = hc_post(attn_out, x_hc, post, comb, cfg=cfg, nm=nm)
    _tap(taps, layer, "attn_x_hc", x_hc)
    return x_hc, pools


def moe_sublayer_ranks(x_hc, layer, w, expert, input_ids, owners, par, *, cfg, nm, taps=None):
    def local_pre(i):
        return hc_pre(x_hc[i], w["hc_ffn_fn"], w["hc_ffn_scale"], w["hc_ffn_base"], cfg=cfg, nm=nm)

    x_mixed, post, comb = par.map_rows(local_pre, owners, nm=nm)
    ffn_out = par.moe(x_mixed, w, expert, input_ids, layer=layer, cfg=cfg, nm=nm, owners=owners)
    _tap(taps, layer, "ffn_out", ffn_out)
    x_hc = hc_post(ffn_out, x_hc, post, comb, cfg=cfg, nm=nm)
    _tap(taps, layer, "x_hc", x_hc)
    return x_hc


def forward_ranks(ckpt, meta, caches, owners, par, *, cfg, nm="device", taps=None) -> ForwardOut:
    """golden.compose.forward, run as the ranks of `par` (a RankEmulation): owners [T] = the rank of
    every row.  Logit rows are computed by their row's TP group (vocab-sharded)."""
    nm = numerics(nm, cfg=cfg)
    if len(caches) != cfg.num_hidden_layers:
        raise AbiError("caches", len(caches), f"one pool dict per layer ({cfg.num_hidden_layers})",
                       where="forward_ranks")
    _check_contiguous(meta)
    owners = np.asarray(owners)
    m = device_meta(meta, nm)
    model = ckpt.model()
    _, x_hc = lookup_embedding(m["input_ids"], model["embed_weight"], cfg=cfg, nm=nm)   # replicated table
    rope = rope_inputs(cfg, meta.position_ids, nm)
    out = []
    for layer in range(cfg.num_hidden_layers):
        w = ckpt.layer(layer)
        x_hc, pools = attention_sublayer_ranks(x_hc, layer, w, caches[layer], m, rope, owners, par, cfg=cfg,
                                               nm=nm, form=meta.form, taps=taps)
        x_hc = moe_sublayer_ranks(x_hc, layer, w, lambda e, _l=layer: ckpt.expert(_l, e), m["input_ids"], owners,
                                  par, cfg=cfg, nm=nm, taps=taps)
        out.append(pools)
    rows = np.asarray(meta.logit_row_indices)
    live = rows >= 0
    src = np.clip(rows, 0, max(meta.T - 1, 0))

    def local_head(i):
        h = hc_head(x_hc[i], model["hc_head_fn"], model["hc_head_scale"], model["hc_head_base"], cfg=cfg, nm=nm)
        return (rms_norm(h, model["final_norm_w"], cfg=cfg, nm=nm),)

    (hn,) = par.map_rows(local_head, owners, nm=nm)
    logits = par.vocab_logits(hn[src], model["lm_head_weight"], nm=nm, owners=owners[src])
    logits = nm.xp.where(nm.xp.asarray(live)[:, None], logits, 0.0)
    _tap(taps, "head", "logits", logits)
    return ForwardOut(logits, greedy_sample(logits, nm=nm), out, x_hc, taps, meta)
