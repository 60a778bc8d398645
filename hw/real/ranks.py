"""The real golden's target forward split across processes, one per rank, with real collectives.

`golden.ranks.forward_ranks` runs golden.compose's target forward as the ranks of the deployment
through a `par` object; `golden.ranks.RankEmulation` plays every rank in one process.  `DistPar`
is the same `par` where each process is one rank and computes only its own share:

  CP   map_rows: this rank's rows (its band of a group's packed prefill stream) of every row-local
       stage (hc_pre, norms, q/kv projections, indexer, sparse attention, hc_head); the results are
       all-gathered (K28)
  TP   o_proj: this rank's o_proj groups for its TP group's rows, reduced over the group (K12)
  EP   moe: this rank gates its own rows; every (token, k) route goes to the rank owning its
       expert with an all-to-all (dispatch), runs there source-rank-major, and comes back with a
       second all-to-all (combine); the source adds the shared expert (K17)
  LM   vocab_logits: this rank's vocab shard for its group's rows, all-gathered in shard order (K18)

The inputs are the real lockstep's first packed prefill dispatch (a `hw.real.Stream` over the
deployment of `world` ranks, lowered and validated by twin.abi.lowering); rank 0 runs the
single-process golden forward of the same dispatch and compares every tap in dependency order,
the logits, the sampled tokens and every pool under the tolerance policy, and requires every tap,
pool and output to be bit-identical to `RankEmulation` of the same split in one process (what the
processes and their collectives must reproduce exactly).  The golden computes in NumPy on the
host, so the collectives are gloo's on CPU tensors (all_gather_object of NumPy arrays, and
all_to_all_single of float64 rows for the EP dispatch and combine), on one node or across nodes.

    torchrun --nproc-per-node 16 -m hw.real.ranks --preset tiny --out rank0.json      # TP4 x EP16
    torchrun --nproc-per-node 4 --master-addr 127.0.0.1 -m hw.real.ranks --preset tiny   # TP4 x EP4
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import numpy as np

from golden.ranks.collectives import rows_by_rank
from golden.ranks.emulation import RankEmulation
from golden.ranks.ep import SHARED_NAMES, tiled
from golden.ranks.tp import group_contributions
from golden.kernels.moe import gate, routed_expert, shared_expert
from twin.abi.errors import AbiError



class DistPar(RankEmulation):
    """`RankEmulation` whose ranks are the processes of a torch.distributed group."""

    def __init__(self, layout, rank: int, reduction: str = "ordered"):
        super().__init__(layout, reduction)
        if not 0 <= rank < layout.ranks:
            raise AbiError("rank", rank, f"0..{layout.ranks - 1}", where="hw.real.ranks")
        self.rank = rank
        self.name = f"dist{layout.ranks}"
        self.collectives: Counter = Counter()

    def _all_gather(self, obj, what: str) -> list:
        import torch.distributed as dist

        out = [None] * self.layout.ranks
        dist.all_gather_object(out, obj)
        self.collectives[what] += 1
        return out

    def _all_to_all(self, parts: list[np.ndarray], width: int, what: str) -> list[np.ndarray]:
        """parts[dst]: float64 rows for rank dst -> the rows each source sent here, by source."""
        import torch
        import torch.distributed as dist

        send = [int(p.shape[0]) for p in parts]
        counts = torch.tensor(send, dtype=torch.int64)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts)
        recv = recv_counts.tolist()
        out = torch.empty((sum(recv), width), dtype=torch.float64)
        flat = np.concatenate(parts) if sum(send) else np.zeros((0, width))
        dist.all_to_all_single(out, torch.from_numpy(np.ascontiguousarray(flat, np.float64)), recv, send)
        self.collectives[what] += 2
        return np.split(out.numpy(), np.cumsum(recv)[:-1])

    # ---- CP: row-local stages ----------------------------------------------------------------------
    def map_rows(self, fn, owners, *, nm):
        owners = self._owners(owners, len(owners))
        rows = rows_by_rank(owners, self.layout.ranks)
        mine = rows[self.rank]
        part = tiled(fn, mine, len(owners)) if mine.size else None
        parts = self._all_gather(part, "cp_allgather")
        order = np.concatenate([idx for idx in rows if idx.size])
        inv = np.empty_like(order)
        inv[order] = np.arange(order.size)
        got = [p for p, idx in zip(parts, rows) if idx.size]
        return tuple(nm.xp.concatenate([p[j] for p in got], axis=0)[inv] for j in range(len(got[0])))

    # ---- TP: the grouped output projection ----------------------------------------------------------
    def o_proj(self, o_packed, lw, *, cfg, nm, owners=None):
        owners = self._owners(owners, o_packed.shape[1])
        lay, T = self.layout, o_packed.shape[1]
        mine = None
        groups = dict(self._by_group(owners))
        g = lay.group_of(self.rank)
        if g in groups:
            idx = groups[g]
            gs = np.asarray(lay.o_groups_of(self.rank))
            ii = np.resize(idx, max(T, idx.size))          # the emulation's tile (same GEMM kernels)
            mine = [c[:idx.size] for c in group_contributions(o_packed[gs][:, ii], lw["wo_a"][gs], lw["wo_b"][gs],
                                                              nm=nm)]
        parts = self._all_gather(mine, "tp_reduce")
        scale = nm.asf(lw["wo_b_scale"])
        out = nm.xp.zeros((T, cfg.hidden_size), nm.f)
        for g, idx in groups.items():
            acc = 0.0
            for r in lay.group_ranks(g):                    # group-local rank order, as one rank folds them
                part = 0.0
                for c in parts[r]:
                    if self.reduction == "ordered":
                        acc = acc + c
                    else:
                        part = part + c
                if self.reduction != "ordered":
                    acc = acc + part * scale
            out[idx] = nm.bf16(acc * scale) if self.reduction == "ordered" else nm.bf16(acc)
        return out

    # ---- EP: dispatch, experts, combine ------------------------------------------------------------
    def moe(self, x_mixed, lw, expert, input_ids, *, layer, cfg, nm, owners=None):
        owners = self._owners(owners, x_mixed.shape[0])
        lay, K, D = self.layout, cfg.num_experts_per_tok, x_mixed.shape[-1]
        rows = rows_by_rank(owners, lay.ranks)
        mine = rows[self.rank]
        cap = lay.ranks * max((len(i) for i in rows), default=0)

        def gated(i):
            return tuple(np.asarray(a) for a in gate(x_mixed[i], lw["norm_w"], lw["gate_w"], lw.get("gate_bias"),
                                                     lw.get("tid2eid"), nm.xp.asarray(input_ids)[i], layer=layer,
                                                     cfg=cfg, nm=nm))
        # dtypes and the scale's row shape of this numerics mode (x_mixed is on every rank): what the
        # float64 rows of the all-to-all are cast back to
        kinds = gated(np.arange(1))
        sc_shape = kinds[1].shape[1:]
        wide = np.float64 if nm.exact else np.float32
        width = 4 + D + int(np.prod(sc_shape))
        parts = [np.zeros((0, width)) for _ in range(lay.ranks)]
        if mine.size:
            x_i8, x_scale, idx, wts = tiled(gated, mine, len(owners))
            send: dict[int, list] = {}
            for t in range(idx.shape[0]):                   # (t, k) order, as the device packs them
                for k in range(K):
                    e = int(idx[t, k])
                    send.setdefault(e // lay.n_local_experts, []).append(
                        np.concatenate([[e % lay.n_local_experts, t, k, float(wts[t, k])],
                                        x_i8[t].astype(np.float64), x_scale[t].reshape(-1).astype(np.float64)]))
            parts = [np.stack(send[d]) if d in send else np.zeros((0, width)) for d in range(lay.ranks)]
        recv = self._all_to_all(parts, width, "ep_all_to_all")
        # this rank's experts: each local expert once, on its rows source-rank-major, then (t, k)
        back = [np.zeros((r.shape[0], D)) for r in recv]
        items = [(s, j) for s, r in enumerate(recv) for j in range(r.shape[0])]
        for loc in range(lay.n_local_experts):
            mine_items = [(s, j) for s, j in items if int(recv[s][j, 0]) == loc]
            if not mine_items:
                continue
            if len(mine_items) > cap:
                raise AbiError("recv_expert_count", len(mine_items), f"<= RECV_MAX={cap}",
                               where=f"rank {self.rank} expert {loc}")
            x = np.stack([recv[s][j, 4:4 + D] for s, j in mine_items]).astype(kinds[0].dtype)
            sc = np.stack([recv[s][j, 4 + D:].reshape(sc_shape) for s, j in mine_items]).astype(kinds[1].dtype)
            w = np.asarray([recv[s][j, 3] for s, j in mine_items]).astype(kinds[3].dtype)
            y = np.asarray(routed_expert(nm.xp.asarray(x), nm.xp.asarray(sc), expert(self.rank * lay.n_local_experts + loc),
                                         nm.xp.asarray(w), cfg=cfg, nm=nm))
            for (s, j), row in zip(mine_items, y):
                back[s][j] = row
        # combine: the rows come back to their source in the order it sent them
        got = self._all_to_all([np.concatenate([recv[s][:, 1:3], back[s]], 1) for s in range(lay.ranks)], 2 + D,
                               "ep_all_to_all")
        res = None
        if mine.size:
            routed = np.zeros((mine.size * K, D), wide)
            for part in got:
                for row in part:
                    routed[int(row[0]) * K + int(row[1])] = row[2:]
            n = mine.size
            shared = {k: lw[k] for k in SHARED_NAMES}
            (sh,) = tiled(lambda i: (shared_expert(x_i8[i], x_scale[i], shared, cfg=cfg, nm=nm),), np.arange(n),
                          len(owners))
            o = nm.asf(sh)
            rr = routed.reshape(n, K, D)
            for k in range(K):
                o = o + rr[:, k]
            res = np.asarray(nm.bf16(o))
        out = np.zeros((x_mixed.shape[0], D), wide)
        for idx, r in zip(rows, self._all_gather(res, "ep_output_allgather")):
            if idx.size:
                out[idx] = r
        return nm.xp.asarray(out)

    # ---- LM head: vocab shards ----------------------------------------------------------------------
    def vocab_logits(self, h, lm_head_weight, *, nm, owners=None):
        owners = self._owners(owners, h.shape[0])
        lay = self.layout
        groups = dict(self._by_group(owners))
        g = lay.group_of(self.rank)
        mine = None
        if g in groups:
            idx = groups[g]
            ii = np.resize(idx, max(len(owners), idx.size))
            w = lm_head_weight[np.asarray(lay.vocab_of(self.rank))]
            mine = (nm.asf(h[ii]) @ nm.asf(w).T)[:idx.size]
        parts = self._all_gather(mine, "lm_head_allgather")
        out = nm.xp.zeros((h.shape[0], lm_head_weight.shape[0]), nm.f)
        for g, idx in groups.items():
            out[idx] = nm.xp.concatenate([parts[r] for r in lay.group_ranks(g)], axis=-1)
        return out


# ---- the check ----------------------------------------------------------------------------------------
class _Bookkeeping:
    """The one part of a lockstep side the stream's scheduler reads: the run's requests and tables."""

    def __init__(self, run):
        self.run = run


def first_prefill(preset: str, world: int, seed: int, mode: str):
    """(cfg, ckpt, meta, caches, owners, layout) of the real lockstep's first packed prefill on a
    deployment of `world` ranks (TP4, EP = world)."""
    from golden.checkpoint import SyntheticCheckpoint
    from golden.paged import PREFILL, alloc_caches, lower
    from golden.ranks import layout_for
    from golden.ranks.target import cp_owners
    from golden.dspark import step as S
    from golden.numerics import numerics
    from twin.abi.presets import get_preset
    from twin.abi.topology import deployment

    from .stream import Stream

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
    rng = np.random.default_rng(seed)
    lens = (80, 40, 100, 30, 60, 50, 70, 20)
    prompts = [rng.integers(2, cfg.vocab_size - 1, lens[i % len(lens)]) for i in range(2 * dep.partitions)]
    stream = Stream(dep, 2, prompts, chunk=64)
    ckpt = SyntheticCheckpoint(cfg, seed)
    nm = numerics(mode)
    run = S.Run(alloc_caches(cfg, stream.pool_pages, nm), [], [])
    side = _Bookkeeping(run)
    stream.setup(side)
    rd = stream.next(side)
    meta = lower(cfg, stream.spans_from_dispatch(rd, run), form=PREFILL)
    owners = cp_owners(meta, {s.index: s.group for s in run.seqs}, layout.tp)
    return cfg, ckpt, meta, run.caches, owners, layout, nm


def rank_forward(rank: int, world: int, *, preset: str = "tiny", seed: int = 0, mode: str = "device",
                 reduction: str = "ordered") -> dict | None:
    """Run inside an initialized process group; rank 0 returns the verdict."""
    from golden.compose import Taps, forward
    from golden.ranks.target import forward_ranks

    from ..compare import compare_pool, compare_tensor
    from ..golden_adapter import compose_kind
    from ..lockstep import first_divergent_tap
    from ..tolerance import Policy
    from .lockstep import POOL_KIND

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
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=init_method or "env://")
    try:
        res = rank_forward(rank, world, preset=preset, seed=seed, mode=mode, reduction=reduction)
        if res is not None:
            res["backend"] = "gloo"
            if out:
                with open(out, "w") as fh:
                    json.dump(res, fh, indent=2)
        return res
    finally:
        dist.destroy_process_group()


def _spawned(rank, world, kw, init_method):
    import torch

    torch.set_num_threads(1)
    worker(rank, world, init_method=init_method, **kw)


def spawn_local(world: int = 4, *, out: str, timeout_s: float = 150.0, **kw) -> dict:
    """`world` processes on 127.0.0.1 with gloo (tests, laptops); returns rank 0's verdict."""
    import socket
    import time

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kw = {"preset": "tiny", "seed": 0, "mode": "device", "reduction": "ordered", **kw, "out": out}
    ctx = mp.start_processes(_spawned, args=(world, kw, f"tcp://127.0.0.1:{port}"), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"{world} ranks did not finish within {timeout_s}s")
    with open(out) as fh:
        return json.load(fh)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hw.real.ranks", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", default="device", choices=("device", "exact"), help="golden numerics mode")
    p.add_argument("--reduction", default="ordered", choices=("ordered", "partial_sums"))
    p.add_argument("--out", default=None, help="rank 0 writes its verdict JSON here")
    a = p.parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    res = worker(rank, world, preset=a.preset, seed=a.seed, mode=a.mode, reduction=a.reduction, out=a.out)
    if res is not None:
        print(json.dumps(res, indent=2))
        return 0 if res["verdict"] == "pass" else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
