"""`l3_decode_fwd_dspark`: the fused K=7 step (kernel-math.md §5.2), per TP group.

1. prepare (K27, K20): each stream slot's lease state gives its 8 verify rows (ids, positions
   min(anchor + o, limit - 1), the active width); from them and the group's ring / absolute tables
   the device derives what the split decode is staged with: positions, every family's slot
   mapping (live rows only: eager publication), windows, kv_seq_lens = anchor + width, RoPE rows
   from the position tables, logit rows local_row * 8 + o for o < width.
2. the target decode (`decode.run_decode`) on those rows; sampled[o] is the greedy token after
   verify row o, dspark_target_hidden its K21 capture.
3. accept (K27): the linear chain, the state advanced on every rank's replica of its group.
4. the drafter (`drafter_program.run_drafter`) on every rank's B rows: row b is local row b; a
   row that redrafts has its accepted rows as context (positions old_anchor + o, o < count, at
   dense offset 8 b + o), anchor old_anchor + count - 1 and tau = the next token (num_sampled 1);
   any other row writes nothing.  Slots come from the row's drafter block table (its lease ring).
5. the Markov sampler (K25 / K26) on the head rows, then commit (K27) of the redrafted rows.

The grammar extension (a constrained `grammar_mask` row, `valid_draft_counts` below 7) is refused:
neither this device nor golden implements it.
"""
from __future__ import annotations

import torch

from twin.abi import constants as C
from twin.abi.errors import AbiError

from .decode import run_decode
from .device_state import accept, commit, prepare
from .drafter_program import run_drafter
from .markov_sample import sample
from .paged import ring_slot, table_slot

ROWS = C.DECODE_SEQ
QW = C.DSPARK_QUERY_WIDTH


def extents(dispatch) -> dict:
    return {"B": int(dispatch.args["draft_block_tables"].shape[2])}


class View:
    """A program's arguments seen under another program's names: `derived` first, then the
    argument `prefix + name`."""

    def __init__(self, a, derived: dict, prefix: str = ""):
        self.a, self.derived, self.prefix, self.device = a, derived, prefix, a.device

    def __getitem__(self, name):
        return self.derived[name] if name in self.derived else self.a[self.prefix + name]

    def __contains__(self, name):
        return name in self.derived or (self.prefix + name) in self.a

    def layer(self, name, i):
        return self.a.layer(self.prefix + name, i)

    def __getattr__(self, name):            # the ranks held, the bound arguments: the program's own
        return getattr(self.a, name)


def _refuse_grammar(a):
    if bool((a["grammar_mask"] != -1).any()):
        raise AbiError("grammar_mask", "a constrained row", "all -1 (unconstrained): the torch device has no "
                       "grammar path", where="l3_decode_fwd_dspark")
    if bool((a["valid_draft_counts"] != QW).any()):
        raise AbiError("valid_draft_counts", int(a["valid_draft_counts"].min()), f"{QW} everywhere (unconstrained)",
                       where="l3_decode_fwd_dspark")


def _rope(table, pos):
    """Rows of a position table at pos (clamped into it); -1 positions give zero rows."""
    p = torch.clamp(pos, 0, table.shape[0] - 1)
    return torch.where((pos >= 0)[..., None], table[p], torch.zeros((), device=table.device))


def _target_args(a, cfg, dep, preps):
    """The split decode's per-token arguments, derived from the prepared stream slots of every group."""
    R, tp = dep.ranks, dep.topology.tp
    dev = a.device
    per = C.DECODE_BATCH // tp
    W = cfg.sliding_window
    d = {k: [] for k in ("position_ids", "swa_slot_mapping", "csa_cmp_slot_mapping", "csa_idx_slot_mapping",
                         "csa_state_slot_mapping", "csa_inner_state_slot_mapping", "hca_cmp_slot_mapping",
                         "hca_state_slot_mapping", "csa_cmp_freqs_cos", "csa_cmp_freqs_sin", "hca_cmp_freqs_cos",
                         "hca_cmp_freqs_sin", "position_ids_local", "input_ids", "freqs_cos", "freqs_sin",
                         "compressed_freqs_cos", "compressed_freqs_sin", "swa_indices", "swa_lens", "csa_kv_seq_lens",
                         "logit_row_indices")}
    half = cfg.qk_rope_head_dim // 2
    for r in range(R):
        g0 = (r // tp) * tp
        p = preps[r // tp]
        pos = p.positions.reshape(-1)                               # [512] group rows
        live = p.rows_live.reshape(-1)
        neg = torch.full_like(pos, -1)

        def paged(name, page):
            t = a[name][r].long()                                  # [64, depth] by stream slot
            return torch.where(live, ring_slot(t.repeat_interleave(ROWS, 0), pos[:, None], page)[:, 0], neg)

        def compressed(name, ratio):
            t = a[name][r].long().repeat_interleave(ROWS, 0)
            rpp = C.COMPRESSED_BLOCK_TOKENS // ratio
            s = table_slot(t, (pos // ratio)[:, None], rpp)[:, 0]
            return torch.where(live & ((pos + 1) % ratio == 0), s, neg)

        d["position_ids"].append(pos.to(torch.int32))
        d["swa_slot_mapping"].append(paged("group_ori_block_tables", C.BLOCK_SIZE))
        d["csa_state_slot_mapping"].append(paged("group_csa_state_block_tables", 2))
        d["csa_inner_state_slot_mapping"].append(paged("group_csa_inner_state_block_tables", 2))
        d["hca_state_slot_mapping"].append(paged("group_hca_state_block_tables", 8))
        d["csa_cmp_slot_mapping"].append(compressed("group_csa_cmp_block_tables", 4))
        d["csa_idx_slot_mapping"].append(compressed("group_idx_block_tables", 4))
        d["hca_cmp_slot_mapping"].append(compressed("group_hca_cmp_block_tables", 128))
        csa_pos = torch.where((pos + 1) % 4 == 0, pos - 3, torch.zeros_like(pos))
        d["csa_cmp_freqs_cos"].append(_rope(a["ratio4_rope_cos_table"][r], csa_pos))
        d["csa_cmp_freqs_sin"].append(_rope(a["ratio4_rope_sin_table"][r], csa_pos))
        start = p.anchor - p.anchor % 128
        d["hca_cmp_freqs_cos"].append(_rope(a["ratio128_rope_cos_table"][r], start)[:, :half])
        d["hca_cmp_freqs_sin"].append(_rope(a["ratio128_rope_sin_table"][r], start)[:, :half])
        m = r - g0
        band = slice(m * per * ROWS, (m + 1) * per * ROWS)
        bpos, blive = pos[band], live[band]
        d["position_ids_local"].append(bpos.to(torch.int32))
        d["input_ids"].append(p.tokens.reshape(-1)[band])
        for name, tab in (("freqs", "swa"), ("compressed_freqs", "ratio128")):
            d[name + "_cos"].append(_rope(a[f"{tab}_rope_cos_table"][r], bpos))
            d[name + "_sin"].append(_rope(a[f"{tab}_rope_sin_table"][r], bpos))
        # the window [max(0, p - W + 1), p] through the request's ori ring, oldest first
        st = torch.clamp(bpos - W + 1, min=0)
        lens = torch.where(blive, bpos - st + 1, torch.zeros_like(bpos))
        q = st[:, None] + torch.arange(W, device=dev)[None, :]
        ok = torch.arange(W, device=dev)[None, :] < lens[:, None]
        ori = a["group_ori_block_tables"][r].long()[m * per:(m + 1) * per].repeat_interleave(ROWS, 0)
        idx = torch.where(ok, ring_slot(ori, torch.where(ok, q, torch.zeros_like(q)), C.BLOCK_SIZE), -1)
        d["swa_indices"].append(idx.to(torch.int32))
        d["swa_lens"].append(lens.to(torch.int32))
        width = p.width[m * per:(m + 1) * per]
        d["csa_kv_seq_lens"].append((p.anchor[m * per:(m + 1) * per] + width).to(torch.int32))
        rows = torch.arange(per * ROWS, device=dev)
        d["logit_row_indices"].append(torch.where(blive, rows, torch.full_like(rows, -1)).to(torch.int32))
    out = {k: torch.stack(v) for k, v in d.items()}
    for kind in ("csa", "hca"):
        out[f"{kind}_ori_slot_mapping"] = out["swa_slot_mapping"]
        out[f"{kind}_window_swa_indices"] = out["swa_indices"]
        out[f"{kind}_window_swa_lens"] = out["swa_lens"]
    out["hca_kv_seq_lens"] = out["csa_kv_seq_lens"]
    for name in ("csa_compress_state_block_table", "csa_inner_compress_state_block_table",
                 "hca_compress_state_block_table"):
        fam = {"csa_compress_state_block_table": "group_csa_state_block_tables",
               "csa_inner_compress_state_block_table": "group_csa_inner_state_block_tables",
               "hca_compress_state_block_table": "group_hca_state_block_tables"}[name]
        out[name] = a[fam]
    return out


def _drafter_args(a, cfg, dep, preps, accs, B, target_hidden):
    """The drafter's host-staged tensors, built on device from the acceptance and the verify's K21
    target hidden [R, LOCAL_ROWS, 3 D]."""
    R, tp = dep.ranks, dep.topology.tp
    dev = a.device
    per = C.DECODE_BATCH // tp
    TM = B * ROWS
    tables = a["draft_block_tables"].long()                      # [R, DL, B, depth]
    DL = tables.shape[1]
    swa_c, swa_s = a["swa_rope_cos_table"], a["swa_rope_sin_table"]
    hidden, ctx_pos, ctx_slot, ns, last, anchors, q_slot = [], [], [], [], [], [], []
    for r in range(R):
        m = r % tp
        acc, p = accs[r // tp], preps[r // tp]
        sl = slice(m * per, m * per + B)
        cnt, red = acc.counts[sl], acc.redraft[sl]
        o = torch.arange(ROWS, device=dev)
        use = red[:, None] & (o[None, :] < cnt[:, None])                                    # [B, 8]
        pos = torch.where(use, p.anchor[sl][:, None] + o[None, :], torch.full_like(use, -1, dtype=torch.long))
        ctx_pos.append(pos.reshape(-1))
        th = target_hidden[r][:TM]
        hidden.append(torch.where(use.reshape(-1)[:, None], th, torch.zeros((), device=dev)))
        ns.append(red.to(torch.int32))
        last.append(torch.where(red, acc.next_token[sl], torch.zeros_like(acc.next_token[sl])))
        anchors.append(torch.where(red, acc.drafter_anchor[sl], torch.zeros_like(acc.drafter_anchor[sl])))
    for r in range(R):
        g0 = (r // tp) * tp
        gpos = torch.cat(ctx_pos[g0:g0 + tp])                                                # [TP * TM]
        per_layer, q_layer = [], []
        for l in range(DL):
            t = torch.cat([tables[g0 + m, l].repeat_interleave(ROWS, 0) for m in range(tp)])  # owner rows' rings
            per_layer.append(ring_slot(t, gpos[:, None], C.BLOCK_SIZE)[:, 0])
            qs = []
            for m in range(tp):
                a0 = anchors[g0 + m].long()
                qp = a0[:, None] + 1 + torch.arange(QW, device=dev)[None, :]
                s = ring_slot(tables[g0 + m, l], qp, C.BLOCK_SIZE)
                s = torch.where(ns[g0 + m].bool()[:, None], s, torch.full_like(s, -1)).reshape(-1)
                band = torch.full((C.DECODE_BATCH // tp * QW,), -1, dtype=torch.long, device=dev)
                band[:s.shape[0]] = s
                qs.append(band)
            q_layer.append(torch.cat(qs))
        ctx_slot.append(torch.stack(per_layer))
        q_slot.append(torch.stack(q_layer))
    gpos_all = [torch.cat(ctx_pos[(r // tp) * tp:(r // tp) * tp + tp]) for r in range(R)]
    # query rows a+1..a+7 of the rows that redraft; every other row's RoPE rows are zero
    qpos = [torch.where(ns[r].bool()[:, None], anchors[r].long()[:, None] + 1 + torch.arange(QW, device=dev)[None, :],
                        -1).reshape(-1) for r in range(R)]
    qrows = C.DECODE_BATCH // tp * QW
    qpad = [torch.cat([q, torch.full((qrows - q.shape[0],), -1, dtype=q.dtype, device=dev)]) for q in qpos]
    return {
        "target_hidden": torch.stack(hidden), "num_sampled": torch.stack(ns), "last_sampled": torch.stack(last),
        "next_prefill_tokens": torch.zeros_like(torch.stack(last)), "anchor_positions": torch.stack(anchors).to(torch.int32),
        "context_group_slot_mapping": torch.stack(ctx_slot),
        "context_group_freqs_cos": torch.stack([_rope(swa_c[r], gpos_all[r]) for r in range(R)]),
        "context_group_freqs_sin": torch.stack([_rope(swa_s[r], gpos_all[r]) for r in range(R)]),
        "query_group_slot_mapping": torch.stack(q_slot),
        "query_freqs_cos": torch.stack([_rope(swa_c[r], qpad[r]) for r in range(R)]),
        "query_freqs_sin": torch.stack([_rope(swa_s[r], qpad[r]) for r in range(R)]),
    }


def run_dspark(a, cfg, dep):
    R, tp = dep.ranks, dep.topology.tp
    if a.ranks.world != 1:
        # accept and commit read every group's replica and every rank's samples by global rank
        raise AbiError("ranks", f"{a.ranks.world} processes", "1 (the fused K=7 step runs its ranks in one "
                       "process; the split programs run over several)", where="l3_decode_fwd_dspark")
    per = C.DECODE_BATCH // tp
    _refuse_grammar(a)
    G = R // tp
    tokens, meta = a["state_tokens"], a["state_meta"]
    # every rank of a group holds the same replica; the group leader's is read, every rank's written
    preps = [prepare(tokens[g * tp], meta[g * tp], a["group_state_slot_ids"][g * tp],
                     a["group_state_generations"][g * tp]) for g in range(G)]
    outs, taps = run_decode(View(a, _target_args(a, cfg, dep, preps)), cfg, dep)
    sampled = outs["sampled_ids"][..., 0].long()                  # [R, 128] per verify row
    accs = []
    for g in range(G):
        smp = torch.cat([sampled[g * tp + m] for m in range(tp)]).reshape(C.DECODE_BATCH, ROWS)
        t, mt = tokens[g * tp].clone(), meta[g * tp].clone()
        acc = accept(t, mt, preps[g], torch.where(preps[g].rows_live, smp, torch.zeros_like(smp)),
                     cfg.dspark_noise_token_id)
        accs.append((acc, t, mt))
    B = a["draft_block_tables"].shape[2]
    dargs = _drafter_args(a, cfg, dep, preps, [x[0] for x in accs], B, outs["dspark_target_hidden"])
    dv = View(a, dargs, prefix="draft_")
    head, dtaps = run_drafter(dv, cfg, dep)
    taps.update(dtaps)
    mv = View(a, {"num_sampled": dargs["num_sampled"], "last_sampled": dargs["last_sampled"],
                  "next_prefill_tokens": dargs["next_prefill_tokens"], "lm_head_weight": a["draft_lm_head_weight"]},
              prefix="draft_")
    drafts, probs, logits = sample(mv, cfg, dep, lambda r: head[r])
    taps.put("markov", "base_logits", logits)
    acc_ids, acc_counts = [], []
    for g in range(G):
        acc, t, mt = accs[g]
        ok = torch.zeros_like(acc.redraft)
        dr = torch.zeros(C.DECODE_BATCH, QW, dtype=torch.long, device=a.device)
        for m in range(tp):
            n = min(per, B)
            dr[m * per:m * per + n] = drafts[g * tp + m][:n].long()
            ok[m * per:m * per + n] = acc.redraft[m * per:m * per + n]
        commit(t, mt, preps[g].lease, dr, ok)
        for m in range(tp):
            tokens[g * tp + m].copy_(t)
            meta[g * tp + m].copy_(mt)
            acc_ids.append(acc.token_ids[m * per:(m + 1) * per].to(torch.int32))
            acc_counts.append(acc.counts[m * per:(m + 1) * per].to(torch.int32))
    outs.update({"accepted_token_ids": torch.stack(acc_ids), "accepted_counts": torch.stack(acc_counts),
                 "draft_head_hidden": head, "draft_draft_token_ids": drafts, "draft_confidence_probs": probs})
    return outs, taps
