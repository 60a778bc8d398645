"""The programs of the torch device on TINY, run in one process and split over gloo processes.

`check(rank, world, ...)` runs in each spawned process: process 0 lowers every case, runs it on
`TorchBackend` holding all ranks and on `TorchBackend(ranks=Ranks.split(R, 0, world))` (whose
other processes serve their slices), and writes which outputs, touched pools and taps are not
bit-identical; the others serve.  Pools hold seeded random values of their storage dtype, so every
attention, compressor and expert reads non-trivial rows.
"""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np

from twin.abi import constants as C

TARGET = ("l3_decode_fwd", "l3_prefill_fwd")


def _random_pools(pools: dict, rng) -> dict:
    out = {}
    for name, a in pools.items():
        a = np.asarray(a)
        if a.dtype == np.int8:
            out[name] = rng.integers(-127, 128, a.shape).astype(np.int8)
        elif a.dtype == np.uint16:           # BF16 bit patterns
            out[name] = (rng.standard_normal(a.shape) * 0.5).astype(ml_dtypes.bfloat16).view(np.uint16)
        else:
            out[name] = np.abs(rng.standard_normal(a.shape)).astype(a.dtype) * 0.1
    return out


def cases(ep: int):
    """[(label, dispatch, state, weights)] on a TINY deployment of `ep` ranks (TP4): a packed
    prefill against resident history, a K=0 decode, a redraft drafter wave, the seeding bootstrap
    and the Markov sampler."""
    from golden.checkpoint import SyntheticCheckpoint
    from golden.dspark.weights import DrafterCheckpoint
    from golden.numerics import numerics
    from golden.paged import alloc_caches
    from golden.staging import PageMap
    from hw.golden_args import stage_pools, stage_weights
    from hw.torchdev.prefill import extents
    from twin.abi.batches import (DecodeBatch, DecodeItem, DrafterBatch, DrafterItem, PrefillBatch,
                                  PrefillItem)
    from twin.abi.lowering import LoweringContext, lower_decode, lower_drafter, lower_markov, lower_prefill, validate
    from twin.abi.lowering import to_bf16_bits
    from twin.abi.topology import deployment

    dep = deployment("tiny", ep=ep, max_model_len=512)
    cfg, slots = dep.model, 2
    ctx = LoweringContext(dep, slots)
    ck, dk = SyntheticCheckpoint(cfg, seed=0), DrafterCheckpoint(cfg, seed=0)
    rng = np.random.default_rng(5)
    caches = alloc_caches(cfg, PageMap(ctx).pool_pages, numerics("device", cfg=cfg))
    blocks = [{f: list(range(j * s.max_blocks_per_seq, (j + 1) * s.max_blocks_per_seq)) for f, s in ctx.sizing.items()}
              for j in range(slots)]
    parts = [g % dep.partitions for g in range(2)]
    out = []

    emb = np.asarray(ck.model()["embed_weight"], np.float32)
    chunks = [("p0", parts[0], 0, 200, 60), ("p1", parts[1], 1, 129, 40)]     # rid, partition, slot, start, n
    items = tuple(PrefillItem(rid, tuple(int(t) for t in rng.integers(2, cfg.vocab_size - 1, n)), start, start + n,
                              blocks[j], p) for rid, p, j, start, n in chunks)
    d = lower_prefill(PrefillBatch(items), ctx, embedding=emb)
    validate(d, ctx)
    ext = extents(d)
    out.append(("prefill", d, _random_pools(stage_pools(d.program, dep, slots, ctx, caches, **ext), rng),
                stage_weights(d.program, dep, slots, ck)))

    d = lower_decode(DecodeBatch(tuple(DecodeItem(f"d{i}", int(rng.integers(2, cfg.vocab_size)), n, blocks[j], p)
                                       for i, (p, j, n) in enumerate(((parts[0], 0, 255), (parts[1], 1, 131)))), k=0),
                     ctx)
    validate(d, ctx)
    out.append(("decode", d, _random_pools(stage_pools(d.program, dep, slots, ctx, caches), rng),
                stage_weights(d.program, dep, slots, ck)))

    # leases 0 and 4 share an owner rank; unique per group however the partitions fall; one seed per group
    redraft = tuple(DrafterItem(f"q{i}", p, lease, 1, a, tuple(range(a - n + 1, a + 1)), 1,
                                last_sampled=int(rng.integers(2, cfg.vocab_size)))
                    for i, (p, lease, a, n) in enumerate(((parts[0], 0, 200, 3), (parts[0], 4, 140, 8),
                                                          (parts[1], 2, 60, 1))))
    seed = tuple(DrafterItem(f"s{i}", p, lease, 1, a, tuple(range(a - 127, a + 1)), 0,
                             next_prefill_token=int(rng.integers(2, cfg.vocab_size)))
                 for i, (p, lease, a) in enumerate(((parts[0], 3, 130), (parts[1], 7, 300))[:dep.partitions]))
    for label, its, program in (("drafter", redraft, "l3_dspark_drafter"),
                                ("bootstrap", seed, "l3_dspark_draft_step_device_state")):
        hidden = {it.request_id: rng.standard_normal((len(it.context_positions), 3 * cfg.hidden_size)).astype(np.float32)
                  for it in its}
        d = lower_drafter(DrafterBatch(its), ctx, target_hidden=hidden, program=program)
        validate(d, ctx)
        state = {"kv_caches": (rng.standard_normal((dep.ranks, cfg.dspark_num_layers, C.DRAFTER_POOL_BLOCKS,
                                                    C.BLOCK_SIZE, 1, cfg.head_dim)) * 0.5)
                 .astype(ml_dtypes.bfloat16).view(np.uint16)}
        out.append((label, d, state, stage_weights(d.program, dep, slots, ck, dk, B=d.meta["B"],
                                                   T_MAIN=d.meta["T_MAIN"])))

    shape = lower_markov(DrafterBatch(redraft), ctx).args["head_hidden"].shape
    d = lower_markov(DrafterBatch(redraft), ctx,
                     head_hidden=to_bf16_bits(rng.standard_normal(shape).astype(np.float32)))
    validate(d, ctx)
    out.append(("markov", d, {}, stage_weights(d.program, dep, slots, ck, dk, B=d.meta["B"])))
    return dep, slots, out


def _differ(a: dict, b: dict) -> list:
    """Names whose arrays are not bit-identical (dtype, shape and bytes), or present on one side only."""
    bad = [str(k) for k in sorted(set(a) ^ set(b), key=str)]
    for k in a.keys() & b.keys():
        x, y = np.asarray(a[k]), np.asarray(b[k])
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            bad.append(str(k))
    return sorted(bad)


def check(rank: int, world: int, ep: int, out: str, init_method: str | None = None) -> None:
    from hw.launch import process_group
    from hw.torchdev import Ranks, TorchBackend, serve

    with process_group("gloo", rank, world, init_method):
        if rank:
            serve("cpu")
            return
        dep, slots, todo = cases(ep)
        one = TorchBackend(dep, slots)
        split = TorchBackend(dep, slots, ranks=Ranks.split(dep.ranks, 0, world))
        verdict = {"ranks": dep.ranks, "world": world, "held": [list(split.ranks.slice_of(p)) for p in range(world)],
                   "cases": {}}
        try:
            for label, d, state, weights in todo:
                a, b = one.run(d, state, weights), split.run(d, state, weights)
                verdict["cases"][label] = {
                    "program": d.program, "outputs": sorted(a.outputs), "state": sorted(a.state),
                    "taps": len(a.taps),
                    "differ": {"outputs": _differ(a.outputs, b.outputs), "state": _differ(a.state, b.state),
                               "taps": _differ(a.taps, b.taps)}}
        finally:
            split.close()
        with open(out, "w") as fh:
            json.dump(verdict, fh)
