"""Compressors (ratio 4 overlapping, ratio 128, indexer) and the lightning indexer against
independent formulations: a dict keyed by absolute position, explicit per-boundary loops."""
import numpy as np
import pytest

from golden.kernels.compressor import compressor, indexer_compressor
from golden.kernels.indexer import lightning_indexer
from golden.kernels.rope import COMPRESS_PROFILE, inv_freq, rope_rows
from golden.paged import compressed_slot, paged_slot, ring_table
from golden_testlib import DEVICE, EXACT, rel
from test_kernels_attention import _complex_rope
from twin.abi.presets import SMALL, TINY

RNG = np.random.default_rng(11)
f64 = lambda a: np.asarray(a, np.float64)


def _setup(cfg, ratio, n, ring_pages, cmp_pages=4):
    page = 2 if ratio == 4 else 8
    rpp = 32 if ratio == 4 else 1
    table = ring_table(RNG.permutation(ring_pages + 3)[:ring_pages], ring_pages)[None, :]
    cmp_table = RNG.permutation(cmp_pages * 4)[:cmp_pages].astype(np.int32)[None, :]
    return page, rpp, table, cmp_table


def _run_compressor(cfg, w, x, calls, ratio, nm, table, cmp_table, page, rpp, prefix):
    out = 2 * cfg.head_dim if ratio == 4 else cfg.head_dim
    state = np.zeros((table.max() + 1, page, 2 * out), nm.state_dtype)
    cmp = np.zeros((cmp_table.max() + 1, rpp, 1, cfg.head_dim), nm.store_dtype)
    start = 0
    for n in calls:
        pos = np.arange(start, start + n)
        cos, sin = rope_rows(cfg, COMPRESS_PROFILE, np.maximum(pos - ratio + 1, 0), nm)
        sslots = paged_slot(pos, table[0], page)
        cslots = compressed_slot(pos, cmp_table[0], ratio, rpp)
        cmp, state, _ = compressor(x[pos], pos, np.zeros(n, int), np.array([start]), state, table, sslots, cmp,
                                   cslots, w[prefix + "wkv"], w[prefix + "wgate"], w[prefix + "ape"],
                                   w[prefix + "norm_w"], cos, sin, ratio=ratio, cfg=cfg, nm=nm)
        start += n
    return cmp


def _reference(cfg, w, x, ratio, prefix, p):
    """Compressed row of boundary p from a position-keyed dict of projections."""
    kv = {q: x[q] @ f64(w[prefix + "wkv"]).T for q in range(p + 1)}
    sc = {q: x[q] @ f64(w[prefix + "wgate"]).T + w[prefix + "ape"][q % ratio] for q in range(p + 1)}
    d = cfg.head_dim
    rows_kv, rows_sc = [], []
    if ratio == 4:
        for q in range(p - 7, p - 3):
            if q >= 0:
                rows_kv.append(kv[q][:d]), rows_sc.append(sc[q][:d])
        for q in range(p - 3, p + 1):
            rows_kv.append(kv[q][d:]), rows_sc.append(sc[q][d:])
    else:
        for q in range(p - 127, p + 1):
            rows_kv.append(kv[q]), rows_sc.append(sc[q])
    K, S = np.array(rows_kv), np.array(rows_sc)
    wgt = np.exp(S - S.max(0)) / np.exp(S - S.max(0)).sum(0)
    y = (wgt * K).sum(0)
    y = y / np.sqrt(np.mean(y * y) + 1e-6) * f64(w[prefix + "norm_w"])
    R = cfg.qk_rope_head_dim
    y[-R:] = _complex_rope(y[-R:], p - ratio + 1, inv_freq(cfg, COMPRESS_PROFILE))
    return y


@pytest.mark.parametrize("ratio,prefix,layer,n,calls", [
    (4, "csa_cmp_", 2, 41, [41]), (4, "csa_cmp_", 2, 41, [5, 1, 2, 9, 24]),
    (128, "hca_cmp_", 3, 300, [300]), (128, "hca_cmp_", 3, 300, [100, 27, 1, 172])])
def test_compressor_against_position_keyed_reference(tiny_ckpt, ratio, prefix, layer, n, calls):
    cfg, w = TINY, tiny_ckpt.layer(layer)
    x = DEVICE.bf16(RNG.standard_normal((n, cfg.hidden_size)))
    # a ring small enough to wrap: the state keeps only what the next windows need
    ring = 8 if ratio == 4 else 40
    page, rpp, table, cmp_table = _setup(cfg, ratio, n, ring)
    cmp = _run_compressor(cfg, w, x, calls, ratio, EXACT, table, cmp_table, page, rpp, prefix)
    flat = cmp.reshape(-1, cfg.head_dim)
    boundaries = [p for p in range(n) if (p + 1) % ratio == 0]
    assert boundaries
    for p in boundaries:
        slot = compressed_slot(np.array([p]), cmp_table[0], ratio, rpp)[0]
        assert rel(flat[slot], _reference(cfg, w, x, ratio, prefix, p)) < 1e-12
    written = {int(compressed_slot(np.array([p]), cmp_table[0], ratio, rpp)[0]) for p in boundaries}
    assert all(np.all(flat[s] == 0) for s in range(flat.shape[0]) if s not in written)


@pytest.mark.parametrize("ratio,prefix,layer", [(4, "csa_cmp_", 2), (128, "hca_cmp_", 3)])
def test_compressor_device_mode_is_call_split_invariant(tiny_ckpt, ratio, prefix, layer):
    cfg, w = TINY, tiny_ckpt.layer(layer)
    n = 260 if ratio == 128 else 40
    x = DEVICE.bf16(RNG.standard_normal((n, cfg.hidden_size)))
    page, rpp, table, cmp_table = _setup(cfg, ratio, n, 40 if ratio == 128 else 8)
    one = _run_compressor(cfg, w, x, [n], ratio, DEVICE, table, cmp_table, page, rpp, prefix)
    split = _run_compressor(cfg, w, x, [3, n // 2, 1, n - 4 - n // 2], ratio, DEVICE, table, cmp_table, page, rpp, prefix)
    assert one.dtype == DEVICE.store_dtype and np.array_equal(f64(one), f64(split))
    ex = _run_compressor(cfg, w, x, [n], ratio, EXACT, table, cmp_table, page, rpp, prefix)
    mask = f64(ex) != 0
    assert rel(f64(one)[mask], ex[mask]) < 2 ** -7


def _idx_setup(cfg, w, n, nm, calls=None):
    x = DEVICE.bf16(np.random.default_rng(n).standard_normal((n, cfg.hidden_size)))
    table = ring_table(np.arange(8), 8)[None, :]
    idx_table = np.array([[2, 0, 1, 3]], np.int32)
    state = np.zeros((8, 2, 4 * cfg.index_head_dim), nm.state_dtype)
    cache = np.zeros((4, 32, 1, cfg.index_head_dim), np.int8 if nm.mode == "device" else np.float64)
    scale = np.zeros((4, 32, 1, 1), nm.state_dtype)
    start = 0
    for m in calls or [n]:
        pos = np.arange(start, start + m)
        cos, sin = rope_rows(cfg, COMPRESS_PROFILE, np.maximum(pos - 3, 0), nm)
        cache, scale, state, _ = indexer_compressor(
            x[pos], pos, np.zeros(m, int), np.array([start]), state, table, paged_slot(pos, table[0], 2), cache,
            scale, compressed_slot(pos, idx_table[0], 4, 32), w["csa_inner_wkv"], w["csa_inner_wgate"],
            w["csa_inner_ape"], w["csa_inner_norm_w"], w["csa_hadamard_idx"], cos, sin, cfg=cfg, nm=nm)
        start += m
    return x, idx_table, cache, scale


def test_indexer_compressor_quant_on_write(small_ckpt):
    cfg, w = SMALL, small_ckpt.layer(2)
    n = 64
    _, idx_table, ce, se = _idx_setup(cfg, w, n, EXACT)
    _, _, cd, sd = _idx_setup(cfg, w, n, DEVICE, calls=[7, 1, 56])
    slots = compressed_slot(np.arange(n), idx_table[0], 4, 32)
    slots = slots[slots >= 0]
    e = ce.reshape(-1, cfg.index_head_dim)[slots]
    di, ds = cd.reshape(-1, cfg.index_head_dim)[slots].astype(np.float64), sd.reshape(-1)[slots]
    assert cd.dtype == np.int8 and np.all(np.abs(di).max(-1) == 127)
    np.testing.assert_allclose(ds, np.maximum(np.abs(DEVICE.bf16(e)).max(-1), 1e-4) / 127, rtol=0.02)
    assert rel(di * ds[:, None], e) < 0.02
    # Hadamard rows are orthonormal: the pooled, normed row keeps its norm through the rotation
    assert np.allclose(np.linalg.norm(e, axis=-1), np.sqrt(cfg.index_head_dim), rtol=0.1)


def test_lightning_indexer_against_loops_and_topk(small_ckpt):
    cfg, w = SMALL, small_ckpt.layer(2)
    n = 300
    x, idx_table, cache, scale = _idx_setup(cfg, w, n, DEVICE)
    T = 6
    pos = np.array([2, 3, 50, 200, 299, 299])
    lens = np.array([300])
    rng = np.random.default_rng(5)
    xq = DEVICE.bf16(rng.standard_normal((T, cfg.hidden_size)))
    qr = rng.integers(-127, 128, (T, cfg.q_lora_rank)).astype(np.float64)
    qs = rng.uniform(1e-3, 2e-3, (T, 1))
    cos, sin = rope_rows(cfg, COMPRESS_PROFILE, pos, DEVICE)
    score, top = lightning_indexer(xq, qr, qs, w["csa_idx_wq_b"], w["csa_idx_wq_b_scale"], w["csa_weights_proj"],
                                   w["csa_hadamard_idx"], cos, sin, cache, scale, idx_table, np.zeros(T, int),
                                   pos, lens // 4, cfg=cfg, nm=DEVICE, cap=2048)
    IH, IHD = cfg.index_n_heads, cfg.index_head_dim
    kv = cache.reshape(-1, IHD).astype(np.float64)
    ks = scale.reshape(-1)
    for t in range(T):
        q = (qr[t] @ (f64(w["csa_idx_wq_b"]) * w["csa_idx_wq_b_scale"])) * qs[t]
        q = q.reshape(IH, IHD)
        c, s = cos[t, :16], sin[t, :16]                  # the device's bf16 table values
        z = (q[:, -32::2] + 1j * q[:, -31::2]) * (c + 1j * s)
        rot = np.stack([DEVICE.bf16(z.real), DEVICE.bf16(z.imag)], -1).reshape(IH, 32)
        q = DEVICE.bf16(np.concatenate([q[:, :-32], rot], -1)) @ f64(w["csa_hadamard_idx"])
        qi, qd = DEVICE.q8(q)
        wt = xq[t] @ f64(w["csa_weights_proj"]) * IHD ** -0.5 * IH ** -0.5
        vis = (pos[t] + 1) // 4
        for c in range(vis):
            slot = idx_table[0, c // 32] * 32 + c % 32
            ref = sum(max(qi[h] @ kv[slot] * qd[h, 0] * ks[slot], 0) * wt[h] for h in range(IH))
            assert abs(score[t, c] - ref) <= 2e-3 * abs(ref) + 1e-3
        assert np.all(score[t, vis:] <= -3e38)
        k = min(vis, cfg.index_topk)
        assert np.all(top[t, k:] == -1) and len(set(top[t, :k])) == k
        if k:
            sv = score[t, top[t, :k]]
            assert np.all(np.diff(sv) <= 0) and sv[-1] >= np.sort(score[t, :vis])[::-1][k - 1]
    # NumPy's token chunks (one token, an uneven split, the default) give the same bits: each token
    # has its own GEMM and the same elementwise steps and head-order sum in any chunk
    for chunk in (1, 4):
        sc, tp = lightning_indexer(xq, qr, qs, w["csa_idx_wq_b"], w["csa_idx_wq_b_scale"], w["csa_weights_proj"],
                                   w["csa_hadamard_idx"], cos, sin, cache, scale, idx_table, np.zeros(T, int),
                                   pos, lens // 4, cfg=cfg, nm=DEVICE, cap=2048, chunk=chunk)
        assert np.array_equal(sc, score) and np.array_equal(tp, top)
