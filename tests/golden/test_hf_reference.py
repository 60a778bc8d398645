"""External reference: transformers' `deepseek_v4` in float64 against golden in exact mode, with
the same weights, and one test pinning each place where that implementation deviates from the
upstream kernels (docs/golden-vs-hf.md)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from golden_hf import hf_config, hf_model  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M  # noqa: E402

from golden.checkpoint import SyntheticCheckpoint  # noqa: E402
from golden.compose import Session  # noqa: E402
from golden.kernels.rope import COMPRESS_PROFILE, SWA_PROFILE, inv_freq  # noqa: E402
from golden.paged import DECODE  # noqa: E402
from twin.abi.presets import TINY  # noqa: E402

# TINY with 16 indexer heads: with 4 heads, a candidate whose four head dot products are all
# negative scores exactly 0, and exact ties make the top-k set depend on the tie rule (pinned below).
HF_TINY = TINY.replace(name="tiny-hf", index_n_heads=16)
PROMPT, STEPS = 110, 32      # decode crosses the 128 window and the ratio-128 boundary at 127


@pytest.fixture(scope="module")
def pair():
    ck = SyntheticCheckpoint(HF_TINY, seed=0)
    return ck, hf_model(ck, HF_TINY)


def _cos(a, b):
    return np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_hf_agrees_with_golden_exact_over_32_greedy_steps(pair):
    ck, model = pair
    prompt = np.random.default_rng(0).integers(0, HF_TINY.vocab_size, PROMPT)
    # golden: prefill (logits of every prompt row), then one row per decode step
    s = Session(ck, HF_TINY, "exact", 1, PROMPT + STEPS + 1)
    from golden.compose import forward
    from golden.paged import Span, lower
    g_pre = forward(ck, lower(HF_TINY, [Span(0, 0, tuple(prompt), s.blocks[0])], logits="all"), s.caches,
                    cfg=HF_TINY, nm=s.nm)
    s.caches, s.lengths[0] = g_pre.caches, PROMPT
    g_tok, g_logits = [int(g_pre.sampled[-1])], []
    for _ in range(STEPS):
        r = s.run({0: [g_tok[-1]]}, form=DECODE)
        g_logits.append(r.logits[0])
        g_tok.append(int(r.sampled[0]))
    # transformers: the same, through its own caches
    with torch.no_grad():
        out = model(torch.tensor(prompt[None]), use_cache=True)
        h_pre, cache = out.logits[0].numpy(), out.cache if hasattr(out, "cache") else out.past_key_values
        h_tok, h_logits = [int(h_pre[-1].argmax())], []
        for _ in range(STEPS):
            out = model(torch.tensor([[h_tok[-1]]]), cache=cache, use_cache=True)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            h_logits.append(out.logits[0, -1].numpy())
            h_tok.append(int(h_logits[-1].argmax()))
    assert _cos(g_pre.logits, h_pre).min() >= 0.99999
    assert _cos(np.array(g_logits), np.array(h_logits)).min() >= 0.99999
    assert g_tok == h_tok and len(set(g_tok)) > 5


# ---- deviations of transformers' implementation from the upstream kernels, pinned -------------
def test_deviation_rope_angles_in_float32():
    """HF computes inv_freq and the angles in float32 even in a float64 model (upstream golden: the
    table is fp32 then bf16; exact mode: float64).  It also matches our YaRN frequencies."""
    conf = hf_config(HF_TINY)
    rot = M.DeepseekV4RotaryEmbedding(conf)
    assert rot.compress_attention_scaling == 1.0                     # no YaRN mscale (kernel-math §7 #13)
    for label, profile in (("main", SWA_PROFILE), ("compress", COMPRESS_PROFILE)):
        f_hf = getattr(rot, f"{label}_inv_freq").double().numpy()
        f = inv_freq(HF_TINY, profile)
        assert np.allclose(f_hf, f, rtol=1e-6)
    pos = torch.tensor([[5000]])
    cos, _ = rot(torch.zeros(1, dtype=torch.float64), pos, layer_type="main")
    exact = np.cos(5000 * inv_freq(HF_TINY, SWA_PROFILE))
    err = np.abs(cos[0, 0].numpy() - exact).max()
    assert 1e-9 < err < 1e-3


def test_deviation_indexer_scores_in_float32_without_hadamard():
    """HF's scorer casts q and keys to float32 and applies no Hadamard rotation.  The rotation is
    orthonormal up to one uniform factor (bf16(1/sqrt(n))^2 n), so it cannot change the top-k:
    golden's scores with the bf16 Hadamard equal the unrotated ones times that factor."""
    scorer = M.DeepseekV4IndexerScorer(hf_config(HF_TINY)).double()
    q = torch.randn(1, 3, HF_TINY.index_n_heads, HF_TINY.index_head_dim, dtype=torch.float64)
    k = torch.randn(1, 5, HF_TINY.index_head_dim, dtype=torch.float64)
    assert scorer(q, k, torch.randn(1, 3, HF_TINY.hidden_size, dtype=torch.float64)).dtype == torch.float32
    ck = SyntheticCheckpoint(HF_TINY, seed=0)
    H = np.asarray(ck.layer(2)["csa_hadamard_idx"], np.float64)
    n = H.shape[0]
    factor = float(H[0, 0]) ** 2 * n
    assert np.allclose(H @ H.T, factor * np.eye(n), atol=1e-12) and factor != 1.0


def test_deviation_topk_tie_order():
    """Exact ties: golden (pypto) takes the lower index first (stable sort); torch.topk does not."""
    s = np.zeros(10)
    s[[1, 8]] = [1.0, 2.0]
    golden = np.argsort(-s, kind="stable")[:4].tolist()
    hf = torch.topk(torch.from_numpy(s), 4).indices.tolist()
    assert golden == [8, 1, 0, 2] and hf[:2] == [8, 1] and sorted(hf[2:]) != [0, 2]


def test_deviation_swiglu_limit_zero_clamps():
    """Official: swiglu_limit = 0 means no clamp; HF clamps the gate to <= 0 and up to [0, 0]."""
    conf = hf_config(HF_TINY.replace(name="t0", swiglu_limit=0.0))
    mlp = M.DeepseekV4MLP(conf).double()
    x = torch.randn(2, HF_TINY.hidden_size, dtype=torch.float64)
    assert torch.all(mlp(x) == 0)
