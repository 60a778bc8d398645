"""The JAX step's two structural shortcuts against NumPy: a compressor pools its boundary rows only
when the call has a real boundary (lax.cond, one compiled step either way), and device mode
multiplies the attn-normed activations by one concatenated projection matrix."""
import jax
import jax.numpy as jnp
import numpy as np

from golden.compose import Session, forward
from golden.jax_kernels import X_PROJ, X_PROJ_KEYS, dot, fused_projections, layout
from golden.jax_numerics import Fp32Numerics
from golden.jax_path import READ_TRANSPOSED, JaxGolden
from golden.numerics import BF16
from golden.paged import DECODE, Span, lower
from golden_testlib import rel
from jax_decode import OPT0
from twin.abi.presets import TINY



def test_jax_compressor_pools_only_with_a_real_boundary_exact(tiny_ckpt):
    """Exact mode, two decode calls on one compiled step: the first crosses position 127 (a real
    ratio-128 boundary in request 1), the second crosses none.  Every layer's pools equal NumPy's,
    and without a boundary the HCA compressed rows are left as they were."""
    cfg = TINY
    rng = np.random.default_rng(11)
    s = Session(tiny_ckpt, cfg, "exact", 2, 160, seed=5)
    ids = rng.integers(0, cfg.vocab_size, 150)
    s.run({0: ids[:130], 1: ids[:123]})
    metas = [lower(cfg, [Span(0, 130, tuple(ids[130:138]), s.blocks[0]),
                         Span(1, 123, tuple(ids[123:131]), s.blocks[1])], form=DECODE),
             lower(cfg, [Span(0, 138, tuple(ids[138:146]), s.blocks[0]),
                         Span(1, 131, tuple(ids[131:139]), s.blocks[1])], form=DECODE)]
    boundaries = [int(layout(m).sel_ok[128].sum()) for m in metas]
    assert boundaries == [1, 0]                        # both branches of the cond run below
    jg = JaxGolden(tiny_ckpt, cfg, "exact", compiler_options=OPT0)
    hca = [l for l in range(cfg.num_hidden_layers) if cfg.compress_ratios[l] == 128]
    caches = s.caches
    for meta, n in zip(metas, boundaries):
        ref = forward(tiny_ckpt, meta, caches, cfg=cfg, nm=s.nm)
        out = jg.forward(meta, caches, extents=jg.static_extents(metas[0]))
        assert rel(np.asarray(out.logits), ref.logits) <= 1e-12
        for layer, pools in enumerate(ref.caches):
            for name, pool in pools.items():
                assert rel(np.asarray(out.caches[layer][name]), pool) <= 1e-12, (layer, name)
        for layer in hca:
            same = np.array_equal(np.asarray(out.caches[layer]["hca_cmp_kv"]), caches[layer]["hca_cmp_kv"])
            assert same == (n == 0), layer
        caches = ref.caches
    assert len(jg._fns) == 1


def test_jax_fused_projections_equal_the_separate_products(tiny_ckpt):
    """One [D, outs] GEMM split by name gives each projection x_n @ w (BF16 operands, FP32 sums:
    only the summation order may differ), for every layer kind; the fused names leave the dict."""
    cfg = TINY
    jg = JaxGolden(tiny_ckpt, cfg, "device")
    nm = Fp32Numerics("device", jnp)
    x = np.random.default_rng(3).standard_normal((24, cfg.hidden_size)).astype(BF16).astype(np.float32)
    for layer in range(cfg.num_hidden_layers):
        ratio = cfg.compress_ratios[layer]
        w, split = jg.layers[layer], jg.splits[layer]
        assert [k for k, _ in split] == list(X_PROJ_KEYS[ratio])
        assert not set(X_PROJ_KEYS[ratio]) & set(w) and X_PROJ in w
        raw = tiny_ckpt.layer(layer)
        with jax.enable_x64(True), nm.bf16_operands():
            got = fused_projections(jnp.asarray(x), w, split, nm)
            for k, _ in split:
                wk = np.asarray(raw[k]).astype(np.float32)
                wk = wk.T if k in READ_TRANSPOSED else wk       # the stored [in, out] layout
                want = np.asarray(dot(jnp.asarray(x), jnp.asarray(wk), (((1,), (0,)), ((), ())), nm))
                assert got[k].shape == want.shape
                assert rel(np.asarray(got[k], np.float64), want.astype(np.float64)) <= 1e-6, (layer, k)
    # other modes keep the separate matrices (official mode's qkv input is an FP8 round trip)
    assert JaxGolden(tiny_ckpt, cfg, "exact").splits == [None] * cfg.num_hidden_layers
