"""The JAX path (jit per layer kind) equals the NumPy reference on a decode step."""
import numpy as np
import pytest

from golden.compose import Session, forward
from golden.jax_path import JaxGolden
from golden.paged import DECODE, Span, lower
from golden_testlib import rel
from twin.abi.presets import TINY


@pytest.mark.parametrize("mode", ["device"])
def test_jax_decode_step_equals_numpy(tiny_ckpt, mode):
    cfg = TINY
    rng = np.random.default_rng(4)
    s = Session(tiny_ckpt, cfg, mode, 2, 160, seed=2)
    ids = rng.integers(0, cfg.vocab_size, 140)
    s.run({0: ids[:130], 1: ids[:123]})               # both requests resident; decode crosses boundaries
    meta = lower(cfg, [Span(0, 130, tuple(ids[130:138]), s.blocks[0]),
                       Span(1, 123, tuple(ids[123:131]), s.blocks[1])], form=DECODE)
    ref = forward(tiny_ckpt, meta, s.caches, cfg=cfg, nm=s.nm)
    out = JaxGolden(tiny_ckpt, cfg, mode, compiler_options={"xla_backend_optimization_level": 0}).forward(
        meta, s.caches)
    logits = np.asarray(out.logits)
    assert rel(logits, ref.logits) <= (1e-12 if mode == "exact" else 1e-6)
    assert np.array_equal(np.asarray(out.sampled), ref.sampled)
    for layer in (0, 2, 3):
        for name, pool in ref.caches[layer].items():
            got = np.asarray(out.caches[layer][name], np.float64)
            assert rel(got, np.asarray(pool, np.float64)) <= (1e-12 if mode == "exact" else 1e-6), (layer, name)
