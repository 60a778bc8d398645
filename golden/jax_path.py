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
from .jax_kernels import attention_sublayer_grouped, layout, moe_blocked
from .kernels.embedding import lookup_embedding
from .kernels.indexer import PREFILL_SCORE_CAP
from .numerics import Numerics
from .paged import PREFILL, StepMeta

EXPERT_KEYS = ("routed_w1", "routed_w1_scale", "routed_w3", "routed_w3_scale", "routed_w2", "routed_w2_scale")


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

    def _embed_fn(self):
        if "embed" not in self._fns:     # eager, its gather and broadcast cost ~5 ms of dispatch per call
            self._fns["embed"] = jax.jit(lambda ids, w: lookup_embedding(ids, w, cfg=self.cfg, nm=self.nm)[1],
                                         compiler_options=self.compiler_options)
        return self._fns["embed"]

    def _head_fn(self):
        if "head" not in self._fns:
            self._fns["head"] = jax.jit(lambda x_hc, model, rows: final_head(x_hc, model, rows, cfg=self.cfg,
                                                                           nm=self.nm),
                                        compiler_options=self.compiler_options)
        return self._fns["head"]

    def static_extents(self, meta: StepMeta):
        """The candidate counts of a call (max indexer visibility, max HCA rows), rounded up to a
        power of two: a decode loop recompiles only when they cross one.  Extra candidates are
        invisible to every token (masked, and ranked after every visible one), so the results
        do not depend on the rounding."""
        cfg, pos, lens = self.cfg, meta.position_ids, meta.kv_seq_lens[meta.req]
        cap = PREFILL_SCORE_CAP if meta.form == PREFILL else cfg.max_position_embeddings // 4
        n_idx = int(max(1, np.minimum(np.minimum(lens // 4, (pos + 1) // 4), cap).max(initial=1)))
        n_hca = int(np.minimum((pos + 1) // 128, lens // 128).max(initial=0))
        return _bucket(n_idx, 16), (_bucket(n_hca, 1) if n_hca else 0)

    def forward(self, meta: StepMeta, caches) -> ForwardOut:
        cfg = self.cfg
        _check_contiguous(meta)
        n_idx, n_hca = self.static_extents(meta)
        lay = layout(meta)
        with jax.enable_x64(True):
            m = {k: jnp.asarray(v) for k, v in meta.arrays().items()}
            g = {k: jnp.asarray(v) for k, v in lay.arrays().items()}
            rope = {k: tuple(jnp.asarray(np.asarray(a)) for a in v)
                    for k, v in rope_inputs(cfg, meta.position_ids, self.host_nm).items()}
            x_hc = self._embed_fn()(m["input_ids"], self.model["embed_weight"])
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


def _bucket(n: int, least: int) -> int:
    return max(least, 1 << (n - 1).bit_length())


def to_numpy(tree):
    return jax.tree_util.tree_map(np.asarray, tree)
