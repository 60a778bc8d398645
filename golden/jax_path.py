"""The JAX path: the golden compositions on jax.numpy, the whole step (embedding, every layer,
head) compiled as one function, equal to NumPy within kernel-math's FP32 tolerances.

Numerics: device (and official) mode carry sums in float32, the device contract's accumulator
(`golden.jax_numerics.Fp32Numerics`: kernel-math's rounding points, INT8 GEMMs exact); exact mode
is float64 as in NumPy.  Calls run under `jax.enable_x64(True)`, a scoped setting restored on
exit; nothing global is changed.

What NumPy decides from data, JAX takes as static shapes computed on the host from the call's
metadata (`golden.jax_kernels.Layout`: token grid, window unions, boundary tokens; candidate
counts rounded up to powers of two), all part of the jit key: a decode loop compiles once per
bucket.  Layers are unrolled in one jit (no host round trip between them); pools may be donated
so that the cache writes happen in place.

    jg = JaxGolden(ckpt, cfg, "device")
    out = jg.forward(meta, caches)                # same signature and result as compose.forward
    out = jg.forward(meta, out.caches, donate=True)   # a decode loop: pools updated in place
    out.caches[layer]["kv_cache"]                # a LayerPools: pools in ABI dtypes on read
    out = jg.forward(meta, caches, taps=("moe_indices", "ffn_x_mixed"))   # out.taps: Taps
"""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from twin.abi.errors import AbiError

from .compose import SHARED_NAMES, ForwardOut, Taps, _check_contiguous, rope_inputs
from .jax_kernels import TRANSPOSED_KEYS, attention_sublayer_grouped, fuse_projections, head, layout
from .jax_moe import moe_sublayer
from .jax_numerics import Fp32Numerics
from .jax_resync import INDEX_STAGE, ROUTE_STAGES, Resyncs
from .kernels.embedding import lookup_embedding
from .kernels.indexer import PREFILL_SCORE_CAP
from .kernels.sparse_attention import TILE
from .numerics import BF16, Numerics
from .paged import PREFILL, StepMeta

EXPERT_KEYS = ("routed_w1", "routed_w1_scale", "routed_w3", "routed_w3_scale", "routed_w2", "routed_w2_scale")
# XLA may otherwise drop a BF16 rounding point (an f32 -> bf16 -> f32 pair) where fusion puts it
# inside one loop ("excess precision"): e.g. o_proj's bf16 output read by hc_post moved the
# residual stream by ~1 BF16 ulp and doubled SMALL's divergence from NumPy at layer 0
XLA_OPTIONS = {"xla_allow_excess_precision": False}
# weights the kernels multiply as w.T (compressor projections, shared experts, LM head)
READ_TRANSPOSED = ("csa_cmp_wkv", "csa_cmp_wgate", "csa_inner_wkv", "csa_inner_wgate", "hca_cmp_wkv", "hca_cmp_wgate",
                   "shared_w1", "shared_w3", "shared_w2", "lm_head_weight")
# stages forward() can hand back (compose.Taps names); sublayer() also hands back cmp_kv, whose
# boundary rows the step holds in a static, padded selection
JAX_TAP_STAGES = ("attn_in", "x_mixed", "x_norm", "q", "kv", "idx_topk", "attn", "attn_out", "attn_x_hc",
                  "ffn_x_mixed", "moe_indices", "moe_weights", "ffn_out", "x_hc")
PARTS = ("attn", "moe")         # a target layer's sub-layers (sublayer())
# the weights of a layer's MoE sub-layer (the rest are its attention's)
MOE_KEYS = ("hc_ffn_fn", "hc_ffn_scale", "hc_ffn_base", "norm_w", "gate_w", "gate_bias", "tid2eid", *SHARED_NAMES)


class JaxGolden:
    def __init__(self, ckpt, cfg, mode: str = "device", compiler_options: dict | None = None,
                 verify_bf16: bool = False, device=None, layers=None):
        """layers: the target layers to hold (default all; forward() needs all, layer_step() the
        one it runs: a checker's single FLASH layer).  compiler_options go to jax.jit on top of XLA_OPTIONS (e.g.
        {"xla_backend_optimization_level": 0} trades step speed for less compile time in tests).  verify_bf16: every BF16 GEMM also checks that its
        operands are BF16 values (Fp32Numerics); forward() then sets `bf16_operands_ok`.  device: a
        jax.Device, or None for `accelerator()` (a GPU or TPU where JAX has one, else the CPU);
        weights, pools and the step live there (`device_note(jg.device)` says which)."""
        self.device = accelerator() if device is None else device
        self.cfg = cfg
        self.compiler_options = {**XLA_OPTIONS, **(compiler_options or {})}
        self.nm = Fp32Numerics(mode, jnp, verify_bf16=verify_bf16).for_config(cfg)
        if self.nm.mode == "official" and not self.nm.rounds_bf16:
            # the jitted step carries the ABI's BF16 pools as 16-bit patterns
            raise AbiError("dtype", cfg.dtype, "an fp8 or bf16 checkpoint for official mode on the JAX path "
                           "(an fp32 checkpoint's FP32 activations run on NumPy: golden.compose)", where="JaxGolden")
        self.bf16_operands_ok = None
        self.resyncs = None             # the last forward's re-syncs (resync_from), jax_resync.Resyncs
        self.host_nm = Numerics(mode).for_config(cfg)
        L = cfg.num_hidden_layers
        held = list(range(L)) if layers is None else sorted({int(l) for l in layers})
        if not held or not all(0 <= l < L for l in held):
            raise AbiError("layers", layers, f"target layers in [0, {L})", where="JaxGolden")
        self.held = held
        # weights widened once to the compute dtype (exact: int8, bf16 and f32 values are f32 values);
        # XLA would otherwise convert every weight on every step.  Index tables stay integers.  In
        # device mode BF16 and INT8 weights are held as BF16, the operand dtype of their GEMMs
        # (see Fp32Numerics: INT8 values are BF16 values)
        keep16 = lambda v: mode == "device" and (v.dtype == BF16 or v.dtype == np.int8)
        wide = lambda v: (v if v.dtype.kind in "iu" and v.dtype.itemsize > 1 else
                          v.astype(BF16) if keep16(v) else v.astype(self.nm.f))
        # device mode's routed expert matrices stay int8 (int8 x int8 -> int32 dots, see Fp32Numerics)
        ewide = (lambda v: v) if mode == "device" else wide
        with jax.enable_x64(True), jax.default_device(self.device):
            # matrices the kernels read transposed (w.T) held as [in, out], the layout XLA CPU's
            # BF16 dot reads (against [out, in] it falls back to f32, ~2x slower); _abi_layout
            # swaps them back in the step, where the kernel's own .T cancels that swap
            put = lambda d: {k: jnp.asarray(_swap(wide(np.asarray(v))) if k in READ_TRANSPOSED else wide(np.asarray(v)))
                             for k, v in d.items() if v is not None}
            self.layers = [put(ckpt.layer(l)) if l in held else {} for l in range(L)]
            # device mode: the matrices that multiply the attn-normed x as one [D, outs] GEMM
            self.splits = [None] * L
            if mode == "device":
                for l in held:
                    self.layers[l], self.splits[l] = fuse_projections(self.layers[l], cfg.compress_ratios[l], jnp)
            # the routed experts stacked on leading (held layer, expert) axes: one block reads one
            # expert of one layer (the matrices as [in, out]: the layout the dot reads, see moe_blocks)
            self.expert_row = {l: i for i, l in enumerate(held)}
            self.experts = {k: jnp.asarray(_stack_experts(ckpt, held, cfg.n_routed_experts, k,
                                                          ewide if k in TRANSPOSED_KEYS else wide))
                            for k in EXPERT_KEYS}
            # the embedding and head: only a whole step needs them (at FLASH ~2 GB)
            self.model = put(ckpt.model()) if len(held) == L else {}
            # the step's arguments: the per-layer vectors stacked by name (see stack_vectors), the rest
            # per layer
            self._rows, self._stacked = stack_vectors(self.layers)
            self._own = [{k: v for k, v in w.items() if k not in self._stacked} for w in self.layers]
        self._fns = {}
        self.rope_rows = RopeRows(cfg, self.host_nm, np.dtype(self.nm.f))

    def _step_fn(self, form, n_idx, n_hca, donate, stages, spec, resync=False):
        # spec (every host array's name, dtype and shape) determines the layout's static sizes:
        # g_tok's shape, g_win_slot's width, the window tiles (swa_indices' width) and g_sel*'s lengths
        key = (form, n_idx, n_hca, donate, stages, spec, resync)
        if key in self._fns:
            return self._fns[key]
        cfg, nm, n_win_tiles, rows = self.cfg, self.nm, win_tiles(spec), self._rows

        def step(model, layers, experts, pools, bufs, refs):
            nm.reads.clear()
            nm.bf16_state[1].clear()
            taps = Taps(stages)
            m, g, rope = _unpack(bufs, spec)
            g["n_win_tiles"] = n_win_tiles
            stacked, layers = layers
            layers = [dict(w, **{k: stacked[k][rows[k][l]] for k in rows if l in rows[k]}) for l, w in enumerate(layers)]
            model, layers = _abi_layout(model), [_abi_layout(w) for w in layers]
            ids = m["input_ids"]
            x_hc = lookup_embedding(ids, model["embed_weight"], cfg=cfg, nm=nm)[1]
            out, scratch, resyncs = [], None, {"route": {}, "index": {}}
            for layer in range(cfg.num_hidden_layers):
                # the expert-block buffer passes from layer to layer (XLA reuses it: no zeroing per layer)
                x_hc, p, scratch = self._layer(x_hc, layer, layers[layer], experts, pools[layer], m, rope, g, form=form,
                                               n_idx=n_idx, n_hca=n_hca, taps=taps, scratch=scratch, refs=refs,
                                               resyncs=resyncs)
                out.append(p)
            logits, sampled = head(x_hc, model, m["logit_row_indices"], cfg=cfg, nm=nm)
            checks = nm.bf16_state[1]
            ok = jnp.all(jnp.stack(checks)) if checks else None
            checks.clear()                     # no tracer outlives its trace
            return logits, sampled, out, x_hc, {f"{l}:{s}": v for (l, s), v in taps.items()}, ok, resyncs

        self._fns[key] = jax.jit(step, donate_argnums=(3,) if donate else (), compiler_options=self.compiler_options)
        return self._fns[key]

    def _layer(self, x_hc, layer, w, experts, pools, m, rope, g, *, form, n_idx, n_hca, taps, scratch=None, refs=None,
               resyncs=None):
        """One target layer inside a step (attention, then MoE) -> (x_hc, pools, expert-block buffer);
        refs / resyncs: the re-sync inputs and the masks found ({"route": .., "index": ..})."""
        cfg, nm, refs = self.cfg, self.nm, refs or {}
        taps.put(layer, "attn_in", x_hc)
        x_hc, pools, masks = attention_sublayer_grouped(
            x_hc, layer, w, pools, m, rope, g, cfg=cfg, nm=nm, form=form, ratio=cfg.compress_ratios[layer],
            n_idx=n_idx, n_hca=n_hca, split=self.splits[layer], index_ref=refs.get("index", {}).get(layer), taps=taps)
        if masks is not None:
            resyncs["index"][layer] = masks
        x_hc, scratch, masks = moe_sublayer(x_hc, layer, w, experts, m["input_ids"], cfg=cfg, nm=nm, taps=taps,
                                            scratch=scratch, ref=refs.get("route", {}).get(layer),
                                            expert_layer=self.expert_row[layer])
        if masks is not None:
            resyncs["route"][layer] = masks
        return x_hc, pools, scratch

    def layer_step(self, x_hc, layer: int, meta: StepMeta, pools, *, extents=None, resync_from=None):
        """compose.layer_step on JAX: target layer `layer` (one this JaxGolden holds) on x_hc [T,
        hc_mult, D] with that layer's pools, for the call `meta` -> (x_hc, LayerPools).  A
        checker's unit of work: one layer of a step, its input re-synced from a device's state.
        resync_from: the reference's taps of this layer (RESYNC_STAGES, as forward's), adopted at
        near ties; `self.resyncs` says where."""
        if layer not in self.expert_row:
            raise AbiError("layer", layer, f"a layer this JaxGolden holds {self.held}", where="JaxGolden.layer_step")
        _check_contiguous(meta)
        n_idx, n_hca = self._extents(meta, extents, "JaxGolden.layer_step")
        bufs, spec = self._host(meta)
        refs = self._resync_refs(resync_from, meta.T, layers=[layer])
        key = ("layer", layer, meta.form, n_idx, n_hca, spec, bool(refs))
        if key not in self._fns:
            n_win_tiles, rows = win_tiles(spec), self._rows

            def step(own, stacked, experts, pools, bufs, x_hc, refs):
                m, g, rope = _unpack(bufs, spec)
                g["n_win_tiles"] = n_win_tiles
                w = _abi_layout(dict(own, **{k: stacked[k][rows[k][layer]] for k in rows if layer in rows[k]}))
                resyncs = {"route": {}, "index": {}}
                x_hc, pools, _ = self._layer(x_hc, layer, w, experts, pools, m, rope, g, form=meta.form, n_idx=n_idx,
                                             n_hca=n_hca, taps=Taps(()), refs=refs, resyncs=resyncs)
                return x_hc, pools, resyncs
            self._fns[key] = jax.jit(step, compiler_options=self.compiler_options)
        with jax.enable_x64(True), jax.default_device(self.device):
            p = pools.raw if isinstance(pools, LayerPools) else _to_bits(pools, False)
            x = jnp.asarray(x_hc, self.nm.f)
            x, p, masks = self._fns[key](self._own[layer], self._stacked, self.experts, p,
                                         jax.device_put(bufs, self.device), x, jax.device_put(refs, self.device))
            self.resyncs = Resyncs.from_masks(masks["route"], masks["index"]) if refs else None
            x.block_until_ready()
        return x, LayerPools(p)

    def sublayer(self, part: str, x_hc, layer: int, meta: StepMeta, pools=None, *, resync_from=None, extents=None):
        """One sub-layer of target layer `layer` (one this JaxGolden holds) with every stage it
        computes tapped: a site checker's unit, its input a device's tap.  part "attn": attention
        from x_hc = the layer's attn_in, with the layer's pools; "moe": the MoE sub-layer from x_hc
        = attn_x_hc (no pools) -> (x_hc, LayerPools or None, taps {stage: NumPy array}), cmp_kv as
        compose taps it (the boundary tokens and their rows).  resync_from: the reference's taps of
        this layer, those of this part's ranking (INDEX_STAGE in a CSA layer's attention,
        ROUTE_STAGES in a routed layer's MoE), adopted at near ties; `self.resyncs` says where.
        meta's host arrays are kept from the last call on the same StepMeta (a new call, a new
        StepMeta: one changed in place is not seen)."""
        if part not in PARTS:
            raise AbiError("part", part, f"one of {PARTS}", where="JaxGolden.sublayer")
        if layer not in self.expert_row:
            raise AbiError("layer", layer, f"a layer this JaxGolden holds {self.held}", where="JaxGolden.sublayer")
        _check_contiguous(meta)
        n_idx, n_hca = self._extents(meta, extents, "JaxGolden.sublayer")
        bufs, spec = self._host_kept(meta)
        refs = self._resync_refs(resync_from, meta.T, layers=[layer], kinds=("index",) if part == "attn" else ("route",))
        refs = {k: {0: v for v in d.values()} for k, d in refs.items()}     # the step's one layer: 0
        cfg, nm = self.cfg, self.nm
        # a JaxGolden of one layer shares its compiled sub-layers with every other one of the same
        # preset, numerics and device whose layer has the same structure (the weights are arguments)
        fns, key = self._fns, ("sub", part, layer, meta.form, n_idx, n_hca, spec, bool(refs))
        if len(self.held) == 1:
            # attention's structure is its ratio (and fused projections), the MoE's its routing kind
            sig = ((cfg.compress_ratios[layer], self.splits[layer]) if part == "attn"
                   else layer < cfg.num_hash_layers)
            fns = _SHARED.setdefault((cfg.name, nm.mode, nm.verify_bf16, tuple(sorted(self.compiler_options.items())),
                                      self.device), {})
            key = ("sub", part, sig, meta.form, n_idx, n_hca, spec, bool(refs))
        if key not in fns:
            n_win_tiles, rows = win_tiles(spec), self._rows

            def step(own, stacked, experts, pools, bufs, x_hc, refs):
                m, g, rope = _unpack(bufs, spec)
                g["n_win_tiles"] = n_win_tiles
                w = _abi_layout(dict(own, **{k: stacked[k][rows[k][layer]] for k in stacked
                                             if layer in rows.get(k, ())}))
                taps = Taps()
                masks = {"route": {}, "index": {}}
                if part == "attn":
                    x_hc, pools, mk = attention_sublayer_grouped(
                        x_hc, layer, w, pools, m, rope, g, cfg=cfg, nm=nm, form=meta.form,
                        ratio=cfg.compress_ratios[layer], n_idx=n_idx, n_hca=n_hca, split=self.splits[layer],
                        index_ref=refs.get("index", {}).get(0), taps=taps)
                    kind = "index"
                else:
                    x_hc, _, mk = moe_sublayer(x_hc, layer, w, experts, m["input_ids"], cfg=cfg, nm=nm, taps=taps,
                                               ref=refs.get("route", {}).get(0),
                                               expert_layer=self.expert_row[layer])
                    kind = "route"
                if mk is not None:
                    masks[kind][0] = mk
                return x_hc, pools, {s: v for (_, s), v in taps.items()}, masks
            fns[key] = jax.jit(step, compiler_options=self.compiler_options)
        with jax.enable_x64(True), jax.default_device(self.device):
            p = {} if part == "moe" else pools.raw if isinstance(pools, LayerPools) else _to_bits(pools, False)
            x = jnp.asarray(x_hc, self.nm.f)
            # only the part's own weights: a sub-layer's program is then the same for every layer of its structure
            part_of = lambda d: {k: v for k, v in d.items() if (k in MOE_KEYS) == (part == "moe")}
            x, p, taps, masks = fns[key](part_of(self._own[layer]), part_of(self._stacked), self.experts, p,
                                               jax.device_put(bufs, self.device), x, jax.device_put(refs, self.device))
            relabel = lambda d: {layer: v for v in d.values()}      # the shared step knows no layer
            self.resyncs = Resyncs.from_masks(relabel(masks["route"]), relabel(masks["index"])) if refs else None
            x.block_until_ready()
        taps = to_numpy(taps)
        if "cmp_kv" in taps:
            ok = layout(meta).sel_ok[cfg.compress_ratios[layer]]
            taps["cmp_kv"] = tuple(np.asarray(v)[ok] for v in taps["cmp_kv"])
        return x, (None if part == "moe" else LayerPools(p)), taps

    def resident(self, pools) -> "LayerPools":
        """A layer's pools (NumPy, ABI dtypes) copied onto this JaxGolden's device once, as
        layer_step and forward take them back (a checker holding a layer's state between checks)."""
        with jax.enable_x64(True), jax.default_device(self.device):
            return LayerPools(jax.device_put(_to_bits(pools, True), self.device))

    def _extents(self, meta, extents, where):
        n_idx, n_hca = need = self.static_extents(meta)
        if extents is not None:
            n_idx, n_hca = (int(e) for e in extents)
            if n_idx < need[0] or n_hca < need[1]:
                raise AbiError("extents", tuple(extents), f"at least static_extents(meta) = {need}", where=where)
        return n_idx, n_hca

    def _host_kept(self, meta):
        """_host(meta), the last call's kept: the sub-layers of one dispatch's check (a StepMeta the
        checker never changes), on one-layer JaxGoldens, share it."""
        key = (meta, self.cfg.name, self.nm.mode, self.nm.f)
        if not (_HOST_LAST and _HOST_LAST[0][0] is meta and _HOST_LAST[0][1:] == key[1:]):
            _HOST_LAST[:] = [key, self._host(meta)]
        return _HOST_LAST[1]

    def _host(self, meta):
        """The call's host arrays (metadata, layout, RoPE rows) as one buffer per dtype, and their spec."""
        host = {**{_META + k: v for k, v in meta.arrays().items()}, **layout(meta).arrays()}
        for k, (c, s) in self.rope_rows(meta.position_ids).items():
            host[f"{_ROPE}{k}:0"], host[f"{_ROPE}{k}:1"] = c, s
        return _pack(host)

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

    def forward(self, meta: StepMeta, caches, *, donate: bool = False, taps=None, extents=None,
                resync_from=None) -> ForwardOut:
        """compose.forward on JAX.  donate=True hands the pools over (JAX arrays the caller does not
        use again, e.g. the previous step's out.caches): writes then happen in place.  taps: stage
        names from JAX_TAP_STAGES; out.taps is a Taps keyed (layer, stage).  extents: (indexer
        candidates, HCA rows) at least static_extents(meta), to share one compiled step across
        calls that need different extents (a decode loop pinned to its largest).  resync_from: the
        reference's taps of the same call (jax_resync.RESYNC_STAGES: ROUTE_STAGES of every routed
        layer, INDEX_STAGE of every CSA layer): its routing and its indexer selections are adopted
        at near ties (golden.jax_resync) and `self.resyncs` says where."""
        cfg = self.cfg
        if len(caches) != cfg.num_hidden_layers:
            raise AbiError("caches", len(caches), f"one pool dict per layer ({cfg.num_hidden_layers})",
                           where="JaxGolden.forward")
        stages = tuple(sorted(taps or ()))
        bad = [s for s in stages if s not in JAX_TAP_STAGES]
        if bad:
            raise AbiError("taps", bad[0], f"stages of {JAX_TAP_STAGES}", where="JaxGolden.forward")
        if len(self.held) != cfg.num_hidden_layers:
            raise AbiError("layers", self.held, "every target layer (JaxGolden(..., layers=None)) for a whole step; "
                           "layer_step runs one", where="JaxGolden.forward")
        _check_contiguous(meta)
        n_idx, n_hca = self._extents(meta, extents, "JaxGolden.forward")
        # the call's host arrays (metadata, layout, RoPE rows) travel as one buffer per dtype
        bufs, spec = self._host(meta)
        refs = self._resync_refs(resync_from, meta.T)
        with jax.enable_x64(True), jax.default_device(self.device):
            bufs = jax.device_put(bufs, self.device)
            pools = [c.raw if isinstance(c, LayerPools) else _to_bits(c, donate) for c in caches]
            fn = self._step_fn(meta.form, n_idx, n_hca, donate, stages, spec, bool(refs))
            args = (self.model, (self._stacked, self._own), self.experts, pools, bufs, jax.device_put(refs, self.device))
            # for stablehlo(): the pools by (shape, dtype) only (holding them would keep a copied-in
            # pool set alive between calls; a ShapeDtypeStruct per pool costs ~5 us a call); the
            # rest's shapes only if stablehlo() asks (~1 ms a call otherwise)
            self._last = (fn, args[:3], [{k: (v.shape, v.dtype) for k, v in p.items()} for p in pools], args[4:])
            logits, sampled, out, x_hc, tapped, ok, masks = fn(*args)
            self.bf16_operands_ok = None if ok is None else bool(ok)
            self.resyncs = Resyncs.from_masks(masks["route"], masks["index"]) if refs else None
            logits.block_until_ready()
        got = None
        if taps is not None:
            got = Taps()
            for k, v in tapped.items():
                layer, stage = k.split(":")
                got[(int(layer), stage)] = v
        return ForwardOut(logits, sampled, [LayerPools(p) for p in out], x_hc, got, meta)


    def _resync_refs(self, taps, T: int, layers=None, kinds=("route", "index")) -> dict:
        """{"route": layer -> (the reference's router input, its expert ids) for every routed layer,
        "index": layer -> its indexer topk for every CSA layer} of `layers` (default all), of the
        rankings `kinds`; {} where none applies."""
        if taps is None:
            return {}
        cfg, refs = self.cfg, {"route": {}, "index": {}}
        K, IK = cfg.num_experts_per_tok, cfg.index_topk
        layers = range(cfg.num_hidden_layers) if layers is None else layers
        for layer in (l for l in layers if l >= cfg.num_hash_layers and "route" in kinds):
            x, idx = (taps.get((layer, s)) for s in ROUTE_STAGES)
            if x is None or idx is None:
                raise AbiError("resync_from", f"layer {layer}", f"taps holding {ROUTE_STAGES} of every routed layer",
                               where="JaxGolden.forward")
            x, idx = np.asarray(x), np.asarray(idx)
            if x.shape != (T, cfg.hidden_size) or idx.shape != (T, K):
                raise AbiError("resync_from", f"layer {layer}: {x.shape}, {idx.shape}",
                               f"[{T}, {cfg.hidden_size}] router inputs and [{T}, {K}] expert ids",
                               where="JaxGolden.forward")
            refs["route"][layer] = (x.astype(np.dtype(self.nm.f)), idx.astype(np.int32))
        for layer in (l for l in layers if cfg.compress_ratios[l] == 4 and "index" in kinds):
            topk = taps.get((layer, INDEX_STAGE))
            if topk is None or np.shape(topk) != (T, IK):
                got = "missing" if topk is None else np.shape(topk)
                raise AbiError("resync_from", f"layer {layer} {INDEX_STAGE}: {got}",
                               f"the [{T}, {IK}] indexer selection of every CSA layer", where="JaxGolden.forward")
            refs["index"][layer] = np.asarray(topk).astype(np.int32)
        return refs

    def stablehlo(self) -> str:
        """The StableHLO text of the last step (what XLA compiled for it), e.g. to check dtypes."""
        fn, head, pools, tail = self._last
        pools = [{k: jax.ShapeDtypeStruct(*sd) for k, sd in p.items()} for p in pools]
        shapes = (*jax.tree_util.tree_map(_shape, head), pools, *jax.tree_util.tree_map(_shape, tail))
        with jax.enable_x64(True):
            return fn.lower(*shapes).as_text()


def _stack_experts(ckpt, layers, E: int, key: str, widen):
    """[len(layers), E, ...] of one expert weight, the matrices as [in, out] (TRANSPOSED_KEYS),
    filled expert by expert into one array (at FLASH one layer's w1 is 2 GB: no stacked copies)."""
    first = widen(np.asarray(ckpt.expert(layers[0], 0)[key]))
    shape = first.shape[::-1] if key in TRANSPOSED_KEYS else first.shape
    out = np.empty((len(layers), E, *shape), first.dtype)
    for i, l in enumerate(layers):
        for e in range(E):
            v = first if (i, e) == (0, 0) else widen(np.asarray(ckpt.expert(l, e)[key]))
            out[i, e] = v.T if key in TRANSPOSED_KEYS else v
    return out


def accelerator():
    """The device the JAX path runs on by default: the first GPU or TPU JAX can use (`jax[cuda]`
    installed and a GPU present), else the first CPU device."""
    for d in jax.devices():
        if d.platform != "cpu":
            return d
    return jax.devices("cpu")[0]


def device_note(device) -> str:
    """One line naming a JAX device: platform, kind and id (e.g. "gpu NVIDIA H200 #0", "cpu cpu #0")."""
    return f"{device.platform} {getattr(device, 'device_kind', '?')} #{device.id}"


class RopeRows:
    """rope_inputs(cfg, positions, nm) in `dtype`, read from a table of every position up to a power
    of two past the largest seen (each row is a function of its position alone): a gather on the
    host per call instead of the cos / sin of every row."""

    def __init__(self, cfg, nm, dtype):
        self.cfg, self.nm, self.dtype = cfg, nm, dtype
        self.n, self.table = 0, {}

    def __call__(self, positions) -> dict:
        pos = np.asarray(positions)
        need = int(pos.max(initial=0)) + 1
        if self.n < need:
            self.n = _bucket(need, 1024)
            tab = rope_inputs(self.cfg, np.arange(self.n), self.nm)
            self.table = {k: tuple(np.asarray(a).astype(self.dtype) for a in v) for k, v in tab.items()}
        return {k: (c[pos], s[pos]) for k, (c, s) in self.table.items()}


def stack_vectors(layers: list) -> tuple:
    """The layers' 1-D weights and APE tables (norm weights, scales, biases: read by elementwise
    fusions, where a static row of a stack costs no copy) as one [n, ...] stack per name: ~200
    fewer arguments to the jitted step (~2.3 us each per call).  -> (name -> {layer: row}, name ->
    stack); a name whose layers disagree in shape or dtype is not stacked."""
    rows, stacked = {}, {}
    for k in dict.fromkeys(k for w in layers for k in w):
        have = [l for l, w in enumerate(layers) if k in w]
        vs = [layers[l][k] for l in have]
        if (vs[0].ndim == 1 or k.endswith("_ape")) and len({(v.shape, v.dtype) for v in vs}) == 1:
            rows[k], stacked[k] = {l: i for i, l in enumerate(have)}, jnp.stack(vs)
    return rows, stacked


_HOST_LAST: list = []    # (the StepMeta, preset, mode, dtype) and its packed host arrays: JaxGolden._host
_SHARED: dict = {}      # compiled sub-layers of one-layer JaxGoldens, by (preset, numerics, options, device)
_META, _ROPE = "m:", "rope:"      # name prefixes of the packed host arrays (layout names start "g_")


def win_tiles(spec) -> int:
    """The window's tiles of a packed call (Layout.n_win_tiles), from swa_indices' width in its spec."""
    width = next(shape for name, _, _, shape in spec if name == _META + "swa_indices")[1]
    return -(-width // TILE)


def _pack(arrays: dict):
    """Host arrays by name -> (one flat NumPy buffer per dtype, the static spec to cut them apart:
    (name, dtype, offset, shape) each).  One transfer per dtype instead of one per array (~40)."""
    by = {}
    for k, v in arrays.items():
        v = np.asarray(v)
        by.setdefault(v.dtype.str, []).append((k, v))
    bufs, spec = {}, []
    for dt, items in by.items():
        off = 0
        for k, v in items:
            spec.append((k, dt, off, v.shape))
            off += v.size
        bufs[dt] = np.concatenate([v.reshape(-1) for _, v in items])
    return bufs, tuple(spec)


def _unpack(bufs, spec):
    """Inside the step: the packed buffers cut back into (meta arrays, layout arrays, RoPE rows)."""
    m, g, rope = {}, {}, {}
    for k, dt, off, shape in spec:
        v = bufs[dt][off:off + int(np.prod(shape, dtype=np.int64))].reshape(shape)
        if k.startswith(_META):
            m[k[len(_META):]] = v
        elif k.startswith(_ROPE):
            name, i = k[len(_ROPE):].rsplit(":", 1)
            rope.setdefault(name, [None, None])[int(i)] = v
        else:
            g[k] = v
    return m, g, {k: tuple(v) for k, v in rope.items()}


def _shape(a) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape, a.dtype)


class LayerPools(Mapping):
    """One layer's pools as the JAX step returns them.  BF16 pools are held as their uint16 bits
    (`raw`), so that passing them back (a decode loop) gathers and scatters them in place with no
    whole-pool conversion; reading a pool gives it in its ABI dtype (a bitcast, one copy)."""

    def __init__(self, raw: dict):
        self.raw = raw

    def __getitem__(self, name):
        v = self.raw[name]
        return jax.lax.bitcast_convert_type(v, jnp.bfloat16) if v.dtype == jnp.uint16 else v

    def __iter__(self):
        return iter(self.raw)

    def __len__(self):
        return len(self.raw)


def _swap(v):
    return np.ascontiguousarray(np.swapaxes(v, -1, -2))


def _abi_layout(weights: dict) -> dict:
    """The weights as the kernels take them (inside the step: a logical transpose XLA folds)."""
    return {k: jnp.swapaxes(v, -1, -2) if k in READ_TRANSPOSED else v for k, v in weights.items()}


def _to_bits(pools, donate: bool) -> dict:
    """A layer's pools (NumPy or JAX, ABI dtypes) as the step takes them: BF16 as uint16 bits.  A
    donated NumPy pool is copied (jnp.asarray may alias host memory, which XLA would overwrite)."""
    out = {}
    for k, v in pools.items():
        if isinstance(v, np.ndarray):
            v = v.view(np.uint16) if v.dtype == BF16 else v
            out[k] = jnp.array(v, copy=True) if donate else jnp.asarray(v)
        else:
            out[k] = jax.lax.bitcast_convert_type(v, jnp.uint16) if v.dtype == jnp.bfloat16 else v
    return out


def _bucket(n: int, least: int) -> int:
    return max(least, 1 << (n - 1).bit_length())


def to_numpy(tree):
    return jax.tree_util.tree_map(np.asarray, tree)
