"""JaxGolden.layer_step: one target layer on JAX (a checker's unit of work at FLASH, where a whole
model does not fit), holding only the layers asked for.  It runs the whole step's own layer code,
so from the same input and pools it gives the whole step's layer output; the experts it reads
are its layer's (held layers stack in order: layer 4 of (4, 6) is row 0).  From NumPy's input,
pools and taps of a layer (re-synced as the whole step is), its output is NumPy's within
kernel-math §2."""
import numpy as np
import pytest

from golden.checkpoint import SyntheticCheckpoint
from golden.compose import Taps, forward
from golden.jax_path import JaxGolden
from golden.jax_resync import COSINE_MIN, REL_L2_MAX, RESYNC_STAGES
from jax_decode import OPT0, session
from twin.abi.errors import AbiError
from twin.abi.presets import TINY


def _rows(a):
    a = np.asarray(a, np.float64)
    return a.reshape(a.shape[0], -1)


def test_layer_step_is_the_whole_steps_layer():
    cfg = TINY
    ckpt = SyntheticCheckpoint(cfg, seed=0)
    s, meta = session(ckpt, cfg, 2, 96)
    whole = JaxGolden(ckpt, cfg, "device", compiler_options=OPT0)
    full = whole.forward(meta, s.caches, taps=("attn_in", "x_hc"))
    part = JaxGolden(ckpt, cfg, "device", compiler_options=OPT0, layers=(6, 4))
    assert part.held == [4, 6] and part.expert_row == {4: 0, 6: 1}
    for layer in (4, 6):
        x, pools = part.layer_step(full.taps[(layer, "attn_in")], layer, meta, s.caches[layer])
        got, want = _rows(x), _rows(full.taps[(layer, "x_hc")])
        # two XLA programs (one layer, the whole step) over the same ops: equal up to fusion's
        # FP32 rounding; another layer's experts or pools would move every row by whole outputs
        rel = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
        assert rel.max() <= 1e-3, (layer, rel.max())
        for name in ("kv_cache", "csa_cmp_kv", "idx_kv_cache"):
            if name in pools:
                a = np.asarray(pools[name], np.float64)
                b = np.asarray(full.caches[layer][name], np.float64)
                assert np.abs(a - b).max() <= 1e-2 * np.abs(b).max(), (layer, name)
    with pytest.raises(AbiError, match="layer"):
        part.layer_step(full.taps[(2, "attn_in")], 2, meta, s.caches[2])
    with pytest.raises(AbiError, match="layers"):
        part.forward(meta, s.caches)
    with pytest.raises(AbiError, match="layers"):
        JaxGolden(ckpt, cfg, "device", layers=(cfg.num_hidden_layers,))


def test_layer_step_resynced_from_numpy_is_numpys_layer():
    """TINY at 104 tokens: layer 4 (CSA, routed: both rankings) from NumPy's layer input."""
    cfg, layer = TINY, 4
    ckpt = SyntheticCheckpoint(cfg, seed=0)
    s, meta = session(ckpt, cfg, 2, 96)
    ref = forward(ckpt, meta, s.caches, cfg=cfg, nm=s.nm, taps=Taps((*RESYNC_STAGES, "attn_in", "x_hc")))
    jg = JaxGolden(ckpt, cfg, "device", compiler_options=OPT0, layers=(layer,))
    x, _ = jg.layer_step(ref.taps[(layer, "attn_in")], layer, meta, s.caches[layer], resync_from=ref.taps)
    got, want = _rows(x), _rows(ref.taps[(layer, "x_hc")])
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    rel = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= COSINE_MIN and rel.max() <= REL_L2_MAX, (cos.min(), rel.max())
    counts = jg.resyncs.counts()
    assert counts["refused"] == 0 and counts["index_refused"] == 0, counts
    with pytest.raises(AbiError, match="resync_from"):
        jg.layer_step(ref.taps[(layer, "attn_in")], layer, meta, s.caches[layer], resync_from=Taps())
