"""The drafter kernels (K22-K26) in device numerics against pypto-lib's own goldens, recorded at the
TINY shape by record_kernel_data.py (inputs drawn there, outputs written by pypto-lib's golden_*).

Where both sides do the same f32 arithmetic in a different summation order, a bf16 output may land
one rounding step apart: those comparisons allow one bf16 ulp on a small share of the elements and
nothing more.  Integer outputs (draft ids) and pure copies (cache rows, embeddings) are exact."""
import os

import ml_dtypes
import numpy as np

from twin.abi import TINY
from golden.dspark import drafter as D
from golden.dspark.markov import dspark_markov, markov_head
from golden.kernels.qkv_proj_rope import qkv_proj_rope
from golden.kernels.rope import SWA_PROFILE, rope_rows
from golden.numerics import numerics

from kernel_data import kernel, source

NM = numerics("device")


def bf16_ulp(x):
    """The spacing of bf16 values at |x| (8 significant bits)."""
    a = np.maximum(np.abs(np.asarray(x, np.float64)), 2.0 ** -126)
    return 2.0 ** (np.floor(np.log2(a)) - 7)


def assert_bf16_close(got, want, *, max_share: float, scale=None):
    """Every element equal or one bf16 rounding step apart, and the differing share <= max_share.
    scale (broadcastable): where an input was itself rounded to bf16 on both sides (a one-step flip
    there moves the result by up to one bf16 step of that input's magnitude), one more step of it."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    d = np.abs(got - want)
    tol = bf16_ulp(np.maximum(np.abs(got), np.abs(want)))
    if scale is not None:
        tol = tol + bf16_ulp(scale)
    assert np.all(d <= tol), f"max excess {np.max(d / tol):.2f} of the allowed"
    assert np.mean(d > 0) <= max_share, f"{np.mean(d > 0):.4f} of the elements differ"


def recorded_rope(positions):
    r = kernel("rope")
    idx = np.searchsorted(r["positions"], positions)
    assert np.array_equal(r["positions"][idx], positions)
    return r["cos"].astype(np.float32)[idx], r["sin"].astype(np.float32)[idx]


def test_the_data_names_its_source():
    assert source().startswith("hw-native-sys/pypto-lib@")


def bf16_flip_possible(values64, f32_ulps=2):
    """Where a f32 result within `f32_ulps` of the float64 value could round to another bf16 value
    (two libms' f32 cos / sin may differ by an ulp; only there may a bf16 table entry differ)."""
    v = np.asarray(values64, np.float64)
    step = f32_ulps * np.spacing(np.abs(v).astype(np.float32)).astype(np.float64)
    lo, hi = (v - step).astype(np.float32), (v + step).astype(np.float32)
    return lo.astype(ml_dtypes.bfloat16) != hi.astype(ml_dtypes.bfloat16)


def _table_check(positions, profile, want_cos, want_sin):
    """golden's device table against pypto-lib's bf16 one -> (entries that must and do agree, the
    entries where a float64 derivation of the inverse frequencies gives another bf16 value)."""
    from golden.kernels.rope import inv_freq
    pos = np.asarray(positions)
    c, s = (np.asarray(a, np.float64) for a in rope_rows(TINY, profile, pos, NM))
    # the f32 angles of pypto-lib's table (f32 inverse frequencies, f32 products: the same IEEE
    # operations, so the same angles); cos / sin of them may differ by an f32 ulp between libms
    ang = np.concatenate([np.outer(pos.astype(np.float32), inv_freq(TINY, profile, np.float32))] * 2, -1)
    old = np.concatenate([np.outer(pos.astype(np.float32), inv_freq(TINY, profile).astype(np.float32))] * 2, -1)
    distinguishing = np.zeros(ang.shape, bool)
    for got, want, fn in ((c, want_cos, np.cos), (s, want_sin, np.sin)):
        want = np.asarray(want, np.float64)
        ambiguous = bf16_flip_possible(fn(ang.astype(np.float64)))
        assert np.array_equal(got[~ambiguous], want[~ambiguous])
        assert np.mean(ambiguous) < 0.01 and np.all(np.abs(got - want)[ambiguous] <= bf16_ulp(want[ambiguous]))
        via_f64 = fn(old).astype(ml_dtypes.bfloat16).astype(np.float64)
        distinguishing |= (via_f64 != want) & ~ambiguous & ~bf16_flip_possible(fn(old.astype(np.float64)))
    return distinguishing


def test_rope_rows_are_pypto_libs_table():
    """Device mode's ratio-0 table (theta 1e4, no YaRN) is pypto-lib's, inverse frequencies in f32:
    derived in float64 and rounded to f32 instead, cos at position 8196, frequency 3, lands on another
    bf16 value (the two entries, cos and its duplicate column, the data distinguish)."""
    r = kernel("rope")
    distinguishing = _table_check(r["positions"], SWA_PROFILE, r["cos"], r["sin"])
    rows, cols = np.nonzero(distinguishing)
    assert r["positions"][rows].tolist() == [8196, 8196] and cols.tolist() == [3, 11]


def test_compress_rope_rows_are_pypto_libs_yarn_table():
    """The compress profile (theta 160000, YaRN interpolation) against pypto-lib's table as its
    prefill compressor takes it (tests/golden/kernel_data: every position 0..1023)."""
    from golden.kernels.rope import COMPRESS_PROFILE
    path = os.path.join(os.path.dirname(__file__), "..", "golden", "kernel_data", "prefill_compressor_ratio4.npz")
    with np.load(path) as z:
        c, s = (z[f"in.freqs_{k}.bf16"].view(ml_dtypes.bfloat16).astype(np.float32) for k in ("cos", "sin"))
    _table_check(np.arange(c.shape[0]), COMPRESS_PROFILE, c, s)


def test_exact_mode_rope_is_float64():
    """Exact mode keeps the float64 inverse frequencies and angles (no f32 step anywhere)."""
    from golden.kernels.rope import COMPRESS_PROFILE, inv_freq
    pos = np.array([1, 777, 8196, 16383])
    for profile in (SWA_PROFILE, COMPRESS_PROFILE):
        f = inv_freq(TINY, profile)
        assert f.dtype == np.float64 and not np.array_equal(f, f.astype(np.float32).astype(np.float64))
        c, s = rope_rows(TINY, profile, pos, numerics("exact"))
        assert np.array_equal(np.asarray(c)[:, :f.size], np.cos(pos[:, None] * f[None, :]))
        assert np.array_equal(np.asarray(s)[:, f.size:], np.sin(pos[:, None] * f[None, :]))
    # the SWA frequencies are 1 / 1e4^(2i/R): against the closed form, independently
    R = TINY.qk_rope_head_dim
    assert np.allclose(inv_freq(TINY, SWA_PROFILE), [1e4 ** (-2 * i / R) for i in range(R // 2)], rtol=1e-15)


def test_dspark_proj_is_pypto_libs():
    k = kernel("dspark_proj")
    got = D.dspark_proj(k["main_hidden"], k["main_proj_w"], k["main_norm_w"], cfg=TINY, nm=NM)
    assert_bf16_close(got, k["main_x"].astype(np.float32), max_share=0.01)


def test_dspark_context_kv_writes_pypto_libs_rows():
    """Every mapped slot holds pypto-lib's row; the unmapped one (slot -1) and all others keep the cache."""
    k = kernel("dspark_context_kv")
    assert (k["slot_mapping"] < 0).any()
    rows = D.context_kv(k["main_x"], k["wkv"], k["gamma_ckv"], k["position_ids"].astype(np.int64), cfg=TINY, nm=NM)
    pool = D.write_rows(k["kv_cache"].astype(np.float32)[None], 0, k["slot_mapping"], rows, nm=NM)
    want = k["kv_cache_out"].astype(np.float32)
    # a row is the same rmsnorm + RoPE of one small GEMM row: at most one bf16 step apart
    assert_bf16_close(pool[0], want, max_share=0.01)
    untouched = np.ones(want.shape[:2], bool).reshape(-1)
    untouched[k["slot_mapping"][k["slot_mapping"] >= 0]] = False
    assert np.array_equal(pool[0].reshape(-1, want.shape[-1])[untouched],
                          k["kv_cache"].astype(np.float32).reshape(-1, want.shape[-1])[untouched])


def _attention_case():
    """The recorded attention inputs through golden's projections and block-KV commit: (data, pool,
    q [B, 7, H, HD], K [B, W, HD] gathered by swa_indices, cos / sin [B, 7, R])."""
    k = kernel("dspark_attention")
    H, HD = TINY.num_attention_heads, TINY.head_dim
    cos, sin = recorded_rope(k["position_ids"].astype(np.int64))
    q, kv, _, _ = qkv_proj_rope(k["x"], k["wq_a"], k["wq_b"], k["wq_b_scale"], k["wkv"], k["gamma_cq"],
                                k["gamma_ckv"], cos, sin, cfg=TINY, nm=NM)
    pool = D.write_rows(k["kv_cache"].astype(np.float32)[None], 0, k["slot_mapping"], kv, nm=NM)
    ind = k["swa_indices"].astype(np.int64)
    B, W = ind.shape
    K = NM.get_rows(pool[0], ind.reshape(-1)).reshape(B, W, HD)
    return k, pool, np.asarray(q).reshape(B, 7, H, HD), K, cos.reshape(B, 7, -1), sin.reshape(B, 7, -1)


def test_dspark_attention_heads_and_block_kv_are_pypto_libs():
    """Block KV committed before attention, the window + whole block visible (no causal mask), the sink
    in the denominator, inverse RoPE: the heads pypto-lib's golden hands to the o_proj."""
    k, pool, q, K, c, s = _attention_case()
    assert_bf16_close(pool[0], k["kv_cache_out"].astype(np.float32), max_share=0.01)
    ind = k["swa_indices"]
    valid = (np.arange(ind.shape[1])[None, :] < k["swa_lens"][:, None]) & (ind >= 0)
    heads = np.asarray(D.block_heads(q, K, valid, k["attn_sink"], c, s, cfg=TINY, nm=NM))
    want = k["heads"].astype(np.float32)
    # q is rounded to bf16 on both sides before the scores: one step of a head's magnitude
    head_scale = np.max(np.abs(want), axis=-1, keepdims=True)
    assert_bf16_close(heads.reshape(want.shape), want, max_share=0.001, scale=head_scale)


def test_dspark_attention_data_distinguishes_the_block_rules():
    """The recorded heads are not met by a causal block or by attention without the sink."""
    k, _, q, K, c, s = _attention_case()
    B, W = k["swa_indices"].shape
    lens = k["swa_lens"]
    want = k["heads"].astype(np.float32).reshape(q.shape)
    step = 10 * bf16_ulp(np.max(np.abs(want)))
    base = np.arange(W)[None, :] < lens[:, None]
    # causal: block row i sees the block rows up to itself only (the last 7 visible columns are the block)
    for i in (0, 3):
        causal = base & (np.arange(W)[None, :] < (lens - 6 + i)[:, None])
        h = np.asarray(D.block_heads(q[:, i:i + 1], K, causal, k["attn_sink"], c[:, i:i + 1], s[:, i:i + 1],
                                     cfg=TINY, nm=NM))
        assert np.max(np.abs(h - want[:, i:i + 1])) > step
    nosink = np.asarray(D.block_heads(q, K, base, np.full(q.shape[2], -1e30, np.float32), c, s, cfg=TINY, nm=NM))
    assert np.max(np.abs(nosink - want)) > step


def test_markov_head_is_pypto_libs():
    k = kernel("markov_head")
    e, bias = markov_head(k["token_ids"], k["markov_w1"], k["markov_w2"], nm=NM)
    # the embedding is a row gather: exact
    assert np.array_equal(np.asarray(e), k["markov_embed"].astype(np.float32))
    # bias: an f32 dot of r = 16 bf16 products, summed in another order: a few f32 ulps of the row scale
    scale = np.abs(k["markov_embed"].astype(np.float32)) @ np.abs(k["markov_w2"].astype(np.float32)).T
    assert np.all(np.abs(np.asarray(bias) - k["logits_bias"]) <= 16 * np.finfo(np.float32).eps * scale)


def test_dspark_markov_chain_is_pypto_libs():
    """pypto-lib's own fixture: base logits through the drafter's final norm and the LM head, the
    bigram bias of the previous draft, first-max argmax, seven sequential drafts.  The older golden
    starts every chain at the anchor token (num_sampled = 0 reads next_prefill_tokens)."""
    k = kernel("dspark_markov")
    B, QW, Dm = k["head_hidden"].shape
    r = k["markov_w1"].shape[1]
    cfg = TINY.replace(dspark_markov_rank=r)
    anchor = k["anchor_token_ids"]
    drafts, _ = dspark_markov(k["head_hidden"], k["final_norm_weight"], k["lm_head_weight"], np.zeros(B, np.int32),
                              np.full(B, -1, np.int64), anchor, k["markov_w1"], k["markov_w2"],
                              np.zeros((1, Dm + r), np.float32), cfg=cfg, nm=NM)
    want = k["draft_token_ids"].astype(np.int64)
    assert len(np.unique(want)) > 1 and not np.array_equal(want[:, 0], want[:, 1])   # a chain that alternates
    assert np.array_equal(np.asarray(drafts), want)

