"""The JAX path equals the NumPy reference: the whole decode step (jit per layer kind), and the
per-request kernels (grouped attention, expert-block MoE, host layout) on inputs that stress what
the regrouping changes: unequal request lengths, empty requests, several window and compressed
tiles, unmapped compressed pages, skewed routing."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from golden.compose import Session, Taps, forward
from golden.jax_kernels import layout, moe_blocks, sparse_attention_grouped
from golden.jax_path import JaxGolden
from golden.kernels.moe import moe_combine, moe_experts
from golden.kernels.rope import SWA_PROFILE, rope_rows
from golden.kernels.sparse_attention import TILE, sparse_attention
from golden.numerics import BF16, Numerics
from golden.paged import DECODE, PREFILL, Span, assign_blocks, lower, window_indices
from golden_testlib import rel
from jax_decode import OPT0
from jax_parity_lib import assert_fp32_parity
from twin.abi.errors import AbiError
from twin.abi.presets import TINY


TAPS = ("ffn_x_mixed", "moe_indices")


def _decode_case(ckpt, mode):
    cfg = TINY
    rng = np.random.default_rng(4)
    s = Session(ckpt, cfg, mode, 2, 160, seed=2)
    ids = rng.integers(0, cfg.vocab_size, 140)
    s.run({0: ids[:130], 1: ids[:123]})               # both requests resident; decode crosses boundaries
    metas = [lower(cfg, [Span(0, 130, tuple(ids[130:138]), s.blocks[0]),
                         Span(1, 123, tuple(ids[123:131]), s.blocks[1])], form=DECODE),
             lower(cfg, [Span(0, 138, tuple(ids[:8]), s.blocks[0]), Span(1, 131, tuple(ids[8:16]), s.blocks[1])],
                   form=DECODE)]
    return s, metas


def test_jax_decode_fp32_matches_numpy_tie_aware(tiny_ckpt):
    """Device mode accumulates in FP32 on JAX: two decode steps (the second on the first's donated
    pools, no recompile) equal NumPy's float64-carry step within kernel-math's full-forward
    tolerances, every routing swap at a near tie; the step computes nothing in float64."""
    cfg = TINY
    s, (meta, meta2) = _decode_case(tiny_ckpt, "device")
    jg = JaxGolden(tiny_ckpt, cfg, "device", compiler_options=OPT0)
    ref = forward(tiny_ckpt, meta, s.caches, cfg=cfg, nm=s.nm, taps=Taps(TAPS))
    kept = {k: v.copy() for k, v in s.caches[2].items()}
    out = jg.forward(meta, s.caches, donate=True, taps=TAPS)
    assert all(np.array_equal(s.caches[2][k], v) for k, v in kept.items())     # NumPy pools untouched
    assert np.asarray(out.logits).dtype == np.float32
    swaps, rows = assert_fp32_parity(out, ref, meta, tiny_ckpt, cfg)
    assert rows.size >= meta.T // 2
    # layer 0 pools depend on the embedding alone: equal up to one BF16 / FP32 rounding flip
    for name, pool in ref.caches[0].items():
        got, want = np.asarray(out.caches[0][name], np.float64), np.asarray(pool, np.float64)
        assert np.all(np.abs(got - want) <= 2 ** -7 * np.abs(want) + 1e-6), name
    assert jg.static_extents(meta2) == jg.static_extents(meta)
    compiled = len(jg._fns)
    ref2 = forward(tiny_ckpt, meta2, ref.caches, cfg=cfg, nm=s.nm, taps=Taps(TAPS))
    kv = out.caches[2].raw["kv_cache"]                # bf16 pools travel as their uint16 bits
    assert kv.dtype == np.uint16 and out.caches[2]["kv_cache"].dtype == BF16
    out2 = jg.forward(meta2, out.caches, donate=True, taps=TAPS)
    assert kv.is_deleted()                           # donated: written in place, not copied
    assert len(jg._fns) == compiled                  # same extents bucket: no recompile
    assert_fp32_parity(out2, ref2, meta2, tiny_ckpt, cfg)
    # no float64 anywhere in the compiled step (integers are 64-bit under enable_x64)
    hlo = jg.stablehlo()
    assert "xf32>" in hlo and not re.search(r"tensor<[0-9x]+xf64>", hlo)   # f64 only as weak scalar literals


def test_jax_decode_exact_equals_numpy(tiny_ckpt):
    cfg = TINY
    s, (meta, _) = _decode_case(tiny_ckpt, "exact")
    ref = forward(tiny_ckpt, meta, s.caches, cfg=cfg, nm=s.nm)
    out = JaxGolden(tiny_ckpt, cfg, "exact", compiler_options=OPT0).forward(meta, s.caches)
    assert np.asarray(out.logits).dtype == np.float64
    assert rel(np.asarray(out.logits), ref.logits) <= 1e-12
    assert np.array_equal(np.asarray(out.sampled), ref.sampled)
    for layer in (0, 2, 3):
        for name, pool in ref.caches[layer].items():
            assert rel(np.asarray(out.caches[layer][name]), pool) <= 1e-12, (layer, name)


def test_jax_long_packed_and_chunked_prefill_tie_aware(tiny_ckpt):
    """Two requests x 256 tokens packed in one prefill, then their next 256 as a chunk against the
    resident prefix (both sides start each call from NumPy's pools; one compiled step serves both
    calls through pinned extents).

    What is true (measured): FP32 vs float64 carry differ by INT8 rounding flips from layer 0 on
    (one INT8 step is ~0.8 % of a row's max), which move router scores by ~1e-2; a long prefill
    crosses many expert near ties at that distance, so routing swaps appear within the first
    tokens of each request and cascade through the rest of it.  The test asserts that every swap
    sits at a near tie, and that every row before its request's first swap agrees within
    kernel-math's tolerances with NumPy's greedy id (near ties aside)."""
    cfg = TINY
    rng = np.random.default_rng(7)
    s = Session(tiny_ckpt, cfg, "device", 2, 512, seed=3)
    ids = rng.integers(0, cfg.vocab_size, (2, 512))
    jg = JaxGolden(tiny_ckpt, cfg, "device", compiler_options=OPT0)
    for lo in (0, 256):
        spans = [Span(r, lo, tuple(ids[r, lo:lo + 256]), s.blocks[r]) for r in range(2)]
        meta = lower(cfg, spans, form=PREFILL, logits="all")
        ref = forward(tiny_ckpt, meta, s.caches, cfg=cfg, nm=s.nm, taps=Taps(TAPS))
        out = jg.forward(meta, s.caches, donate=True, taps=TAPS, extents=(128, 4))
        swaps, rows = assert_fp32_parity(out, ref, meta, tiny_ckpt, cfg)
        assert swaps and rows.size >= 2              # swaps happen; each request's first row is clean
        s.caches = ref.caches
    assert len(jg._fns) == 1                         # one compiled step for both calls
    with pytest.raises(AbiError, match="extents"):
        jg.forward(meta, s.caches, extents=(16, 0))


def _spans(cfg, runs, max_len=640, seed=0):
    """runs: {request: (start, n)}; requests not named get no tokens (an empty grid row)."""
    blocks, pages = assign_blocks(cfg, max(runs) + 1, max_len, rng=np.random.default_rng(seed))
    rng = np.random.default_rng(seed + 1)
    spans = [Span(r, a, tuple(rng.integers(0, cfg.vocab_size, n)), blocks[r]) for r, (a, n) in sorted(runs.items())]
    return spans, pages


@settings(max_examples=30)
@given(st.dictionaries(st.integers(0, 4), st.tuples(st.integers(0, 400), st.integers(1, 12)), min_size=1, max_size=4),
       st.sampled_from([128, 192]), st.sampled_from([4, 64]))
def test_layout_places_every_window_entry_and_boundary(runs, W, group):
    cfg = TINY
    spans, _ = _spans(cfg, runs)
    meta = lower(cfg, spans, form=PREFILL)
    if W != cfg.sliding_window:       # DSpark draft layers read a wider window
        ori = meta.tables["ori_block_table"]
        win = [window_indices(meta.position_ids[t:t + 1], ori[meta.req[t]], 128, W) for t in range(meta.T)]
        meta = dataclasses.replace(meta, swa_indices=np.concatenate([a for a, _ in win]),
                                   swa_lens=np.concatenate([b for _, b in win]))
    lay = layout(meta, group=group)
    T, pos, req, grp = meta.T, meta.position_ids, meta.req, lay.grp
    assert np.array_equal(lay.tok[grp, lay.cell], np.arange(T))
    assert (lay.tok == T).sum() == lay.tok.size - T
    assert np.array_equal(lay.grp_req[grp], req) and lay.S <= group
    assert np.all(np.bincount(grp) <= group)
    for t in range(T):
        j = np.nonzero((np.arange(W) < meta.swa_lens[t]) & (meta.swa_indices[t] >= 0))[0]
        cols = np.nonzero(lay.win_tile[grp[t], lay.cell[t]] >= 0)[0]
        assert cols.size == j.size
        assert np.array_equal(lay.win_slot[grp[t], cols], meta.swa_indices[t, j])
        assert np.array_equal(lay.win_tile[grp[t], lay.cell[t], cols], j // TILE)
    assert lay.n_win_tiles == -(-W // TILE)
    # the whole union rows, against a scatter of every valid window entry (nothing else is set)
    jj = np.arange(W)
    valid = (jj[None, :] < meta.swa_lens[:, None]) & (meta.swa_indices >= 0)
    off = np.maximum(pos - W + 1, 0)
    off = off - np.array([off[grp == g].min() for g in range(grp.max() + 1)])[grp]
    tt, jj = np.nonzero(valid)
    slot = np.full(lay.win_slot.shape, -1)
    slot[grp[tt], off[tt] + jj] = meta.swa_indices[tt, jj]
    tile = np.full(lay.win_tile.shape, -1)
    tile[grp[tt], lay.cell[tt], off[tt] + jj] = jj // TILE
    np.testing.assert_array_equal(lay.win_slot, slot)
    np.testing.assert_array_equal(lay.win_tile, tile)
    for ratio in (4, 128):
        b = np.nonzero((pos + 1) % ratio == 0)[0]
        assert lay.sel_ok[ratio].sum() == b.size and np.array_equal(lay.sel[ratio][:b.size], b)


@pytest.mark.parametrize("kind", ["csa", "hca", "swa192"])
def test_grouped_attention_equals_numpy(kind):
    """Requests of 20, 5 (at position 0), none and 1 token; CSA candidates in a shuffled top-k order
    over 200 columns (two compressed tiles) with rows past the mapped pages, the 20-token request
    split into groups of 8; HCA rows 0..n_c-1."""
    cfg, nm = TINY, Numerics("device")
    rng = np.random.default_rng(11)
    spans, pages = _spans(cfg, {0: (150, 20), 1: (0, 5), 3: (300, 1)})
    meta = lower(cfg, spans, form=PREFILL)
    T, H, HD = meta.T, cfg.num_attention_heads, cfg.head_dim
    if kind == "swa192":
        ori = meta.tables["ori_block_table"]
        win = [window_indices(meta.position_ids[t:t + 1], ori[meta.req[t]], 128, 192) for t in range(T)]
        meta = dataclasses.replace(meta, swa_indices=np.concatenate([a for a, _ in win]),
                                   swa_lens=np.concatenate([b for _, b in win]))
    bf = lambda shape: nm.store_bf16(rng.standard_normal(shape))
    q = nm.asf(bf((T, H, HD)))
    kv_cache = bf((pages["ori"], 128, 1, HD))
    sink = rng.standard_normal(H)
    cos, sin = rope_rows(cfg, SWA_PROFILE, meta.position_ids, nm)
    cmp, n_cmp = {}, 0
    if kind == "csa":
        n_cmp, cols = 170, 200                      # cmp_c4 pages cover 160 rows: 160..169 unmapped
        rows = np.stack([np.concatenate([rng.permutation(n_cmp), np.full(cols - n_cmp, -1)]) for _ in range(T)])
        rows = np.where(rng.random(rows.shape) < 0.2, -1, rows).astype(np.int32)
        cmp = dict(cmp_kv=bf((pages["cmp_c4"], 32, 1, HD)), cmp_rows=rows,
                   cmp_block_table=meta.tables["csa_cmp_block_table"])
    elif kind == "hca":
        n_cmp = 3
        n_c = np.minimum((meta.position_ids + 1) // 128, n_cmp)
        rows = np.where(np.arange(n_cmp)[None, :] < n_c[:, None], np.arange(n_cmp)[None, :], -1).astype(np.int32)
        cmp = dict(cmp_kv=bf((pages["cmp_c128"], 1, 1, HD)), cmp_rows=rows,
                   cmp_block_table=meta.tables["hca_cmp_block_table"])
    ref = sparse_attention(q, kv_cache, meta.swa_indices, meta.swa_lens, sink, cos, sin, req=meta.req, cfg=cfg,
                           nm=nm, **cmp)
    lay = layout(meta, group=8 if kind == "csa" else 64)
    with jax.enable_x64(True):
        g = dict({k: jnp.asarray(v) for k, v in lay.arrays().items()}, n_win_tiles=lay.n_win_tiles)
        j = {k: jnp.asarray(v) for k, v in cmp.items()}
        n_win_tiles = g.pop("n_win_tiles")
        fn = jax.jit(lambda q, kv, sink, cos, sin, g, req, j: sparse_attention_grouped(
            q, kv, sink, cos, sin, dict(g, n_win_tiles=n_win_tiles), n_cmp=n_cmp, req=req, cfg=cfg,
            nm=Numerics("device", jnp), **j), compiler_options={"xla_backend_optimization_level": 0})
        got = fn(jnp.asarray(q), jnp.asarray(kv_cache), jnp.asarray(sink), jnp.asarray(cos), jnp.asarray(sin), g,
                 jnp.asarray(meta.req), j)
        got = np.asarray(got)
    assert np.abs(ref).max() > 0
    assert rel(got, ref) <= 1e-6


@pytest.mark.parametrize("mode", ["device", "exact"])
@pytest.mark.parametrize("routing", ["random", "skewed", "repeats"])
def test_moe_blocks_equal_grouped_dispatch(tiny_ckpt, mode, routing):
    """Every route lands in its expert's block: random routing, all routes on two experts (blocks
    of one expert far past the block size), and tokens that pick one expert more than once (a
    route's rank counts its own token's earlier picks)."""
    cfg, layer, T = TINY, 3, 40
    rng = np.random.default_rng(5)
    K, E = cfg.num_experts_per_tok, cfg.n_routed_experts
    x_i8 = rng.integers(-127, 128, (T, cfg.hidden_size)).astype(np.float64)
    x_scale = rng.uniform(1e-3, 1e-2, (T, 1))
    if routing == "random":
        idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    elif routing == "skewed":
        idx = np.tile(np.array([[3, 7]], np.int32), (T, 1))
    else:
        idx = rng.integers(0, 3, (T, K)).astype(np.int32)
    wts = rng.uniform(0.1, 1.0, (T, K))
    w = tiny_ckpt.layer(layer)
    shared = {k: w[k] for k in w if k.startswith("shared_")}
    ref = moe_experts(x_i8, x_scale, idx, wts, lambda e: tiny_ckpt.expert(layer, e), shared, cfg=cfg,
                      nm=Numerics(mode))
    keys = tiny_ckpt.expert(layer, 0).keys()
    with jax.enable_x64(True):
        stacked = {k: jnp.asarray(np.stack([tiny_ckpt.expert(layer, e)[k] for e in range(E)])) for k in keys}
        def blocked(x_i8, x_scale, idx, wts, stacked, shared):      # what jax_moe.moe_sublayer runs
            nm = Numerics(mode, jnp)
            routed, _ = moe_blocks(x_i8, x_scale, idx, wts, stacked, cfg=cfg, nm=nm)
            return moe_combine(routed, x_i8, x_scale, shared, cfg=cfg, nm=nm)
        got = jax.jit(blocked)(
            jnp.asarray(x_i8), jnp.asarray(x_scale), jnp.asarray(idx), jnp.asarray(wts), stacked,
            {k: jnp.asarray(v) for k, v in shared.items()})
        got = np.asarray(got)
    assert rel(got, ref) <= (1e-12 if mode == "exact" else 1e-6)


def test_moe_blocks_layer_axis_and_scratch(tiny_ckpt):
    """The experts of every layer in one [L, E, ...] array, indexed by `layer`, give the layer's
    own result; a scratch buffer's values are never read (NaN in, the same rows out), and the
    buffer comes back for the next layer."""
    cfg, T = TINY, 40
    rng = np.random.default_rng(6)
    K, E, L = cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.num_hidden_layers
    x_i8 = rng.integers(-127, 128, (T, cfg.hidden_size)).astype(np.float64)
    x_scale = rng.uniform(1e-3, 1e-2, (T, 1))
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    wts = rng.uniform(0.1, 1.0, (T, K))
    keys = tiny_ckpt.expert(0, 0).keys()
    nm = Numerics("device", jnp)
    with jax.enable_x64(True):
        per = lambda l: {k: jnp.asarray(np.stack([tiny_ckpt.expert(l, e)[k] for e in range(E)])) for k in keys}
        every = {k: jnp.stack([per(l)[k] for l in range(L)]) for k in keys}
        args = (jnp.asarray(x_i8), jnp.asarray(x_scale), jnp.asarray(idx), jnp.asarray(wts))
        for layer in (0, L - 1):
            want, buf = jax.jit(lambda *a: moe_blocks(*a, cfg=cfg, nm=nm))(*args, per(layer))
            nan = jnp.full(buf.shape, jnp.nan, buf.dtype)
            got, buf2 = jax.jit(lambda *a: moe_blocks(*a[:5], cfg=cfg, nm=nm, layer=layer, scratch=a[5]))(
                *args, every, nan)
            assert buf2.shape == buf.shape
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            assert np.isfinite(np.asarray(got)).all()


@pytest.mark.parametrize("K", [8, 1024, 3000])
@settings(max_examples=3)
@given(M=st.integers(1, 17), seed=st.integers(0, 2**16))
def test_int8_weight_dot_is_the_exact_integer(K, M, seed):
    """Device mode's int8 x int8 -> int32 dot (routed experts kept int8) gives the same f32 as the
    f32 K-slices against the widened weight, and both are the exact integer, also past 2^24
    (extreme operands, K > 1024)."""
    from golden.jax_numerics import Fp32Numerics
    rng = np.random.default_rng(seed)
    a = rng.choice([-127, 127], (M, K)) if seed % 2 else rng.integers(-127, 128, (M, K))
    b = np.where(rng.random((K, 5)) < 0.5, 127, rng.integers(-127, 128, (K, 5))).astype(np.int8)
    nm = Fp32Numerics("device", jnp)
    f = jax.jit(lambda a, b: nm.int_mm(a, b))
    via_int8 = np.asarray(f(jnp.asarray(a, jnp.float32), jnp.asarray(b)))
    via_f32 = np.asarray(f(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)))
    exact = (a.astype(np.int64) @ b.astype(np.int64)).astype(np.float32)
    assert via_int8.dtype == np.float32
    np.testing.assert_array_equal(via_int8, exact)
    np.testing.assert_array_equal(via_f32, exact)
