"""What "JAX (FP32 accumulation) equals NumPy (float64 carry)" means, as checks shared by the JAX
tests (a uniquely named module: tests/ is not a package).  The JAX side runs in XLA's own CPU
kernels and threads: .ci/run's OPENBLAS_* configuration changes only the NumPy side.

kernel-math §2 (full forward): logits cosine >= 0.99 and relative L2 <= 0.10 per row, sampled ids
equal.  Accumulating in FP32 instead of float64 moves values by an FP32 ulp; quantization points
(BF16, INT8, top-k routing) amplify a ulp into a step where a value sits on a rounding or ranking
boundary.  So the checks are tie-aware:

* routing: wherever the two sides pick different experts, the swap must be explained by the
  score perturbation: each expert only JAX picked scores (on NumPy's input) within 2 * delta of
  NumPy's K-th pick, delta = the largest score difference between the two sides' inputs.  A wrong
  expert (a bug) sits far from the boundary and fails.
* logits: every row whose request saw no routing swap (in any layer, at or before the row's
  position) is within the §2 tolerances, and its greedy id is NumPy's unless NumPy's top-2 margin
  is within twice the row's largest logit difference (a near tie).
"""
import numpy as np

from golden.jax_resync import COSINE_MIN, REL_L2_MAX
from golden.kernels.moe import _softplus
from golden.kernels.rmsnorm import rms_scale
from golden.numerics import Numerics

_EXACT = Numerics("exact")


def gate_scores(x_mixed, w, cfg):
    """The biased router scores sqrt(softplus(inv_rms * (x * norm_w) . gate_w)) + bias in float64."""
    x = np.asarray(x_mixed, np.float64)
    logits = rms_scale(x, _EXACT, cfg.rms_norm_eps) * ((x * np.asarray(w["norm_w"], np.float64))
                                                       @ np.asarray(w["gate_w"], np.float64).T)
    return np.sqrt(_softplus(logits, np)) + np.asarray(w["gate_bias"], np.float64)


def routing_swaps(jax_taps, np_taps, ckpt, cfg):
    """-> ([(layer, token)] swaps, [(layer, token, gap, delta)] swaps NOT explained by a near tie)."""
    swaps, unexplained = [], []
    for layer in range(cfg.num_hash_layers, cfg.num_hidden_layers):
        a = np.asarray(jax_taps[(layer, "moe_indices")])
        b = np.asarray(np_taps[(layer, "moe_indices")])
        rows = np.nonzero(np.any(np.sort(a, 1) != np.sort(b, 1), axis=1))[0]
        if not rows.size:
            continue
        w = ckpt.layer(layer)
        sj = gate_scores(np.asarray(jax_taps[(layer, "ffn_x_mixed")])[rows], w, cfg)
        sn = gate_scores(np.asarray(np_taps[(layer, "ffn_x_mixed")])[rows], w, cfg)
        for i, t in enumerate(rows):
            swaps.append((layer, int(t)))
            delta = np.abs(sj[i] - sn[i]).max() + 1e-6 * np.abs(sn[i]).max()
            kth = sn[i][b[t]].min()
            only_jax = np.setdiff1d(a[t], b[t])
            gap = float(kth - sn[i][only_jax].min())
            if gap > 2 * delta:
                unexplained.append((layer, int(t), gap, float(delta)))
    return swaps, unexplained


def clean_rows(meta, swaps):
    """Logit rows whose request had no routing swap at or before the row's position."""
    pos, req = np.asarray(meta.position_ids), np.asarray(meta.req)
    first_bad = {}
    for _, t in swaps:
        first_bad[req[t]] = min(first_bad.get(req[t], np.inf), pos[t])
    src = np.asarray(meta.logit_row_indices)
    return np.array([i for i, t in enumerate(src) if t >= 0 and pos[t] < first_bad.get(req[t], np.inf)], int)


def row_metrics(got, ref):
    a, b = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-300)
    rl2 = np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-300)
    return cos, rl2


def greedy_mismatches(got_logits, ref_logits, got_ids, ref_ids, rows):
    """Rows (of `rows`) whose greedy ids differ although NumPy's top-2 margin is not a near tie."""
    a, b = np.asarray(got_logits, np.float64), np.asarray(ref_logits, np.float64)
    bad = []
    for r in rows:
        if int(got_ids[r]) == int(ref_ids[r]):
            continue
        top2 = np.sort(b[r])[-2:]
        if top2[1] - top2[0] > 2 * np.abs(a[r] - b[r]).max():
            bad.append(int(r))
    return bad


def assert_fp32_parity(out, ref, meta, ckpt, cfg, max_swapped_fraction=1.0):
    """out: JaxGolden.forward(..., taps=("ffn_x_mixed", "moe_indices")); ref: compose.forward with
    Taps.  Returns (swaps, clean rows) for the caller's own assertions."""
    swaps, unexplained = routing_swaps(out.taps, ref.taps, ckpt, cfg)
    assert not unexplained, f"routing swaps with no near tie (layer, token, gap, delta): {unexplained[:5]}"
    rows = clean_rows(meta, swaps)
    assert rows.size >= (1 - max_swapped_fraction) * len(meta.logit_row_indices)
    cos, rl2 = row_metrics(np.asarray(out.logits)[rows], np.asarray(ref.logits)[rows])
    assert cos.min(initial=1.0) >= COSINE_MIN and rl2.max(initial=0.0) <= REL_L2_MAX, (cos.min(), rl2.max())
    got_ids, ref_ids = np.asarray(out.sampled), np.asarray(ref.sampled)
    assert not greedy_mismatches(out.logits, ref.logits, got_ids, ref_ids, rows)
    return swaps, rows
