"""Gate and experts: the grouped dispatch against a per-token loop, routing rules."""
import numpy as np
import pytest

from golden.compose import SHARED_NAMES
from golden.kernels.moe import gate, moe_experts
from golden_testlib import DEVICE, EXACT, rel
from twin.abi.presets import SMALL, TINY

f64 = lambda a: np.asarray(a, np.float64)


def _per_token_moe(cfg, x_i8, x_scale, idx, wts, expert, shared, nm):
    """One token at a time, one route at a time: the textbook SwiGLU MoE, W8A8 where the device is."""
    lim = cfg.swiglu_limit
    out = np.zeros((x_i8.shape[0], cfg.hidden_size))

    def ffn(x_row, xs, w1, s1, w3, s3, w2, s2, route):
        g = min_(nm.r32((f64(w1) @ x_row) * xs * s1), lim)
        u = np.clip(nm.r32((f64(w3) @ x_row) * xs * s3), -lim, lim)
        h = g / (1 + np.exp(-g)) * u
        hi, hd = nm.q8(h[None])
        return nm.bf16((f64(w2) @ hi[0]) * hd[0, 0] * route * s2)

    min_ = np.minimum
    for t in range(x_i8.shape[0]):
        acc = ffn(x_i8[t], x_scale[t, 0], *(shared[k] for k in SHARED_NAMES), 1.0)
        for k in range(idx.shape[1]):
            e = expert(int(idx[t, k]))
            acc = acc + ffn(x_i8[t], x_scale[t, 0], e["routed_w1"], e["routed_w1_scale"], e["routed_w3"],
                            e["routed_w3_scale"], e["routed_w2"], e["routed_w2_scale"], wts[t, k])
        out[t] = nm.bf16(acc)
    return out


@pytest.mark.parametrize("layer", [0, 4])
def test_grouped_dispatch_equals_per_token_loop(small_ckpt, nm, layer):
    cfg, w = SMALL, small_ckpt.layer(layer)
    rng = np.random.default_rng(layer)
    T = 24
    x = DEVICE.bf16(rng.standard_normal((T, cfg.hidden_size)) * 3)
    ids = rng.integers(0, cfg.vocab_size, T)
    x_i8, xs, idx, wts = gate(x, w["norm_w"], w["gate_w"], w["gate_bias"], w.get("tid2eid"), ids, layer=layer,
                              cfg=cfg, nm=nm)
    expert = lambda e: small_ckpt.expert(layer, e)
    shared = {k: w[k] for k in SHARED_NAMES}
    grouped = moe_experts(x_i8, xs, idx, wts, expert, shared, cfg=cfg, nm=nm)
    loop = _per_token_moe(cfg, x_i8, xs, idx, wts, expert, shared, nm)
    # rows are independent and every sum is exact-then-rounded: identical bits in device mode
    assert rel(grouped, loop) < (1e-12 if nm.exact else 1e-300)


def test_gate_routing_rules(small_ckpt):
    cfg = SMALL
    rng = np.random.default_rng(3)
    T, K = 16, cfg.num_experts_per_tok
    x = DEVICE.bf16(rng.standard_normal((T, cfg.hidden_size)))
    ids = rng.integers(0, cfg.vocab_size, T)
    w0, w5 = small_ckpt.layer(0), small_ckpt.layer(5)
    _, _, idx0, wts0 = gate(x, w0["norm_w"], w0["gate_w"], w0["gate_bias"], w0["tid2eid"], ids, layer=0, cfg=cfg, nm=EXACT)
    assert np.array_equal(idx0, w0["tid2eid"][ids])                      # hash layer: tid2eid[input_ids]
    x_i8, xs, idx, wts = gate(x, w5["norm_w"], w5["gate_w"], w5["gate_bias"], None, ids, layer=5, cfg=cfg, nm=EXACT)
    xn = x * f64(w5["norm_w"]) / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)
    logits = xn @ w5["gate_w"].T
    scores = np.sqrt(np.log1p(np.exp(logits)))
    biased = scores + w5["gate_bias"]
    for t in range(T):
        assert set(idx[t]) == set(np.argsort(-biased[t])[:K])             # bias selects ...
        np.testing.assert_allclose(wts[t], scores[t, idx[t]] / scores[t, idx[t]].sum() * 1.5)   # ... not weights
    np.testing.assert_allclose(x_i8 * xs, xn, rtol=1e-12)
    # ties go to the lower expert id (stable sort)
    flat = gate(np.ones((1, cfg.hidden_size)), np.ones(cfg.hidden_size), np.zeros((cfg.n_routed_experts, cfg.hidden_size)),
                np.zeros(cfg.n_routed_experts), None, [0], layer=5, cfg=cfg, nm=DEVICE)
    assert flat[2].tolist() == [list(range(K))] and np.allclose(flat[3], 1.5 / K)
    # padded rows: scale 0, expert 0, weight 0
    pad = gate(x, w5["norm_w"], w5["gate_w"], w5["gate_bias"], None, ids, layer=5, cfg=cfg, nm=DEVICE, num_tokens=10)
    assert np.all(pad[1][10:] == 0) and np.all(pad[2][10:] == 0) and np.all(pad[3][10:] == 0)


def test_device_moe_close_to_exact(tiny_ckpt):
    cfg, layer = TINY, 3
    w = tiny_ckpt.layer(layer)
    x = DEVICE.bf16(np.random.default_rng(9).standard_normal((8, cfg.hidden_size)))
    outs = []
    for nm in (EXACT, DEVICE):
        x_i8, xs, idx, wts = gate(x, w["norm_w"], w["gate_w"], w["gate_bias"], None, None, layer=layer, cfg=cfg, nm=nm)
        outs.append(moe_experts(x_i8, xs, idx, wts, lambda e: tiny_ckpt.expert(layer, e),
                                {k: w[k] for k in SHARED_NAMES}, cfg=cfg, nm=nm))
    a, b = outs
    l2 = np.linalg.norm(a - b, axis=-1) / np.linalg.norm(a, axis=-1)
    assert l2.max() < 0.03                              # quantization noise, not a formula difference
