"""The JAX path: the golden layer compositions on jax.numpy, each layer kind jit-compiled once,
equal to NumPy within FP32 tolerance (the same greedy tokens).

Compute is float64 as in NumPy (kernel-math rounding points are explicit), so every call runs
under `jax.enable_x64(True)` — a scoped setting, restored on exit; nothing global is changed.
What NumPy decides from data, JAX takes as static shapes computed on the host from the call's
metadata (`golden.jax_kernels.Layout`: the token grid, window unions, boundary tokens; candidate
counts), all part of the jit cache key.  Attention and the indexer gather candidates per request,
routed experts run in expert blocks (`golden.jax_kernels`): on a CPU, XLA's small-M batched
GEMMs over per-token candidates and dense all-expert MoE were 3-5x slower than NumPy.

    jg = JaxGolden(ckpt, cfg, "device")
    out = jg.forward(meta, caches)            # same signature and result as compose.forward
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .compose import ForwardOut, _check_contiguous, final_head, moe_sublayer, rope_inputs
from .kernels.embedding import lookup_embedding
from .kernels.indexer import PREFILL_SCORE_CAP
from .kernels.moe import shared_expert
from .jax_kernels import attention_sublayer_grouped, layout, moe_blocked
from .numerics import Numerics
from .paged import PREFILL, StepMeta

EXPERT_KEYS = ("routed_w1", "routed_w1_scale", "routed_w3", "routed_w3_scale", "routed_w2", "routed_w2_scale")


def _expert_mm(x, w, nm):
    """[E, T, N] = x . W_e^T for every expert: integer-valued x [T, K] or [E, T, K], int8 W [E, N, K];
    f32 GEMMs on K slices of <= 1024 (exact), slices added in the compute dtype."""
    from .numerics import EXACT_F32_K
    xp = nm.xp
    if nm.mode != "device":
        spec = "tk,enk->etn" if x.ndim == 2 else "etk,enk->etn"
        return xp.einsum(spec, nm.asf(x), nm.asf(w))
    x32, w32 = x.astype(xp.float32), w.astype(xp.float32)
    spec = "tk,enk->etn" if x.ndim == 2 else "etk,enk->etn"
    out = 0.0
    for k0 in range(0, x.shape[-1], EXACT_F32_K):
        out = out + xp.einsum(spec, x32[..., k0:k0 + EXACT_F32_K], w32[..., k0:k0 + EXACT_F32_K]).astype(nm.f)
    return out


def moe_dense_jax(x_i8, x_scale, indices, weights, expert, shared, *, cfg, nm):
    """The MoE on JAX: every expert on every row (dense batched GEMMs, E/K times the routed work,
    which on a small preset beats any gather or ragged GEMM on CPU), then each route (t, k) picks
    its expert's row.  The routing weight multiplies after the w2 GEMM, on the dequant scale, as
    on the device, so the rounding points are those of the NumPy grouped dispatch."""
    xp = nm.xp
    T, K = indices.shape
    lim = cfg.swiglu_limit
    sh = shared_expert(x_i8, x_scale, shared, cfg=cfg, nm=nm)
    g = _expert_mm(x_i8, expert["routed_w1"], nm) * x_scale[None] * nm.asf(expert["routed_w1_scale"])[:, None, :]
    u = _expert_mm(x_i8, expert["routed_w3"], nm) * x_scale[None] * nm.asf(expert["routed_w3_scale"])[:, None, :]
    g = xp.minimum(nm.r32(g), lim)
    u = xp.clip(nm.r32(u), -lim, lim)
    h_i8, h_dq = nm.q8(g / (1.0 + xp.exp(-g)) * u)                  # [E, T, I], [E, T, 1]
    y = _expert_mm(h_i8, expert["routed_w2"], nm)                   # [E, T, D]
    rows = xp.arange(T)[:, None]
    sel = y[indices, rows]                                          # [T, K, D]
    dq = h_dq[indices, rows] * weights[..., None]
    routed = nm.bf16(sel * dq * nm.asf(expert["routed_w2_scale"])[indices])
    out = nm.asf(sh)
    for k in range(K):
        out = out + routed[:, k]
    return nm.bf16(out)


class JaxGolden:
    def __init__(self, ckpt, cfg, mode: str = "device", compiler_options: dict | None = None):
        """compiler_options go to every jax.jit (e.g. {"xla_backend_optimization_level": 0} trades
        step speed for less compile time in tests)."""
        self.cfg = cfg
        self.compiler_options = compiler_options
        self.nm = Numerics(mode, jnp)
        self.host_nm = Numerics(mode)
        L = cfg.num_hidden_layers
        with jax.enable_x64(True):
            put = lambda d: {k: jnp.asarray(v) for k, v in d.items() if v is not None}
            self.layers = [put(ckpt.layer(l)) for l in range(L)]
            # a layer's routed experts stacked on a leading expert axis (one block reads one expert)
            self.experts = [{k: jnp.asarray(np.stack([ckpt.expert(l, e)[k] for e in range(cfg.n_routed_experts)]))
                             for k in EXPERT_KEYS} for l in range(L)]
            self.model = put(ckpt.model())
        self._fns = {}

    def _layer_fn(self, layer, form, n_idx, n_hca, lay):
        cfg = self.cfg
        ratio = cfg.compress_ratios[layer]
        key = (ratio, layer < cfg.num_hash_layers, form, n_idx, n_hca, lay.key())
        if key not in self._fns:
            n_win_tiles = lay.n_win_tiles

            def step(x_hc, w, ex, pools, m, g, rope, layer_id):
                g = dict(g, n_win_tiles=n_win_tiles)
                x_hc, pools = attention_sublayer_grouped(x_hc, layer_id, w, pools, m, rope, g, cfg=cfg, nm=self.nm,
                                                         form=form, ratio=ratio, n_idx=n_idx, n_hca=n_hca)
                x_hc = moe_sublayer(x_hc, layer_id, w, ex, m["input_ids"], cfg=cfg, nm=self.nm, moe=moe_blocked)
                return x_hc, pools
            # the layer id only selects routing (hash or scored): part of the key
            self._fns[key] = jax.jit(step, static_argnums=(7,), compiler_options=self.compiler_options)
        return self._fns[key], self._canonical_layer(key)

    def _head_fn(self):
        if "head" not in self._fns:
            self._fns["head"] = jax.jit(lambda x_hc, model, rows: final_head(x_hc, model, rows, cfg=self.cfg,
                                                                           nm=self.nm),
                                        compiler_options=self.compiler_options)
        return self._fns["head"]

    def static_extents(self, meta: StepMeta):
        """The candidate counts of a call: max indexer visibility and max HCA rows."""
        cfg, pos, lens = self.cfg, meta.position_ids, meta.kv_seq_lens[meta.req]
        cap = PREFILL_SCORE_CAP if meta.form == PREFILL else cfg.max_position_embeddings // 4
        n_idx = int(max(1, np.minimum(np.minimum(lens // 4, (pos + 1) // 4), cap).max(initial=1)))
        n_hca = int(np.minimum((pos + 1) // 128, lens // 128).max(initial=0))
        return n_idx, n_hca

    def forward(self, meta: StepMeta, caches) -> ForwardOut:
        cfg, nm = self.cfg, self.nm
        _check_contiguous(meta)
        n_idx, n_hca = self.static_extents(meta)
        lay = layout(meta)
        with jax.enable_x64(True):
            m = {k: jnp.asarray(v) for k, v in meta.arrays().items()}
            g = {k: jnp.asarray(v) for k, v in lay.arrays().items()}
            rope = {k: tuple(jnp.asarray(np.asarray(a)) for a in v)
                    for k, v in rope_inputs(cfg, meta.position_ids, self.host_nm).items()}
            _, x_hc = lookup_embedding(m["input_ids"], self.model["embed_weight"], cfg=cfg, nm=nm)
            out = []
            for layer in range(cfg.num_hidden_layers):
                fn, layer_id = self._layer_fn(layer, meta.form, n_idx, n_hca, lay)
                pools = {k: jnp.asarray(v) for k, v in caches[layer].items()}
                x_hc, pools = fn(x_hc, self.layers[layer], self.experts[layer], pools, m, g, rope, layer_id)
                out.append(pools)
            logits, sampled = self._head_fn()(x_hc, self.model, m["logit_row_indices"])
            logits.block_until_ready()
        return ForwardOut(logits, sampled, out, x_hc, None, meta)

    def _canonical_layer(self, key):
        """A representative layer id of a jit key (the first layer with that ratio and routing)."""
        cfg = self.cfg
        for l in range(cfg.num_hidden_layers):
            if (cfg.compress_ratios[l], l < cfg.num_hash_layers) == key[:2]:
                return l
        raise AssertionError(key)


def to_numpy(tree):
    return jax.tree_util.tree_map(np.asarray, tree)
