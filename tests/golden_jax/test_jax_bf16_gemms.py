"""The JAX path's BF16 GEMMs (golden.jax_numerics): a product of BF16 values is exact in f32, so
"bf16 in, fp32 acc" may hand XLA bf16 operands.  What must hold: every GEMM that takes that path
multiplies BF16 values (checked inside the real step), the GEMMs really run on BF16 operands (the
compiled step), integer GEMMs stay the exact integer, and a BF16 dot is an f32-accumulated dot."""
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from golden.compose import Session
from golden.jax_kernels import dot, o_proj_grouped
from golden.jax_numerics import Fp32Numerics
from golden.jax_path import JaxGolden
from golden.kernels.o_proj import o_proj, pack_groups
from golden.numerics import Numerics
from golden.paged import DECODE, Span, lower
from jax_decode import OPT0
from twin.abi.presets import TINY



def _bf16_values(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(ml_dtypes.bfloat16).astype(np.float32)


def test_every_bf16_gemm_of_the_step_multiplies_bf16_values(tiny_ckpt):
    """A TINY decode step with verify_bf16: each GEMM run on BF16 operands checks (traced, on the
    step's own values) that both operands were BF16 values; the compiled step has BF16 dots and
    keeps the FP32 GEMMs (hc mixes, hc_post, gate) FP32."""
    cfg = TINY
    s = Session(tiny_ckpt, cfg, "device", 2, 160, seed=2)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, 140)
    s.run({0: ids[:130], 1: ids[:123]})
    meta = lower(cfg, [Span(0, 130, tuple(ids[130:138]), s.blocks[0]),
                       Span(1, 123, tuple(ids[123:131]), s.blocks[1])], form=DECODE)
    jg = JaxGolden(tiny_ckpt, cfg, "device", compiler_options=OPT0, verify_bf16=True)
    jg.forward(meta, s.caches)
    assert jg.bf16_operands_ok is True
    hlo = jg.stablehlo()
    dots = re.findall(r"stablehlo.dot_general %\S+, %\S+, .*?: \(tensor<([^>]+)>, tensor<([^>]+)>\)", hlo)
    kinds = {(a.rsplit("x", 1)[-1], b.rsplit("x", 1)[-1]) for a, b in dots}
    assert ("bf16", "bf16") in kinds and ("f32", "f32") in kinds, kinds
    n16 = sum(1 for a, b in dots if a.endswith("xbf16") and b.endswith("xbf16"))
    assert n16 > len(dots) / 2, (n16, len(dots))


def test_verify_bf16_flags_an_operand_that_is_not_bf16():
    nm = Fp32Numerics("device", jnp, verify_bf16=True)
    rng = np.random.default_rng(0)
    w = _bf16_values(rng, (16, 8))

    def f(x):
        nm.bf16_state[1].clear()
        with nm.bf16_operands():
            y = nm.mm(x, w)
        ok = jnp.all(jnp.stack(nm.bf16_state[1]))
        nm.bf16_state[1].clear()
        return y, ok

    assert bool(jax.jit(f)(_bf16_values(rng, (4, 16)))[1])
    assert not bool(jax.jit(f)(rng.standard_normal((4, 16)).astype(np.float32))[1])
    # outside the context (or outside device mode) nothing is checked or narrowed
    x = rng.standard_normal((4, 16)).astype(np.float32)
    assert not nm.bf16_state[0]
    exact = x.astype(np.float64) @ w
    err = np.abs(np.asarray(nm.mm(jnp.asarray(x), jnp.asarray(w)), np.float64) - exact).max()
    assert err <= 1e-5 * np.abs(exact).max()        # x was not rounded to BF16 (that moves ~1e-3)


@settings(max_examples=20)
@given(M=st.integers(1, 40), K=st.sampled_from([1, 7, 64, 300, 1024]), N=st.integers(1, 40),
       seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_bf16_dot_is_an_f32_accumulated_dot(M, K, N, seed, scale):
    """|bf16 dot - exact| is within an f32 accumulation bound (K ulps of sum |a||b|): the products
    are exact, only the summation rounds."""
    rng = np.random.default_rng(seed)
    a, b = _bf16_values(rng, (M, K), scale), _bf16_values(rng, (K, N))
    nm = Fp32Numerics("device", jnp)
    with nm.bf16_operands():
        got = np.asarray(jax.jit(lambda a, b: dot(a, b, (((1,), (0,)), ((), ())), nm))(a, b), np.float64)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    bound = K * 2.0 ** -24 * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64))
    assert got.dtype == np.float64 and np.all(np.abs(got - exact) <= bound + 1e-300)


@pytest.mark.parametrize("seed", [0, 1])
def test_o_proj_grouped_equals_the_kernel(seed):
    """The JAX o_proj (dot_generals on the ABI layouts, BF16 operands) equals golden's o_proj:
    the same INT8 codes (f32 vs float64 sums of the wo_a GEMM may flip one) and output."""
    cfg, rng = TINY, np.random.default_rng(seed)
    T, G = 24, cfg.o_groups
    o = _bf16_values(rng, (T, cfg.num_attention_heads, cfg.head_dim))
    wo_a = _bf16_values(rng, (G, cfg.o_lora_rank, cfg.o_group_in), 0.05)
    wo_b = rng.integers(-127, 128, (G, cfg.hidden_size, cfg.o_lora_rank)).astype(np.int8)
    scale = rng.uniform(1e-3, 1e-2, cfg.hidden_size)
    ref = o_proj(pack_groups(o, cfg=cfg), wo_a, wo_b, scale, cfg=cfg, nm=Numerics("device"))
    nm = Fp32Numerics("device", jnp)

    def f(o, wo_a, wo_b, scale):
        with nm.bf16_operands():
            return o_proj_grouped(o, wo_a, wo_b, scale, cfg=cfg, nm=nm)
    got = np.asarray(jax.jit(f)(o, wo_a.astype(ml_dtypes.bfloat16), wo_b.astype(ml_dtypes.bfloat16),
                                scale.astype(np.float32)), np.float64)
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel <= 2e-3, rel          # an INT8 code flip moves a row by < 1 step of 127
    assert np.mean(np.isclose(got, ref, rtol=2 ** -7, atol=0)) > 0.95


def test_bf16_rounding_points_survive_fusion(tiny_ckpt):
    """A BF16 rounding point (o_proj's bf16 output) read by hc_post_streams inside one XLA fusion:
    with JaxGolden's XLA_OPTIONS the rounding happens, as in NumPy (XLA's default may drop the
    f32 -> bf16 -> f32 pair there, a BF16 ulp of error); JaxGolden compiles with those options."""
    from golden.jax_kernels import hc_post_streams
    from golden.jax_path import XLA_OPTIONS
    from golden.kernels.hyper_connections import hc_post
    from twin.abi.presets import SMALL
    cfg, rng = SMALL, np.random.default_rng(0)
    T = 128
    # small integers: every product and partial sum of a @ w is exact in f32, so NumPy's OpenBLAS and
    # XLA give the same GEMM bits in any summation order, and only the rounding point is under test
    a, w = (rng.integers(-8, 9, shape).astype(np.float32) for shape in ((T, 128), (128, 256)))
    r = rng.standard_normal((T, cfg.hc_mult, 256)).astype(np.float32)
    post, comb = rng.random((T, cfg.hc_mult)).astype(np.float32), rng.random((T, cfg.hc_mult ** 2)).astype(np.float32)
    nm, host = Fp32Numerics("device", jnp), Numerics("device")

    def f(a, w, r, post, comb):
        return hc_post_streams(nm.bf16(jnp.matmul(a, w) * 0.01), r, post, comb, cfg=cfg, nm=nm)
    ref = hc_post(host.bf16((a @ w) * np.float32(0.01)), r, post, comb, cfg=cfg, nm=host)
    got = np.asarray(jax.jit(f, compiler_options=XLA_OPTIONS)(a, w, r, post, comb), np.float64)
    assert np.abs(got - ref).max() <= 4 * 2.0 ** -24 * np.abs(ref).max()      # f32 sums only
    jg = JaxGolden(tiny_ckpt, TINY, "device", compiler_options=OPT0)
    assert jg.compiler_options == {**XLA_OPTIONS, **OPT0}
