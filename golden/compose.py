"""Compositions: the per-layer step, prefill_fwd (packed, chunked, against a resident prefix),
decode_fwd (S rows per request), with per-stage taps keyed by (layer, stage).

Order of one layer (kernel-math.md §5, K13, K17):
  attention sub-layer: hc_pre(hc_attn) -> rms_norm(attn_norm) -> qkv_proj_rope ->
      CSA: compressor ratio 4 + indexer compressor + lightning indexer; HCA: compressor ratio 128 ->
      KV written to the ori pool -> sparse attention -> grouped o_proj -> hc_post
  MoE sub-layer: hc_pre(hc_ffn) -> gate -> shared + routed experts -> combine -> hc_post
then hc_head -> final rms_norm -> lm_head on the logit rows -> greedy.

Prefill and decode run the same layer code; the forms differ only where upstream's kernels do:
the indexer visibility cap (2048 compressed rows in prefill, max_position/4 in decode), the HCA
compressed-row cap (512 in prefill, 8192 in decode) and the pypto prefill ratio-128 golden's
treatment of an unmapped state page (score 0).  All of them bind only past 8192 positions or on
unmapped pages.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from twin.abi.errors import AbiError

from .kernels.compressor import EAGER_PUBLISH, EXCLUDE, ZERO, compressor, indexer_compressor
from .kernels.embedding import lookup_embedding
from .kernels.hyper_connections import hc_head, hc_post, hc_pre
from .kernels.indexer import PREFILL_SCORE_CAP, lightning_indexer
from .kernels.lm_head import greedy_sample, lm_head
from .kernels.moe import gate, moe_experts
from .kernels.o_proj import o_proj, pack_groups
from .kernels.qkv_proj_rope import qkv_proj_rope
from .kernels.rmsnorm import rms_norm
from .kernels.rope import COMPRESS_PROFILE, SWA_PROFILE, rope_rows
from .kernels.sparse_attention import csa_rows, hca_rows, sparse_attention
from .numerics import Numerics, numerics
from .paged import DECODE, PREFILL, Span, StepMeta, alloc_caches, assign_blocks, lower

PREFILL_HCA_CAP = 512
TARGET_HIDDEN_TAPS = ("hc_head_of_outputs", "mean_of_inputs")
SHARED_NAMES = ("shared_w1", "shared_w1_scale", "shared_w3", "shared_w3_scale", "shared_w2", "shared_w2_scale")


class Taps(dict):
    """(layer, stage) -> array.  Stages per layer: attn_in, x_mixed, x_norm, q, kv, cmp_kv, idx_topk,
    attn, attn_out, attn_x_hc, ffn_x_mixed, moe_indices, moe_weights, ffn_out, x_hc (the layer
    output).  cmp_kv is (token rows pooled, their compressed rows): NumPy pools only boundary
    tokens.  Model stages under layer "head": hidden, x_norm, logits.  The drafter's
    (golden.dspark.drafter_forward): ("input", draft_x_hc), (l, draft_x_hc) per draft layer l.
    `stages` keeps a subset."""

    def __init__(self, stages=None):
        super().__init__()
        self.stages = None if stages is None else set(stages)

    def put(self, layer, stage, value):
        if self.stages is None or stage in self.stages:
            self[(layer, stage)] = value


def _tap(taps, layer, stage, value):
    if taps is not None:
        taps.put(layer, stage, value)


def rope_inputs(cfg, positions, nm) -> dict:
    """Per-token cos/sin rows: swa (ratio-0 table at p), compressed (compress table at p), csa_cmp
    (at the ratio-4 window start p-3), hca_cmp (at the ratio-128 window start p-127)."""
    pos = np.asarray(positions)
    return {"swa": rope_rows(cfg, SWA_PROFILE, pos, nm), "compressed": rope_rows(cfg, COMPRESS_PROFILE, pos, nm),
            "csa_cmp": rope_rows(cfg, COMPRESS_PROFILE, np.maximum(pos - 3, 0), nm),
            "hca_cmp": rope_rows(cfg, COMPRESS_PROFILE, np.maximum(pos - 127, 0), nm)}


def device_meta(meta: StepMeta, nm) -> dict:
    """The metadata arrays in the namespace of `nm` (JAX arrays under the JAX path)."""
    xp = nm.xp
    return {k: xp.asarray(v) for k, v in meta.arrays().items()}


def attention_sublayer(x_hc, layer, w, pools, m, rope, *, cfg, nm, form, taps=None, ratio=None, indexer=None,
                       contract=EAGER_PUBLISH):
    """One attention sub-layer: x_hc [T, HC, D] -> (x_hc, pools).  `m` = device_meta(meta).

    `ratio` overrides compress_ratios[layer] (the DSpark draft layers are SWA-profile layers that
    carry target layer ids 40..42 for routing); swa_indices may be wider than 128 (192 there).
    `indexer` replaces lightning_indexer (same signature; lockstep re-syncs near-tie top-k with it).
    `contract`: the compressors' named contract (golden.kernels.compressor: EAGER_PUBLISH, serving's,
    or DEVICE_KERNEL, pypto-lib's decode kernels)."""
    ratio = cfg.compress_ratios[layer] if ratio is None else ratio
    pools = dict(pools)
    _tap(taps, layer, "attn_in", x_hc)
    x_mixed, post, comb = hc_pre(x_hc, w["hc_attn_fn"], w["hc_attn_scale"], w["hc_attn_base"], cfg=cfg, nm=nm)
    x_n = rms_norm(x_mixed, w["attn_norm_w"], cfg=cfg, nm=nm)
    _tap(taps, layer, "x_mixed", x_mixed)
    _tap(taps, layer, "x_norm", x_n)
    cos, sin = rope["swa"] if ratio == 0 else rope["compressed"]
    q, kv, qr, qr_scale = qkv_proj_rope(x_n, w["wq_a"], w["wq_b"], w["wq_b_scale"], w["wkv"], w["gamma_cq"],
                                        w["gamma_ckv"], cos, sin, cfg=cfg, nm=nm)
    _tap(taps, layer, "q", q)
    _tap(taps, layer, "kv", kv)
    pos, req, first = m["position_ids"], m["req"], m["first_pos"]
    cmp = {}
    if ratio == 4:
        _tap(taps, layer, "cmp_kv", csa_compress(x_n, pos, req, first, w, pools, m, rope, cfg=cfg, nm=nm,
                                                 contract=contract))
        cap = PREFILL_SCORE_CAP if form == PREFILL else cfg.max_position_embeddings // 4
        _, topk = (indexer or lightning_indexer)(x_n, qr, qr_scale, w["csa_idx_wq_b"], w["csa_idx_wq_b_scale"],
                                    w["csa_weights_proj"], w["csa_hadamard_idx"], cos, sin, pools["idx_kv_cache"],
                                    pools["idx_kv_scale"], m["idx_block_table"], req, pos, m["kv_seq_lens"] // 4,
                                    cfg=cfg, nm=nm, cap=cap, n_candidates=m.get("n_idx_candidates"))
        _tap(taps, layer, "idx_topk", topk)
        cmp = dict(cmp_kv=pools["csa_cmp_kv"], cmp_rows=csa_rows(topk, pos, nm=nm),
                   cmp_block_table=m["csa_cmp_block_table"], req=req)
    elif ratio == 128:
        rows, cmp = hca_compress(x_n, pos, req, first, w, pools, m, rope, cfg=cfg, nm=nm, form=form, contract=contract)
        _tap(taps, layer, "cmp_kv", rows)
        cmp["req"] = req
    pools["kv_cache"] = nm.set_rows(pools["kv_cache"], m["ori_slot_mapping"], nm.store_bf16(kv))
    o = sparse_attention(q, pools["kv_cache"], m["swa_indices"], m["swa_lens"], w["attn_sink"], cos, sin,
                         cfg=cfg, nm=nm, **cmp)
    _tap(taps, layer, "attn", o)
    attn_out = o_proj(pack_groups(o, cfg=cfg), w["wo_a"], w["wo_b"], w["wo_b_scale"], cfg=cfg, nm=nm)
    _tap(taps, layer, "attn_out", attn_out)
    x_hc = hc_post(attn_out, x_hc, post, comb, cfg=cfg, nm=nm)
    _tap(taps, layer, "attn_x_hc", x_hc)
    return x_hc, pools


def csa_compress(x_n, pos, req, first, w, pools, m, rope, *, cfg, nm, selection=None, proj=None, pool_branch=None,
                 contract=EAGER_PUBLISH):
    """The two ratio-4 compressors of a CSA layer, the attention one and the indexer's (writes
    `pools` in place of the returned arrays) -> the compressed rows written to csa_cmp_kv.
    selection, pool_branch: as `compressor` takes them; proj(wkv name, wgate name): the products
    when the caller has them (the JAX path's fused projection GEMM; its w then lacks those names)."""
    ccos, csin = rope["csa_cmp"]
    pj = proj or (lambda a, b: None)
    rows = _main_compressor("csa", 4, x_n, pos, req, first, w, pools, m, rope, cfg=cfg, nm=nm, selection=selection,
                            proj=pj, pool_branch=pool_branch, contract=contract)
    pools["idx_kv_cache"], pools["idx_kv_scale"], pools["csa_inner_compress_state"], _ = indexer_compressor(
        x_n, pos, req, first, pools["csa_inner_compress_state"], m["csa_inner_compress_state_block_table"],
        m["csa_inner_state_slot_mapping"], pools["idx_kv_cache"], pools["idx_kv_scale"],
        m["csa_idx_slot_mapping"], w.get("csa_inner_wkv"), w.get("csa_inner_wgate"), w["csa_inner_ape"],
        w["csa_inner_norm_w"], w["csa_hadamard_idx"], ccos, csin, cfg=cfg, nm=nm, selection=selection,
        proj=pj("csa_inner_wkv", "csa_inner_wgate"), contract=contract)
    return rows


def _main_compressor(kind, ratio, x_n, pos, req, first, w, pools, m, rope, *, cfg, nm, proj, missing=EXCLUDE,
                     selection=None, pool_branch=None, contract=EAGER_PUBLISH):
    """The layer's main KV compressor ("csa": ratio 4, "hca": ratio 128), its ABI names by kind."""
    cos, sin = rope[f"{kind}_cmp"]
    wkv, wgate = f"{kind}_cmp_wkv", f"{kind}_cmp_wgate"
    pools[f"{kind}_cmp_kv"], pools[f"{kind}_compress_state"], rows = compressor(
        x_n, pos, req, first, pools[f"{kind}_compress_state"], m[f"{kind}_compress_state_block_table"],
        m[f"{kind}_state_slot_mapping"], pools[f"{kind}_cmp_kv"], m[f"{kind}_cmp_slot_mapping"], w.get(wkv),
        w.get(wgate), w[f"{kind}_cmp_ape"], w[f"{kind}_cmp_norm_w"], cos, sin, ratio=ratio, cfg=cfg, nm=nm,
        missing=missing, selection=selection, proj=proj(wkv, wgate), pool_branch=pool_branch, contract=contract)
    return rows


def hca_compress(x_n, pos, req, first, w, pools, m, rope, *, cfg, nm, form, selection=None, proj=None,
                 pool_branch=None, n_max=None, contract=EAGER_PUBLISH):
    """The ratio-128 compressor of an HCA layer (writes `pools` in place of the returned arrays) and
    the compressed rows attention reads: (rows written, cmp keyword arguments of sparse_attention).
    selection, proj, pool_branch as in `csa_compress`; n_max: the rows' static width (default:
    m's n_hca_rows, else the call's most)."""
    rows = _main_compressor("hca", 128, x_n, pos, req, first, w, pools, m, rope, cfg=cfg, nm=nm,
                            missing=ZERO if form == PREFILL else EXCLUDE, selection=selection,
                            proj=proj or (lambda a, b: None), pool_branch=pool_branch, contract=contract)
    cap = PREFILL_HCA_CAP if form == PREFILL else cfg.max_position_embeddings // 128
    n_max = m.get("n_hca_rows") if n_max is None else n_max
    cmp = dict(cmp_kv=pools["hca_cmp_kv"], cmp_rows=hca_rows(pos, req, m["kv_seq_lens"], cap=cap, nm=nm, n_max=n_max),
               cmp_block_table=m["hca_cmp_block_table"])
    return rows, cmp


def moe_router(x_hc, layer, w, input_ids, *, cfg, nm, taps=None, top_k=None):
    """The MoE sub-layer up to its routing: the stream mix and the router -> (x_mixed, post, comb,
    x_i8, x_scale, expert ids, weights), tapping ffn_x_mixed, moe_indices and moe_weights (a checker
    decides a layer's routing from it without running the experts)."""
    x_mixed, post, comb = hc_pre(x_hc, w["hc_ffn_fn"], w["hc_ffn_scale"], w["hc_ffn_base"], cfg=cfg, nm=nm)
    _tap(taps, layer, "ffn_x_mixed", x_mixed)
    x_i8, x_scale, idx, wts = gate(x_mixed, w["norm_w"], w["gate_w"], w.get("gate_bias"), w.get("tid2eid"),
                                   input_ids, layer=layer, cfg=cfg, nm=nm, top_k=top_k)
    _tap(taps, layer, "moe_indices", idx)
    _tap(taps, layer, "moe_weights", wts)
    return x_mixed, post, comb, x_i8, x_scale, idx, wts


def moe_sublayer(x_hc, layer, w, expert, input_ids, *, cfg, nm, taps=None, moe=None, top_k=None,
                 stream_mix=None):
    """One MoE sub-layer.  expert(e) -> routed weights of expert e of this layer.  A backend may
    swap in its own routed/shared experts (`moe`, moe_experts' signature), router selection
    (`top_k`, as `gate` takes it) and stream mix (`stream_mix`, as `hc_post` takes it)."""
    x_mixed, post, comb, x_i8, x_scale, idx, wts = moe_router(x_hc, layer, w, input_ids, cfg=cfg, nm=nm, taps=taps,
                                                              top_k=top_k)
    shared = {k: w[k] for k in SHARED_NAMES}
    ffn_out = (moe or moe_experts)(x_i8, x_scale, idx, wts, expert, shared, cfg=cfg, nm=nm)
    _tap(taps, layer, "ffn_out", ffn_out)
    x_hc = hc_post(ffn_out, x_hc, post, comb, cfg=cfg, nm=nm, stream_mix=stream_mix)
    _tap(taps, layer, "x_hc", x_hc)
    return x_hc


def layer_step(x_hc, layer, ckpt, pools, m, rope, *, cfg, nm, form, taps=None, moe=None, ratio=None, indexer=None,
               contract=EAGER_PUBLISH):
    """Attention + MoE of target layer `layer`: (x_hc, pools) -> (x_hc, pools)."""
    w = ckpt.layer(layer)
    x_hc, pools = attention_sublayer(x_hc, layer, w, pools, m, rope, cfg=cfg, nm=nm, form=form, taps=taps,
                                     ratio=ratio, indexer=indexer, contract=contract)
    expert = ckpt.experts_of(layer) if hasattr(ckpt, "experts_of") else (lambda e: ckpt.expert(layer, e))
    x_hc = moe_sublayer(x_hc, layer, w, expert, m["input_ids"], cfg=cfg, nm=nm, taps=taps, moe=moe)
    return x_hc, pools


def final_head(x_hc, model, logit_row_indices, *, cfg, nm, taps=None):
    """hc_head -> final rms_norm -> lm_head on the logit rows -> (logits, greedy ids)."""
    h = hc_head(x_hc, model["hc_head_fn"], model["hc_head_scale"], model["hc_head_base"], cfg=cfg, nm=nm)
    hn = rms_norm(h, model["final_norm_w"], cfg=cfg, nm=nm)
    _tap(taps, "head", "hidden", h)
    _tap(taps, "head", "x_norm", hn)
    logits = lm_head(hn, model["lm_head_weight"], logit_row_indices, nm=nm)
    _tap(taps, "head", "logits", logits)
    return logits, greedy_sample(logits, nm=nm)


def target_hidden(taps, model, *, cfg, nm, tap: str = "hc_head_of_outputs"):
    """DSpark main_hidden [T, 3D] (bf16 values) from a run's taps (K21): hc_head (final-head params)
    of the outputs of layers L-3..L-1, or the mean over streams of their inputs."""
    if tap not in TARGET_HIDDEN_TAPS:
        raise AbiError("target_hidden_tap", tap, f"one of {TARGET_HIDDEN_TAPS}", where="target_hidden")
    parts = []
    for layer in cfg.dspark_target_layer_ids:
        if tap == "hc_head_of_outputs":
            x = taps[(layer, "x_hc")]
            parts.append(hc_head(x, model["hc_head_fn"], model["hc_head_scale"], model["hc_head_base"], cfg=cfg, nm=nm))
        else:
            parts.append(nm.bf16(nm.xp.mean(nm.asf(taps[(layer, "attn_in")]), axis=1)))
    return nm.xp.concatenate(parts, axis=-1)


@dataclass
class ForwardOut:
    logits: object
    sampled: object
    caches: list
    x_hc: object
    taps: Taps | None = None
    meta: StepMeta | None = None


def forward(ckpt, meta: StepMeta, caches, *, cfg, nm="device", taps=None, moe=None, indexer=None,
            contract=EAGER_PUBLISH) -> ForwardOut:
    """Run the whole target model over one call's tokens.  Pools come in and new pools go out
    (NumPy never mutates the inputs).  contract: the compressors' (attention_sublayer)."""
    nm = numerics(nm, cfg=cfg)
    if len(caches) != cfg.num_hidden_layers:
        raise AbiError("caches", len(caches), f"one pool dict per layer ({cfg.num_hidden_layers})", where="forward")
    _check_contiguous(meta)
    m = device_meta(meta, nm)
    model = ckpt.model()
    _, x_hc = lookup_embedding(m["input_ids"], model["embed_weight"], cfg=cfg, nm=nm)
    rope = rope_inputs(cfg, meta.position_ids, nm)
    out = []
    for layer in range(cfg.num_hidden_layers):
        x_hc, pools = layer_step(x_hc, layer, ckpt, caches[layer], m, rope, cfg=cfg, nm=nm, form=meta.form,
                                 taps=taps, moe=moe, indexer=indexer, contract=contract)
        out.append(pools)
    logits, sampled = final_head(x_hc, model, m["logit_row_indices"], cfg=cfg, nm=nm, taps=taps)
    return ForwardOut(logits, sampled, out, x_hc, taps, meta)


def _check_contiguous(meta: StepMeta):
    """Each request's tokens must be consecutive rows at consecutive positions (the compressor reads
    this call's fresh rows by offset)."""
    pos, req = np.asarray(meta.position_ids), np.asarray(meta.req)
    if not req.size:
        return
    # vectorized over all rows (a per-request loop costs ~12 us per request): a request's rows are one
    # block (as many blocks as requests), its first row at first_pos, each next row one position on
    start = np.ones(req.size, bool)
    start[1:] = req[1:] != req[:-1]
    step_ok = np.ones(req.size, bool)
    step_ok[1:] = np.diff(pos) == 1
    if np.all(np.where(start, pos == np.asarray(meta.first_pos)[req], step_ok)) and \
            np.count_nonzero(start) == np.unique(req).size:
        return
    for b in np.unique(req):        # name the first request that breaks the rule
        rows = np.nonzero(req == b)[0]
        if rows.size and (np.any(np.diff(rows) != 1) or np.any(np.diff(pos[rows]) != 1)
                          or pos[rows[0]] != meta.first_pos[b]):
            raise AbiError("position_ids", pos[rows].tolist(),
                           "consecutive rows at consecutive positions starting at first_pos", where=f"request {b}")


def prefill_fwd(ckpt, caches, spans, *, cfg, nm="device", taps=None, **kw) -> ForwardOut:
    """Packed prefill: several requests' chunks in one call, each against its resident prefix."""
    return forward(ckpt, lower(cfg, spans, form=PREFILL, **kw), caches, cfg=cfg, nm=nm, taps=taps)


def decode_fwd(ckpt, caches, spans, *, cfg, nm="device", taps=None, **kw) -> ForwardOut:
    """Decode: S rows per request (the current token and S-1 drafts), logits for every row."""
    return forward(ckpt, lower(cfg, spans, form=DECODE, **kw), caches, cfg=cfg, nm=nm, taps=taps)


@dataclass
class Session:
    """A convenience driver: requests with their own block ids, caches carried across calls.

    `run(chunks, form)` takes {request: token ids} and runs them as one packed call after each
    request's resident prefix; it returns the ForwardOut and advances the lengths."""

    ckpt: object
    cfg: object
    nm: Numerics
    n_requests: int
    max_len: int
    seed: int | None = None
    lengths: list = field(default_factory=list)

    def __post_init__(self):
        self.nm = numerics(self.nm, cfg=self.cfg)
        rng = None if self.seed is None else np.random.default_rng(self.seed)
        self.blocks, self.pages = assign_blocks(self.cfg, self.n_requests, self.max_len, rng=rng)
        self.caches = alloc_caches(self.cfg, self.pages, self.nm)
        self.lengths = [0] * self.n_requests

    def run(self, chunks: dict, form: str = PREFILL, taps=None) -> ForwardOut:
        spans = []
        for r, ids in sorted(chunks.items()):
            if self.lengths[r] + len(ids) > self.max_len:
                raise AbiError("tokens", self.lengths[r] + len(ids), f"at most max_len={self.max_len}",
                               where=f"request {r}")
            spans.append(Span(r, self.lengths[r], tuple(int(t) for t in ids), self.blocks[r]))
        meta = lower(self.cfg, spans, form=form)
        res = forward(self.ckpt, meta, self.caches, cfg=self.cfg, nm=self.nm, taps=taps)
        self.caches = res.caches
        for r, ids in chunks.items():
            self.lengths[r] += len(ids)
        return res
