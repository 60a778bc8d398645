"""Where the JAX path may stand in for NumPy: routing and indexer near-ties re-synced from the
reference, the agreement criterion, and the rule that says for which (preset, program) a checker
may use JAX.

Why re-sync.  The JAX path carries sums in FP32 (the device's accumulator), NumPy in float64; the
two differ by an FP32 ulp at layer 0's first hc mix.  Quantization points amplify that: an INT8
code of a row flips by one step (~1/127 of the row's amax), and wherever a token's K-th and
(K+1)-th expert scores are within the drift, the two sides route it to different experts, after
which its request's rows differ by whole expert outputs.  On SMALL's decode step the first such
swap is at layer 2 (the first routed layer), and by the head a quarter of the rows are outside
kernel-math §2; with every route re-synced, every row is inside it.  A lockstep re-syncs a device
the same way; here NumPy plays the device's part.  The indexer's top-k is the other ranking: its
scores are sums of INT8 products, where one code flip of a token's query moves a score by percents,
so past min(index_topk, TILE) candidates the two sides can keep different compressed rows at the
boundary.  There the JAX path takes the lockstep's own indexer rule (golden.ties.index_near_ties,
under JAX's scores), and counts any other difference as refused.

The margin is a bound, not a fitted number.  A router score is b_e = f(l_e) + bias_e with
f = sqrt(softplus), l_e = u . g_e, u = x * norm_w * rsqrt(mean(x^2) + eps) (kernel-math K14) and
g_e the gate row of expert e.  |f'| <= SCORE_SLOPE everywhere, so the two sides' scores of expert
e differ by at most

    delta_e = SCORE_SLOPE * (|u_jax - u_ref|_2 + D * 2^-24 * |u_jax|_2) * |g_e|_2 + rounding

(Cauchy-Schwarz on the input difference; the second term bounds JAX's FP32 dot over D terms; the
rounding term covers the FP32 rounding of logits and scores).  NumPy choosing expert a over b
means b_ref[a] >= b_ref[b], hence b_jax[b] - b_jax[a] <= delta_a + delta_b.  A reference
selection is adopted on a row only when every pair (a only NumPy picked, b only JAX picked) meets
that: the difference is then explained by the input drift alone.  Any other difference is refused
and counted (a divergence: a wrong expert, a broken score).  Rows with the same experts in
another order take NumPy's order (the combine adds routes in k order) and are counted apart.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

from twin.abi.errors import AbiError

from .kernels.rmsnorm import rms_scale

# max over l of d/dl sqrt(softplus(l)) = sigmoid(l) / (2 sqrt(softplus(l))), reached at l ~ 0.92
# (tests/golden_jax/test_jax_resync.py evaluates it on a fine grid)
SCORE_SLOPE = 0.3191
COSINE_MIN, REL_L2_MAX = 0.99, 0.10          # kernel-math §2, full forward: every logit row
ROUTE_STAGES = ("ffn_x_mixed", "moe_indices")    # what the reference's taps hold to re-sync routing
INDEX_STAGE = "idx_topk"                          # ... and the indexer's selection (every CSA layer)
RESYNC_STAGES = (*ROUTE_STAGES, INDEX_STAGE)
# the programs the JAX path runs (compose.forward's target model)
JAX_PROGRAMS = ("l3_prefill_fwd", "l3_decode_fwd")


def route_bounds(x_own, x_ref, norm_w, gate_w, *, cfg, nm):
    """delta [T, E]: the most the biased router scores of inputs x_own and x_ref [T, D] can differ
    by, per expert (see the module docstring)."""
    D = x_own.shape[-1]

    def u(x):
        x = nm.asf(x)
        return x * nm.asf(norm_w) * rms_scale(x, nm, cfg.rms_norm_eps)
    uo = u(x_own)
    du = jnp.linalg.norm(uo - u(x_ref), axis=-1)
    dot_err = D * 2.0 ** -24 * jnp.linalg.norm(uo, axis=-1)
    gn = jnp.linalg.norm(nm.asf(gate_w), axis=-1)
    return SCORE_SLOPE * (du + dot_err)[:, None] * gn[None, :]


def adopt_routes(biased, own, ref, delta):
    """-> (selection, adopted [T], refused [T], reordered [T]): NumPy's selection `ref` [T, K] on
    every row where it differs from JAX's `own` [T, K] within the bound (biased: JAX's scores
    [T, E]; delta [T, E] from route_bounds), `own` elsewhere."""
    ref = ref.astype(own.dtype)
    ref_in_own = jnp.any(ref[:, :, None] == own[:, None, :], axis=2)           # [T, K]
    own_in_ref = jnp.any(own[:, :, None] == ref[:, None, :], axis=2)
    same_set = jnp.all(ref_in_own, axis=1)
    reordered = same_set & jnp.any(ref != own, axis=1)
    s = jnp.take_along_axis(biased, ref, axis=1), jnp.take_along_axis(biased, own, axis=1)
    d = jnp.take_along_axis(delta, ref, axis=1), jnp.take_along_axis(delta, own, axis=1)
    # fp32 rounding of the compared scores themselves: a few ulps of the row's largest
    slack = 8 * 2.0 ** -24 * jnp.max(jnp.abs(biased), axis=1)
    gap = s[1][:, None, :] - s[0][:, :, None]                                  # [T, ref k, own k]
    viol = (~ref_in_own[:, :, None]) & (~own_in_ref[:, None, :]) & \
        (gap > d[0][:, :, None] + d[1][:, None, :] + slack[:, None, None])
    ok = ~jnp.any(viol, axis=(1, 2))
    adopted, refused = ~same_set & ok, ~same_set & ~ok
    take = adopted | reordered
    return jnp.where(take[:, None], ref, own), adopted, refused, reordered


@dataclass
class Resyncs:
    """What one JAX forward adopted from the reference: layer -> token rows, per kind."""

    adopted: dict = field(default_factory=dict)      # other experts, within the bound
    refused: dict = field(default_factory=dict)      # other experts, beyond it (divergences)
    reordered: dict = field(default_factory=dict)    # the same experts in NumPy's order
    index_adopted: dict = field(default_factory=dict)   # other compressed rows, a near tie (golden.ties)
    index_refused: dict = field(default_factory=dict)   # other compressed rows, beyond it (divergences)

    KINDS = ("adopted", "refused", "reordered", "index_adopted", "index_refused")

    @classmethod
    def from_masks(cls, routes: dict, index: dict | None = None) -> "Resyncs":
        """routes: layer -> [3, T] bool (adopted, refused, reordered); index: layer -> [2, T] bool
        (adopted, refused)."""
        out = cls()
        for masks, kinds in ((routes, cls.KINDS[:3]), (index or {}, cls.KINDS[3:])):
            for layer, m in sorted(masks.items()):
                for kind, row in zip(kinds, np.asarray(m)):
                    if row.any():
                        getattr(out, kind)[layer] = np.flatnonzero(row).tolist()
        return out

    def counts(self) -> dict:
        return {k: sum(len(v) for v in getattr(self, k).values()) for k in self.KINDS}


def agreement(out, ref, resyncs: Resyncs | None = None) -> dict:
    """The JAX forward `out` against NumPy's `ref` (compose.ForwardOut both), kernel-math §2 per
    logit row: counts, the worst row, greedy ids (equal, or NumPy's top-2 within twice the row's
    largest logit difference: a near tie), and the re-syncs (routes, indexer rows).  `agrees`:
    every row within the tolerances, every greedy difference a near tie, no refused re-sync."""
    a, b = np.asarray(out.logits, np.float64), np.asarray(ref.logits, np.float64)
    cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-300)
    rl2 = np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-300)
    ga, gb = np.asarray(out.sampled), np.asarray(ref.sampled)
    top2 = np.sort(b, axis=1)[:, -2:]
    near = (top2[:, 1] - top2[:, 0]) <= 2 * np.abs(a - b).max(axis=1, initial=0.0)
    within = (cos >= COSINE_MIN) & (rl2 <= REL_L2_MAX)
    counts = (resyncs or Resyncs()).counts()
    res = {"rows": int(a.shape[0]), "rows_within_tol": int(within.sum()), "min_row_cosine": float(cos.min(initial=1.0)),
           "max_row_rel_l2": float(rl2.max(initial=0.0)), "same_greedy_rows": int(np.sum(ga == gb)),
           "greedy_near_tie_rows": int(np.sum((ga != gb) & near)),
           "greedy_mismatch_rows": int(np.sum((ga != gb) & ~near)),
           "route_resyncs": counts["adopted"], "route_refused": counts["refused"],
           "route_reordered": counts["reordered"], "index_resyncs": counts["index_adopted"],
           "index_refused": counts["index_refused"]}
    res["agrees"] = bool(within.all() and res["greedy_mismatch_rows"] == 0 and counts["refused"] == 0
                         and counts["index_refused"] == 0)
    return res


def jax_admissible(cfg, program: str, mode: str = "device", *, max_len: int | None = None) -> tuple[bool, str]:
    """May a checker use the JAX path for `program` on preset `cfg` up to `max_len` tokens (default
    the preset's max_position_embeddings)?  -> (yes, why).

    The agreement criterion (`agreement`: every logit row within kernel-math §2, no refused
    re-sync) holds where the JAX path runs the program and every ranking it makes is re-synced
    from the reference at near ties: the router's experts (the score bound above) and the
    indexer's compressed rows (golden.ties.index_near_ties), so the context length does not
    limit it.  Official mode on an FP32 checkpoint has no JAX path."""
    if program not in JAX_PROGRAMS:
        return False, f"{program}: the JAX path runs only {JAX_PROGRAMS} (the target model)"
    if mode not in ("device", "exact"):
        return False, f"mode {mode}: agreement is established for device and exact mode only"
    L = cfg.max_position_embeddings if max_len is None else int(max_len)
    if not 1 <= L <= cfg.max_position_embeddings:
        raise AbiError("max_len", max_len, f"a token count in [1, {cfg.max_position_embeddings}] "
                       f"({cfg.name}'s max_position_embeddings)", where="jax_admissible")
    return True, (f"{cfg.name} {program} ({mode}) up to {L} tokens: the agreement criterion with routing "
                  f"and the indexer's top-k re-synced")
