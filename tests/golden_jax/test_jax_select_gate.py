"""The JAX path's sort-free selections and its MoE router equal the NumPy kernels' choices
exactly: top-k ids in the stable descending order (ties to the lower index, -0.0 == 0.0), greedy
ids as argmax, the router's experts and weights, and hc_post's stream mix."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from golden.jax_kernels import hc_post_streams
from golden.jax_numerics import Fp32Numerics
from golden.jax_select import first_max, top_k_desc
from golden.kernels.hyper_connections import hc_post
from golden.kernels.moe import gate
from golden.numerics import Numerics
from twin.abi.presets import SMALL


def _scores(rng, shape, ties):
    if ties:      # few distinct values, signed zeros among them
        x = rng.choice(np.array([-1.5, -0.0, 0.0, 0.25, 2.0, -3.4028e38], np.float32), shape)
    else:
        x = rng.standard_normal(shape).astype(np.float32)
    return x


@settings(max_examples=40)
@given(rows=st.integers(1, 5), C=st.sampled_from([1, 2, 5, 32, 64, 128, 129, 300]),
       kfrac=st.sampled_from([0.1, 0.5, 1.0, 2.0]), ties=st.booleans(), seed=st.integers(0, 2**16))
def test_top_k_desc_is_the_stable_argsort(rows, C, kfrac, ties, seed):
    x = _scores(np.random.default_rng(seed), (rows, C), ties)
    k = max(1, int(C * kfrac))
    got = np.asarray(jax.jit(lambda x: top_k_desc(x, k))(x))
    want = np.asarray(jnp.argsort(-jnp.asarray(x), axis=-1, stable=True))[:, :k]
    assert got.dtype == np.int32 and got.shape == (rows, min(k, C))
    np.testing.assert_array_equal(got, want)


@settings(max_examples=30)
@given(rows=st.integers(1, 6), V=st.integers(1, 50), seed=st.integers(0, 2**16), ties=st.booleans(),
       nan=st.booleans())
def test_first_max_is_argmax(rows, V, seed, ties, nan):
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 3, (rows, V)).astype(np.float32) if ties else rng.standard_normal((rows, V)).astype(np.float32)
    if nan:
        x[rng.random(x.shape) < 0.1] = np.nan
    got = np.asarray(jax.jit(first_max)(x))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


@pytest.mark.parametrize("mode", ["device", "exact", "official"])
@pytest.mark.parametrize("layer", [0, 4])           # a hash layer (tid2eid) and a scored one
def test_the_steps_gate_equals_the_kernel(small_ckpt, mode, layer):
    """moe.gate with top_k=top_k_desc (what the JAX step runs): same experts (ties included:
    duplicated gate rows score alike) and weights as moe.gate's stable argsort."""
    cfg, rng = SMALL, np.random.default_rng(layer)
    w = dict(small_ckpt.layer(layer))
    gate_w = np.array(w["gate_w"])
    gate_w[5], gate_w[9] = gate_w[2], gate_w[2]     # three experts tie on every token
    bias = None if w.get("gate_bias") is None else np.array(w["gate_bias"])
    if bias is not None:
        bias[5] = bias[9] = bias[2]
    T = 64
    x = (rng.standard_normal((T, cfg.hidden_size)) * 0.5).astype(np.float32)
    ids = rng.integers(0, cfg.vocab_size, T)
    args = (w["norm_w"], gate_w, bias, w.get("tid2eid"), ids)
    ref = gate(x, *args, layer=layer, cfg=cfg, nm=Numerics(mode))
    nm = Fp32Numerics(mode, jnp)
    with jax.enable_x64(True):
        got = jax.jit(lambda x: gate(x, *[None if a is None else jnp.asarray(a) for a in args], layer=layer,
                                     cfg=cfg, nm=nm, top_k=top_k_desc))(x)
        got = [np.asarray(g) for g in got]
    np.testing.assert_array_equal(got[2], ref[2])                  # experts, in order
    tol = 1e-12 if mode == "exact" else 2e-6
    for g, r in zip((got[0], got[1], got[3]), (ref[0], ref[1], ref[3])):
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol * np.abs(r).max())


@pytest.mark.parametrize("mode", ["device", "exact", "official"])
def test_hc_post_streams_equals_hc_post(mode):
    cfg, rng = SMALL, np.random.default_rng(3)
    T, hc = 40, SMALL.hc_mult
    x = rng.standard_normal((T, cfg.hidden_size))
    r, post, comb = rng.standard_normal((T, hc, cfg.hidden_size)), rng.random((T, hc)), rng.random((T, hc * hc))
    ref = hc_post(x, r, post, comb, cfg=cfg, nm=Numerics(mode))
    nm = Fp32Numerics(mode, jnp)
    with jax.enable_x64(True):
        got = np.asarray(jax.jit(lambda *a: hc_post_streams(*a, cfg=cfg, nm=nm))(
            *[jnp.asarray(v, nm.f) for v in (x, r, post, comb)]), np.float64)
    bound = 1e-12 if mode == "exact" else (2 ** -8 if mode == "official" else 4 * 2.0 ** -24)
    assert np.abs(got - ref).max() <= bound * np.abs(ref).max()
