"""External reference: transformers' `deepseek_v4` in float64 against golden in exact mode, with
the same weights, and one test pinning each place where that implementation deviates from the
upstream kernels (docs/golden-vs-hf.md)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from golden_hf import cosine_rows, golden_greedy, hf_config, hf_model, hf_with_golden_ties, official_qat  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M  # noqa: E402

from golden.checkpoint import SyntheticCheckpoint  # noqa: E402
from golden.kernels.rope import COMPRESS_PROFILE, SWA_PROFILE, inv_freq  # noqa: E402
from twin.abi.presets import TINY  # noqa: E402

PROMPT, STEPS = 110, 32      # decode crosses the 128 window and the ratio-128 boundary at 127

# TINY with 16, 4 or 2 indexer heads.  With few heads a candidate whose head dot products are all
# non-positive scores exactly 0, so rows with fewer positive scores than index_topk select among
# exact ties: golden's order (lower index first) and torch.topk's (unspecified) differ there, and
# the comparison applies golden's selection to both (golden.ties).  16 heads meet no exact tie.
def _config(heads, **kw):
    return TINY.replace(name=f"tiny-hf-{heads}", index_n_heads=heads, **kw)


# not FLASH's shape: 6 layers in another order, 2 output groups, a 16-token window; the prompt
# crosses the ratio-128 boundary at 127 (4 indexer heads: it meets ties too)
SIX = TINY.replace(name="six-layers", num_hidden_layers=6, compress_ratios=(128, 4, 0, 4, 128, 0, 0),
                   dspark_target_layer_ids=(3, 4, 5), o_groups=2, sliding_window=16)
CONFIGS = {"16 heads": (_config(16), PROMPT), "4 heads": (_config(4), PROMPT), "2 heads": (_config(2), PROMPT),
           "six layers": (SIX, 140)}


@pytest.mark.parametrize("name", CONFIGS)
def test_hf_agrees_with_golden_exact_over_greedy_steps_tie_aware(name):
    cfg, prompt_len = CONFIGS[name]
    ck = SyntheticCheckpoint(cfg, seed=0)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, prompt_len)
    tokens, g_logits, calls = golden_greedy(ck, cfg, "exact", prompt, STEPS if prompt_len == PROMPT else 24)
    h_logits, stats = hf_with_golden_ties(hf_model(ck, cfg), cfg, prompt, tokens, calls)
    assert stats["diverged"] == 0                  # every selection difference was an exact tie
    if cfg.index_n_heads < 16:
        assert stats["adopted"] > 0 and stats["short"] > 0     # the config does meet ties
    assert cosine_rows(g_logits, h_logits).min() >= 0.999999
    assert np.abs(g_logits - h_logits).max() <= 1e-4
    assert h_logits[prompt_len - 1:].argmax(-1).tolist() == tokens and len(set(tokens)) > 5


def test_official_mode_on_an_fp32_checkpoint_reproduces_the_reference_with_its_qat_round_trips():
    """The official reference on FP32 weights: FP32 activations, no FP8 linear inputs, and its
    always-on FP8 KV / FP4 indexer round trips (added to transformers by forward hooks, with the
    exact Hadamard rotation).  Golden's official mode on an FP32 checkpoint gives its greedy tokens."""
    cfg = _config(4, dtype="fp32")
    ck = SyntheticCheckpoint(cfg, seed=0)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, PROMPT)
    tokens, g_logits, calls = golden_greedy(ck, cfg, "official", prompt, STEPS)
    h_logits, stats = hf_with_golden_ties(hf_model(ck, cfg), cfg, prompt, tokens, calls, qat=official_qat(cfg))
    assert stats["diverged"] == 0
    assert cosine_rows(g_logits, h_logits).min() >= 0.999999
    assert np.abs(g_logits - h_logits).max() <= 1e-4
    assert h_logits[PROMPT - 1:].argmax(-1).tolist() == tokens and len(set(tokens)) > 5
    # the round trips act: without them transformers' logits move far beyond that tolerance
    plain, _ = hf_with_golden_ties(hf_model(ck, cfg), cfg, prompt, tokens, calls)
    assert np.abs(g_logits - plain).max() > 1e-2


# ---- deviations of transformers' implementation from the upstream kernels, pinned -------------
def test_deviation_rope_angles_in_float32():
    """HF computes inv_freq and the angles in float32 even in a float64 model (upstream golden: the
    table is fp32 then bf16; exact mode: float64).  It also matches our YaRN frequencies."""
    conf = hf_config(TINY)
    rot = M.DeepseekV4RotaryEmbedding(conf)
    assert rot.compress_attention_scaling == 1.0                     # no YaRN mscale (kernel-math §7 #13)
    for label, profile in (("main", SWA_PROFILE), ("compress", COMPRESS_PROFILE)):
        f_hf = getattr(rot, f"{label}_inv_freq").double().numpy()
        f = inv_freq(TINY, profile)
        assert np.allclose(f_hf, f, rtol=1e-6)
    pos = torch.tensor([[5000]])
    cos, _ = rot(torch.zeros(1, dtype=torch.float64), pos, layer_type="main")
    exact = np.cos(5000 * inv_freq(TINY, SWA_PROFILE))
    err = np.abs(cos[0, 0].numpy() - exact).max()
    assert 1e-9 < err < 1e-3


def test_deviation_indexer_scores_in_float32_without_hadamard():
    """HF's scorer casts q and keys to float32 and applies no Hadamard rotation.  The rotation is
    orthonormal up to one uniform factor (bf16(1/sqrt(n))^2 n), so it cannot change the top-k:
    golden's scores with the bf16 Hadamard equal the unrotated ones times that factor."""
    scorer = M.DeepseekV4IndexerScorer(hf_config(TINY)).double()
    q = torch.randn(1, 3, TINY.index_n_heads, TINY.index_head_dim, dtype=torch.float64)
    k = torch.randn(1, 5, TINY.index_head_dim, dtype=torch.float64)
    assert scorer(q, k, torch.randn(1, 3, TINY.hidden_size, dtype=torch.float64)).dtype == torch.float32
    ck = SyntheticCheckpoint(TINY, seed=0)
    H = np.asarray(ck.layer(2)["csa_hadamard_idx"], np.float64)
    n = H.shape[0]
    factor = float(H[0, 0]) ** 2 * n
    assert np.allclose(H @ H.T, factor * np.eye(n), atol=1e-12) and factor != 1.0


def test_deviation_swiglu_limit_zero_clamps():
    """Official: swiglu_limit = 0 means no clamp; HF clamps the gate to <= 0 and up to [0, 0]."""
    conf = hf_config(TINY.replace(name="t0", swiglu_limit=0.0))
    mlp = M.DeepseekV4MLP(conf).double()
    x = torch.randn(2, TINY.hidden_size, dtype=torch.float64)
    assert torch.all(mlp(x) == 0)
