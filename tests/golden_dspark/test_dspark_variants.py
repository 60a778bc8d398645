"""The official V4.1-Flash drafter variant, one test per point where it departs from the device's
(docs/drafter.md), each against a formulation written here from the V4.1 reference's description,
and the device variant as the default everywhere."""
import dataclasses

import numpy as np
import pytest

from twin.abi import TINY
from twin.abi.errors import AbiError
from golden.checkpoint import SyntheticCheckpoint
from golden.dspark import drafter as D
from golden.dspark import step as S
from golden.dspark.markov import confidence_probs, dspark_markov
from golden.dspark.parallel import SINGLE
from golden.dspark.ring import new_pools
from golden.dspark.variants import DEVICE, V41, DrafterVariant, drafter_variant
from golden.dspark.weights import DrafterCheckpoint
from golden.kernels.qkv_proj_rope import qkv_proj_rope
from golden.kernels.rmsnorm import rms_norm
from golden.kernels.rope import SWA_PROFILE, rope_rows
from golden.numerics import numerics

CFG = TINY
EXACT = numerics("exact")
CK, DK = SyntheticCheckpoint(CFG, 5), DrafterCheckpoint(CFG, 5)
HC = CFG.hc_mult


def test_device_is_the_default_and_names_resolve():
    g = S.Golden(CFG, CK, DK)
    assert g.drafter is DEVICE
    assert S.Golden(CFG, CK, DK, drafter="v4.1").drafter is V41
    assert (DEVICE.target_hidden_tap, DEVICE.hc_order, DEVICE.q_head_norm, DEVICE.confidence_output) == \
        ("hc_head_of_outputs", "own", True, "probability")
    assert (V41.target_hidden_tap, V41.hc_order, V41.q_head_norm, V41.confidence_output) == \
        ("mean_of_inputs", "carried", False, "logit")
    with pytest.raises(AbiError, match="drafter"):
        drafter_variant("v4")


# ---- the V4.1 block wiring, written out from the reference ---------------------------------------
def _mixes(h, fn, scale, base):
    """V4.1 hc_mixes in float64: one rms statistic over the flattened streams, sigmoid pre / 2 sigmoid
    post, Sinkhorn (softmax rows + eps, then columns, then iters - 1 (rows, columns) rounds) comb."""
    flat = h.reshape(h.shape[0], -1)
    m = (flat @ fn[:CFG.mix_hc].T) / np.sqrt(np.mean(flat ** 2, axis=-1, keepdims=True) + CFG.rms_norm_eps)
    sig = lambda z: 1 / (1 + np.exp(-z))                              # noqa: E731
    pre = sig(m[:, :HC] * scale[0] + base[:HC]) + CFG.hc_eps
    post = 2 * sig(m[:, HC:2 * HC] * scale[1] + base[HC:2 * HC])
    c = (m[:, 2 * HC:] * scale[2] + base[2 * HC:]).reshape(-1, HC, HC)
    c = np.exp(c - c.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + CFG.hc_eps
    c = c / (c.sum(-2, keepdims=True) + CFG.hc_eps)
    for _ in range(CFG.hc_sinkhorn_iters - 1):
        c = c / (c.sum(-1, keepdims=True) + CFG.hc_eps)
        c = c / (c.sum(-2, keepdims=True) + CFG.hc_eps)
    return pre, post, c


def _expand(x, residual, post, comb):
    """y[:, j] = post_j x + sum_i comb[i, j] residual[:, i]."""
    return post[:, :, None] * x[:, None, :] + np.einsum("tij,tid->tjd", comb, residual)


def _v41_reference(rows, main_hidden, dk, *, q_head_norm=False):
    """forward_spec's drafter: embed [tau, noise x 6] into HC copies; pre_mix = one-hot on stream 0;
    per block: mixes of the block input, attention on hc_pre(x, pre_mix), FFN on hc_pre(x, attention's
    pre), hand on the FFN's pre; the head input is hc_pre(x, last pre).  The attention sub-layer and
    the MoE are golden's kernels (the same in both variants); the wiring is this function's."""
    f64 = lambda a: np.asarray(a, np.float64)                          # noqa: E731
    dm = dk.model()
    pool = new_pools(CFG, 1, EXACT)[0]
    layers = [dk.layer(l) for l in range(3)]
    main_x = D.dspark_proj(main_hidden, dm["main_proj_weight"], dm["main_norm_weight"], cfg=CFG, nm=EXACT)
    pool = D.write_context(pool, main_x, layers, rows, cfg=CFG, nm=EXACT)
    ids = np.array([[r.anchor_token] + [CFG.dspark_noise_token_id] * 6 for r in rows]).reshape(-1)
    h = np.repeat(f64(CK.model()["embed_weight"])[ids][:, None, :], HC, axis=1)
    pre_mix = np.zeros((len(ids), HC))
    pre_mix[:, 0] = 1.0
    for l, lw in enumerate(layers):
        a_pre, a_post, a_comb = _mixes(h, f64(lw["hc_attn_fn"]), f64(lw["hc_attn_scale"]), f64(lw["hc_attn_base"]))
        x = np.einsum("th,thd->td", pre_mix, h)
        x = rms_norm(x, lw["attn_norm_w"], cfg=CFG, nm=EXACT)
        x, pool = D.dspark_attention(x, lw, pool, l, rows, cfg=CFG, nm=EXACT, q_head_norm=q_head_norm)
        h = _expand(f64(x), h, a_post, a_comb)
        f_pre, f_post, f_comb = _mixes(h, f64(lw["hc_ffn_fn"]), f64(lw["hc_ffn_scale"]), f64(lw["hc_ffn_base"]))
        x = np.einsum("th,thd->td", a_pre, h)
        x = SINGLE.moe(x, lw, lambda e, _l=l: dk.expert(_l, e), ids, layer=CFG.dspark_target_layer_ids[l], cfg=CFG,
                       nm=EXACT)
        h = _expand(f64(x), h, f_post, f_comb)
        pre_mix = f_pre
    return np.einsum("th,thd->td", pre_mix, h).reshape(len(rows), 7, -1)


def _rows_and_hidden(seed=0):
    rows = [D.DraftRow(3, 40, 17, tuple(range(30, 41))), D.DraftRow(9, 5, 900, tuple(range(0, 6)))]
    n = sum(len(r.context_positions) for r in rows)
    return rows, np.random.default_rng(seed).standard_normal((n, 3 * CFG.hidden_size))


def test_v41_drafter_is_the_reference_wiring():
    rows, mh = _rows_and_hidden()
    head, _ = D.drafter_forward(new_pools(CFG, 1, EXACT)[0], mh, rows, DK, CK.model(), cfg=CFG, nm=EXACT, variant=V41)
    want = _v41_reference(rows, mh, DK)
    np.testing.assert_allclose(head, want, rtol=1e-12, atol=1e-12 * np.max(np.abs(want)))


def test_the_carried_hc_order_alone_moves_drafts():
    """Only the hyper-connection order changed (device q renorm and hc_head otherwise): the head hidden
    is the reference's carried wiring with q renormalized, not the device's, and drafts move."""
    only_hc = DrafterVariant("hc-only", "hc_head_of_outputs", "carried", True, "probability")
    rows, mh = _rows_and_hidden(1)
    pool = new_pools(CFG, 1, EXACT)[0]
    heads = {v.name: D.drafter_forward(pool, mh, rows, DK, CK.model(), cfg=CFG, nm=EXACT, variant=v)[0]
             for v in (DEVICE, only_hc)}
    want = _v41_reference(rows, mh, DK, q_head_norm=True)
    np.testing.assert_allclose(heads["hc-only"], want, rtol=1e-12, atol=1e-12 * np.max(np.abs(want)))
    dm, lm = DK.model(), CK.model()["lm_head_weight"]
    tau = np.array([r.anchor_token for r in rows])
    drafts = {n: dspark_markov(h, dm["final_norm_weight"], lm, [1, 1], tau, tau, dm["markov_w1"], dm["markov_w2"],
                               dm["confidence_head_weight"], cfg=CFG, nm=EXACT)[0] for n, h in heads.items()}
    assert np.any(drafts["device"] != drafts["hc-only"])


# ---- no q renormalization ---------------------------------------------------------------------------
def test_v41_block_q_is_not_renormalized():
    """RoPE turns pairs, so it keeps a head's norm: the renormalized q is the plain q over its own
    rms, head by head; the plain q's heads are not unit-rms."""
    lw = DK.layer(0)
    x = EXACT.bf16(np.random.default_rng(2).standard_normal((14, CFG.hidden_size)))
    cos, sin = rope_rows(CFG, SWA_PROFILE, np.arange(100, 114), EXACT)
    args = (x, lw["wq_a"], lw["wq_b"], lw["wq_b_scale"], lw["wkv"], lw["gamma_cq"], lw["gamma_ckv"], cos, sin)
    q1, kv1, _, _ = qkv_proj_rope(*args, cfg=CFG, nm=EXACT)
    q0, kv0, _, _ = qkv_proj_rope(*args, cfg=CFG, nm=EXACT, q_head_norm=False)
    rms = np.sqrt(np.mean(np.asarray(q0) ** 2, axis=-1, keepdims=True) + CFG.rms_norm_eps)
    np.testing.assert_allclose(q1, np.asarray(q0) / rms, rtol=1e-12, atol=1e-12)
    assert np.max(np.abs(rms - 1)) > 0.1
    assert np.array_equal(kv0, kv1)


# ---- confidence: a logit, and the device's probability named as one ---------------------------------
def test_confidence_is_the_logit_and_the_device_output_its_sigmoid():
    rng = np.random.default_rng(3)
    head = rng.standard_normal((2, 7, CFG.hidden_size))
    dm, lm = DK.model(), CK.model()["lm_head_weight"]
    ns, last, nxt = np.array([1, 0]), np.array([3, 4]), np.array([5, 6])
    drafts, logit = dspark_markov(head, dm["final_norm_weight"], lm, ns, last, nxt, dm["markov_w1"],
                                  dm["markov_w2"], dm["confidence_head_weight"], cfg=CFG, nm=EXACT)
    w = np.asarray(dm["confidence_head_weight"], np.float64)[0]
    w1 = np.asarray(dm["markov_w1"], np.float64)
    Dm = CFG.hidden_size
    for b in range(2):
        prev = [last[b] if ns[b] else nxt[b]] + list(drafts[b, :-1])
        want = head[b] @ w[:Dm] + w1[prev] @ w[Dm:]                      # c_i = w . [h_i ; W1[x_{i-1}]], no bias
        np.testing.assert_allclose(logit[b], want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    p = confidence_probs(logit, EXACT)
    np.testing.assert_allclose(p, 1 / (1 + np.exp(-np.asarray(logit))), rtol=1e-12)
    assert np.all((p > 0) & (p < 1)) and np.any(np.asarray(logit) < 0)  # a logit, not a probability


def test_runs_keep_the_logit():
    req = S.Prompt("r0", tuple(int(t) for t in np.random.default_rng(4).integers(0, CFG.vocab_size, 20)), 9)
    run = S.generate(S.Golden(CFG, CK, DK, nm="exact", max_model_len=64), [req], k=7)
    c = run.seqs[0].confidence_logit
    assert c is not None and c.shape == (7,) and np.any((c < 0) | (c > 1))


# ---- target hidden: the mean of the target layers' input streams ------------------------------------
def test_v41_captures_the_mean_of_the_target_layers_inputs():
    """A V4.1 run's main_hidden rows are the mean over the 4 streams of what enters each target layer,
    i.e. of the previous layer's output, taken here from a separate target forward."""
    from golden.paged import PREFILL, Span, lower
    from golden.compose import Taps
    prompt = tuple(int(t) for t in np.random.default_rng(5).integers(0, CFG.vocab_size, 24))
    g = S.Golden(CFG, CK, DK, nm="exact", max_model_len=64, drafter="v4.1")
    run = S.new_run(g, [S.Prompt("r0", prompt, 1)], k=0, log_hidden=True)
    S.prefill_and_seed(g, run, k=0)
    got = np.stack([run.hidden_log["r0"][p] for p in range(len(prompt))])
    ref = S.new_run(g, [S.Prompt("r0", prompt, 1)], k=0)
    taps = Taps(stages={"x_hc"})
    meta = lower(CFG, [Span(0, 0, prompt, ref.blocks[0])], form=PREFILL)
    SINGLE.target_forward(CK, meta, ref.caches, np.zeros(len(prompt), np.int64), cfg=CFG, nm=EXACT, taps=taps)
    want = np.concatenate([np.asarray(taps[(l - 1, "x_hc")]).mean(axis=1) for l in CFG.dspark_target_layer_ids], -1)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    dev = S.Golden(CFG, CK, DK, nm="exact", max_model_len=64)
    run_d = S.new_run(dev, [S.Prompt("r0", prompt, 1)], k=0, log_hidden=True)
    S.prefill_and_seed(dev, run_d, k=0)
    assert not np.allclose(np.stack([run_d.hidden_log["r0"][p] for p in range(len(prompt))]), want)


# ---- the V4.1 drafter config ------------------------------------------------------------------------
def test_v41_drafter_config_is_greedy_and_carries_its_expert_counts():
    with pytest.raises(AbiError, match="temperature"):
        dataclasses.replace(V41, temperature=0.6)
    own = dataclasses.replace(V41, n_routed_experts=8, n_activated_experts=1)
    mcfg = own.moe_cfg(CFG)
    assert (mcfg.n_routed_experts, mcfg.num_experts_per_tok) == (8, 1) and V41.moe_cfg(CFG) is CFG
    with pytest.raises(AbiError, match="n_activated_experts"):
        dataclasses.replace(V41, n_routed_experts=4, n_activated_experts=5).moe_cfg(CFG)
    rows, mh = _rows_and_hidden(6)
    pool = new_pools(CFG, 1, EXACT)[0]
    with pytest.raises(AbiError, match="experts"):              # a checkpoint with the target's 16 experts
        D.drafter_forward(pool, mh, rows, DK, CK.model(), cfg=CFG, nm=EXACT, variant=own)
    dk8 = DrafterCheckpoint(mcfg, 5)
    assert dk8.layer(0)["gate_w"].shape[0] == 8
    head, _ = D.drafter_forward(pool, mh, rows, dk8, CK.model(), cfg=CFG, nm=EXACT, variant=own)
    assert np.all(np.isfinite(head))
    # the drafter layers route with the variant's counts: one expert per row out of 8
    from golden.kernels.moe import gate
    x = np.asarray(EXACT.bf16(np.random.default_rng(7).standard_normal((4, CFG.hidden_size))))
    lw = dk8.layer(0)
    _, _, idx, _ = gate(x, lw["norm_w"], lw["gate_w"], lw["gate_bias"], None, np.zeros(4, np.int64),
                        layer=CFG.dspark_target_layer_ids[0], cfg=mcfg, nm=EXACT)
    assert np.asarray(idx).shape == (4, 1) and np.all((np.asarray(idx) >= 0) & (np.asarray(idx) < 8))
