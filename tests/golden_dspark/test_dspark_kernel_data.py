"""The drafter kernels (K22-K26) in device numerics against pypto-lib's own goldens, recorded at the
TINY shape by record_kernel_data.py (inputs drawn there, outputs written by pypto-lib's golden_*).

Where both sides do the same f32 arithmetic in a different summation order, a bf16 output may land
one rounding step apart: those comparisons allow one bf16 ulp on a small share of the elements and
nothing more.  Integer outputs (draft ids) and pure copies (cache rows, embeddings) are exact."""
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


def test_rope_rows_are_pypto_libs_ratio0_table():
    """The ratio-0 table (theta 1e4, no YaRN) is pypto-lib's up to its angle rounding: pypto-lib takes the
    inverse frequencies in f32, golden rounds f64 ones to f32, so an f32 angle pos * f may sit one or two
    f32 steps off; cos / sin move by at most that much, plus one bf16 rounding step."""
    from golden.kernels.rope import inv_freq
    r = kernel("rope")
    c, s = rope_rows(TINY, SWA_PROFILE, r["positions"], NM)
    f = inv_freq(TINY, SWA_PROFILE).astype(np.float32)
    angle = np.concatenate([np.outer(r["positions"].astype(np.float32), f)] * 2, axis=-1)
    for got, want in ((c, r["cos"]), (s, r["sin"])):
        got, want = np.asarray(got, np.float64), want.astype(np.float64)
        tol = bf16_ulp(np.maximum(np.abs(got), np.abs(want))) + 2 * np.spacing(angle)
        assert np.all(np.abs(got - want) <= tol)
        assert np.mean(got != want) <= 0.01


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

