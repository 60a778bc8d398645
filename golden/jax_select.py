"""Selections on the JAX path, mostly without XLA CPU's comparator sort (a stable argsort of a
[128, 64] row block costs ~0.6 ms there, a (value, index) argmax ~10x a plain reduction).
`top_k_desc` is XLA's TopK, a partial selection while k < C; at k >= C (the whole row kept) XLA
lowers it to a stable sort, which the indexer reaches when index_topk > TILE and a request has
between TILE and index_topk candidates (FLASH: 512 > 128); the router always keeps k < C.

Both give exactly what the NumPy kernels' jnp/np calls give: `top_k_desc(x, k)` is
`argsort(-x, stable=True)[..., :k]` (descending, ties to the lower index, -0.0 equal to 0.0 as
JAX's sort canonicalizes it); `first_max(x)` is `argmax(x)` (the first maximum; the first NaN of
a row that holds one).  Scores reaching top_k_desc are never NaN (masked entries are -3.4e38).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def top_k_desc(x, k: int):
    """Indices [..., min(k, C)] of the k largest of x along the last axis, in stable descending
    order: XLA's TopK (descending, ties to the lower index; a partial selection for k < C, a
    stable sort for k >= C) with -0.0 ranked as 0.0."""
    k = min(k, x.shape[-1])
    x = jnp.where(x == 0, 0.0, x).astype(x.dtype)
    return lax.top_k(x, k)[1].astype(jnp.int32)


def first_max(logits):
    """jnp.argmax's ids (the first maximum; the first NaN in a row holding one) as two plain
    reductions."""
    V = logits.shape[-1]
    mx = jnp.max(logits, axis=-1, keepdims=True)
    hit = (logits == mx) | jnp.isnan(logits)
    return jnp.min(jnp.where(hit, jnp.arange(V, dtype=jnp.int32), V), axis=-1).astype(jnp.int32)
