"""Multi-rank execution of a target layer with real collectives, one process per rank.

Run under torchrun (or `spawn_local` for tests).  One layer of a packed prefill is split the way
the deployment splits it:

  CP   each rank owns a contiguous band of L = P / world rows (position_ids_local); the normed
       activations and the KV of all bands are all-gathered (prefill_kv_allgather, K28);
  TP   each rank owns H / world attention heads and the matching rows of the output projection;
       the partial projections are all-reduced;
  EP   each rank owns n_routed_experts / world experts; routed tokens go to their owner with an
       all-to-all (dispatch) and come back with a second all-to-all (combine).

Rank 0 gathers the layer output and compares it with the single-process NumPy golden of the same
layer under the tolerance policy.  Backend: gloo on CPU, nccl on CUDA, hccl on NPU.

    torchrun --nproc-per-node 4 -m hw.distributed --preset tiny --device cpu
    torchrun --nproc-per-node 16 -m hw.distributed --preset small --device npu     # one node, 16 NPUs
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from twin.abi.errors import AbiError
from twin.abi.presets import get_preset

from .compare import compare_tensor
from .launch import process_group, run_local_ranks, torchrun_rank, verdict_status, write_verdict
from .model import golden_np as G
from .model.spec import Geometry
from .model.weights import synthetic_weights
from .tolerance import Policy

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def layer_inputs(cfg, rows: int, seed: int = 0):
    rng = np.random.default_rng(seed + 11)
    ids = rng.integers(0, cfg.vocab_size, rows)
    return ids.astype(np.int64), np.arange(rows, dtype=np.int32)


def golden_layer(cfg, w, layer: int, ids, pos):
    """Single-process reference: one SWA/routed layer of a packed causal prefill (no pools)."""
    H, HD, R, eps, W = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim, cfg.rms_norm_eps, cfg.sliding_window
    T = len(ids)
    x = w["embed_weight"][ids].astype(np.float32)
    h = G.bf16(G.rms(x, w["attn_norm_w"][layer], eps))
    q = G.bf16(G.rope(G.rms(G.bf16(h @ w["wq"][layer]).reshape(T, H, HD), None, eps), pos[:, None], cfg.rope_theta, R))
    kv = G.bf16(G.rope(h @ w["wkv"][layer], pos, cfg.rope_theta, R))
    j = np.arange(T)
    valid = (j[None, :] <= j[:, None]) & (j[None, :] > j[:, None] - W)
    o = G.bf16(G.attention(q, np.broadcast_to(kv, (T, T, HD)), valid, w["attn_sink"][layer], cfg.softmax_scale))
    x = G.bf16(x + G.bf16(o.reshape(T, H * HD) @ w["wo"][layer]))
    hn = G.bf16(G.rms(x, w["norm_w"][layer], eps))
    step = G.GoldenStep(Geometry(cfg), w)
    route, wts = step._route(layer, hn, ids, None, [], {"route": 0.0})
    return G.bf16(x + step._experts(layer, hn, route, wts))


def rank_layer(rank: int, world: int, cfg, w, layer: int, ids, pos, device: str = "cpu"):
    """This rank's share of the layer; returns the full output on every rank (all-gathered)."""
    import torch
    import torch.distributed as dist

    from .model.torch_step import TorchStep

    dev = torch.device(device if device == "cpu" else f"{device}:{rank % max(1, _count(device))}")
    st = TorchStep(Geometry(cfg), w, dev)
    W_ = st.w
    H, HD, R = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
    eps, Wn = cfg.rms_norm_eps, cfg.sliding_window
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    T = len(ids)
    if T % world or H % world or E % world:
        raise AbiError("world", world, f"a divisor of rows={T}, heads={H} and experts={E}", where="hw.distributed")
    band = T // world
    lo, hi = rank * band, (rank + 1) * band
    t_ids = torch.from_numpy(ids).to(dev)
    t_pos = torch.from_numpy(pos).to(dev).long()

    def gather_rows(x):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, 0)

    with torch.no_grad():
        x_loc = W_["embed_weight"][t_ids[lo:hi]]
        h_loc = st.bf16(st.rms(x_loc, W_["attn_norm_w"][layer], eps))
        kv_loc = st.bf16(st.rope(h_loc @ W_["wkv"][layer], t_pos[lo:hi], cfg.rope_theta, R))
        kv = gather_rows(kv_loc)                                   # CP: KV all-gather
        h = gather_rows(h_loc)                                     # CP: activations for the TP heads
        hs = slice(rank * H // world, (rank + 1) * H // world)     # TP: this rank's heads
        wq = W_["wq"][layer].view(-1, H, HD)[:, hs].reshape(-1, (H // world) * HD)
        q = st.bf16(h @ wq).view(T, H // world, HD)
        q = st.bf16(st.rope(st.rms(q, None, eps), t_pos[:, None], cfg.rope_theta, R))
        j = torch.arange(T, device=dev)
        valid = (j[None, :] <= j[:, None]) & (j[None, :] > j[:, None] - Wn)
        o = st.bf16(st.attention(q, kv[None].expand(T, T, HD), valid, W_["attn_sink"][layer][hs], cfg.softmax_scale))
        wo = W_["wo"][layer].view(H, HD, -1)[hs].reshape((H // world) * HD, -1)
        y = (o.reshape(T, -1) @ wo).contiguous()
        dist.all_reduce(y)                                         # TP: sum of head-group partials
        x = st.bf16(W_["embed_weight"][t_ids] + st.bf16(y))
        x_loc = x[lo:hi]
        hn = st.bf16(st.rms(x_loc, W_["norm_w"][layer], eps))
        scores = torch.sqrt(torch.nn.functional.softplus(hn @ W_["gate_w"][layer].T))
        if layer < cfg.num_hash_layers:
            route = W_["tid2eid"][layer][t_ids[lo:hi]].long()
        else:
            route = torch.topk(scores + W_["gate_bias"][layer], K, -1).indices
        wts = scores.gather(-1, route)
        wts = wts / wts.sum(-1, keepdim=True) * cfg.routed_scaling_factor
        # EP dispatch: (token, k) pairs sorted by owner rank
        per = E // world
        owner = (route // per).flatten()
        order = torch.argsort(owner, stable=True)
        tok = torch.arange(band, device=dev).repeat_interleave(K)[order]
        eid = route.flatten()[order]
        send_counts = torch.bincount(owner, minlength=world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        send_x = hn[tok].contiguous()
        recv_x = torch.empty((sum(rc), hn.shape[1]), device=dev)
        dist.all_to_all_single(recv_x, send_x, rc, sc)
        send_e = eid.float().contiguous()
        recv_e = torch.empty(sum(rc), device=dev)
        dist.all_to_all_single(recv_e, send_e, rc, sc)
        recv_e = recv_e.long()
        out_rows = torch.zeros_like(recv_x)
        for e in torch.unique(recv_e).tolist():
            m = recv_e == e
            out_rows[m] = st.expert(recv_x[m], W_["routed_w1"][layer, e], W_["routed_w1_scale"][layer, e],
                                    W_["routed_w3"][layer, e], W_["routed_w3_scale"][layer, e],
                                    W_["routed_w2"][layer, e], W_["routed_w2_scale"][layer, e])
        back = torch.empty_like(send_x)
        dist.all_to_all_single(back, out_rows.contiguous(), sc, rc)       # EP combine
        kk = torch.arange(band * K, device=dev) % K
        kk = kk[order]
        moe = st.expert(hn, W_["shared_w1"][layer], W_["shared_w1_scale"][layer], W_["shared_w3"][layer],
                        W_["shared_w3_scale"][layer], W_["shared_w2"][layer], W_["shared_w2_scale"][layer])
        moe.index_add_(0, tok, back * wts[tok, kk][:, None])
        x_out = st.bf16(x_loc + st.bf16(moe))
        return gather_rows(x_out).cpu().numpy(), {"cp_allgather": 2, "tp_allreduce": 1, "ep_all_to_all": 4,
                                                   "final_allgather": 1}


def _count(device: str) -> int:
    import torch

    if device == "cuda":
        return torch.cuda.device_count()
    if device == "npu":
        return torch.npu.device_count()      # registered by torch_npu
    return 1


def worker(rank: int, world: int, preset: str, device: str, rows: int, layer: int, out: str | None,
           init_method: str | None = None) -> dict | None:
    if device not in BACKENDS:
        raise AbiError("device", device, f"one of {sorted(BACKENDS)}", where="hw.distributed")
    if device == "npu":
        import torch_npu  # noqa: F401
    with process_group(BACKENDS[device], rank, world, init_method):
        cfg = get_preset(preset)
        w = synthetic_weights(cfg)
        ids, pos = layer_inputs(cfg, rows)
        got, collectives = rank_layer(rank, world, cfg, w, layer, ids, pos, device)
        if rank != 0:
            return None
        want = golden_layer(cfg, w, layer, ids, pos)
        tol = Policy().lookup("activation", "bf16", "w8a8")
        f = compare_tensor("x_out", got, want, tol, ("activation", "bf16", "w8a8"))
        res = {"verdict": "pass" if f.passed else "fail", "world": world, "backend": BACKENDS[device],
               "preset": preset, "layer": layer, "rows": rows, "collectives": collectives, **f.to_dict()}
        return write_verdict(res, out)


def spawn_local(world: int = 4, *, preset: str = "tiny", rows: int = 64, layer: int = 1, out: str,
                port: int | None = None, timeout_s: float = 120.0) -> dict:
    """World processes on 127.0.0.1 with gloo (tests and laptops); returns rank 0's verdict."""
    return run_local_ranks(worker, (world, preset, "cpu", rows, layer, out), world, out, port=port,
                           timeout_s=timeout_s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hw.distributed", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu", choices=sorted(BACKENDS))
    p.add_argument("--rows", type=int, default=64, help="packed prefill rows P (a multiple of the world size)")
    p.add_argument("--layer", type=int, default=1)
    p.add_argument("--out", default=None, help="rank 0 writes its verdict JSON here")
    a = p.parse_args(argv)
    rank, world = torchrun_rank()
    return verdict_status(worker(rank, world, a.preset, a.device, a.rows, a.layer, a.out))


if __name__ == "__main__":
    sys.exit(main())
