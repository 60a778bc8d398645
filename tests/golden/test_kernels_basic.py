"""Embedding, RMSNorm, RoPE, hyper-connections, LM head: each against an independent formulation."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from golden.kernels.embedding import lookup_embedding
from golden.kernels.hyper_connections import hc_head, hc_post, hc_pre, sinkhorn
from golden.kernels.lm_head import greedy_sample, lm_head, sampled_ids_pad
from golden.kernels.rmsnorm import rms_norm
from golden.kernels.rope import COMPRESS_PROFILE, SWA_PROFILE, inv_freq, rope_rotate, rope_rows
from twin.abi.rope import yarn_range
from golden_testlib import DEVICE, EXACT, rel
from twin.abi.errors import AbiError
from twin.abi.presets import SMALL, TINY

RNG = np.random.default_rng(0)


def test_embedding_replicates_rows_and_rejects_bad_ids(tiny_ckpt):
    emb = tiny_ckpt.model()["embed_weight"]
    h, x_hc = lookup_embedding(np.array([3, 0, 3]), emb, cfg=TINY, nm=DEVICE)
    assert np.array_equal(h[0], np.asarray(emb[3], np.float64)) and np.array_equal(h[0], h[2])
    assert x_hc.shape == (3, 4, TINY.hidden_size) and np.all(x_hc == h[:, None, :])
    with pytest.raises(AbiError, match="input_ids=1616"):
        lookup_embedding(np.array([1616]), emb, cfg=TINY, nm=DEVICE)


def test_rms_norm_one_rounding_at_the_end():
    x = DEVICE.bf16(RNG.standard_normal((4, 64)))
    w = DEVICE.bf16(1 + 0.1 * RNG.standard_normal(64))
    ref = np.array([[v * w[j] / np.sqrt(np.mean(row ** 2) + 1e-6) for j, v in enumerate(row)] for row in x])
    assert rel(rms_norm(x, w, cfg=TINY, nm=EXACT), ref) < 1e-13
    y = rms_norm(x, w, cfg=TINY, nm=DEVICE)
    assert np.array_equal(y, DEVICE.bf16(ref)) or rel(y, ref) < 2 ** -8


def test_yarn_range_of_flash_matches_the_contract():
    assert yarn_range(64, 160000, 65536, 32, 1) == (15, 25)


def test_rope_tables_layout_and_profiles():
    pos = np.array([0, 1, 77, 16000])
    c, s = rope_rows(SMALL, SWA_PROFILE, pos, EXACT)
    R = SMALL.qk_rope_head_dim
    assert c.shape == (4, R) and np.array_equal(c[:, : R // 2], c[:, R // 2:])
    np.testing.assert_allclose(c[:, : R // 2], np.cos(pos[:, None] * 10000.0 ** (-np.arange(0, R, 2) / R)), atol=1e-12)
    f_swa, f_cmp = inv_freq(SMALL, SWA_PROFILE), inv_freq(SMALL, COMPRESS_PROFILE)
    base = 160000.0 ** (-np.arange(0, R, 2) / R)
    assert np.isclose(f_cmp[0], base[0]) and np.isclose(f_cmp[-1], base[-1] / 16)   # YaRN: fast kept, slow / 16
    assert not np.allclose(f_swa, f_cmp)
    cd, _ = rope_rows(SMALL, SWA_PROFILE, pos, DEVICE)
    assert np.array_equal(cd, DEVICE.bf16(cd)) and np.abs(cd - c).max() < 2 ** -8


@settings(max_examples=30)
@given(st.integers(0, 100000), st.integers(0, 100000))
def test_rope_is_a_rotation_by_relative_position(p1, p2):
    R = 16
    rng = np.random.default_rng(p1 ^ p2)
    q, k = rng.standard_normal(R), rng.standard_normal(R)
    c1, s1 = rope_rows(TINY, COMPRESS_PROFILE, np.array([p1]), EXACT)
    c2, s2 = rope_rows(TINY, COMPRESS_PROFILE, np.array([p2]), EXACT)
    rq, rk = rope_rotate(q[None], c1, s1, EXACT)[0], rope_rotate(k[None], c2, s2, EXACT)[0]
    # complex formulation: pairs (e, o) as e + i o multiplied by exp(i p f)
    f = inv_freq(TINY, COMPRESS_PROFILE)
    zq = (q[0::2] + 1j * q[1::2]) * np.exp(1j * p1 * f)
    assert np.allclose(rq[0::2], zq.real, atol=1e-9) and np.allclose(rq[1::2], zq.imag, atol=1e-9)
    # <rot(q, p1), rot(k, p2)> depends only on p1 - p2; inverse undoes forward
    c0, s0 = rope_rows(TINY, COMPRESS_PROFILE, np.array([p1 - p2 if p1 >= p2 else 0]), EXACT)
    if p1 >= p2:
        assert np.isclose(rq @ rk, rope_rotate(q[None], c0, s0, EXACT)[0] @ k, atol=1e-6)
    assert np.allclose(rope_rotate(rq[None], c1, s1, EXACT, inverse=True)[0], q, atol=1e-12)


def _hc_params(cfg, rng):
    mix, hcd = cfg.mix_hc, cfg.hc_dim
    return (rng.standard_normal((mix, hcd)) / np.sqrt(hcd), rng.uniform(0.5, 1.5, 3), 0.5 * rng.standard_normal(mix))


def test_sinkhorn_is_close_to_doubly_stochastic():
    c = sinkhorn(RNG.standard_normal((5, 4, 4)) * 3, 20, 1e-6, EXACT)
    assert np.abs(c.sum(-1) - 1).max() < 2e-2 and np.abs(c.sum(-2) - 1).max() < 1e-5 and np.all(c > 0)


def test_hc_pre_against_a_per_token_loop(nm):
    cfg = TINY
    fn, sc, base = _hc_params(cfg, RNG)
    x = RNG.standard_normal((3, 4, cfg.hidden_size))
    xm, post, comb = hc_pre(x, fn, sc, base, cfg=cfg, nm=nm)
    for t in range(3):
        flat = x[t].reshape(-1)
        m = (fn @ flat) / np.sqrt(np.mean(flat ** 2) + 1e-6)
        pre = 1 / (1 + np.exp(-(m[:4] * sc[0] + base[:4]))) + 1e-6
        ps = 2 / (1 + np.exp(-(m[4:8] * sc[1] + base[4:8])))
        C = (m[8:] * sc[2] + base[8:]).reshape(4, 4)
        C = np.exp(C) / np.exp(C).sum(1, keepdims=True) + 1e-6
        C = C / (C.sum(0, keepdims=True) + 1e-6)
        for _ in range(19):
            C = C / (C.sum(1, keepdims=True) + 1e-6)
            C = C / (C.sum(0, keepdims=True) + 1e-6)
        tol = 1e-12 if nm is EXACT or nm.exact else 2 ** -8
        assert rel(xm[t], sum(pre[i] * x[t, i] for i in range(4))) < tol
        assert rel(post[t], ps) < max(tol, 1e-6) and rel(comb[t].reshape(4, 4), C) < max(tol, 1e-6)


def test_hc_post_and_head_against_loops(nm):
    cfg = TINY
    D = cfg.hidden_size
    x, res = nm.bf16(RNG.standard_normal((2, D))), RNG.standard_normal((2, 4, D))
    post, comb = RNG.uniform(0, 2, (2, 4)), RNG.uniform(0, 1, (2, 16))
    y = hc_post(x, res, post, comb, cfg=cfg, nm=nm)
    for t in range(2):
        for j in range(4):
            ref = post[t, j] * x[t] + sum(comb[t, 4 * i + j] * res[t, i] for i in range(4))
            assert rel(y[t, j], ref) < (1e-13 if nm.exact else 1e-6)
    fn, sc, base = RNG.standard_normal((4, 4 * D)) / np.sqrt(4 * D), np.array([0.7]), RNG.standard_normal(4)
    h = hc_head(res, fn, sc, base, cfg=cfg, nm=nm)
    for t in range(2):
        flat = res[t].reshape(-1)
        pre = 1 / (1 + np.exp(-((fn @ flat) / np.sqrt(np.mean(flat ** 2) + 1e-6) * 0.7 + base))) + 1e-6
        assert rel(h[t], pre @ res[t]) < (1e-13 if nm.exact else 2 ** -8)


def test_lm_head_rows_and_first_maximum():
    W = DEVICE.bf16(RNG.standard_normal((12, 8)))
    h = DEVICE.bf16(RNG.standard_normal((3, 8)))
    logits = lm_head(h, W, np.array([2, -1, 7, 0]), nm=DEVICE)
    assert np.all(logits[1] == 0)
    np.testing.assert_allclose(logits[2], h[2] @ W.T, rtol=1e-6)        # src clamps to T-1
    np.testing.assert_allclose(logits[3], h[0] @ W.T, rtol=1e-6)
    tie = np.array([[1.0, 3.0, 3.0, -1.0], [5.0, 5.0, 5.0, 5.0]])
    ids = greedy_sample(tie, nm=DEVICE)
    assert ids.tolist() == [1, 0]
    assert greedy_sample(tie, nm=DEVICE, active=np.array([True, False])).tolist() == [1, -1]
    assert sampled_ids_pad(ids, nm=DEVICE).tolist() == [[1] + [0] * 7, [0] * 8]
