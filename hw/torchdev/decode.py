"""`l3_decode_fwd`: the split target decode step (K=0, and the legacy K=7 split), per rank.

Each TP group runs its 64 stream slots x 8 rows; rank m of a group owns rows [128 m, 128 m + 128)
of the group stream (local rows = 16 requests x 8).  Per-token group-level arguments (slot
mappings, positions, compressor RoPE rows, state tables) index the group stream; local ones
(windows, indexer and compressed tables, kv_seq_lens, query RoPE rows, input ids) the rank's rows.
"""
from __future__ import annotations

import torch

from twin.abi import constants as C

from .final import final
from .layers import GroupRows, LocalRows, Taps, attention_sublayer, moe_sublayer

ROWS = C.DECODE_SEQ


def run_decode(a, cfg, dep):
    R, tp = dep.ranks, dep.topology.tp
    dev = a.device
    taps = Taps(a.ranks)

    def bands(per_rank, g0):
        return torch.cat(per_rank[g0:g0 + tp], dim=0)

    pos_g = [a["position_ids"][r].long() for r in range(R)]
    first_g = [p.reshape(-1, ROWS)[:, :1].expand(-1, ROWS).reshape(-1) for p in pos_g]
    slot_of = lambda t: torch.arange(t.shape[0], device=dev) // ROWS      # noqa: E731  row -> stream slot
    G = GroupRows(pos_g, first_g)
    for r in range(R):
        s = slot_of(pos_g[r])
        G.csa_state_tables.append(a["csa_compress_state_block_table"][r][s])
        G.inner_state_tables.append(a["csa_inner_compress_state_block_table"][r][s])
        G.hca_state_tables.append(a["hca_compress_state_block_table"][r][s])
        G.csa_cmp_cos.append(a["csa_cmp_freqs_cos"][r])
        G.csa_cmp_sin.append(a["csa_cmp_freqs_sin"][r])
        G.hca_cmp_cos.append(a["hca_cmp_freqs_cos"][r][s])
        G.hca_cmp_sin.append(a["hca_cmp_freqs_sin"][r][s])
    for key, name in (("csa_state", "csa_state_slot_mapping"), ("csa_inner_state", "csa_inner_state_slot_mapping"),
                      ("hca_state", "hca_state_slot_mapping"), ("csa_cmp", "csa_cmp_slot_mapping"),
                      ("csa_idx", "csa_idx_slot_mapping"), ("hca_cmp", "hca_cmp_slot_mapping"),
                      ("swa_ori", "swa_slot_mapping"), ("csa_ori", "csa_ori_slot_mapping"),
                      ("hca_ori", "hca_ori_slot_mapping")):
        G.slots[key] = [a[name][r].long() for r in range(R)]

    tables = {"idx": "csa_idx_block_table", "csa_cmp": "csa_cmp_block_table", "hca_cmp": "hca_cmp_block_table"}
    local_req = lambda r: torch.arange(a["position_ids_local"].shape[1], device=dev) // ROWS   # noqa: E731
    L = LocalRows(
        pos=[a["position_ids_local"][r].long() for r in range(R)],
        input_ids=[a["input_ids"][r].long() for r in range(R)],
        num_tokens=a["num_tokens_per_owner"].long(),
        swa_cos=list(a["freqs_cos"]), swa_sin=list(a["freqs_sin"]),
        cmp_cos=list(a["compressed_freqs_cos"]), cmp_sin=list(a["compressed_freqs_sin"]),
        windows={"swa": (a["swa_indices"], a["swa_lens"]),
                 "csa": (a["csa_window_swa_indices"], a["csa_window_swa_lens"]),
                 "hca": (a["hca_window_swa_indices"], a["hca_window_swa_lens"])},
        req_tables=lambda r, t: a[tables[t]][r][local_req(r)].long(),
        kv_seq_lens=lambda r, kind: a[f"{kind}_kv_seq_lens"][r][local_req(r)].long(),
        csa_cap=cfg.max_position_embeddings // 4, hca_cap=cfg.max_position_embeddings // 128)

    emb = a["embed_weight"]

    def embedded(r):
        live = (torch.arange(L.input_ids[r].shape[0], device=dev) < L.num_tokens[r])[:, None]
        h = torch.where(live, emb[r][L.input_ids[r]], torch.zeros((), device=dev))
        return h[:, None, :].expand(-1, cfg.hc_mult, -1)
    x_hc = a.ranks.local(embedded)
    for layer in range(cfg.num_hidden_layers):
        x_hc = attention_sublayer(a, cfg, dep, layer, x_hc, G, L, taps, bands=bands)
        x_hc = moe_sublayer(a, cfg, dep, layer, x_hc, L, taps)
    return final(a, cfg, dep, x_hc, taps, group_rows=False)
