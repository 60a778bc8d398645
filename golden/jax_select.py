"""Selections on the JAX path without XLA CPU's comparator sort (a stable argsort of a [128, 64]
row block costs ~0.6 ms there, a (value, index) argmax ~10x a plain reduction).

Both give exactly what the NumPy kernels' jnp/np calls give: `top_k_desc(x, k)` is
`argsort(-x, stable=True)[..., :k]` (descending, ties to the lower index, -0.0 equal to 0.0 as
JAX's sort canonicalizes it); `first_max(x)` is `argmax(x)` (the first maximum; the first NaN of
a row that holds one).  Scores reaching top_k_desc are never NaN (masked entries are -3.4e38).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

RANK_MAX = 128      # widest row ranked by pairwise comparison (C^2 work) when every entry is kept


def top_k_desc(x, k: int):
    """Indices [..., k] of the k largest of x along the last axis, in stable descending order."""
    C = x.shape[-1]
    k = min(k, C)
    x = jnp.where(x == 0, 0.0, x).astype(x.dtype)          # -0.0 ranks as 0.0
    if k < C or C > RANK_MAX:
        # XLA's TopK (a partial selection for k < C): descending, ties to the lower index
        return lax.top_k(x, k)[1].astype(jnp.int32)
    # the whole order: each entry's rank = how many entries come before it, then the inverse
    i = jnp.arange(C, dtype=jnp.int32)
    xi, xj = x[..., :, None], x[..., None, :]
    before = (xj > xi) | ((xj == xi) & (i[None, :] < i[:, None]))
    rank = jnp.sum(before, axis=-1, dtype=jnp.int32)                      # [..., C]
    hit = rank[..., None, :] == i[:, None]                                # [..., r, c]
    return jnp.sum(jnp.where(hit, i, 0), axis=-1, dtype=jnp.int32)


def first_max(logits):
    """jnp.argmax's ids (the first maximum; the first NaN in a row holding one) as two plain
    reductions."""
    V = logits.shape[-1]
    mx = jnp.max(logits, axis=-1, keepdims=True)
    hit = (logits == mx) | jnp.isnan(logits)
    return jnp.min(jnp.where(hit, jnp.arange(V, dtype=jnp.int32), V), axis=-1).astype(jnp.int32)
