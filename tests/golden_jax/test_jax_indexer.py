"""The JAX lightning indexer against golden's: with more candidates than index_topk the same ids
in the same order; with at most min(index_topk, TILE) candidates (every candidate is selected)
the same set per row, unscored, and a short-context decode step still equals NumPy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from golden.compose import Session, Taps, forward
from golden.jax_kernels import layout, lightning_indexer_grouped
from golden.jax_numerics import Fp32Numerics
from golden.jax_path import JaxGolden
from golden.kernels.indexer import lightning_indexer
from golden.kernels.sparse_attention import TILE
from golden.numerics import Numerics
from golden.paged import DECODE, Span, lower
from jax_parity_lib import assert_fp32_parity
from twin.abi.presets import TINY

LAYER = 2                      # a CSA layer of TINY


def _case(ckpt, prefix, seed=0):
    cfg = TINY
    rng = np.random.default_rng(seed)
    s = Session(ckpt, cfg, "device", 3, prefix + 8, seed=seed)
    ids = rng.integers(0, cfg.vocab_size, prefix + 8)
    s.run({r: ids[:prefix - 3 * r] for r in range(3)})
    meta = lower(cfg, [Span(r, prefix - 3 * r, tuple(ids[:8]), s.blocks[r]) for r in range(3)], form=DECODE)
    return s, meta


def _both(ckpt, s, meta, n_candidates, unmap=False):
    cfg, nm = TINY, Numerics("device")
    rng = np.random.default_rng(1)
    T = meta.T
    m = meta.arrays()
    table = np.array(m["idx_block_table"])
    if unmap:                                 # request 1 loses its second indexer page
        table[1, 1] = -1
    w = ckpt.layer(LAYER)
    x = nm.store_bf16(rng.standard_normal((T, cfg.hidden_size)))
    qr = rng.integers(-127, 128, (T, cfg.q_lora_rank)).astype(np.float64)
    qr_scale = rng.uniform(1e-3, 1e-2, (T, 1))
    rope = [np.asarray(v) for v in (np.ones((T, cfg.qk_rope_head_dim)), np.zeros((T, cfg.qk_rope_head_dim)))]
    pools = s.caches[LAYER]
    args = (x, qr, qr_scale, w["csa_idx_wq_b"], w["csa_idx_wq_b_scale"], w["csa_weights_proj"], w["csa_hadamard_idx"],
            rope[0], rope[1], pools["idx_kv_cache"], pools["idx_kv_scale"], table, m["req"], m["position_ids"],
            m["kv_seq_lens"] // 4)
    cap = cfg.max_position_embeddings // 4
    _, ref = lightning_indexer(*args, cfg=cfg, nm=nm, cap=cap, n_candidates=n_candidates)
    lay = layout(meta)
    jnm = Fp32Numerics("device", jnp)
    with jax.enable_x64(True):
        g = {k: jnp.asarray(v) for k, v in lay.arrays().items()}
        got = jax.jit(lambda *a: lightning_indexer_grouped(*a, cfg=cfg, nm=jnm, cap=cap, n_candidates=n_candidates)[0])(
            *[jnp.asarray(np.asarray(a)) for a in args], g)
    return np.asarray(got), np.asarray(ref)


@pytest.mark.parametrize("unmap", [False, True])
def test_all_candidates_selected_gives_the_same_sets(tiny_ckpt, unmap):
    """Prefix ~50: at most 13 visible compressed rows, 16 candidates = index_topk: every row's
    selection is the same set as golden's (which scored and ordered them)."""
    s, meta = _case(tiny_ckpt, 50)
    C = 16
    assert C <= min(TINY.index_topk, TILE)
    got, ref = _both(tiny_ckpt, s, meta, C, unmap)
    assert got.shape == ref.shape and (ref >= 0).any()
    for g_row, r_row in zip(got, ref):
        assert sorted(g_row[g_row >= 0]) == sorted(r_row[r_row >= 0])
    assert not np.array_equal(got, ref)      # golden's is score order: the shortcut is exercised


def test_more_candidates_than_topk_gives_the_same_order(tiny_ckpt):
    s, meta = _case(tiny_ckpt, 150)
    got, ref = _both(tiny_ckpt, s, meta, 64)
    assert (ref >= 0).sum() > 0
    np.testing.assert_array_equal(got, ref)


def test_short_context_decode_equals_numpy(tiny_ckpt):
    """A whole decode step where the indexer selects every candidate (prefix 50: 16 candidates)."""
    cfg, TAPS = TINY, ("ffn_x_mixed", "moe_indices")
    s, meta = _case(tiny_ckpt, 50, seed=3)
    jg = JaxGolden(tiny_ckpt, cfg, "device", compiler_options={"xla_backend_optimization_level": 0})
    assert jg.static_extents(meta)[0] <= cfg.index_topk
    ref = forward(tiny_ckpt, meta, s.caches, cfg=cfg, nm=s.nm, taps=Taps(TAPS))
    out = jg.forward(meta, s.caches, taps=TAPS)
    swaps, rows = assert_fp32_parity(out, ref, meta, tiny_ckpt, cfg)
    assert rows.size >= meta.T // 2
