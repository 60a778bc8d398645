"""Golden's weights and pools as a program's ABI arguments: what a device backend is given.

`stage_weights(program, dep, slots, ckpt)` turns a checkpoint (golden's protocol: model(),
layer(l), expert(l, e), ABI names in the ABI's per-layer orientation) into the program's WEIGHT
arguments; `stage_pools(program, dep, slots, ctx, caches)` golden's pools into its STATE
arguments; `unstage_rows` reads one rank's pages of one layer back.

Golden holds one pool per cache family with every partition in it (partition p's local page b is
golden page p * num_blocks + b, `golden.staging.PageMap`); the ABI gives every rank its own replica
of its partition's pages plus 64 scratch pages, stacked over the layers that own the pool.  Weights:
replicated on every rank except the TP-sharded o_proj groups (wo_a, wo_b) and LM-head vocabulary
rows and the EP-sharded routed experts; a layer's missing tensor (tid2eid on a score-routed
layer) is zeros, and the decode hc mixes are padded to MIX_HC_PAD rows.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from twin.abi.programs import STATE, WEIGHT, bind
from twin.abi.lowering.context import NP_DTYPES, default_rope

STACK_LAYERS = {"NL": lambda c: range(c.num_hidden_layers), "NC": lambda c: c.csa_layers,
                "NH": lambda c: c.hca_layers, "DL": lambda c: range(c.dspark_num_layers)}
# programs whose model tensors are the drafter's first (its final norm, Markov heads, hc_head)
DRAFTER_PROGRAMS = ("l3_dspark_drafter", "l3_dspark_draft_step_device_state", "l3_distributed_markov_sample")
# ABI names the drafter programs give the target's or golden's tensors under another name
ALIASES = {"embedding_weight": "embed_weight", "ffn_norm_w": "norm_w"}


def _abi(x, dtype: str) -> np.ndarray:
    x = np.asarray(x)
    if dtype == "bf16":          # ABI BF16 arguments are the bit patterns (twin.abi.lowering.context)
        return np.ascontiguousarray(x).view(np.uint16) if x.dtype.itemsize == 2 else \
            np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    return np.asarray(x, NP_DTYPES[dtype])


def _fit(v, shape, dtype):
    """A per-layer tensor into its ABI per-layer shape (zero rows padded at the end)."""
    out = np.zeros(shape, NP_DTYPES[dtype])
    if v is None:
        return out
    v = _abi(v, dtype).reshape((-1,) + tuple(shape[1:])) if len(shape) > 1 else _abi(v, dtype).reshape(-1)
    out[: v.shape[0]] = v
    return out


FUSED = "l3_decode_fwd_dspark"
# the fused program's position tables (one row per position of the deployment) and their RoPE profile
ROPE_TABLES = {"swa_rope": 0, "ratio4_rope": 4, "ratio128_rope": 128}


def _fused_weights(dep, slots: int, ckpt, drafter) -> dict:
    """The fused K=7 program's weights: the target decode's, the drafter's and Markov sampler's
    under their draft_ names, and the RoPE position tables."""
    out = stage_weights("l3_decode_fwd", dep, slots, ckpt)
    for prog in ("l3_dspark_drafter", "l3_distributed_markov_sample"):
        out.update({"draft_" + n: v for n, v in stage_weights(prog, dep, slots, ckpt, drafter).items()})
    rope = default_rope(dep.model)
    pos = np.arange(dep.limits.max_model_len)
    for name, ratio in ROPE_TABLES.items():
        for part, t in zip(("cos", "sin"), rope(ratio, pos)):
            out[f"{name}_{part}_table"] = np.broadcast_to(_abi(t, "bf16"), (dep.ranks,) + t.shape)
    return {b.name: out[b.name] for b in bind(FUSED, dep, slots) if b.arg.role == WEIGHT}


def stage_weights(program: str, dep, slots: int, ckpt, drafter=None, **extents) -> dict:
    """ckpt: the target checkpoint; drafter: the DSpark drafter's (golden.dspark.weights), whose
    model tensors and layers the drafter and Markov programs' arguments name first (a target
    program takes the target's only, whatever is passed)."""
    if program == FUSED:
        return _fused_weights(dep, slots, ckpt, drafter)
    cfg, topo = dep.model, dep.topology
    tp, n_local = topo.tp, topo.experts_per_rank(cfg)
    lg = cfg.o_groups // tp
    model = dict(ckpt.model())
    if drafter is not None and program in DRAFTER_PROGRAMS:
        model.update(drafter.model())
    layers = {}
    out = {}
    for b in bind(program, dep, slots, **extents):
        if b.arg.role != WEIGHT:
            continue
        name, dims, shape, dt = b.name, b.arg.dims, b.shape, b.dtype
        src_name = ALIASES.get(name, name)
        per_rank = []
        for r in range(shape[0]):
            m = r % tp
            if src_name in model:
                v = model[src_name]
                if name == "lm_head_weight":
                    vt = shape[1]
                    v = np.asarray(v)[m * vt:(m + 1) * vt]
                per_rank.append(_abi(v, dt).reshape(shape[1:]))
                continue
            head = dims[1]
            stack = head.split("*")[0].strip()
            ls = list(STACK_LAYERS[stack](cfg))
            n = len(ls)
            inner = shape[2:] if head == stack else (shape[1] // n,) + shape[2:]
            src = drafter if stack == "DL" else ckpt
            parts = []
            for l in ls:
                w = layers.setdefault((stack == "DL", l), src.layer(l))
                if name.startswith("routed_"):
                    v = np.stack([np.asarray(src.expert(l, e)[name]) for e in range(r * n_local, (r + 1) * n_local)])
                elif name in ("wo_a", "wo_b"):
                    v = np.asarray(w[name])[m * lg:(m + 1) * lg]
                else:
                    v = w.get(src_name)
                parts.append(_fit(v, inner, dt))
            per_rank.append(np.concatenate(parts).reshape(shape[1:]) if head != stack else np.stack(parts))
        out[name] = np.stack(per_rank)
    return out


def pool_layers(cfg, arg) -> list:
    """The layers a stacked argument holds (NL, NC or NH), in stack order."""
    head = arg.dims[1].split("*")[0].strip()
    return list(STACK_LAYERS[head](cfg))


def stage_pools(program: str, dep, slots: int, ctx, caches, **extents) -> dict:
    """golden caches (one dict per layer) -> the program's STATE arguments (per-rank replicas)."""
    cfg = dep.model
    out = {}
    for b in bind(program, dep, slots, **extents):
        if b.arg.role != STATE or b.arg.pool in ("drafter", "device_state"):
            continue
        fam = b.arg.pool
        nb = ctx.num_blocks[fam]
        ls = pool_layers(cfg, b.arg)
        N = b.shape[1] // len(ls)
        arr = np.zeros(b.shape, NP_DTYPES[b.dtype])
        view = arr.reshape(b.shape[0], len(ls), N, *b.shape[2:])
        gname = b.arg.buffer_id           # golden names its pools by the device buffer
        for r in range(b.shape[0]):
            g = r // ctx.tp
            for i, l in enumerate(ls):
                src = np.asarray(caches[l][gname])[g * nb:(g + 1) * nb]
                view[r, i, :nb] = _abi(src, b.dtype).reshape(view[r, i, :nb].shape)
        out[b.name] = arr
    return out


def unstage_rows(program: str, dep, slots: int, ctx, name: str, arr, layer: int, rank: int) -> np.ndarray:
    """One rank's pages [nb, ...] of one layer of a staged pool (scratch pages dropped)."""
    cfg = dep.model
    b = {x.name: x for x in bind(program, dep, slots)}[name]
    ls = pool_layers(cfg, b.arg)
    N = b.shape[1] // len(ls)
    view = np.asarray(arr).reshape(b.shape[0], len(ls), N, *b.shape[2:])
    return view[rank, ls.index(layer), :ctx.num_blocks[b.arg.pool]]


__all__ = ["stage_weights", "stage_pools", "unstage_rows", "pool_layers"]
