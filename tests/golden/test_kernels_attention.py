"""qkv_proj_rope, sparse attention, o_proj: each against an independent formulation."""
import numpy as np
import pytest

from golden.kernels.o_proj import o_proj, pack_groups
from golden.kernels.qkv_proj_rope import qkv_proj_rope
from golden.kernels.rope import COMPRESS_PROFILE, SWA_PROFILE, inv_freq, rope_rows
from golden.kernels.sparse_attention import csa_rows, hca_rows, sparse_attention
from golden_testlib import DEVICE, EXACT, rel
from twin.abi.presets import SMALL, TINY

RNG = np.random.default_rng(7)


def _complex_rope(x, pos, f, inverse=False):
    """Independent RoPE: interleaved pairs as complex numbers times exp(+-i p f)."""
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp((-1j if inverse else 1j) * pos * f)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


@pytest.mark.parametrize("profile", [SWA_PROFILE, COMPRESS_PROFILE])
def test_qkv_proj_rope_against_per_token_formulation(tiny_ckpt, profile):
    cfg, w = TINY, tiny_ckpt.layer(2)
    T, R, H, HD = 5, cfg.qk_rope_head_dim, cfg.num_attention_heads, cfg.head_dim
    pos = np.array([0, 3, 4, 130, 9000])
    x = DEVICE.bf16(RNG.standard_normal((T, cfg.hidden_size)))
    cos, sin = rope_rows(cfg, profile, pos, EXACT)
    q, kv, qr, qs = qkv_proj_rope(x, w["wq_a"], w["wq_b"], w["wq_b_scale"], w["wkv"], w["gamma_cq"], w["gamma_ckv"],
                                  cos, sin, cfg=cfg, nm=EXACT)
    f = inv_freq(cfg, profile)
    f64 = lambda a: np.asarray(a, np.float64)
    for t in range(T):
        a = x[t] @ f64(w["wq_a"])
        a = a / np.sqrt(np.mean(a * a) + 1e-6) * f64(w["gamma_cq"])
        qf = (a @ (f64(w["wq_b"]) * w["wq_b_scale"])).reshape(H, HD)
        qf = qf / np.sqrt(np.mean(qf * qf, -1, keepdims=True) + 1e-6)
        qf[:, -R:] = _complex_rope(qf[:, -R:], pos[t], f)
        k = x[t] @ f64(w["wkv"])
        k = k / np.sqrt(np.mean(k * k) + 1e-6) * f64(w["gamma_ckv"])
        k[-R:] = _complex_rope(k[-R:], pos[t], f)
        assert rel(q[t], qf) < 1e-12 and rel(kv[t], k) < 1e-12
    # device: bf16 outputs, int8 low-rank query, close to exact within the K6 tolerance
    cd, sd = rope_rows(cfg, profile, pos, DEVICE)
    qd, kvd, qrd, qsd = qkv_proj_rope(x, w["wq_a"], w["wq_b"], w["wq_b_scale"], w["wkv"], w["gamma_cq"],
                                      w["gamma_ckv"], cd, sd, cfg=cfg, nm=DEVICE)
    assert np.array_equal(qd, DEVICE.bf16(qd)) and np.all(np.abs(qrd) <= 127) and np.all(qrd == np.round(qrd))
    assert rel(qd, q) < 0.03 and rel(kvd, kv) < 0.02 and rel(qrd * qsd, qr) < 0.01


def _pool(cfg, n_pages, rows, nm):
    pool = np.zeros((n_pages, rows, 1, cfg.head_dim), np.float64)
    pool[:] = nm.bf16(RNG.standard_normal(pool.shape))
    return pool


def _dense_reference(q, K, sink, pos, f, R, scale):
    """softmax over every candidate with the sink as an extra logit, then inverse RoPE."""
    out = np.zeros(q.shape)
    for t in range(q.shape[0]):
        s = q[t] @ K[t].T * scale                                   # [H, N]
        m = np.maximum(s.max(-1, keepdims=True), sink[:, None])
        p = np.exp(s - m)
        o = (p @ K[t]) / (p.sum(-1, keepdims=True) + np.exp(sink[:, None] - m))
        o[:, -R:] = _complex_rope(o[:, -R:], pos[t], f, inverse=True)
        out[t] = o
    return out


def test_sparse_attention_with_every_index_equals_dense_attention():
    cfg = SMALL
    T, H, HD, R = 6, cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
    ori = _pool(cfg, 8, 32, EXACT)
    cmp = _pool(cfg, 4, 32, EXACT)
    cmp_table = np.array([[2, 0, 3, 1]])
    pos = np.array([5, 100, 127, 40, 90, 126])
    # window: every position 0..p lives in ori slot perm[pos]
    perm = RNG.permutation(8 * 32)
    swa = np.full((T, 128), -1)
    for t, p in enumerate(pos):
        swa[t, : p + 1] = perm[: p + 1]
    lens = pos + 1
    n_cmp = np.array([3, 25, 31, 10, 0, 20])
    cmp_rows = np.full((T, 40), -1)
    for t, n in enumerate(n_cmp):
        cmp_rows[t, :n] = RNG.permutation(n)                        # any order: softmax is a set op
    q = RNG.standard_normal((T, H, HD))
    sink = RNG.standard_normal(H)
    cos, sin = rope_rows(cfg, COMPRESS_PROFILE, pos, EXACT)
    out = sparse_attention(q, ori, swa, lens, sink, cos, sin, cmp_kv=cmp, cmp_rows=cmp_rows,
                           cmp_block_table=cmp_table, req=np.zeros(T, int), cfg=cfg, nm=EXACT)
    flat_o, flat_c = ori.reshape(-1, HD), cmp.reshape(-1, HD)
    phys = lambda c: cmp_table[0, c // 32] * 32 + c % 32
    K = [np.concatenate([flat_o[perm[: p + 1]], flat_c[[phys(c) for c in range(n)]]]) for p, n in zip(pos, n_cmp)]
    ref = _dense_reference(q, K, sink, pos, inv_freq(cfg, COMPRESS_PROFILE), R, cfg.softmax_scale)
    assert rel(out, ref) < 1e-12
    # device: bf16 P and tiles of 128 stay within the K11 tolerance of the exact result
    qd = DEVICE.bf16(q)
    cd, sd = rope_rows(cfg, COMPRESS_PROFILE, pos, DEVICE)
    outd = sparse_attention(qd, ori, swa, lens, sink, cd, sd, cmp_kv=cmp, cmp_rows=cmp_rows,
                            cmp_block_table=cmp_table, req=np.zeros(T, int), cfg=cfg, nm=DEVICE)
    bad = np.abs(outd - ref) > 1e-2 + np.abs(ref) / 128
    assert bad.mean() < 0.005


def test_attention_masks_unmapped_and_empty_rows():
    cfg = TINY
    ori = _pool(cfg, 2, 32, EXACT)
    q = np.repeat(RNG.standard_normal((1, cfg.num_attention_heads, cfg.head_dim)), 2, axis=0)
    cos, sin = rope_rows(cfg, SWA_PROFILE, np.array([3, 3]), EXACT)
    swa = np.full((2, 128), -1)
    swa[0, :4] = [0, 1, 2, 3]
    swa[1, :4] = [0, 1, -1, 3]                      # an unmapped window row is dropped
    out = sparse_attention(q, ori, swa, np.array([4, 4]), np.zeros(cfg.num_attention_heads), cos, sin,
                           cfg=cfg, nm=EXACT)
    swa[0, 2] = -1
    again = sparse_attention(q, ori, swa, np.array([4, 4]), np.zeros(cfg.num_attention_heads), cos, sin,
                             cfg=cfg, nm=EXACT)
    assert np.allclose(again[0], out[1]) and not np.allclose(out[0], out[1])
    none = sparse_attention(q, ori, np.full((2, 128), -1), np.array([0, 0]), np.zeros(cfg.num_attention_heads),
                            cos, sin, cfg=cfg, nm=EXACT)
    assert np.all(none == 0)


def test_visibility_rows_are_causal():
    pos = np.array([0, 3, 127, 128, 255, 1000])
    rows = hca_rows(pos, np.zeros(6, int), np.array([10000]), nm=EXACT)
    assert [(r >= 0).sum() for r in rows] == [0, 0, 1, 1, 2, 7]
    assert rows[5].tolist()[:7] == list(range(7))
    top = np.array([[5, 0, 2, -1], [1, 0, 3, 2]])
    assert csa_rows(top, np.array([11, 7]), nm=EXACT).tolist() == [[-1, 0, 2, -1], [1, 0, -1, -1]]


def test_o_proj_against_the_dense_product(nm):
    cfg = SMALL
    rng = np.random.default_rng(3)
    G, OL, D = cfg.o_groups, cfg.o_lora_rank, cfg.hidden_size
    o = DEVICE.bf16(rng.standard_normal((5, cfg.num_attention_heads, cfg.head_dim)))
    wo_a = DEVICE.bf16(rng.standard_normal((G, OL, cfg.o_group_in)) / 30)
    wo_b = rng.integers(-127, 128, (G, D, OL)).astype(np.int8)
    s = rng.uniform(1e-4, 3e-4, D).astype(np.float32)
    out = o_proj(pack_groups(o, cfg=cfg), wo_a, wo_b, s, cfg=cfg, nm=nm)
    # dense: one [H*HD] -> [G*OL] block-diagonal low-rank map, then one [G*OL] -> [D] map
    A = np.zeros((G * OL, cfg.num_attention_heads * cfg.head_dim))
    for g in range(G):
        A[g * OL:(g + 1) * OL, g * cfg.o_group_in:(g + 1) * cfg.o_group_in] = wo_a[g]
    Bm = wo_b.transpose(1, 0, 2).reshape(D, G * OL) * s[:, None].astype(np.float64)
    ref = (o.reshape(5, -1) @ A.T) @ Bm.T
    assert rel(out, ref) < (1e-12 if nm.exact else 0.02)


@pytest.mark.parametrize("preset", ["tiny", "small", "flash"])
def test_the_lowerings_default_tables_are_golden_device_tables(preset):
    # the lowering stages RoPE rows a device reads as BF16; golden's device mode must see the same
    # values: both take twin.abi.rope's float32 frequencies and float32 angles (same operations, same
    # order, elementwise), so after the BF16 rounding they are equal bit for bit
    from twin.abi.lowering.context import default_rope
    from twin.abi.presets import get_preset

    cfg = get_preset(preset)
    rows = default_rope(cfg)
    pos = np.array([0, 1, 127, 128, 4095, 8196, 65_537, 1_048_575])
    nm = DEVICE
    for ratio, profile in ((0, SWA_PROFILE), (4, COMPRESS_PROFILE), (128, COMPRESS_PROFILE)):
        c, s = rows(ratio, pos)
        gc, gs = rope_rows(cfg, profile, pos, nm)
        np.testing.assert_array_equal(np.asarray(nm.bf16(c)), np.asarray(gc))
        np.testing.assert_array_equal(np.asarray(nm.bf16(s)), np.asarray(gs))
