"""The real golden's target forward split across processes, one per rank, with real collectives.

Every process runs `golden.ranks.forward_ranks` with a `DistPar` (`hw.real.dist_par`): each rank
computes only its share (its CP band, its o_proj groups, the experts it owns, its vocab shard) and
the all-gathers, the TP reduction and the EP all-to-all dispatch and combine are torch.distributed
collectives.  The inputs are a packed prefill dispatch over the deployment of `world` ranks (lowered and
validated by twin.abi.lowering, run by `golden.dispatch` as a parity run's first dispatch is); rank 0 runs the
single-process golden forward of the same dispatch and compares every tap in dependency order, the
logits, the sampled tokens and every pool under the tolerance policy, and requires every tap, pool
and output to be bit-identical to `RankEmulation` of the same split in one process (what the
processes and their collectives must reproduce exactly).  Collectives: gloo (the golden is NumPy
on the host), on one node or across nodes.

    torchrun --nproc-per-node 16 -m hw.real.ranks --preset tiny --out rank0.json      # TP4 x EP16
    torchrun --nproc-per-node 4 --master-addr 127.0.0.1 -m hw.real.ranks --preset tiny   # TP4 x EP4
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from golden.ranks.emulation import RankEmulation
from twin.abi.errors import AbiError

from ..launch import process_group, run_local_ranks, torchrun_rank, verdict_status, write_verdict
from .dist_par import DistPar

__all__ = ["DistPar", "first_prefill", "rank_forward", "spawn_local", "worker"]


# ---- the check ----------------------------------------------------------------------------------------
def first_prefill(preset: str, world: int, seed: int, mode: str):
    """(cfg, ckpt, meta, caches, owners, layout) of a packed prefill on a deployment of `world` ranks
    (TP4, EP = world): the first 64-token chunk of two seeded prompts per cache partition, each
    request on its own slot's pages, lowered and validated by twin.abi.lowering; golden runs it
    through `golden.dispatch` (what a parity run's first dispatch is)."""
    from golden.checkpoint import SyntheticCheckpoint
    from golden.dispatch import Served, run_dispatch
    from golden.dspark import step as S
    from golden.paged import PREFILL, lower
    from golden.ranks import layout_for
    from golden.ranks.target import cp_owners
    from twin.abi.batches import PrefillBatch, PrefillItem
    from twin.abi.lowering import LoweringContext, lower as lower_batch, validate
    from twin.abi.presets import get_preset
    from twin.abi.topology import deployment

    cfg = get_preset(preset)
    if not cfg.small:
        raise AbiError("preset", preset, "a small preset (tiny or small)", where="hw.real.ranks")
    try:
        layout = layout_for(cfg, tp=4, ep=world)
        dep = deployment(cfg, ep=world, max_model_len=512, long_prefill_token_threshold=64, max_num_seqs=8,
                         max_num_batched_tokens=256, num_speculative_tokens=0)
    except (ValueError, AbiError) as e:
        raise AbiError("world", world, f"a rank count the preset's topology allows (4, 8 or 16): {e}",
                       where="hw.real.ranks") from None
    slots, chunk = 2, 64
    ctx = LoweringContext(dep, slots)
    rng = np.random.default_rng(seed)
    lens = (80, 40, 100, 30, 60, 50, 70, 20)
    G = dep.partitions
    served = Served(S.Golden(cfg, SyntheticCheckpoint(cfg, seed), None, mode), ctx)
    per = {f: n // slots for f, n in ctx.num_blocks.items()}
    items = []
    for i in range(slots * G):
        prompt = rng.integers(2, cfg.vocab_size - 1, lens[i % len(lens)])
        served.admit(f"r{i}", prompt, 8)
        part, slot = i % G, i // G
        blocks = {f: tuple(range(slot * n, (slot + 1) * n)) for f, n in per.items()}
        items.append(PrefillItem(f"r{i}", tuple(int(t) for t in prompt[:chunk]), 0, len(prompt), blocks, part))
    d = lower_batch(PrefillBatch(tuple(items)), ctx)
    validate(d, ctx)
    caches = served.run.caches
    run_dispatch(served, "prefill", d, items)          # golden's own run of it, cross-checked against the dispatch
    spans = [S.Span(served.seqs[it.request_id].index, 0, it.chunk_tokens, served.run.blocks[served.seqs[it.request_id].index])
             for it in items]
    meta = lower(cfg, spans, form=PREFILL)
    owners = cp_owners(meta, {s.index: s.group for s in served.run.seqs}, layout.tp)
    return cfg, served.g.ckpt, meta, caches, owners, layout, served.g.nm


def rank_forward(rank: int, world: int, *, preset: str = "tiny", seed: int = 0, mode: str = "device",
                 reduction: str = "ordered") -> dict | None:
    """Run inside an initialized process group; rank 0 returns the verdict."""
    from golden.compose import Taps, forward
    from golden.ranks.target import forward_ranks

    from ..compare import compare_pool, compare_tensor
    from ..localize import compose_kind, first_divergent_tap
    from ..tolerance import Policy
    from .side import POOL_KIND

    cfg, ckpt, meta, caches, owners, layout, nm = first_prefill(preset, world, seed, mode)
    par = DistPar(layout, rank, reduction)
    dtaps = Taps()
    dist_out = forward_ranks(ckpt, meta, caches, owners, par, cfg=cfg, nm=nm, taps=dtaps)
    if rank != 0:
        return None
    etaps = Taps()                         # the same split, every rank in this process
    emu = forward_ranks(ckpt, meta, caches, owners, RankEmulation(layout, reduction), cfg=cfg, nm=nm, taps=etaps)
    gtaps = Taps()                         # the single-process forward
    gold = forward(ckpt, meta, caches, cfg=cfg, nm=nm, taps=gtaps)
    policy = Policy()
    first = first_divergent_tap(list(gtaps), dtaps, gtaps, policy, compose_kind)
    logits = compare_tensor("logits", np.asarray(dist_out.logits), np.asarray(gold.logits),
                            policy.lookup("logits", "f32", "none"), ("logits", "f32", "none"))
    pools_ok = True
    for layer, (pd, pg, pb) in enumerate(zip(dist_out.caches, gold.caches, caches)):
        for pool, e in pg.items():
            kind, e = POOL_KIND[pool], np.asarray(e)
            every_row = np.arange(e.reshape(-1, e.shape[-1]).shape[0])
            f = compare_pool(f"{layer}/{pool}", np.asarray(pd[pool]), e, np.asarray(pb[pool]), every_row,
                             policy.lookup(*kind), kind)
            pools_ok &= f.passed
    sampled = np.array_equal(np.asarray(dist_out.sampled), np.asarray(gold.sampled))
    # the processes and their collectives must reproduce the one-process emulation bit for bit
    same = [("taps", s) for s in etaps if not _bits_equal(dtaps.get(s), etaps[s])]
    same += [("pool", f"{layer}/{pool}") for layer, (pd, pe) in enumerate(zip(dist_out.caches, emu.caches))
             for pool in pe if not _bits_equal(pd[pool], pe[pool])]
    same += [("out", n) for n in ("logits", "sampled") if not _bits_equal(getattr(dist_out, n), getattr(emu, n))]
    ok = first is None and logits.passed and pools_ok and sampled and not same
    return {"verdict": "pass" if ok else "fail", "world": world, "preset": preset, "mode": mode,
            "reduction": reduction, "rows": int(meta.T), "layers": cfg.num_hidden_layers,
            "topology": {"tp": layout.tp, "ep": layout.ranks, "groups": layout.groups,
                         "experts_per_rank": layout.n_local_experts},
            "bitwise_vs_emulation": not same, "not_bitwise": [list(map(str, x)) for x in same[:8]],
            "sampled_equal": bool(sampled), "logits_vs_single": logits.to_dict()["metrics"],
            "pools_pass": bool(pools_ok),
            "first_divergence": None if first is None else {"layer": str(first.site[0]), "stage": first.site[1],
                                                             "reasons": first.reasons},
            "collectives": dict(sorted(par.collectives.items()))}


def _bits_equal(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_bits_equal(x, y) for x, y in zip(a, b))
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def worker(rank: int, world: int, *, preset: str, seed: int, mode: str, reduction: str, out: str | None,
           init_method: str | None = None) -> dict | None:
    with process_group("gloo", rank, world, init_method):
        res = rank_forward(rank, world, preset=preset, seed=seed, mode=mode, reduction=reduction)
        if res is not None:
            res["backend"] = "gloo"
        return write_verdict(res, out)


def spawn_local(world: int = 4, *, out: str, timeout_s: float = 150.0, **kw) -> dict:
    """`world` processes on 127.0.0.1 with gloo (tests, laptops); returns rank 0's verdict."""
    kw = {"preset": "tiny", "seed": 0, "mode": "device", "reduction": "ordered", **kw, "out": out}
    return run_local_ranks(worker, (world,), world, out, kwargs=kw, timeout_s=timeout_s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hw.real.ranks", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", default="device", choices=("device", "exact"), help="golden numerics mode")
    p.add_argument("--reduction", default="ordered", choices=("ordered", "partial_sums"))
    p.add_argument("--out", default=None, help="rank 0 writes its verdict JSON here")
    a = p.parse_args(argv)
    rank, world = torchrun_rank()
    return verdict_status(worker(rank, world, preset=a.preset, seed=a.seed, mode=a.mode, reduction=a.reduction,
                                 out=a.out))


if __name__ == "__main__":
    sys.exit(main())
