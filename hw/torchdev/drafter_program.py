"""`l3_dspark_drafter`: one drafter call (K22-K24) over every TP group, per rank.

Rank r holds B drafter rows (row b: anchor a = anchor_positions[r, b], block [tau, noise x 6] at
positions a+1..a+7, tau = last_sampled if num_sampled > 0 else next_prefill_tokens) and T_MAIN
context rows of target hidden.  The context rows' KV (all-gathered over the group, positions and
slots group-level) and the block rows' KV are written into every rank's replica of the group's
drafter pool before the block attends; the window is read through the row's block table.  Each
draft layer is the SWA layer with its MoE routed as target layer 40 + l; head_hidden is the
drafter's hc_head of the last residual stream.
"""
from __future__ import annotations

import torch

from twin.abi import constants as C

from .drafter import block_attention, context_kv, dspark_proj
from .hyper import hc_head, hc_post, hc_pre
from .layers import LocalRows, Taps, moe_sublayer, tp_o_proj
from .paged import flat, get_rows, set_rows
from .qkv import qkv_proj_rope
from .rmsnorm import rms_norm

QW = C.DSPARK_QUERY_WIDTH


def extents(dispatch) -> dict:
    a = dispatch.args
    return {"B": int(a["num_sampled"].shape[1]), "T_MAIN": int(a["target_hidden"].shape[1])}


def window(anchor, table, width: int):
    """[B, width] slots of positions max(0, a-127)..a+7 (oldest first), -1 beyond."""
    W = C.SLIDING_WINDOW
    s = anchor + 1
    start = torch.clamp(s - W, min=0)
    n = s + QW - start
    pos = start[:, None] + torch.arange(width, device=anchor.device)[None, :]
    ok = torch.arange(width, device=anchor.device)[None, :] < n[:, None]
    p = torch.where(ok, pos, 0)
    ent = torch.gather(table, 1, p // C.BLOCK_SIZE).long()
    return torch.where(ok & (ent >= 0), ent * C.BLOCK_SIZE + p % C.BLOCK_SIZE, -1)


def run_drafter(a, cfg, dep):
    ranks, tp = a.ranks, dep.topology.tp
    R = ranks.R
    dev = a.device
    eps, rd = cfg.rms_norm_eps, cfg.qk_rope_head_dim
    w, layer_w = a.__getitem__, a.layer
    taps = Taps(ranks)
    pools = a["kv_caches"]                                   # [DL, blocks, 32, 1, HD] per rank
    B = a["num_sampled"].shape[1]
    width = -(-(C.SLIDING_WINDOW + QW) // 64) * 64

    # K22 / K23: the context rows of every rank, all-gathered over the group
    main_x = ranks.gather(ranks.local(lambda r: dspark_proj(a["target_hidden"][r], w("main_proj_weight")[r],
                                                            w("main_norm_weight")[r], eps)))
    for r in ranks.mine:
        g0 = (r // tp) * tp
        x_g = torch.cat(main_x[g0:g0 + tp])
        for l in range(cfg.dspark_num_layers):
            kv = context_kv(x_g, layer_w("wkv", l)[r], layer_w("gamma_ckv", l)[r], a["context_group_freqs_cos"][r],
                            a["context_group_freqs_sin"][r], rope_dims=rd, eps=eps)
            set_rows(flat(pools[r][l]), a["context_group_slot_mapping"][r, l].long(), kv[:, None, :])

    tau = torch.where(a["num_sampled"] > 0, a["last_sampled"], a["next_prefill_tokens"]).long()     # [R, B]
    ids = torch.full((R, B, QW), cfg.dspark_noise_token_id, dtype=torch.long, device=dev)
    ids[:, :, 0] = tau
    ids = ids.reshape(R, B * QW)
    emb = a["embedding_weight"]
    h = ranks.local(lambda r: emb[r][ids[r]][:, None, :].expand(-1, cfg.hc_mult, -1))
    L = LocalRows(pos=None, input_ids=list(ids), num_tokens=torch.full((R,), B * QW, device=dev), swa_cos=None,
                  swa_sin=None, cmp_cos=None, cmp_sin=None, windows={}, req_tables=None, kv_seq_lens=None,
                  csa_cap=0, hca_cap=0)
    qrows = B * QW
    for l in range(cfg.dspark_num_layers):
        taps.put(f"draft{l}", "attn_in", h)
        post, comb, q, kv = ([None] * R for _ in range(4))
        for r in ranks.mine:
            xm, p_, c_ = hc_pre(h[r], layer_w("hc_attn_fn", l)[r], layer_w("hc_attn_scale", l)[r],
                                layer_w("hc_attn_base", l)[r], hc=cfg.hc_mult, rms_eps=eps, hc_eps=cfg.hc_eps,
                                iters=cfg.hc_sinkhorn_iters)
            x_n = rms_norm(xm, layer_w("attn_norm_w", l)[r], eps)
            lw = {n: layer_w(n, l)[r] for n in ("wq_a", "wq_b", "wq_b_scale", "wkv", "gamma_cq", "gamma_ckv")}
            q[r], kv[r], _, _ = qkv_proj_rope(x_n, lw, a["query_freqs_cos"][r][:qrows], a["query_freqs_sin"][r][:qrows],
                                              heads=cfg.num_attention_heads, head_dim=cfg.head_dim, rope_dims=rd,
                                              eps=eps)
            post[r], comb[r] = p_, c_
        taps.put(f"draft{l}", "q", q)
        kv = ranks.gather(kv)                                # the group's block rows
        o_all = [None] * R
        for r in ranks.mine:
            g0 = (r // tp) * tp
            band = a["query_group_slot_mapping"].shape[-1] // tp
            slots = torch.cat([a["query_group_slot_mapping"][r, l][m * band:m * band + qrows] for m in range(tp)])
            set_rows(flat(pools[r][l]), slots.long(), torch.cat(kv[g0:g0 + tp])[:, None, :])
            ws = window(a["anchor_positions"][r].long(), a["block_tables"][r, l].long(), width)
            K = get_rows(flat(pools[r][l]).reshape(-1, cfg.head_dim), ws)
            cos = a["query_freqs_cos"][r][:qrows].reshape(B, QW, -1)
            sin = a["query_freqs_sin"][r][:qrows].reshape(B, QW, -1)
            o = block_attention(q[r].reshape(B, QW, cfg.num_attention_heads, cfg.head_dim), K, ws >= 0,
                                layer_w("attn_sink", l)[r], cos, sin, scale=cfg.head_dim ** -0.5, rope_dims=rd)
            o_all[r] = o.reshape(qrows, cfg.num_attention_heads, cfg.head_dim)
        taps.put(f"draft{l}", "attn", o_all)
        attn_out = tp_o_proj(a, cfg, dep, l, o_all, lambda per, g0: torch.cat(per[g0:g0 + tp]))
        taps.put(f"draft{l}", "attn_out", attn_out)
        h = ranks.local(lambda r: hc_post(attn_out[r], h[r], post[r], comb[r]))
        h = moe_sublayer(a, cfg, dep, l, h, L, taps, route_layer=cfg.dspark_target_layer_ids[l], norm="ffn_norm_w",
                         tap=f"draft{l}")
    head = ranks.stack(ranks.local(lambda r: hc_head(h[r], w("hc_head_fn")[r], w("hc_head_scale")[r],
                                                     w("hc_head_base")[r], rms_eps=eps, hc_eps=cfg.hc_eps)))
    taps.put("draft_head", "head_hidden", head)
    return head.reshape(head.shape[0], B, QW, -1), taps


def run_program(a, cfg, dep):
    head, taps = run_drafter(a, cfg, dep)
    return {"head_hidden": head}, taps
