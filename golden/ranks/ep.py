"""EP dispatch and combine (K17) across the emulated ranks.

Each source rank gates its own rows; every route (t, k) with expert e goes to rank e // N_LOCAL,
local expert e % N_LOCAL; a destination packs a local expert's rows source-rank-major, then in (t, k)
order, and runs the expert once on them; the outputs return to the source's buffer row t*K + k,
and the source combines bf16(shared + sum_k routed) in k order.  Receive capacity per local expert
is EP x the rows per rank (RECV_MAX = 2048 at 16 x 128).
"""
from __future__ import annotations

import numpy as np

from twin.abi.errors import AbiError

from ..kernels.moe import gate, routed_expert, shared_expert
from .collectives import rows_by_rank

SHARED_NAMES = ("shared_w1", "shared_w1_scale", "shared_w3", "shared_w3_scale", "shared_w2", "shared_w2_scale")


def tiled(fn, idx, tile: int):
    """Run a row-local fn for one rank on a fixed tile of `tile` rows: the rank's rows, then copies
    of them as padding (results of padding rows are dropped).  The device runs fixed tiles too; here
    the tile is the call's row count, so NumPy runs a GEMM of the single-rank reference's shape
    (never its GEMV or small-matrix paths).  A row may sit at another position of that GEMM than in
    the reference: in device mode its bits are the same anyway (golden.numerics, Accumulation), in
    exact mode BLAS may round it differently (agreement to ~1e-15 relative)."""
    n = len(idx)
    if n == tile:
        return fn(idx)
    res = fn(np.resize(idx, max(tile, n)))
    return tuple(x[:n] for x in res)


def dispatch(indices_by_rank, layout):
    """(dst rank, local expert) -> [(src rank, local row, k)], source-rank-major, (t, k) order."""
    recv: dict = {}
    for src, idx in enumerate(indices_by_rank):
        if idx is None:
            continue
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                recv.setdefault((e // layout.n_local_experts, e % layout.n_local_experts), []).append((src, t, k))
    return recv


def ep_moe(x_mixed, lw, expert, input_ids, owners, layout, *, layer, cfg, nm, recv_max=None):
    """x_mixed [T, D] with owner ranks [T] -> ffn_out [T, D] (bf16 values)."""
    xp = nm.xp
    K = cfg.num_experts_per_tok
    rows = rows_by_rank(owners, layout.ranks)
    g = [None] * layout.ranks
    for r, idx in enumerate(rows):
        if idx.size:
            g[r] = tiled(lambda i: gate(x_mixed[i], lw["norm_w"], lw["gate_w"], lw.get("gate_bias"),
                                               lw.get("tid2eid"), xp.asarray(input_ids)[i], layer=layer,
                                               cfg=cfg, nm=nm), idx, len(owners))
    recv = dispatch([None if gr is None else np.asarray(gr[2]) for gr in g], layout)
    cap = recv_max if recv_max is not None else layout.ranks * max((len(i) for i in rows), default=0)
    D = x_mixed.shape[-1]
    routed = [None if gr is None else np.zeros((len(rows[r]) * K, D), np.float64 if nm.exact else np.float32)
              for r, gr in enumerate(g)]
    for (dst, loc), items in sorted(recv.items()):
        if len(items) > cap:
            raise AbiError("recv_expert_count", len(items), f"<= RECV_MAX={cap}", where=f"rank {dst} expert {loc}")
        x = xp.stack([g[s][0][t] for s, t, _ in items])
        sc = xp.stack([g[s][1][t] for s, t, _ in items])
        w = xp.asarray([g[s][3][t, k] for s, t, k in items])
        y = np.asarray(routed_expert(x, sc, expert(dst * layout.n_local_experts + loc), w, cfg=cfg, nm=nm))
        for (s, t, k), row in zip(items, y):
            routed[s][t * K + k] = row
    shared = {k: lw[k] for k in SHARED_NAMES}
    out = np.zeros((x_mixed.shape[0], D), np.float64 if nm.exact else np.float32)
    for r, idx in enumerate(rows):
        if not idx.size:
            continue
        n = len(idx)
        (sh,) = tiled(lambda i, r=r: (shared_expert(g[r][0][i], g[r][1][i], shared, cfg=cfg, nm=nm),),
                      np.arange(n), len(owners))
        o = nm.asf(sh)
        rr = routed[r].reshape(len(idx), K, D)
        for k in range(K):
            o = o + rr[:, k]
        out[idx] = np.asarray(nm.bf16(o))
    return xp.asarray(out)

