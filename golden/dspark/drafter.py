"""The DSpark drafter (kernel-math.md K22-K24): dspark_proj, context KV into the lease ring, the
anchor-first 7-row query block and the three draft layers.  The target-hidden capture (K21, both
`target_hidden_tap` conventions) is `golden.compose.target_hidden` over the target's taps.

A drafter row of a request is (lease, anchor a, anchor token tau, context rows): the context rows
are the target hidden states of the tokens committed since the last drafter call (positions
`context_positions`), the query block is [tau, noise x 6] at positions a+1 .. a+7, and every block
row attends to the context window a-127 .. a and to all 7 block rows (no causal mask inside the
block).  The block's own KV is written into the ring before attention; the next step's context rows
overwrite those positions (they are position-addressed, nothing is rolled back).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from twin.abi import constants as C
from twin.abi.errors import AbiError

from ..compose import _tap
from ..kernels.embedding import lookup_embedding
from ..kernels.hyper_connections import collapse, hc_head, hc_post, hc_pre, hc_weights
from ..kernels.o_proj import pack_groups
from ..kernels.qkv_proj_rope import qkv_proj_rope
from ..kernels.rmsnorm import rms_norm
from ..kernels.rope import SWA_PROFILE, compressed_rows, rope_rotate, rope_rows
from ..numerics import NEG_INF_ATTN
from .parallel import SINGLE
from .ring import ring_slots, window_positions
from .variants import DEVICE, DrafterVariant

QW = C.DSPARK_QUERY_WIDTH


# ---- K22 dspark_proj ------------------------------------------------------------------------------
def dspark_proj(main_hidden, main_proj_weight, main_norm_weight, *, cfg, nm):
    """main_x = rms_norm(bf16(main_hidden . main_proj^T)) -> [T, D] (bf16 values)."""
    p = nm.bf16(nm.act(main_hidden) @ nm.asf(main_proj_weight).T)
    return rms_norm(p, main_norm_weight, cfg=cfg, nm=nm)


def block_rope(positions, *, cfg, nm, rope=None):
    """cos, sin [T, R] at `positions`: rows of `rope` = (freqs_cos, freqs_sin) [P, R], the RoPE
    table the device program takes as arguments, or, rope None, golden's own (theta 1e4, no YaRN)."""
    if rope is None:
        return rope_rows(cfg, SWA_PROFILE, positions, nm)
    pos = np.asarray(positions, np.int64)
    if pos.size and pos.max() >= rope[0].shape[0]:
        raise AbiError("freqs_cos", tuple(rope[0].shape), f"a table of more than {int(pos.max())} rows (the largest "
                       "position read)", where="drafter RoPE")
    idx = nm.xp.asarray(pos)
    return nm.xp.asarray(rope[0])[idx], nm.xp.asarray(rope[1])[idx]


# ---- K23 context KV ---------------------------------------------------------------------------------
def context_kv(main_x, wkv, gamma_ckv, positions, *, cfg, nm, rope=None):
    """k = rmsnorm(main_x . wkv) (f32), RoPE (`block_rope`) on the tail, stored bf16."""
    cos, sin = block_rope(positions, cfg=cfg, nm=nm, rope=rope)
    return compressed_rows(nm.act(main_x) @ nm.asf(wkv), gamma_ckv, cos, sin, cfg=cfg, nm=nm)


def write_rows(pool, l, slots, rows, *, nm):
    """pool [DL, blocks, 32, 1, HD] with rows written at the flat slots of layer l (>= 0 only)."""
    new_l = nm.set_rows(pool[l], nm.xp.asarray(slots), rows)
    if nm.is_numpy:
        out = pool.copy()
        out[l] = new_l
        return out
    return pool.at[l].set(new_l)


# ---- K24 the query block and its attention ----------------------------------------------------------
@dataclass(frozen=True)
class DraftRow:
    """One request in a drafter call.  lease None = a dense padding row on the filler ring."""

    lease: int | None
    anchor: int                        # drafter anchor: the last committed input position
    anchor_token: int                  # tau: the target's next token (block row 0)
    context_positions: tuple[int, ...] # positions of the context rows this call writes
    owner_rank: int = 0                # rank that holds the request's query rows (for emulation)


def block_positions(anchor: int) -> np.ndarray:
    return anchor + 1 + np.arange(QW)


def dspark_attend(q, K, valid, attn_sink, *, cfg, nm):
    """q [B, 7, H, HD]; K [B, N, HD]; valid [B, N] -> [B, 7, H, HD] (f32, not rounded).

    One softmax over all N candidates (no tiling, no bf16 P in this golden, §7 #16) with the sink
    in the denominator; every block row sees the same candidates: no causal mask in the block."""
    xp = nm.xp
    s = xp.einsum("bqhd,bnd->bqhn", nm.asf(q), nm.asf(K)) * cfg.softmax_scale
    v = valid[:, None, None, :]
    s = xp.where(v, s, NEG_INF_ATTN)
    m = xp.max(s, axis=-1, keepdims=True)
    e = xp.where(v, xp.exp(s - m), 0.0)
    den = xp.sum(e, axis=-1, keepdims=True) + xp.exp(nm.asf(attn_sink)[None, None, :, None] - m)
    return xp.einsum("bqhn,bnd->bqhd", e, nm.asf(K)) / den


def block_heads(q, K, valid, attn_sink, cos, sin, *, cfg, nm):
    """The attention heads of query blocks: q [B, 7, H, HD], K [B, N, HD], valid [B, N], cos/sin
    [B, 7, R] at the block positions -> [B, 7, H, HD] (bf16 values), the grouped o_proj's input.

    The attention output in f32, the inverse RoPE of its tail in f32, one bf16 rounding of the
    whole head (pypto-lib's golden; the kernel's per-half rounding is the same values)."""
    o = dspark_attend(q, K, valid, attn_sink, cfg=cfg, nm=nm)
    R = cfg.qk_rope_head_dim
    rot = rope_rotate(o[..., -R:], cos[:, :, None, :], sin[:, :, None, :], nm, inverse=True)
    return nm.bf16(nm.xp.concatenate([o[..., :-R], rot], axis=-1))


def dspark_attention(x_n, lw, pool, l, rows: list[DraftRow], *, cfg, nm, par=SINGLE, q_head_norm=True, rope=None):
    """x_n [B*7, D] (attn-normed block rows) -> (attn_out [B*7, D] bf16 values, new pool).

    q/kv by the K6 math at the block positions (RoPE as `block_rope`), block KV written into the
    ring first, attention over the 192-wide window, inverse RoPE in f32, the grouped o_proj (K12).
    q_head_norm False: q without the per-head renormalization (official V4.1)."""
    xp = nm.xp
    B = len(rows)
    pos = np.concatenate([block_positions(r.anchor) for r in rows])
    cos, sin = block_rope(pos, cfg=cfg, nm=nm, rope=rope)
    owners = np.repeat([r.owner_rank for r in rows], QW)

    def project(idx):
        q, kv, _, _ = qkv_proj_rope(x_n[idx], lw["wq_a"], lw["wq_b"], lw["wq_b_scale"], lw["wkv"], lw["gamma_cq"],
                                    lw["gamma_ckv"], cos[idx], sin[idx], cfg=cfg, nm=nm, q_head_norm=q_head_norm)
        return q, kv

    q, kv = par.map_rows(project, owners, nm=nm)
    # padding rows read the zero filler ring but publish nothing
    slots = np.concatenate([ring_slots(r.lease, block_positions(r.anchor), l) if r.lease is not None
                            else np.full(QW, -1, np.int64) for r in rows])
    pool = write_rows(pool, l, slots, kv, nm=nm)
    win = np.stack([window_positions(r.anchor) for r in rows])                     # [B, 192]
    wslots = np.stack([ring_slots(r.lease, win[b], l) for b, r in enumerate(rows)])
    K = nm.get_rows(pool[l], xp.asarray(wslots.reshape(-1))).reshape(B, win.shape[1], -1)
    valid = xp.asarray(wslots >= 0)
    H, HD = cfg.num_attention_heads, cfg.head_dim
    q = q.reshape(B, QW, H, HD)
    req_owner = np.array([r.owner_rank for r in rows])

    def attend_rows(bidx):
        c, s_ = cos.reshape(B, QW, -1)[bidx], sin.reshape(B, QW, -1)[bidx]
        return block_heads(q[bidx], K[bidx], valid[bidx], lw["attn_sink"], c, s_, cfg=cfg, nm=nm)

    (o,) = par.map_rows(lambda b: (attend_rows(b),), req_owner, nm=nm)
    o = o.reshape(B * QW, H, HD)
    return par.o_proj(pack_groups(o, cfg=cfg), lw, cfg=cfg, nm=nm, owners=owners), pool


def write_context(pool, main_x, dw_layers, rows: list[DraftRow], *, cfg, nm, rope=None):
    """K23 for every draft layer: the context rows' KV at their positions in each lease's ring."""
    pos = np.concatenate([np.asarray(r.context_positions, np.int64) for r in rows]) if rows else np.zeros(0, np.int64)
    if pos.size == 0:
        return pool
    for l, lw in enumerate(dw_layers):
        kv = context_kv(main_x, lw["wkv"], lw["gamma_ckv"], pos, cfg=cfg, nm=nm, rope=rope)
        slots = np.concatenate([ring_slots(r.lease, np.asarray(r.context_positions, np.int64), l) if r.lease is not None
                                else np.full(len(r.context_positions), -1, np.int64) for r in rows])
        pool = write_rows(pool, l, slots, kv, nm=nm)
    return pool


def _sublayer_input(h, fn, scale, base, carried, *, cfg, nm):
    """-> (x_mixed, post, comb, pre-weights handed to the next sub-layer).  carried None: collapse
    with this sub-layer's own pre-weights (device); else with the carried ones (V4.1)."""
    if carried is None:
        x_mixed, post, comb = hc_pre(h, fn, scale, base, cfg=cfg, nm=nm)
        return x_mixed, post, comb, None
    pre, post, comb = hc_weights(h, fn, scale, base, cfg=cfg, nm=nm)
    return nm.bf16(collapse(h, carried, nm)), post, comb, pre


def stream0_pre(T: int, *, cfg, nm):
    """The V4.1 drafter's first pre-weights: a one-hot on stream 0 for every row."""
    pre = np.zeros((T, cfg.hc_mult), np.float64 if nm.exact else np.float32)
    pre[:, 0] = 1.0
    return nm.xp.asarray(pre)


def drafter_forward(pool, main_hidden, rows: list[DraftRow], dckpt, target_model, *, cfg, nm, par=SINGLE,
                    variant: DrafterVariant = DEVICE, rope=None, taps=None):
    """One drafter call for one TP group -> (head_hidden [B, 7, D] bf16 values, new pool).

    main_hidden [sum(len(context)), 3D]: the captured target hidden of the context rows, in row
    order.  Padding rows (lease None) use the filler ring and publish nothing.  variant: the device's
    wiring (default) or the official V4.1 one (golden.dspark.variants); dckpt's config carries the
    variant's expert counts (DrafterCheckpoint(variant.moe_cfg(cfg))).  rope: the program's RoPE
    table (`block_rope`).  taps (golden.compose.Taps): ("input", "draft_x_hc") the embedded block's
    streams, (l, "draft_x_hc") draft layer l's output streams."""
    for r in rows:
        if r.lease is not None and r.anchor + QW >= cfg.max_position_embeddings:
            raise AbiError("anchor", r.anchor, f"anchor + 7 < {cfg.max_position_embeddings}", where="drafter row")
        if len(r.context_positions) and (max(r.context_positions) > r.anchor or min(r.context_positions) < 0):
            raise AbiError("context_positions", r.context_positions, f"positions in [0, anchor={r.anchor}]",
                           where="drafter row")
    moe_cfg = variant.moe_cfg(cfg)
    have = (dckpt.cfg.n_routed_experts, dckpt.cfg.num_experts_per_tok)
    if have != (moe_cfg.n_routed_experts, moe_cfg.num_experts_per_tok):
        raise AbiError("drafter checkpoint experts", have,
                       f"the {variant.name} drafter's (routed, activated) = "
                       f"({moe_cfg.n_routed_experts}, {moe_cfg.num_experts_per_tok})", where="drafter_forward")
    dm = dckpt.model()
    layers = [dckpt.layer(l) for l in range(cfg.dspark_num_layers)]
    n_ctx = sum(len(r.context_positions) for r in rows)
    if main_hidden.shape[0] != n_ctx:
        raise AbiError("main_hidden", tuple(main_hidden.shape), f"[{n_ctx}, 3D] (one row per context position)",
                       where="drafter_forward")
    if n_ctx:
        main_x = dspark_proj(main_hidden, dm["main_proj_weight"], dm["main_norm_weight"], cfg=cfg, nm=nm)
        pool = write_context(pool, main_x, layers, rows, cfg=cfg, nm=nm, rope=rope)
    ids = np.array([[r.anchor_token] + [cfg.dspark_noise_token_id] * (QW - 1) for r in rows], np.int64).reshape(-1)
    _, h = lookup_embedding(nm.xp.asarray(ids), target_model["embed_weight"], cfg=cfg, nm=nm)
    _tap(taps, "input", "draft_x_hc", h)
    carried = None if variant.hc_order == "own" else stream0_pre(len(ids), cfg=cfg, nm=nm)
    owners = np.repeat([r.owner_rank for r in rows], QW)
    for l, lw in enumerate(layers):
        x_mixed, post, comb, carried = _sublayer_input(h, lw["hc_attn_fn"], lw["hc_attn_scale"], lw["hc_attn_base"],
                                                       carried, cfg=cfg, nm=nm)
        x_n = rms_norm(x_mixed, lw["attn_norm_w"], cfg=cfg, nm=nm)
        attn_out, pool = dspark_attention(x_n, lw, pool, l, rows, cfg=cfg, nm=nm, par=par,
                                          q_head_norm=variant.q_head_norm, rope=rope)
        h = hc_post(attn_out, h, post, comb, cfg=cfg, nm=nm)
        x_mixed, post, comb, carried = _sublayer_input(h, lw["hc_ffn_fn"], lw["hc_ffn_scale"], lw["hc_ffn_base"],
                                                       carried, cfg=cfg, nm=nm)
        ffn = par.moe(x_mixed, lw, lambda e, _l=l: dckpt.expert(_l, e), nm.xp.asarray(ids),
                      layer=cfg.dspark_target_layer_ids[l], cfg=moe_cfg, nm=nm, owners=owners)
        h = hc_post(ffn, h, post, comb, cfg=cfg, nm=nm)
        _tap(taps, l, "draft_x_hc", h)
    if carried is None:
        head = hc_head(h, dm["hc_head_fn"], dm["hc_head_scale"], dm["hc_head_base"], cfg=cfg, nm=nm)
    else:
        head = nm.bf16(collapse(h, carried, nm))
    return head.reshape(len(rows), QW, -1), pool
