"""The NumPy golden's fast paths give the bits of the plain formulations they replace: int GEMM
layouts, np.take gathers, in-place Sinkhorn rounds, grouped routed experts, chunked attention,
candidate addresses made once per attention call, the tile combination without masks when every
tile has a candidate, set_rows without mask copies."""
import platform

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from golden.compose import SHARED_NAMES
from golden.heap import retain_heap
from golden.kernels.hyper_connections import sinkhorn
from golden.kernels import moe
from golden.kernels import sparse_attention as sa
from golden.kernels.moe import moe_experts, routed_expert, shared_expert
from golden.kernels.rope import rope_tail, rope_tail_bf16
from golden.kernels.sparse_attention import (TILE, _combine_tiles_np, attend, candidate_slots, gather_candidates,
                                             sparse_attention)
from golden.numerics import BF16, NEG_INF_ATTN, Numerics
from golden_testlib import DEVICE
from twin.abi.errors import AbiError
from twin.abi.presets import SMALL


@settings(max_examples=30)
@given(m=st.sampled_from([1, 3, 64, 65, 130]), k=st.sampled_from([1, 7, 1024, 1025, 2100]),
       n=st.sampled_from([1, 5, 128, 300]), transposed=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_int_mm_is_the_integer_product_in_every_layout(m, k, n, transposed, seed):
    """n = 300 crosses the weight blocks of a transposed weight (256 channels at K <= 1024, 124 at 2100)."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-127, 128, (m, k)).astype(np.float64)
    w = rng.integers(-127, 128, (n, k) if transposed else (k, n), dtype=np.int8)
    b = w.T if transposed else w                       # an [out, in] weight read as w.T, or [in, out]
    got = DEVICE.int_mm(a, b)
    assert got.shape == (m, n) and got.flags.c_contiguous
    assert np.array_equal(got, (a.astype(np.int64) @ b.astype(np.int64)).astype(np.float64))


def test_get_rows_reads_row_zero_below_and_refuses_past_the_pool():
    pool = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    rows = DEVICE.get_rows(pool, np.array([[5, -1], [0, -7]]))
    flat = pool.reshape(6, 4)
    assert np.array_equal(rows, np.stack([[flat[5], flat[0]], [flat[0], flat[0]]]))
    with pytest.raises(AbiError, match="slots=6"):
        DEVICE.get_rows(pool, np.array([6]))


def _sinkhorn_reference(logits, iters, eps):
    c = np.exp(logits - logits.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + eps
    c = c / (c.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdims=True) + eps)
        c = c / (c.sum(-2, keepdims=True) + eps)
    return c


@settings(max_examples=25)
@given(t=st.integers(1, 40), scale=st.floats(0.01, 30.0), iters=st.integers(1, 25), seed=st.integers(0, 2 ** 16))
def test_sinkhorn_in_place_rounds_are_bit_identical(t, scale, iters, seed):
    logits = np.random.default_rng(seed).standard_normal((t, 4, 4)) * scale
    got = sinkhorn(logits, iters, 1e-6, DEVICE)
    # bitwise: no BLAS here; both sides are NumPy reductions of 4 terms added in order (NumPy's loop
    # for these shapes, the same on every CPU) and elementwise divisions, correctly rounded
    assert np.array_equal(got, _sinkhorn_reference(logits, iters, 1e-6))


def _check_against_one_call_per_expert(x_i8, x_scale, idx, wts, expert, shared, cfg, nm):
    """moe_experts equals the shared expert plus one routed_expert call per expert over its routes
    (routes with idx < 0 add nothing), summed over the K routes in order, rounded to bf16 once."""
    T, K = idx.shape
    got = moe_experts(x_i8, x_scale, idx, wts, expert, shared, cfg=cfg, nm=nm)
    routed = np.zeros((T, K, cfg.hidden_size))
    for e in np.unique(idx[idx >= 0]):
        t, k = np.nonzero(idx == e)
        routed[t, k] = routed_expert(x_i8[t], x_scale[t], expert(int(e)), wts[t, k], cfg=cfg, nm=nm)
    out = nm.asf(shared_expert(x_i8, x_scale, shared, cfg=cfg, nm=nm))
    for k in range(K):
        out = out + routed[:, k]
    # bitwise in every mode: the first GEMMs have integer operands (exact), and each expert's rows
    # reach its down-projection GEMM in the same (t, k) order on both sides (a stable sort)
    assert np.array_equal(got, nm.bf16(out))


@pytest.mark.parametrize("chunk_bytes", [None, 1, 3 * 8 * SMALL.hidden_size])
@pytest.mark.parametrize("mode", ["device", "exact", "official"])
def test_grouped_routed_experts_equal_one_swiglu_call_per_expert(small_ckpt, mode, chunk_bytes, monkeypatch):
    """chunk_bytes: all routes in one chunk (SMALL's default), one expert per chunk, >= 3 routes per chunk."""
    if chunk_bytes is not None:
        monkeypatch.setattr(moe, "ROUTE_CHUNK_BYTES", chunk_bytes)
    cfg, nm, layer = SMALL, Numerics(mode), 4
    w, expert = small_ckpt.layer(layer), (lambda e: small_ckpt.expert(layer, e))
    rng = np.random.default_rng(7)
    T, K = 40, cfg.num_experts_per_tok
    x_i8 = rng.integers(-127, 128, (T, cfg.hidden_size)).astype(np.float64)
    x_scale = rng.uniform(1e-3, 1e-2, (T, 1))
    idx = np.stack([rng.choice(cfg.n_routed_experts // 2, K, replace=False) for _ in range(T)]).astype(np.int32)
    wts = rng.uniform(0.1, 1.0, (T, K))
    _check_against_one_call_per_expert(x_i8, x_scale, idx, wts, expert, {k: w[k] for k in SHARED_NAMES}, cfg, nm)


@pytest.mark.parametrize("rope_rows", [None, 3])
@pytest.mark.parametrize("mode", ["device", "exact"])
def test_attention_chunks_do_not_change_bits(mode, rope_rows, monkeypatch):
    """rope_rows: the output rows per inverse-RoPE pass (None: every row in one pass on SMALL)."""
    cfg, nm = SMALL, Numerics(mode)
    if rope_rows is not None:
        monkeypatch.setattr(sa, "CHUNK_BYTES", rope_rows * 8 * cfg.num_attention_heads * cfg.head_dim)
    rng = np.random.default_rng(3)
    T, H, HD, pages, rpp = 20, cfg.num_attention_heads, cfg.head_dim, 8, 32
    bf = lambda a: a.astype(np.float32).astype(BF16).astype(np.float64)
    q = bf(rng.standard_normal((T, H, HD)))
    kv = rng.standard_normal((pages, rpp, 1, HD)).astype(np.float32).astype(BF16)
    cmp_kv = rng.standard_normal((4, 16, 1, HD)).astype(np.float32).astype(BF16)
    swa = rng.integers(-1, pages * rpp, (T, 128)).astype(np.int32)
    lens = rng.integers(0, 129, T).astype(np.int32)
    cmp_rows = np.where(rng.random((T, 40)) < 0.8, rng.integers(0, 60, (T, 40)), -1).astype(np.int32)
    table = np.array([[2, 0, 3, -1]], np.int32)
    cos = bf(np.cos(rng.uniform(0, 6, (T, cfg.qk_rope_head_dim))))
    sin = bf(np.sin(rng.uniform(0, 6, (T, cfg.qk_rope_head_dim))))
    sink = rng.standard_normal(H).astype(np.float32)
    run = lambda chunk: sparse_attention(q, kv, swa, lens, sink, cos, sin, cmp_kv=cmp_kv, cmp_rows=cmp_rows,
                                         cmp_block_table=table, req=np.zeros(T, np.int32), cfg=cfg, nm=nm,
                                         chunk=chunk)
    whole = run(T)
    assert np.isfinite(whole).all() and np.abs(whole).max() > 0
    for chunk in (1, 7, None):
        # bitwise in both modes: each token's score and value products are its own GEMMs (batched
        # over tokens), the same shape in any chunk, so a chunk changes no GEMM a token goes through
        assert np.array_equal(run(chunk), whole)


def _combine_tiles_generic(m, l_t, o_raw, any_t, sink):
    """attend's tile combination as written for every namespace."""
    o_t = o_raw.transpose(0, 2, 1, 3)
    has = np.any(any_t, axis=-1)
    M = np.max(np.where(any_t, m, -np.inf), axis=-1)
    M = np.where(has, M, 0.0)
    a = np.where(any_t, np.exp(m - M[..., None]), 0.0)
    o = np.sum(a[..., None] * o_t, axis=2)
    den = np.sum(a * l_t, axis=2) + np.exp(sink[None, :] - M)
    return np.where(has[..., None], o / den[..., None], 0.0)


@settings(max_examples=40)
@given(t=st.integers(1, 12), nt=st.sampled_from([1, 2, 3, 5, 9]), empty=st.floats(0.0, 0.6),
       seed=st.integers(0, 2 ** 16))
@example(t=5, nt=3, empty=0.0, seed=1)        # every tile valid: the path that skips the masks
@example(t=12, nt=9, empty=0.0, seed=2)
def test_tile_combination_gives_the_generic_bits(t, nt, empty, seed):
    """Tiles with no valid candidate (m = the masking value) and rows with none at all included;
    9 tiles: the denominator's sum over tiles is pairwise there, as in the generic code; -0 and +0
    terms in the output sums."""
    rng = np.random.default_rng(seed)
    H, HD = 8, 16
    any_t = rng.random((t, 1, nt)) >= empty
    m = np.where(any_t, rng.standard_normal((t, H, nt)) * 4, -1e20)
    l_t = np.where(any_t, rng.uniform(1, 50, (t, H, nt)), 0.0)
    o_raw = rng.standard_normal((t, nt, H, HD)) * (rng.random((t, nt, 1, 1)) < 0.9)
    o_raw[0, :, 0, 0] = -0.0
    sink = rng.standard_normal(H)
    got = _combine_tiles_np(m, l_t, o_raw, any_t, sink)
    want = _combine_tiles_generic(m, l_t, o_raw, any_t, sink)
    assert got.shape == want.shape and np.array_equal(got.view(np.int64), want.view(np.int64))


@settings(max_examples=30)
@given(mode=st.sampled_from(["device", "exact", "official"]), t=st.integers(1, 9), heads=st.sampled_from([0, 1, 3]),
       inverse=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_rope_tail_rounded_once_gives_the_bits_of_rounding_twice(mode, t, heads, inverse, seed):
    """bf16(rope_tail(x)) rounds the rotated part twice; rope_tail_bf16 once (values on and
    halfway between bf16 neighbours included)."""
    nm, rng, R, HD = Numerics(mode), np.random.default_rng(seed), 16, 48
    shape = (t, HD) if heads == 0 else (t, heads, HD)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape))
    x.reshape(-1)[::5] = x.reshape(-1)[::5].astype(np.float32).astype(BF16).astype(np.float64) * (1 + 2.0 ** -9)
    cos, sin = np.cos(rng.uniform(0, 6, (t, R))), np.sin(rng.uniform(0, 6, (t, R)))
    if heads:
        cos, sin = cos[:, None, :], sin[:, None, :]
    got = rope_tail_bf16(x, cos, sin, nm, inverse=inverse)
    want = nm.bf16(rope_tail(x, cos, sin, nm, inverse=inverse))
    assert np.array_equal(got.view(np.int64), want.view(np.int64))


def _attend_qk_reference(q, K, valid, sink, *, cfg, nm):
    """attend's device-mode steps as written for every namespace, with the scores as the plain
    q K^T GEMM (attend's NumPy device path computes them as (K q^T)^T)."""
    T, N, HD = K.shape
    nt = N // TILE
    s = np.asarray(q, np.float64) @ K.transpose(0, 2, 1)                    # [T, H, N]
    v = valid.reshape(T, 1, nt, TILE)
    s = np.where(v, (s * cfg.softmax_scale).reshape(T, -1, nt, TILE), NEG_INF_ATTN)
    m = np.max(s, axis=-1)
    e = np.where(v, np.exp(s - m[..., None]), 0.0)
    l_t = np.sum(e, axis=-1)
    pt = np.ascontiguousarray(nm.bf16(e).transpose(0, 2, 1, 3))
    o_raw = nm.mm(pt, K.reshape(T, nt, TILE, HD))
    return _combine_tiles_generic(m, l_t, o_raw, np.any(v, axis=-1), nm.asf(sink))


def test_device_scores_orientation_gives_the_same_bits():
    """attend in device mode scores as (K q^T)^T; on bf16 values it gives the bits of the q K^T
    GEMM (the reference), masked rows and an all-masked tile included."""
    cfg, nm = SMALL, DEVICE
    rng = np.random.default_rng(5)
    bf = lambda a: a.astype(np.float32).astype(BF16).astype(np.float64)
    H, HD = cfg.num_attention_heads, cfg.head_dim
    for T, n in ((6, 128), (6, 256), (3, 640)):
        q, K = bf(rng.standard_normal((T, H, HD))), bf(rng.standard_normal((T, n, HD)))
        valid = rng.random((T, n)) < 0.8
        valid[0, :TILE] = False                                 # one tile with no candidate
        sink = rng.standard_normal(H).astype(np.float32)
        got = attend(q, K, valid, sink, cfg=cfg, nm=nm)
        want = _attend_qk_reference(q, K, valid, sink, cfg=cfg, nm=nm)
        assert np.isfinite(got).all() and np.abs(got).max() > 0
        assert np.array_equal(np.asarray(got, np.float64).view(np.int64), want.view(np.int64)), n


def test_retain_heap_names_bad_thresholds():
    with pytest.raises(AbiError, match="mmap_mib=0"):
        retain_heap(0)
    with pytest.raises(AbiError, match="trim_mib=4"):
        retain_heap(8, 4)
    got = retain_heap()
    want = {"mmap_threshold_mib": 32, "trim_threshold_mib": 64}
    if platform.libc_ver()[0] == "glibc":       # mallopt is there: the settings must be applied
        assert got == want
    else:
        assert got is None or got == want


@settings(max_examples=15)
@given(lo=st.integers(0, 10), n=st.integers(1, 10), cmp=st.sampled_from([0, 1, 40]), seed=st.integers(0, 2 ** 16))
def test_a_chunk_gathers_the_same_candidates_from_precomputed_slots(lo, n, cmp, seed):
    rng = np.random.default_rng(seed)
    T, HD, pages, rpp = 20, 16, 8, 32
    hi = min(T, lo + n)
    kv = rng.standard_normal((pages, rpp, 1, HD)).astype(np.float32).astype(BF16)
    cmp_kv = rng.standard_normal((4, 16, 1, HD)).astype(np.float32).astype(BF16)
    swa = rng.integers(-1, pages * rpp, (T, 130)).astype(np.int32)
    lens = rng.integers(0, 131, T).astype(np.int32)
    rows = np.where(rng.random((T, cmp)) < 0.8, rng.integers(0, 70, (T, cmp)), -1).astype(np.int32)
    table, req = np.array([[2, 0, 3, -1], [1, -1, 0, 2]], np.int32), rng.integers(0, 2, T).astype(np.int32)
    kw = dict(cmp_kv=cmp_kv, cmp_rows=rows, cmp_block_table=table, req=req) if cmp else {}
    slots = candidate_slots(swa, lens, nm=DEVICE, **kw)
    own = candidate_slots(swa[lo:hi], lens[lo:hi], nm=DEVICE,
                          **{k: (v[lo:hi] if k in ("cmp_rows", "req") else v) for k, v in kw.items()})
    want = gather_candidates(kv, own, cmp_kv=kw.get("cmp_kv"), nm=DEVICE)
    got = gather_candidates(kv, tuple(None if a is None else a[lo:hi] for a in slots), cmp_kv=kw.get("cmp_kv"),
                            nm=DEVICE)
    for g, w in zip(got, want):
        assert g.shape == w.shape and np.array_equal(g, w)
    # an independent per-row reference of the addresses: window entry j of row t is read when
    # j < lens[t] and its ori slot is >= 0; compressed row c through req[t]'s block table (page
    # c // rows-per-page mapped, slot = entry * rows-per-page + c % rows-per-page); each part padded to
    # whole tiles of 128 columns, never valid
    Wp = -(-swa.shape[1] // 128) * 128
    n_pad = -(-cmp // 128) * 128 if cmp else 0
    K_ref, v_ref = np.zeros((hi - lo, Wp + n_pad, HD)), np.zeros((hi - lo, Wp + n_pad), bool)
    kv_rows, cmp_rows_flat, crpp = kv.reshape(-1, HD), cmp_kv.reshape(-1, HD), cmp_kv.shape[1]
    for i, t in enumerate(range(lo, hi)):
        for j in range(min(int(lens[t]), swa.shape[1])):
            if swa[t, j] >= 0:
                K_ref[i, j], v_ref[i, j] = kv_rows[swa[t, j]], True
        for j in range(cmp):
            c = int(rows[t, j])
            if c < 0 or c // crpp >= table.shape[1] or table[req[t], c // crpp] < 0:
                continue
            K_ref[i, Wp + j] = cmp_rows_flat[table[req[t], c // crpp] * crpp + c % crpp]
            v_ref[i, Wp + j] = True
    K, valid = got
    assert K.shape == K_ref.shape and np.array_equal(valid, v_ref)
    assert np.array_equal(K[valid], K_ref[valid])


def _set_rows_reference(pool, slots, rows):
    flat = pool.reshape(pool.shape[0] * pool.shape[1], -1).copy()
    rows = np.asarray(rows).astype(pool.dtype).reshape(-1, flat.shape[1])
    for s, r in zip(slots, rows):
        if s >= 0:
            flat[s] = r
    return flat.reshape(pool.shape)


@settings(max_examples=20)
@given(unmapped=st.booleans(), n=st.integers(0, 12), dtype=st.sampled_from(["f32", "bf16", "i8"]),
       seed=st.integers(0, 2 ** 16))
def test_set_rows_writes_each_mapped_row_and_leaves_the_input(unmapped, n, dtype, seed):
    rng = np.random.default_rng(seed)
    dt = {"f32": np.float32, "bf16": BF16, "i8": np.int8}[dtype]
    pool = rng.integers(-100, 100, (4, 8, 1, 6)).astype(dt)
    before = pool.copy()
    slots = rng.permutation(32)[:n]
    if unmapped and n:
        slots[rng.random(n) < 0.5] = -1
    rows = rng.integers(-100, 100, (n, 6)).astype(np.float64)      # f64 values, stored as the pool's dtype
    got = DEVICE.set_rows(pool, slots, rows)
    assert got.dtype == pool.dtype and np.array_equal(got, _set_rows_reference(pool, slots, rows))
    assert np.array_equal(pool, before)


def test_grouped_routed_experts_with_routes_outside_every_expert(small_ckpt):
    """Routes whose index names no expert (not produced by the gate, but the grouped path's
    fallback) add nothing; the rest as one swiglu call per expert."""
    cfg, nm, layer = SMALL, Numerics("device"), 4
    w, expert = small_ckpt.layer(layer), (lambda e: small_ckpt.expert(layer, e))
    rng = np.random.default_rng(11)
    T, K = 24, cfg.num_experts_per_tok
    x_i8 = rng.integers(-127, 128, (T, cfg.hidden_size)).astype(np.float64)
    x_scale = rng.uniform(1e-3, 1e-2, (T, 1))
    idx = np.stack([rng.choice(cfg.n_routed_experts, K, replace=False) for _ in range(T)]).astype(np.int32)
    idx[rng.random((T, K)) < 0.2] = -1
    wts = rng.uniform(0.1, 1.0, (T, K))
    _check_against_one_call_per_expert(x_i8, x_scale, idx, wts, expert, {k: w[k] for k in SHARED_NAMES}, cfg, nm)


def _contiguous_reference(pos, req, first_pos):
    """The per-request rule: one block of rows, at first_pos, one position per row."""
    for b in np.unique(req):
        rows = np.nonzero(req == b)[0]
        if np.any(np.diff(rows) != 1) or np.any(np.diff(pos[rows]) != 1) or pos[rows[0]] != first_pos[b]:
            return False
    return True


@settings(max_examples=60)
@given(lens=st.lists(st.integers(1, 6), min_size=0, max_size=6), shuffle=st.booleans(), bump=st.integers(-1, 30),
       seed=st.integers(0, 2 ** 16))
def test_contiguity_check_accepts_exactly_what_the_per_request_rule_accepts(lens, shuffle, bump, seed):
    from types import SimpleNamespace
    from golden.compose import _check_contiguous
    rng = np.random.default_rng(seed)
    first = rng.integers(0, 50, max(len(lens), 1)).astype(np.int32)
    req = np.repeat(np.arange(len(lens)), lens).astype(np.int32)
    pos = np.concatenate([first[b] + np.arange(n) for b, n in enumerate(lens)] or [np.zeros(0)]).astype(np.int32)
    if shuffle and req.size > 1:                       # rows out of order (a request split into blocks)
        perm = rng.permutation(req.size)
        req, pos = req[perm], pos[perm]
    if 0 <= bump < req.size:                           # one position off
        pos[bump] += 1
    meta = SimpleNamespace(position_ids=pos, req=req, first_pos=first)
    ok = _contiguous_reference(pos, req, first)
    if ok:
        _check_contiguous(meta)
    else:
        with pytest.raises(AbiError, match="consecutive rows"):
            _check_contiguous(meta)


@pytest.mark.parametrize("mode", ["device", "exact"])
def test_o_proj_low_rank_per_group_equals_the_batched_product(mode):
    """o_proj's wo_a product, one group's weight widened at a time, gives the batched product's bits:
    each group's GEMM is the same BLAS call on the same strided views the batched matmul makes per
    batch element (in exact mode too, where the products round)."""
    from golden.kernels.o_proj import _low_rank, pack_groups
    cfg, nm = SMALL, Numerics(mode)
    rng = np.random.default_rng(11)
    o = nm.bf16(rng.standard_normal((13, cfg.num_attention_heads, cfg.head_dim)))
    wo_a = rng.standard_normal((cfg.o_groups, cfg.o_lora_rank, cfg.o_group_in)).astype(np.float32).astype(BF16)
    packed = pack_groups(o, cfg=cfg)
    got = _low_rank(packed, wo_a, nm)
    assert cfg.o_groups >= 2 and got.shape == (cfg.o_groups, 13, cfg.o_lora_rank)
    assert np.array_equal(got, nm.asf(packed) @ nm.asf(wo_a).transpose(0, 2, 1))


@pytest.mark.parametrize("mode", ["device", "exact", "official"])
def test_query_heads_in_row_chunks_equal_one_pass(small_ckpt, mode, monkeypatch):
    """qkv_proj_rope's per-row query steps (dequantize, per-head RMS, RoPE tail) give the same bits
    over chunks of 1 and 3 rows as in one pass over all rows."""
    from golden.compose import rope_inputs
    from golden.kernels import qkv_proj_rope as k6
    cfg, nm, T = SMALL, Numerics(mode), 7
    w = small_ckpt.layer(2)
    x = nm.bf16(np.random.default_rng(4).standard_normal((T, cfg.hidden_size)))
    cos, sin = rope_inputs(cfg, np.arange(100, 100 + T), nm)["compressed"]
    args = (x, w["wq_a"], w["wq_b"], w["wq_b_scale"], w["wkv"], w["gamma_cq"], w["gamma_ckv"], cos, sin)
    whole = k6.qkv_proj_rope(*args, cfg=cfg, nm=nm)
    for rows in (1, 3):
        monkeypatch.setattr(k6, "CHUNK_BYTES", rows * 8 * cfg.num_attention_heads * cfg.head_dim)
        got = k6.qkv_proj_rope(*args, cfg=cfg, nm=nm)
        assert all(np.array_equal(a, b) for a, b in zip(got, whole))
