"""JAX formulations of the gather-heavy kernels, with the NumPy kernels' rounding points.

XLA on CPU runs batched GEMMs with a small M (one token's 8 heads against its own gathered
candidates) at ~1 GFLOP/s, and dense "every expert on every row" MoE costs E/K times the routed
work.  So on JAX:

* attention and the indexer gather candidates once per REQUEST (a request's tokens share their
  window and compressed rows), score every (token, head) of the request in one GEMM, and mask each
  token's own candidates.  Tiles keep NumPy's membership (window = tile 0 in the token's window
  order, compressed rows in tiles of 128 in the token's top-k order), so per-tile maxima, bf16(P)
  and the sink combine are the same; only the f64 summation order inside a dot differs.
* routed experts run grouped: routes sorted by expert into blocks of G rows of one expert, a
  loop over the used blocks (dynamic trip count, static shapes), so the work is ~the routed work.
* compressors pool only the boundary tokens, picked on the host from positions (static count).

Host-side layout (`Layout`): a request's tokens in groups of at most GROUP consecutive tokens (a
long prefill chunk would make per-request dense scores quadratic), the groups in a [G, S] grid,
and each group's window union: positions max(0, first - W + 1) .. last.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from jax import lax

from .compose import csa_compress, hca_compress
from .jax_select import first_max, top_k_desc
from .kernels.hyper_connections import hc_head, hc_post, hc_pre
from .kernels.lm_head import lm_head
from .kernels.indexer import PREFILL_SCORE_CAP, index_query
from .kernels.moe import swiglu_expert
from .kernels.o_proj import o_proj, pack_groups
from .kernels.qkv_proj_rope import qkv_proj_rope
from .kernels.rmsnorm import rms_norm
from .kernels.rope import rope_tail_bf16
from .kernels.sparse_attention import TILE, csa_rows
from .numerics import EXACT_F32_K, FP32_NEG_INF, NEG_INF_ATTN
from .paged import PREFILL
from .ties import index_near_ties

MOE_BLOCK = 16          # rows per expert block: small enough that padding stays < E * G rows
TRANSPOSED_KEYS = ("routed_w1", "routed_w3", "routed_w2")
GROUP = 64              # most tokens sharing one candidate gather: a window union is <= GROUP + W - 1


@dataclass(frozen=True)
class Layout:
    """Host-computed index arrays of one call (all NumPy int32 / bool) and their static sizes."""

    S: int                  # grid width: most tokens of one group
    tok: np.ndarray         # [G, S] token row of grid cell, T for empty cells
    grp: np.ndarray         # [T] group (grid row) of each token
    cell: np.ndarray        # [T] grid column of each token
    grp_req: np.ndarray     # [G] request of each group
    win_slot: np.ndarray    # [G, Wu] ori slot of each window-union position, -1 none
    win_tile: np.ndarray    # [G, S, Wu] tile of that position in the token's window, -1 not in it
    n_win_tiles: int
    sel: dict               # ratio -> [n] boundary token rows (padded with 0)
    sel_ok: dict            # ratio -> [n] real boundary

    def arrays(self) -> dict:
        out = {"g_tok": self.tok, "g_grp": self.grp, "g_cell": self.cell, "g_req": self.grp_req,
               "g_win_slot": self.win_slot, "g_win_tile": self.win_tile}
        for r in self.sel:
            out[f"g_sel{r}"], out[f"g_sel_ok{r}"] = self.sel[r], self.sel_ok[r]
        return out


def layout(meta, group: int = GROUP) -> Layout:
    pos, req = np.asarray(meta.position_ids, np.int64), np.asarray(meta.req, np.int64)
    B, T = meta.first_pos.shape[0], pos.shape[0]
    counts = np.bincount(req, minlength=B)
    r0 = np.full(B, T, np.int64)
    np.minimum.at(r0, req, np.arange(T))
    k = np.arange(T) - r0[req]                              # token's index within its request
    n_grp = -(-counts // group)
    grp = (np.cumsum(n_grp) - n_grp)[req] + k // group
    cell = k % group
    G = max(int(n_grp.sum()), 1)
    grp_req = np.zeros(G, np.int32)
    grp_req[grp] = req
    S = max(min(int(counts.max(initial=0)), group), 1)
    tok = np.full((G, S), T, np.int32)
    tok[grp, cell] = np.arange(T)
    swa, lens = np.asarray(meta.swa_indices), np.asarray(meta.swa_lens)
    W = swa.shape[1]
    Wu = S + W - 1
    start = np.maximum(pos - W + 1, 0)
    p0 = np.full(G, np.iinfo(np.int64).max)
    np.minimum.at(p0, grp, start)
    off = start - p0[grp]                                   # token's window column 0 in the union
    # each token's row over the union: union column u holds window entry j = u - off (if valid)
    j = np.arange(Wu)[None, :] - off[:, None]                                 # [T, Wu]
    jc = np.clip(j, 0, W - 1)
    slot = np.take_along_axis(swa, jc, axis=1)
    valid = (j >= 0) & (j < np.minimum(lens, W)[:, None]) & (slot >= 0)
    win_tile = np.full((G, S, Wu), -1, np.int32)
    win_tile[grp, cell] = np.where(valid, jc // TILE, -1)
    # a group's union row: its tokens agree on every position they share (one request's slots)
    rows = np.full((G, S, Wu), -1, np.int32)
    rows[grp, cell] = np.where(valid, slot, -1)
    win_slot = rows.max(axis=1, initial=-1)
    sel, sel_ok = {}, {}
    for ratio in (4, 128):
        n = max(1, int(sum(-(-int(c) // ratio) for c in counts)))   # a run of c positions has <= ceil(c/r)
        rows = np.nonzero((pos + 1) % ratio == 0)[0]
        sel[ratio] = np.zeros(n, np.int32)
        sel[ratio][:rows.size] = rows
        sel_ok[ratio] = np.arange(n) < rows.size
    return Layout(S, tok, grp.astype(np.int32), cell.astype(np.int32), grp_req, win_slot, win_tile,
                  -(-W // TILE), sel, sel_ok)


# ---- compressors: pool the host-selected boundary tokens only ---------------------------------
def boundary_branch(sel_ok, nm):
    """`compressor`'s pool_branch on JAX: pool the host-selected rows only when one of them is a real
    boundary (a ratio-128 compressor's decode step mostly has none, and would pool 16 padded
    windows of 128 rows for nothing); one compiled step serves both cases."""
    def branch(rows, state, shape):
        def traced(st):
            y = rows(st)
            nm.reads.pop(id(st), None)              # a tracer of the branch: see _if_any_boundary
            return y
        return _if_any_boundary(sel_ok, traced, state, shape, nm)
    return branch


def _if_any_boundary(sel_ok, rows, state, shape, nm):
    """rows(state) when any of sel_ok, else zeros (then written nowhere): one compiled step
    whatever the call's boundary count.  The state pool read inside the branch is recorded as read
    through the branch's result, so that its later commit (nm.set_rows) still follows the read
    and updates the pool in place."""
    y = lax.cond(jnp.any(sel_ok), rows, lambda st: jnp.zeros(shape, nm.f), state)
    nm.reads[id(state)] = (state, y)
    return y


# ---- one GEMM for the projections of the attn-normed activations ----------------------------
X_PROJ = "x_proj"       # a layer's fused [D, sum of outs] matrix (device mode, see fused_projections)
X_PROJ_KEYS = {0: ("wq_a", "wkv"),
               4: ("wq_a", "wkv", "csa_cmp_wkv", "csa_cmp_wgate", "csa_inner_wkv", "csa_inner_wgate"),
               128: ("wq_a", "wkv", "hca_cmp_wkv", "hca_cmp_wgate")}


def fuse_projections(w: dict, ratio: int, xp):
    """A layer's stored weights with the [in, out] matrices that multiply the attn-normed x
    (X_PROJ_KEYS) replaced by one concatenation along out, and their (name, width) in order."""
    keys = X_PROJ_KEYS[ratio]
    fused = {k: v for k, v in w.items() if k not in keys}
    fused[X_PROJ] = xp.concatenate([w[k] for k in keys], axis=1)
    return fused, tuple((k, int(w[k].shape[1])) for k in keys)


def fused_projections(x_n, w, split, nm):
    """name -> x_n @ w[name] for the fused names: one GEMM, its columns split.  Device mode only:
    there every product is a BF16 dot with f32 sums, so one wider GEMM changes nothing but XLA's
    summation order (official mode's qkv input is an FP8 round trip the compressors do not see)."""
    y = dot(x_n, w[X_PROJ], (((1,), (0,)), ((), ())), nm)
    out, c = {}, 0
    for k, n in split:
        out[k], c = y[:, c:c + n], c + n
    return out


# ---- per-request candidate gathers ------------------------------------------------------------
def _grid(a, tok):
    """Token rows [T, ...] -> grid [G, S, ...] (empty cells: zeros)."""
    pad = jnp.zeros((1,) + a.shape[1:], a.dtype)
    return jnp.concatenate([a, pad], axis=0)[tok]


def _paged_rows(table, n, rpp):
    """Flat slots [G, n] of logical rows 0..n-1 through each group's table row, -1 unmapped."""
    c = jnp.arange(n)
    pg = c // rpp
    width = table.shape[1]
    ent = table[:, jnp.minimum(pg, width - 1)]
    ok = (pg[None, :] < width) & (ent >= 0)
    return jnp.where(ok, ent * rpp + c[None, :] % rpp, -1), ok


def _int_dots(spec, a, b, nm):
    """Dots of integer-valued operands: exact in f32 on the device path (|sum| < 2^24)."""
    if nm.mode == "device":      # integers |v| <= 127: BF16 values, exact f32 sums
        return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32).astype(nm.f)
    return jnp.einsum(spec, nm.asf(a), nm.asf(b))


def lightning_indexer_grouped(x, qr, qr_scale, csa_idx_wq_b, csa_idx_wq_b_scale, csa_weights_proj,
                              csa_hadamard_idx, rope_cos, rope_sin, idx_kv_cache, idx_kv_scale, idx_block_table,
                              req, positions, cache_lens, g, *, cfg, nm, cap, n_candidates, ref=None):
    """golden.kernels.indexer.lightning_indexer, candidates gathered once per request -> (topk,
    re-sync masks [2, T] or None).  ref: a reference's topk of the same call [T, IK], adopted on
    the rows where it picks other compressed rows within the indexer's near-tie margin under these
    scores (golden.ties.index_near_ties); masks: adopted rows, refused rows (other rows beyond it).

    With at most min(index_topk, TILE) candidates (n_candidates is static) every candidate is
    selected: the top min(visible, IK) = visible of a row are then exactly its rows c < visible
    (the visible ones outscore the rest; an unmapped visible one ties with the invisible ones at
    FP32_NEG_INF and precedes them by index).  They are returned in index order instead of score
    order without scoring; attention reads them all in its first compressed tile either way, so
    its result is the same but for the f32 summation order inside that tile."""
    IK, C = cfg.index_topk, n_candidates
    T = x.shape[0]
    visible = jnp.minimum(jnp.minimum(cache_lens[req], (positions + 1) // 4), cap)
    if C <= min(IK, TILE):
        c = jnp.arange(IK, dtype=jnp.int32)
        topk = jnp.where(c[None, :] < visible[:, None], c[None, :], -1)
        # nothing ranked: a reference that picks other rows is refused wherever it does
        return topk, (None if ref is None else jnp.stack([jnp.zeros(T, bool), _picks_other(topk, ref)]))
    q_i8, q_scale = index_query(qr, qr_scale, csa_idx_wq_b, csa_idx_wq_b_scale, csa_hadamard_idx,
                                rope_cos, rope_sin, cfg=cfg, nm=nm)
    w = nm.r32(nm.mm(nm.asf(x), nm.asf(csa_weights_proj)) * (cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5))
    grp = g["g_grp"]
    slot, ok = _paged_rows(idx_block_table[g["g_req"]], C, idx_kv_cache.shape[1])
    k = nm.get_rows(idx_kv_cache, slot)                                   # [G, C, IHD]
    ks = nm.asf(nm.get_rows(idx_kv_scale, slot))[..., 0]                  # [G, C]
    dots = _int_dots("bshd,bcd->bshc", _grid(q_i8, g["g_tok"]), k, nm)[grp, g["g_cell"]]   # [T, IH, C]
    s = jnp.sum(jnp.maximum(dots * q_scale * ks[grp][:, None, :], 0.0) * w[:, :, None], axis=1)
    keep = ok[grp] & (jnp.arange(C)[None, :] < visible[:, None])
    score = jnp.where(keep, nm.r32(s), FP32_NEG_INF)
    order = top_k_desc(score, IK)
    kk = jnp.minimum(visible, IK)
    topk = jnp.where(jnp.arange(order.shape[1])[None, :] < kk[:, None], order, -1)
    if order.shape[1] < IK:
        topk = jnp.concatenate([topk, jnp.full((T, IK - order.shape[1]), -1, jnp.int32)], axis=1)
    topk = topk.astype(jnp.int32)
    if ref is None:
        return topk, None
    near = index_near_ties(score, topk, ref, xp=jnp)
    return jnp.where(near[:, None], ref, topk), jnp.stack([near, _picks_other(topk, ref) & ~near])


def _picks_other(a, b):
    """[T] bool: selections a, b [T, k] hold other rows (as sets)."""
    return jnp.any(jnp.sort(a, axis=-1) != jnp.sort(b, axis=-1), axis=-1)


def _tile(s, mask, K, nm):
    """One softmax tile over the masked columns: (m, l, o, any) as golden's `attend` forms them."""
    st = jnp.where(mask, s, NEG_INF_ATTN)
    m = jnp.max(st, axis=-1)
    e = jnp.where(mask, jnp.exp(st - m[..., None]), 0.0)
    p = e if nm.mode == "official" else nm.bf16(e)
    return m, jnp.sum(e, axis=-1), _per_group(p, K, nm), jnp.any(mask, axis=-1)


def _per_group(a, b, nm, contract_b=1):
    """[G, S, H, N] x [G, N, D] (contract_b=1) or [G, D, N] (contract_b=2) -> [G, S, H, D] as one
    3-D batched GEMM (XLA CPU runs the 4-D form ~1.4x slower)."""
    G, S, H, N = a.shape
    y = dot(a.reshape(G, S * H, N), b, (((2,), (contract_b,)), ((0,), (0,))), nm)
    return y.reshape(G, S, H, y.shape[-1])


def dot(a, b, dims, nm):
    """lax.dot_general(a, b, dims) in the compute dtype; inside nm.bf16_operands() (device mode)
    with BF16 operands and f32 sums (see Fp32Numerics).  dims name the contracted axes: XLA CPU
    keeps a BF16 dot BF16 only when no transpose sits between it and its operands (jnp.matmul of
    a transposed operand falls back to f32 GEMMs)."""
    if getattr(nm, "bf16_active", False):
        return lax.dot_general(*nm.as_bf16(a, b), dims, preferred_element_type=jnp.float32)
    return lax.dot_general(nm.asf(a), nm.asf(b), dims)


def sparse_attention_grouped(q, kv_cache, attn_sink, rope_cos, rope_sin, g, *, cmp_kv=None, cmp_rows=None,
                             cmp_block_table=None, n_cmp=0, req, cfg, nm):
    """golden.kernels.sparse_attention.sparse_attention over per-request candidate sets.

    cmp_rows [T, n] logical compressed rows (-1 none) in the token's order; every row is < n_cmp."""
    T = q.shape[0]
    grp = g["g_grp"]
    qg = _grid(nm.asf(q), g["g_tok"])                                       # [G, S, H, HD]
    Kw = nm.asf(nm.get_rows(kv_cache, g["g_win_slot"]))                     # [G, Wu, HD]
    sw = _per_group(qg, Kw, nm, contract_b=2) * cfg.softmax_scale
    wt = g["g_win_tile"][:, :, None, :]
    tiles = [_tile(sw, wt == j, Kw, nm) for j in range(g["n_win_tiles"])]
    if cmp_rows is not None and n_cmp:
        slot, ok = _paged_rows(cmp_block_table[g["g_req"]], n_cmp, cmp_kv.shape[1])
        Kc = nm.asf(nm.get_rows(cmp_kv, slot))                              # [G, Cu, HD]
        r = jnp.arange(cmp_rows.shape[1])
        tile_of = jnp.full((T, n_cmp + 1), -1, jnp.int32).at[jnp.arange(T)[:, None],
                                                             jnp.where(cmp_rows >= 0, cmp_rows, n_cmp)].set(
            jnp.broadcast_to((r // TILE).astype(jnp.int32), cmp_rows.shape))[:, :n_cmp]
        tile_of = jnp.where(ok[grp], tile_of, -1)
        ct = _grid(tile_of + 1, g["g_tok"])[:, :, None, :] - 1                  # empty cells: -1
        sc = _per_group(qg, Kc, nm, contract_b=2) * cfg.softmax_scale
        tiles += [_tile(sc, ct == j, Kc, nm) for j in range(-(-cmp_rows.shape[1] // TILE))]
    anys = jnp.stack([t[3] for t in tiles], -1)                              # [G, S, 1, nt]
    ms = jnp.stack([t[0] for t in tiles], -1)                                # [G, S, H, nt]
    has = jnp.any(anys, axis=-1)
    M = jnp.where(has, jnp.max(jnp.where(anys, ms, -jnp.inf), axis=-1), 0.0)
    o, den = 0.0, 0.0
    for j, (m, l_t, o_t, a_t) in enumerate(tiles):
        a = jnp.where(a_t, jnp.exp(m - M), 0.0)
        o = o + a[..., None] * o_t
        den = den + a * l_t
    den = den + jnp.exp(nm.asf(attn_sink)[None, None, :] - M)
    o = jnp.where(has[..., None], o / den[..., None], 0.0)[grp, g["g_cell"]]       # [T, H, HD]
    return rope_tail_bf16(o, rope_cos[:, None, :], rope_sin[:, None, :], nm, inverse=True)


# ---- routed experts in expert blocks ------------------------------------------------------------
def moe_blocks(x_i8, x_scale, indices, weights, expert, *, cfg, nm, block=MOE_BLOCK, transposed=False, layer=None,
               scratch=None):
    """The routed part of golden.kernels.moe.moe_experts on JAX -> (each route's weighted expert
    row [T, K, D], the block buffer); kernels.moe.moe_combine adds the shared expert.  Routes are
    sorted by expert into blocks of `block` rows of one expert; a loop over the used blocks runs
    swiglu_expert on each (same rounding points).  transposed: the stacked w1/w3/w2 are
    [E, in, out] (the layout the dot reads: XLA CPU's int8 dot against a transposed slice runs ~3x
    slower); swiglu_expert's .T then cancels out.  layer: the expert arrays carry a leading layer
    axis (every layer's experts, one argument each) and this is the layer's index into it.
    scratch: a block buffer to run in instead of a zeroed one (e.g. the previous
    layer's, which XLA then reuses in place): its values are never read, every slot read back is
    written by this call's blocks."""
    T, K = indices.shape
    E, D = cfg.n_routed_experts, x_i8.shape[1]
    n = T * K
    nb = (n + min(E, n) * (block - 1)) // block + 1
    flat = indices.reshape(-1)
    # a route's rank among its expert's routes (in route order, token-major): the slots a stable
    # sort by expert would give, without XLA's CPU sort.  The routes to that expert of earlier
    # tokens (a running count over the T tokens: XLA CPU's cumsum is quadratic in its length, so
    # not over the T * K routes) plus those of the token's own earlier picks
    per_tok = jnp.sum(indices[:, :, None] == jnp.arange(E), axis=1, dtype=jnp.int32)          # [T, E]
    before = jnp.cumsum(per_tok, axis=0, dtype=jnp.int32) - per_tok
    k = jnp.arange(K)
    own = jnp.sum((indices[:, :, None] == indices[:, None, :]) & (k[None, :] < k[:, None]), axis=2, dtype=jnp.int32)
    rank = (jnp.take_along_axis(before, indices, axis=1) + own).reshape(-1)
    cnt = jnp.sum(per_tok, axis=0, dtype=jnp.int32)
    padded = (cnt + block - 1) // block * block
    pend = jnp.cumsum(padded)
    dest = ((pend - padded)[flat] + rank).astype(jnp.int32)              # [n] block-layout slot of each route
    route = jnp.full((nb * block,), -1, jnp.int32).at[dest].set(jnp.arange(n, dtype=jnp.int32))
    blk_e = jnp.minimum(jnp.searchsorted(pend, jnp.arange(nb) * block, side="right"), E - 1)
    wflat = weights.reshape(-1)

    def body(i, acc):
        rt = lax.dynamic_slice_in_dim(route, i * block, block)
        r = jnp.maximum(rt, 0)
        e = blk_e[i]
        at = (e,) if layer is None else (jnp.asarray(layer, e.dtype), e)
        ew = {}
        for k, v in expert.items():         # expert e (of `layer`): a [1, ..., 1, *shape] slice
            shape = v.shape[len(at):]
            start = at + (jnp.zeros((), e.dtype),) * len(shape)
            ew[k] = lax.dynamic_slice(v, start, (1,) * len(at) + shape).reshape(shape)
        if transposed:
            ew = {k: v.T if k in TRANSPOSED_KEYS else v for k, v in ew.items()}
        y = swiglu_expert(x_i8[r // K], x_scale[r // K], ew["routed_w1"], ew["routed_w1_scale"], ew["routed_w3"],
                          ew["routed_w3_scale"], ew["routed_w2"], ew["routed_w2_scale"], cfg=cfg, nm=nm,
                          route_weight=jnp.where(rt >= 0, wflat[r], 0.0))
        return lax.dynamic_update_slice_in_dim(acc, y[None], i, axis=0)

    if scratch is None or scratch.shape != (nb, block, D):
        scratch = jnp.zeros((nb, block, D), nm.f)
    acc = lax.fori_loop(0, pend[-1] // block, body, scratch)
    # each route's row read back from its block slot (a gather: no zeroed [n, D] scatter target)
    return acc.reshape(-1, D)[dest].reshape(T, K, D), acc


# ---- the attention sub-layer on the grouped kernels -------------------------------------------
def attention_sublayer_grouped(x_hc, layer, w, pools, m, rope, g, *, cfg, nm, form, ratio, n_idx, n_hca, split=None,
                               index_ref=None, taps=None):
    """golden.compose.attention_sublayer with the JAX kernels above (same order and pools) ->
    (x_hc, pools, the indexer's re-sync masks or None); index_ref: a reference's indexer topk of
    this layer (lightning_indexer_grouped's ref); taps: a compose.Taps for its stages (compose's
    names; cmp_kv as (the static boundary selection, its rows): the layout's sel_ok says which
    are real boundaries; idx_topk is the selection attention read)."""
    pools = dict(pools)
    tap = (lambda s, v: taps.put(layer, s, v)) if taps is not None else (lambda s, v: None)
    x_mixed, post, comb = hc_pre(x_hc, w["hc_attn_fn"], w["hc_attn_scale"], w["hc_attn_base"], cfg=cfg, nm=nm)
    x_n = rms_norm(x_mixed, w["attn_norm_w"], cfg=cfg, nm=nm)
    tap("x_mixed", x_mixed)
    tap("x_norm", x_n)
    with bf16_operands(nm):
        attn_out, pools, index = _attention_core(x_n, w, pools, m, rope, g, cfg=cfg, nm=nm, form=form, ratio=ratio,
                                                 n_idx=n_idx, n_hca=n_hca, split=split, index_ref=index_ref, tap=tap)
    tap("attn_out", attn_out)
    masks = None
    if index is not None:
        topk, masks = index
        tap("idx_topk", topk)
    x_hc = hc_post_streams(attn_out, x_hc, post, comb, cfg=cfg, nm=nm)
    tap("attn_x_hc", x_hc)
    return x_hc, pools, masks


def stream_sum(c, r):
    """hc_post's stream mix [T, in, out] x [T, in, D] -> [T, out, D] as a sum of products over the
    input streams (XLA CPU runs the per-token 4 x 4 batched GEMM ~2x slower; written as chained
    multiply-adds instead, XLA fuses it into the next hc_post and recomputes it per read)."""
    return jnp.sum(c[:, :, :, None] * r[:, :, None, :], axis=1)


def hc_post_streams(x, residual, post, comb, *, cfg, nm):
    """golden.kernels.hyper_connections.hc_post with `stream_sum` as its stream mix."""
    return hc_post(x, residual, post, comb, cfg=cfg, nm=nm, stream_mix=stream_sum)


def _attention_core(x_n, w, pools, m, rope, g, *, cfg, nm, form, ratio, n_idx, n_hca, split=None, index_ref=None,
                    tap=lambda stage, value: None):
    """qkv -> compressors and indexer -> KV write -> attention -> o_proj: every GEMM here multiplies
    BF16 values (x_n, q, P and o are BF16 rounding points; the weights and pools BF16 or INT8);
    tap(stage, value) sees q, kv, cmp_kv and attn."""
    cos, sin = rope["swa"] if ratio == 0 else rope["compressed"]
    pr = fused_projections(x_n, w, split, nm) if split else {}
    pj = lambda a, b: (pr[a], pr[b]) if pr else None
    # fused (device mode): wq_a and wkv live only inside w[X_PROJ]
    q, kv, qr, qr_scale = qkv_proj_rope(x_n, w.get("wq_a"), w["wq_b"], w["wq_b_scale"], w.get("wkv"), w["gamma_cq"],
                                        w["gamma_ckv"], cos, sin, cfg=cfg, nm=nm, proj=pj("wq_a", "wkv"))
    tap("q", q)
    tap("kv", kv)
    pos, req, first = m["position_ids"], m["req"], m["first_pos"]
    cmp, index = {}, None
    if ratio == 4:
        ok = g["g_sel_ok4"]
        tap("cmp_kv", csa_compress(x_n, pos, req, first, w, pools, m, rope, cfg=cfg, nm=nm,
                                   selection=(g["g_sel4"], ok), proj=pj, pool_branch=boundary_branch(ok, nm)))
        cap = PREFILL_SCORE_CAP if form == PREFILL else cfg.max_position_embeddings // 4
        topk, masks = lightning_indexer_grouped(x_n, qr, qr_scale, w["csa_idx_wq_b"], w["csa_idx_wq_b_scale"],
                                                w["csa_weights_proj"], w["csa_hadamard_idx"], cos, sin,
                                                pools["idx_kv_cache"], pools["idx_kv_scale"], m["idx_block_table"],
                                                req, pos, m["kv_seq_lens"] // 4, g, cfg=cfg, nm=nm, cap=cap,
                                                n_candidates=n_idx, ref=index_ref)
        index = topk, masks
        cmp = dict(cmp_kv=pools["csa_cmp_kv"], cmp_rows=csa_rows(topk, pos, nm=nm),
                   cmp_block_table=m["csa_cmp_block_table"], n_cmp=n_idx)
    elif ratio == 128:
        ok = g["g_sel_ok128"]
        rows, hca = hca_compress(x_n, pos, req, first, w, pools, m, rope, cfg=cfg, nm=nm, form=form,
                                 selection=(g["g_sel128"], ok), proj=pj, pool_branch=boundary_branch(ok, nm),
                                 n_max=n_hca)
        tap("cmp_kv", rows)
        if n_hca:
            cmp = dict(hca, n_cmp=n_hca)
    pools["kv_cache"] = nm.set_rows(pools["kv_cache"], m["ori_slot_mapping"], nm.store_bf16(kv))
    o = sparse_attention_grouped(q, pools["kv_cache"], w["attn_sink"], cos, sin, g, req=req, cfg=cfg, nm=nm, **cmp)
    tap("attn", o)
    return o_proj_grouped(o, w["wo_a"], w["wo_b"], w["wo_b_scale"], cfg=cfg, nm=nm), pools, index


def o_proj_grouped(o, wo_a, wo_b, wo_b_scale, *, cfg, nm):
    """golden.kernels.o_proj.o_proj on o [T, H, HD] (same rounding points, groups summed in
    order), its GEMMs as dot_generals on the ABI layouts (wo_a [G, OL, GI], wo_b [G, D, OL])."""
    if nm.mode != "device" or wo_b.shape[-1] > EXACT_F32_K:
        return o_proj(pack_groups(o, cfg=cfg), wo_a, wo_b, wo_b_scale, cfg=cfg, nm=nm)
    T, G = o.shape[0], cfg.o_groups
    o_a = dot(o.reshape(T, G, cfg.o_group_in), wo_a, (((2,), (2,)), ((1,), (0,))), nm)    # [G, T, OL]
    o_i8, dq = nm.q8(o_a)
    out = 0.0
    for g in range(G):          # exact integers: K = OL <= EXACT_F32_K
        out = out + dot(o_i8[g], wo_b[g], (((1,), (1,)), ((), ())), nm) * dq[g]
    return nm.bf16(out * nm.asf(wo_b_scale))


def bf16_operands(nm):
    """nm.bf16_operands() where nm has it (Fp32Numerics), else nothing."""
    return nm.bf16_operands() if hasattr(nm, "bf16_operands") else contextlib.nullcontext()


# ---- the head ---------------------------------------------------------------------------------
def head(x_hc, model, logit_row_indices, *, cfg, nm):
    """golden.compose.final_head (no taps): the LM head's GEMM multiplies BF16 values (the normed
    hidden, the BF16 weight); greedy ids as greedy_sample's (first maximum)."""
    h = hc_head(x_hc, model["hc_head_fn"], model["hc_head_scale"], model["hc_head_base"], cfg=cfg, nm=nm)
    hn = rms_norm(h, model["final_norm_w"], cfg=cfg, nm=nm)
    with bf16_operands(nm):
        logits = lm_head(hn, model["lm_head_weight"], logit_row_indices, nm=nm)
    return logits, first_max(logits)

