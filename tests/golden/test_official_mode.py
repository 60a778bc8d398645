"""The `official` numerics mode: the official reference's own FP8 / FP4 round trips."""
import numpy as np

from golden.compose import Session, Taps, forward
from golden.numerics import FP8, Numerics
from golden.paged import Span, lower
from golden_testlib import rel
from twin.abi.presets import SMALL


def test_official_mode_is_close_to_exact_and_rounds_where_official_does(small_ckpt):
    cfg = SMALL
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 60)
    out, taps = {}, {}
    for mode in ("exact", "official", "device"):
        s = Session(small_ckpt, cfg, mode, 1, 64)
        taps[mode] = Taps(stages=["kv", "x_hc"])
        out[mode] = forward(small_ckpt, lower(cfg, [Span(0, 0, tuple(ids), s.blocks[0])], logits="all"), s.caches,
                            cfg=cfg, nm=s.nm, taps=taps[mode]).logits
    ex, off = out["exact"], out["official"]
    cos = np.sum(ex * off, -1) / np.linalg.norm(ex, axis=-1) / np.linalg.norm(off, axis=-1)
    dv = out["device"]
    cos_dv = np.sum(ex * dv, -1) / np.linalg.norm(ex, axis=-1) / np.linalg.norm(dv, axis=-1)
    # FP8 e4m3 keeps 3 mantissa bits on every linear's input: coarser than W8A8, so further from exact
    assert np.median(cos) > 0.9 and np.median(cos_dv) > np.median(cos) and 0 < rel(off, ex)
    # the non-RoPE KV dims sit on the FP8 e4m3 grid with a power-of-two scale per block (gcd(64, 96) = 32)
    R = cfg.qk_rope_head_dim
    kv = taps["official"][(2, "kv")][:, :-R].reshape(60, -1, 32)
    scale = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(kv).max(-1, keepdims=True), 1e-4) / 448.0))
    q = kv / scale
    assert np.array_equal(q.astype(FP8).astype(np.float64), q)
    # official rounds every hc_post output (the residual streams) to bf16; pypto keeps f32
    x = taps["official"][(3, "x_hc")]
    assert np.array_equal(Numerics("device").bf16(x), x)
    assert not np.array_equal(Numerics("device").bf16(taps["device"][(3, "x_hc")]), taps["device"][(3, "x_hc")])


def test_official_mode_rounds_linear_inputs_only_when_the_weights_are_fp8(small_ckpt):
    """The official `linear` quantizes its input to FP8 only for an FP8 weight: an FP8 release
    (dtype "fp8") rounds, an FP32 or BF16 checkpoint passes the input through; the KV and
    indexer round trips (quantization-aware training) stay in both."""
    x = np.random.default_rng(3).standard_normal((4, 256))
    fp8 = Numerics("official").for_config(SMALL)
    assert not np.array_equal(fp8.act(x), x) and np.array_equal(fp8.q8(x)[0], fp8.act(x))
    for dtype in ("fp32", "bf16"):
        nm = Numerics("official").for_config(SMALL.replace(dtype=dtype))
        assert np.array_equal(nm.act(x), x) and np.array_equal(nm.q8(x)[0], x)
        assert not np.array_equal(nm.kv_fp8(x), x) and not np.array_equal(nm.fp4(x), x)
    assert Numerics("device").for_config(SMALL.replace(dtype="fp32")).q8(x)[0].max() == 127
    ids = np.random.default_rng(0).integers(0, SMALL.vocab_size, 40)
    out, taps = {}, {}
    for dtype in ("fp8", "fp32"):
        cfg = SMALL.replace(dtype=dtype)
        s = Session(small_ckpt, cfg, "official", 1, 48)
        assert s.nm.fp8_linears == (dtype == "fp8") and s.nm.rounds_bf16 == (dtype == "fp8")
        taps[dtype] = Taps(stages=["kv"])
        out[dtype] = forward(small_ckpt, lower(cfg, [Span(0, 0, tuple(ids), s.blocks[0])], logits="all"), s.caches,
                             cfg=cfg, nm="official", taps=taps[dtype]).logits
    assert not np.allclose(out["fp8"], out["fp32"], rtol=1e-3, atol=1e-3)
    kv = taps["fp32"][(2, "kv")][:, :-SMALL.qk_rope_head_dim].reshape(40, -1, 32)    # still FP8 (QAT)
    scale = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(kv).max(-1, keepdims=True), 1e-4) / 448.0))
    assert np.array_equal((kv / scale).astype(FP8).astype(np.float64), kv / scale)


def test_jax_path_names_the_fp32_official_checkpoint_it_does_not_run(tiny_ckpt):
    pytest = __import__("pytest")
    pytest.importorskip("jax")
    from golden.jax_path import JaxGolden
    from twin.abi.errors import AbiError
    from twin.abi.presets import TINY
    with pytest.raises(AbiError, match="dtype='fp32'.*fp8 or bf16"):
        JaxGolden(tiny_ckpt, TINY.replace(dtype="fp32"), "official")
