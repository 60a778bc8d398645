"""`l3_prefill_fwd`: packed, chunked prefill, context-parallel over each TP group.

A group's stream packs its requests' chunks (`query_start_loc`), padded to P rows with synthetic
positions that write nothing; rank m owns the band [m L, (m + 1) L) of it (queries, indexer,
attention, MoE), the KV and the compressors run on the whole all-gathered stream (K28), with the
group-level slot mappings.  The window of a query at p is positions max(0, p - 127)..p through
the request's ori ring table; the indexer sees min((p+1)//4, 2048) compressed rows and HCA
attention min((p+1)//128, 512) (the prefill caps); an unmapped old HCA state row scores 0.
"""
from __future__ import annotations

import torch

from twin.abi import constants as C

from .final import final
from .layers import GroupRows, LocalRows, Taps, attention_sublayer, moe_sublayer
from .paged import ring_slot

PREFILL_SCORE_CAP = 2048
PREFILL_HCA_CAP = 512


def extents(dispatch) -> dict:
    """The dynamic extents the dispatch was bound at: P packed rows, Q requests per group."""
    return {"P": int(dispatch.args["x_hc"].shape[1]), "Q": int(dispatch.args["query_start_loc"].shape[1]) - 1}


def run_prefill(a, cfg, dep):
    R, tp = dep.ranks, dep.topology.tp
    dev = a.device
    taps = Taps(a.ranks)
    P = a["x_hc"].shape[1]
    Lb = P // tp
    W = cfg.sliding_window

    def bands(per_rank, g0):
        return torch.cat(per_rank[g0:g0 + tp], dim=0)

    qsl = a["query_start_loc"].long()
    rows = torch.arange(P, device=dev)
    pos_g, first_g, req_g, total = [], [], [], []
    for r in range(R):
        req = torch.clamp(torch.searchsorted(qsl[r], rows, right=True) - 1, max=qsl.shape[1] - 2)
        p = a["position_ids_full"][r].long()
        start = p[torch.clamp(qsl[r][req], max=P - 1)]
        n = int(qsl[r][-1])
        pad = rows >= n          # padding rows: one pseudo-request from the first padding position
        first_g.append(torch.where(pad, p[min(n, P - 1)], start))
        pos_g.append(p)
        req_g.append(req)
        total.append(n)
    G = GroupRows(pos_g, first_g, hca_missing_zero=True)
    for r in range(R):
        G.csa_state_tables.append(a["csa_compress_state_block_table"][r][req_g[r]])
        G.inner_state_tables.append(a["csa_inner_compress_state_block_table"][r][req_g[r]])
        G.hca_state_tables.append(a["hca_compress_state_block_table"][r][req_g[r]])
        G.csa_cmp_cos.append(a["csa_cmp_freqs_cos"][r])
        G.csa_cmp_sin.append(a["csa_cmp_freqs_sin"][r])
        G.hca_cmp_cos.append(a["hca_cmp_freqs_cos"][r])
        G.hca_cmp_sin.append(a["hca_cmp_freqs_sin"][r])
    ori = [a["ori_slot_mapping_full"][r].long() for r in range(R)]
    G.slots = {"swa_ori": ori, "csa_ori": ori, "hca_ori": ori}
    for key in ("csa_state", "csa_inner_state", "hca_state", "csa_cmp", "csa_idx", "hca_cmp"):
        G.slots[key] = [a[f"{key}_slot_mapping_full"][r].long() for r in range(R)]

    def band(r, t):
        m = r % tp
        return t[m * Lb:(m + 1) * Lb]

    tables = {"idx": "idx_block_table", "csa_cmp": "csa_cmp_block_table", "hca_cmp": "hca_cmp_block_table"}
    ends = [a["position_ids_full"][r].long()[torch.clamp(qsl[r][1:] - 1, min=0, max=P - 1)] + 1 for r in range(R)]
    windows = []
    for r in range(R):
        p = band(r, pos_g[r])
        start = torch.clamp(p - W + 1, min=0)
        lens = p - start + 1
        q = start[:, None] + torch.arange(W, device=dev)[None, :]
        table = a["ori_block_table"][r][band(r, req_g[r])].long()
        idx = ring_slot(table, q, C.BLOCK_SIZE)
        windows.append(torch.where(torch.arange(W, device=dev)[None, :] < lens[:, None], idx, -1))
    win = (windows, [torch.full((Lb,), W, device=dev).minimum(band(r, pos_g[r]) + 1) for r in range(R)])
    L = LocalRows(
        pos=[band(r, pos_g[r]) for r in range(R)],
        input_ids=[a["input_ids"][r].long() for r in range(R)],
        num_tokens=torch.tensor([max(0, min(Lb, total[r] - (r % tp) * Lb)) for r in range(R)], device=dev),
        swa_cos=[band(r, a["swa_freqs_cos"][r]) for r in range(R)],
        swa_sin=[band(r, a["swa_freqs_sin"][r]) for r in range(R)],
        cmp_cos=[band(r, a["compressed_freqs_cos"][r]) for r in range(R)],
        cmp_sin=[band(r, a["compressed_freqs_sin"][r]) for r in range(R)],
        windows={"swa": win, "csa": win, "hca": win},
        req_tables=lambda r, t: a[tables[t]][r][band(r, req_g[r])].long(),
        kv_seq_lens=lambda r, kind: ends[r][band(r, req_g[r])],
        csa_cap=PREFILL_SCORE_CAP, hca_cap=PREFILL_HCA_CAP)

    x_hc = a.ranks.local(lambda r: band(r, a["x_hc"][r]))
    for layer in range(cfg.num_hidden_layers):
        x_hc = attention_sublayer(a, cfg, dep, layer, x_hc, G, L, taps, bands=bands)
        x_hc = moe_sublayer(a, cfg, dep, layer, x_hc, L, taps)
    return final(a, cfg, dep, x_hc, taps, group_rows=True)
