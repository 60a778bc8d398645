"""The indexer's Hadamard rotation: the exact +-1/sqrt(d) in exact and official mode, the ABI's
BF16 tensor in device mode, each against an independent fast Walsh-Hadamard transform."""
import numpy as np

from golden.checkpoint import SyntheticCheckpoint
from golden.kernels.indexer import index_query
from golden.kernels.rope import COMPRESS_PROFILE, rope_rows, rope_tail_bf16
from golden.numerics import FP4, FP4_MAX, Numerics, block_round_trip
from twin.abi.presets import TINY


def fwht(x):
    """Walsh-Hadamard transform of the last axis by butterflies (Sylvester order), scaled by
    n^-0.5: the official `rotate_activation`'s formula, written without a matrix."""
    y = np.array(x, np.float64)
    n, h = y.shape[-1], 1
    while h < n:
        y = y.reshape(y.shape[:-1] + (n // (2 * h), 2, h))
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :], y[..., 1, :] = a + b, a - b
        y = y.reshape(y.shape[:-3] + (n,))
        h *= 2
    return y * n ** -0.5


def test_rotation_is_exact_outside_device_mode_and_the_abi_tensor_in_it():
    H = SyntheticCheckpoint(TINY, seed=0).layer(2)["csa_hadamard_idx"]     # bf16, the ABI's dtype
    n = H.shape[0]
    x = np.random.default_rng(0).standard_normal((5, n))
    assert abs(float(H[0, 0]) * np.sqrt(n) - 1) > 1e-5      # TINY's bf16(1/sqrt(32)) is not exact
    for mode in ("exact", "official"):
        R = Numerics(mode).rotation(H)
        np.testing.assert_allclose(x @ R, fwht(x), rtol=0, atol=1e-13)
        np.testing.assert_allclose(R @ R.T, np.eye(n), rtol=0, atol=1e-15)
    R = Numerics("device").rotation(H)
    np.testing.assert_array_equal(R, np.asarray(H, np.float64))
    np.testing.assert_allclose(x @ R, fwht(x) * float(H[0, 0]) * np.sqrt(n), rtol=0, atol=1e-13)


def test_official_indexer_query_rounds_the_exactly_rotated_query_to_fp4():
    """The FP4 step sees the exact rotation: with BF16's 1e-4 factor some elements land on another
    FP4 step (the test shows both: the kernel matches the exact formulation, the BF16 one does not)."""
    cfg, nm = TINY, Numerics("official")
    w = SyntheticCheckpoint(cfg, seed=0).layer(2)
    rng = np.random.default_rng(1)
    T = 512
    qr = rng.integers(-127, 128, (T, cfg.q_lora_rank)).astype(np.float64)
    qs = rng.uniform(1e-3, 2e-3, (T, 1))
    cos, sin = rope_rows(cfg, COMPRESS_PROFILE, rng.integers(0, 4000, T), nm)
    q, scale = index_query(qr, qs, w["csa_idx_wq_b"], w["csa_idx_wq_b_scale"], w["csa_hadamard_idx"], cos, sin,
                           cfg=cfg, nm=nm)
    pre = (qr @ (np.asarray(w["csa_idx_wq_b"], np.float64) * w["csa_idx_wq_b_scale"])) * qs
    pre = rope_tail_bf16(pre.reshape(T, cfg.index_n_heads, cfg.index_head_dim), cos[:, None], sin[:, None], nm)
    want = block_round_trip(fwht(pre), 32, FP4, FP4_MAX)
    bf16_rotated = block_round_trip(pre @ np.asarray(w["csa_hadamard_idx"], np.float64), 32, FP4, FP4_MAX)
    assert np.all(scale == 1)
    # the two formulations sum in different orders (1e-16): allow a flip at an exact FP4 midpoint
    assert np.mean(q != want) < 1e-4
    assert np.sum(bf16_rotated != want) >= 10 * max(1, np.sum(q != want))
