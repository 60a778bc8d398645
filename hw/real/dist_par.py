"""`DistPar`: golden.ranks' `par` object whose ranks are processes of a torch.distributed group.

`golden.ranks.forward_ranks` runs golden.compose's target forward as the ranks of the deployment
through a `par`; `golden.ranks.RankEmulation` plays every rank in one process.  Here each process
is one rank and computes only its own share, with real collectives:

  CP   map_rows: this rank's rows (its band of a group's packed prefill stream) of every row-local
       stage (hc_pre, norms, q/kv projections, indexer, sparse attention, hc_head); all-gathered (K28)
  TP   o_proj: this rank's o_proj groups for its TP group's rows, reduced over the group (K12)
  EP   moe: this rank gates its own rows; every (token, k) route goes to the rank owning its
       expert with an all-to-all (dispatch), runs there source-rank-major, and comes back with a
       second all-to-all (combine); the source adds the shared expert (K17)
  LM   vocab_logits: this rank's vocab shard for its group's rows, all-gathered in shard order (K18)

Each rank computes exactly what `RankEmulation` computes for it (same tiles, same fold order), so
the processes reproduce the emulation bit for bit.  The golden computes in NumPy on the host: the
collectives are gloo's on CPU tensors (all_gather_object of NumPy arrays; all_to_all_single of
float64 rows, which carry INT8, FP32 and FP64 values exactly).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from golden.kernels.moe import gate, routed_expert, shared_expert
from golden.ranks.collectives import rows_by_rank
from golden.ranks.emulation import RankEmulation
from golden.ranks.ep import SHARED_NAMES, tiled
from golden.ranks.tp import fold, group_contributions
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
        out = nm.xp.zeros((T, cfg.hidden_size), nm.f)
        for g, idx in groups.items():
            # group-local rank order, as one rank folds them
            out[idx] = fold([parts[r] for r in lay.group_ranks(g)], lw["wo_b_scale"], nm=nm, reduction=self.reduction)
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
            ew = expert(self.rank * lay.n_local_experts + loc)
            y = np.asarray(routed_expert(nm.xp.asarray(x), nm.xp.asarray(sc), ew,
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
