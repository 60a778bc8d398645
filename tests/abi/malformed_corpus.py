"""A corpus of malformed dispatches: each entry breaks exactly one named rule of `validate`.

Entries are (id, base, mutate, rule): `base` names a valid dispatch of `bases(ctx)`, `mutate`
returns a broken copy.  Built at TINY on the production 16-rank topology so the whole corpus
validates in a second or two; the rules do not depend on the preset.
"""
from __future__ import annotations

import numpy as np

from twin.abi import constants as C
from twin.abi import deployment
from twin.abi.batches import Dispatch
from twin.abi.lowering import (LoweringContext, lower_bootstrap, lower_decode, lower_drafter, lower_fused,
                               lower_markov, lower_prefill)
from twin.abi.lowering.primitives import absolute_table, ring_table

from lowering_batches import decode_batch, drafter_batch, prefill_batch


def context(**limits):
    kw = dict(ep=16, max_model_len=4096, max_num_seqs=64, long_prefill_token_threshold=256,
              max_num_batched_tokens=8192)
    kw.update(limits)
    return LoweringContext(deployment("tiny", **kw), slots=4)


def bases(ctx):
    pre = lower_prefill(prefill_batch(ctx, [(0, 0, 100), (0, 256, 128), (0, 600, 5), (2, 1000, 7)]), ctx)
    specs = [(0, 300, True, 5), (0, 1000, True, 9), (0, 64, False, 13), (1, 50, False, 6), (3, 4000, True, 63)]
    dec = lower_decode(decode_batch(ctx, specs, k=7), ctx)
    fus = lower_fused(decode_batch(ctx, specs, k=7), ctx)
    dr_b = drafter_batch(ctx, [(0, 5, 300, 3), (0, 9, 1000, 8), (1, 6, 50, 1), (0, 13, 80, 2)])
    return {
        "prefill": pre, "decode": dec, "fused": fus,
        "drafter": lower_drafter(dr_b, ctx),
        "bootstrap": lower_bootstrap(drafter_batch(ctx, [(0, 5, 300, 0), (1, 9, 60, 0)], seed=True), ctx),
        "markov": lower_markov(dr_b, ctx),
    }


def put(d: Dispatch, **args) -> Dispatch:
    new = dict(d.args)
    for k, v in args.items():
        if v is None:
            new.pop(k)
        else:
            new[k] = v
    return Dispatch(d.program, new, d.meta)


def edit(d: Dispatch, name: str, fn) -> Dispatch:
    a = np.array(d.args[name], copy=True)
    out = fn(a)
    return put(d, **{name: a if out is None else out})


def group(ctx, g=0):
    r = ctx.group_ranks(g)
    return slice(r.start, r.stop)


def resize(d: Dispatch, axis_args: dict, n: int, fill=-1) -> Dispatch:
    """Grow or shrink a dynamic axis on every argument that carries it (consistently)."""
    new = {}
    for name, axis in axis_args.items():
        a = np.asarray(d.args[name])
        cur = a.shape[axis]
        if n <= cur:
            new[name] = np.take(a, range(n), axis=axis)
        else:
            pad = [(0, 0)] * a.ndim
            pad[axis] = (0, n - cur)
            new[name] = np.pad(a, pad, constant_values=fill if np.issubdtype(a.dtype, np.signedinteger) else 0)
    return put(d, **new)


B_ARGS_DRAFTER = {"num_sampled": 1, "last_sampled": 1, "next_prefill_tokens": 1, "anchor_positions": 1,
                  "block_tables": 2}
B_ARGS_MARKOV = {"num_sampled": 1, "last_sampled": 1, "next_prefill_tokens": 1, "head_hidden": 1}


def corpus(ctx):
    """[(id, base name, mutate(dispatch) -> dispatch, expected rule)]"""
    nbo = ctx.num_blocks["ori"]
    g0 = group(ctx, 0)
    P = lambda d: d.args["x_hc"].shape[1]                       # noqa: E731
    E = []

    def add(i, base, fn, rule):
        E.append((i, base, fn, rule))

    # ---- l3_prefill_fwd --------------------------------------------------------------------
    add("prefill-program", "prefill", lambda d: Dispatch("l3_prefil_fwd", d.args), "program")
    add("prefill-unknown", "prefill", lambda d: put(d, foo=np.zeros(3)), "unknown_arg")
    add("prefill-missing-qsl", "prefill", lambda d: put(d, query_start_loc=None), "missing_arg")
    add("prefill-missing-ori-table", "prefill", lambda d: put(d, ori_block_table=None), "missing_arg")
    add("prefill-x_hc-rows", "prefill", lambda d: put(d, x_hc=d.args["x_hc"][:, :-4]), "shape")
    add("prefill-ori-shallow", "prefill",
        lambda d: put(d, ori_block_table=d.args["ori_block_table"][..., : ctx.depth("ORI_DEPTH") // 2]), "table_depth")
    add("prefill-csa-deep", "prefill",
        lambda d: put(d, csa_compress_state_block_table=np.pad(d.args["csa_compress_state_block_table"],
                                                               [(0, 0), (0, 0), (0, 1)], constant_values=-1)),
        "table_depth")
    add("prefill-pos-dtype", "prefill", lambda d: put(d, position_ids_full=d.args["position_ids_full"].astype(np.int64)),
        "dtype")
    add("prefill-pool-shape", "prefill", lambda d: put(d, kv_cache=np.zeros((16, 7, 32, 1, 32), np.uint16)), "shape")
    add("prefill-weight-dtype", "prefill",
        lambda d: put(d, attn_sink=np.zeros(ctx.bind("l3_prefill_fwd")["attn_sink"].shape, np.float64)), "dtype")
    add("prefill-rope-dtype", "prefill", lambda d: put(d, swa_freqs_cos=d.args["swa_freqs_cos"].astype(np.float32)),
        "dtype")
    q_args = {n: 1 for n in ("query_start_loc", "hca_compress_state_block_table", "csa_compress_state_block_table",
                             "csa_inner_compress_state_block_table", "ori_block_table", "hca_cmp_block_table",
                             "csa_cmp_block_table", "idx_block_table")}

    def q65(d):
        d2 = resize(d, {k: v for k, v in q_args.items() if k != "query_start_loc"}, 65)
        q = d.args["query_start_loc"]
        return put(d2, query_start_loc=np.concatenate([q, np.repeat(q[:, -1:], 65 + 1 - q.shape[1], 1)], 1))
    add("prefill-q65", "prefill", q65, "group_requests")
    add("prefill-terminal-beyond-P", "prefill",
        lambda d: edit(d, "query_start_loc", lambda a: a.__setitem__((g0, 3), P(d) + 4)), "group_tokens")
    p_args = {n: 1 for n, a in d_args_with_dyn("l3_prefill_fwd", "P")}
    add("prefill-P-8196", "prefill",
        lambda d: resize(resize(d, p_args, 8196), {n: 1 for n in l_args()}, 8196 // ctx.tp), "group_tokens")
    add("prefill-qsl-decreasing", "prefill",
        lambda d: edit(d, "query_start_loc", lambda a: a.__setitem__((g0, 2), 1)), "query_start_loc")
    add("prefill-qsl-replication", "prefill",
        lambda d: edit(d, "query_start_loc", lambda a: a.__setitem__((1, 1), a[1, 1] - 1)), "replication")

    def ring_of(d, name, ids, row=0):
        a = np.array(d.args[name])
        a[g0, row] = ring_table(ids, a.shape[-1])
        return put(d, **{name: a})
    add("prefill-ori-repeat", "prefill", lambda d: ring_of(d, "ori_block_table", [1, 2, 1, 3]), "block_repeat")

    def abs_of(d, name, ids, row=0):
        a = np.array(d.args[name])
        a[g0, row] = absolute_table(ids, a.shape[-1])
        return put(d, **{name: a})
    add("prefill-cmp-repeat", "prefill", lambda d: abs_of(d, "hca_cmp_block_table", [4, 4]), "block_repeat")
    add("prefill-cmp-range", "prefill",
        lambda d: abs_of(d, "csa_cmp_block_table", [0, ctx.num_blocks["cmp_c4"]]), "block_range")
    add("prefill-scratch-in-ring", "prefill", lambda d: ring_of(d, "ori_block_table", [nbo + 3, 1]), "block_range")
    add("prefill-absent-row", "prefill",
        lambda d: edit(d, "idx_block_table", lambda a: a.__setitem__((group(ctx, 2), 1, 0), 7)), "table_layout")
    add("prefill-abs-hole", "prefill",
        lambda d: edit(d, "idx_block_table", lambda a: a.__setitem__((g0, 0, 0), -1)), "table_layout")
    period = ctx.ring_period("csa_state")
    add("prefill-ring-period", "prefill",
        lambda d: ring_of(d, "csa_compress_state_block_table", list(range(period + 1))), "ring_period")
    add("prefill-slot-range", "prefill",
        lambda d: edit(d, "ori_slot_mapping_full", lambda a: a.__setitem__((g0, 3), nbo * 32)), "slot_range")
    add("prefill-slot-mapping", "prefill",
        lambda d: edit(d, "ori_slot_mapping_full", lambda a: a.__setitem__((g0, 5), a[0, 5] + 1 if a[0, 5] + 1 < nbo * 32
                                                                         else a[0, 5] - 1)), "slot_mapping")
    add("prefill-compressed-off-boundary", "prefill",
        lambda d: edit(d, "csa_cmp_slot_mapping_full", lambda a: a.__setitem__((g0, 4), 0)), "slot_mapping")
    add("prefill-padding-publish", "prefill",
        lambda d: edit(d, "csa_state_slot_mapping_full", lambda a: a.__setitem__((group(ctx, 2), P(d) - 1), 5)),
        "padding_publish")
    add("prefill-position-ceiling", "prefill",
        lambda d: edit(d, "position_ids_full", lambda a: a.__setitem__((g0, 0), ctx.max_position)), "position_ceiling")
    add("prefill-padding-positions", "prefill",
        lambda d: edit(d, "position_ids_full", lambda a: a.__setitem__((group(ctx, 2), P(d) - 1), 1000)),
        "padding_positions")
    add("prefill-band", "prefill",
        lambda d: edit(d, "position_ids_local", lambda a: a.__setitem__((1, 0), a[1, 0] + 1)), "band_layout")
    add("prefill-token", "prefill",
        lambda d: edit(d, "input_ids", lambda a: a.__setitem__((0, 0), ctx.model.vocab_size)), "token_range")
    add("prefill-logit-rows", "prefill",
        lambda d: edit(d, "logit_row_indices", lambda a: a.__setitem__((0, 0), 5)), "logit_rows")
    add("prefill-grammar-header", "prefill",
        lambda d: edit(d, "grammar_mask", lambda a: a.__setitem__((0, 0, 0, -1), 5)), "grammar_header")
    add("prefill-grammar-padding", "prefill",
        lambda d: edit(d, "grammar_mask", lambda a: a.__setitem__((0, 3, 1, 60), 0)), "grammar_padding")

    # ---- l3_decode_fwd ---------------------------------------------------------------------
    add("decode-owner-overflow", "decode",
        lambda d: edit(d, "num_tokens_per_owner", lambda a: a.__setitem__(1, 136)), "owner_rows")
    add("decode-owner-partial", "decode",
        lambda d: edit(d, "num_tokens_per_owner", lambda a: a.__setitem__(1, 12)), "owner_rows")
    add("decode-hca-depth", "decode",
        lambda d: put(d, hca_compress_state_block_table=d.args["hca_compress_state_block_table"][..., :8]),
        "table_depth")
    add("decode-csa-depth", "decode",
        lambda d: put(d, csa_compress_state_block_table=np.pad(d.args["csa_compress_state_block_table"],
                                                               [(0, 0), (0, 0), (0, 8)], constant_values=-1)),
        "table_depth")
    add("decode-local-range", "decode",
        lambda d: edit(d, "csa_cmp_block_table", lambda a: a.__setitem__((1, 0, 0), ctx.num_blocks["cmp_c4"] + 70)),
        "block_range")
    add("decode-inactive-live-id", "decode",
        lambda d: edit(d, "hca_cmp_block_table", lambda a: a.__setitem__((2, 5, 0), 3)), "block_range")

    def trailing_repeat(d):
        a = np.array(d.args["csa_compress_state_block_table"])
        s = d.meta["placement"]["d0"]["stream_slot"]
        live = np.flatnonzero(a[0, s] >= 0)
        a[g0, s, live[1]] = a[0, s, live[0]]
        return put(d, csa_compress_state_block_table=a)
    add("decode-trailing-repeat", "decode", trailing_repeat, "block_repeat")
    add("decode-inactive-publish", "decode",
        lambda d: edit(d, "hca_state_slot_mapping", lambda a: a.__setitem__((g0, 63 * 8), 5)), "inactive_publish")
    add("decode-slot-range", "decode",
        lambda d: edit(d, "csa_idx_slot_mapping", lambda a: a.__setitem__((g0, 0), 10 ** 9)), "slot_range")

    def dslot(d, rid="d0"):
        return d.meta["placement"][rid]

    add("decode-state-slot-mapping", "decode",
        lambda d: edit(d, "hca_state_slot_mapping", lambda a: a.__setitem__((g0, dslot(d)["stream_slot"] * 8 + 2),
                                                                           a[0, dslot(d)["stream_slot"] * 8 + 2] ^ 1)),
        "slot_mapping")
    add("decode-ori-copies-disagree", "decode",
        lambda d: edit(d, "csa_ori_slot_mapping", lambda a: a.__setitem__((g0, dslot(d)["stream_slot"] * 8), 0)),
        "slot_mapping")
    add("decode-noncommitted-publish", "decode",
        lambda d: edit(d, "csa_state_slot_mapping", lambda a: a.__setitem__((g0, dslot(d, "d2")["stream_slot"] * 8 + 3), 4)),
        "slot_mapping")
    add("decode-seq-lens", "decode",
        lambda d: edit(d, "csa_kv_seq_lens", lambda a: a.__setitem__((dslot(d)["rank"], dslot(d)["local_row"]),
                                                                     a[dslot(d)["rank"], dslot(d)["local_row"]] + 2)),
        "seq_lens")
    add("decode-seq-lens-empty-row", "decode",
        lambda d: edit(d, "hca_kv_seq_lens", lambda a: a.__setitem__((3, 15), 9)), "seq_lens")
    add("decode-window-empty-row", "decode",
        lambda d: edit(d, "csa_window_swa_lens", lambda a: a.__setitem__((3, 127), 1)), "window_lens")

    def pos_ceiling(d):
        d2 = edit(d, "position_ids", lambda a: a.__setitem__((g0, 7), ctx.max_position))
        return d2
    add("decode-position-ceiling", "decode", pos_ceiling, "position_ceiling")
    add("decode-position-replication", "decode",
        lambda d: edit(d, "position_ids", lambda a: a.__setitem__((2, 7), 1)), "replication")
    add("decode-window-lens", "decode",
        lambda d: edit(d, "swa_lens", lambda a: a.__setitem__((0, 0), 129)), "window_lens")
    add("decode-window-range", "decode",
        lambda d: edit(d, "hca_window_swa_indices", lambda a: a.__setitem__((0, 0, 0), nbo * 32 + 1)), "slot_range")
    add("decode-logit-rows", "decode",
        lambda d: edit(d, "logit_row_indices", lambda a: a.__setitem__((1, 1), 0)), "logit_rows")
    add("decode-token", "decode",
        lambda d: edit(d, "input_ids", lambda a: a.__setitem__((1, 0), -3)), "token_range")
    add("decode-grammar-dtype", "decode", lambda d: put(d, grammar_mask=d.args["grammar_mask"].astype(np.int32)), "dtype")
    add("decode-window-shape", "decode", lambda d: put(d, swa_indices=d.args["swa_indices"][..., :64]), "shape")
    add("decode-missing-owner", "decode", lambda d: put(d, num_tokens_per_owner=None), "missing_arg")
    add("decode-scalar-owner", "decode", lambda d: put(d, num_tokens_per_owner=5), "shape")
    add("decode-list-lens", "decode", lambda d: put(d, swa_lens=d.args["swa_lens"].tolist()), "dtype")

    # ---- l3_decode_fwd_dspark --------------------------------------------------------------
    def fused_slot(d, rid):
        return d.meta["placement"][rid]

    add("fused-lease-range", "fused",
        lambda d: edit(d, "state_slot_ids", lambda a: a.__setitem__((1, 0), 64)), "lease_range")

    def dup_lease(d):
        p0, p1 = fused_slot(d, "d0"), fused_slot(d, "d1")
        a = np.array(d.args["group_state_slot_ids"])
        a[g0, p1["stream_slot"]] = a[0, p0["stream_slot"]]
        return put(d, group_state_slot_ids=a)
    add("fused-lease-unique", "fused", dup_lease, "lease_unique")
    add("fused-generation", "fused",
        lambda d: edit(d, "group_state_generations",
                       lambda a: a.__setitem__((g0, fused_slot(d, "d0")["stream_slot"]), 0)), "generation")
    add("fused-descriptor", "fused",
        lambda d: edit(d, "state_generations", lambda a: a.__setitem__((1, 0), 99)), "descriptor_mismatch")

    def wrong_owner(d):
        p = fused_slot(d, "d0")                          # lease 5 on member 1: move to lease 6 (member 2)
        g, s = np.array(d.args["group_state_slot_ids"]), np.array(d.args["state_slot_ids"])
        g[g0, p["stream_slot"]] = 6 + 4 * 10
        s[p["rank"], p["local_row"]] = 6 + 4 * 10
        return put(d, group_state_slot_ids=g, state_slot_ids=s)
    add("fused-owner-placement", "fused", wrong_owner, "owner_placement")
    add("fused-owner-rows", "fused",
        lambda d: edit(d, "num_tokens_per_owner", lambda a: a.__setitem__(0, 8)), "owner_rows")
    add("fused-draft-count", "fused",
        lambda d: edit(d, "valid_draft_counts", lambda a: a.__setitem__((g0, 0), 8)), "draft_count")
    add("fused-draft-count-replication", "fused",
        lambda d: edit(d, "valid_draft_counts", lambda a: a.__setitem__((1, 0), 3)), "replication")
    add("fused-ori-depth", "fused",
        lambda d: put(d, group_ori_block_tables=d.args["group_ori_block_tables"][..., :-1]), "table_depth")
    add("fused-state-depth", "fused",
        lambda d: put(d, group_hca_state_block_tables=np.pad(d.args["group_hca_state_block_tables"],
                                                             [(0, 0), (0, 0), (0, 1)])), "table_depth")
    add("fused-idx-repeat", "fused",
        lambda d: abs_of(d, "group_idx_block_tables", [2, 2], row=fused_slot(d, "d0")["stream_slot"]), "block_repeat")
    add("fused-drafter-ring", "fused",
        lambda d: edit(d, "draft_block_tables", lambda a: a.__setitem__((1, 0, 0, 5), a[1, 0, 0, 4])), "drafter_ring")
    add("fused-drafter-range", "fused",
        lambda d: edit(d, "draft_block_tables", lambda a: a.__setitem__((1, 0, 0, 5), 400)), "block_range")
    add("fused-B5", "fused", lambda d: resize(d, {"draft_block_tables": 2}, 5), "drafter_batch")

    # ---- l3_dspark_drafter -----------------------------------------------------------------
    add("drafter-B6", "drafter", lambda d: resize(d, B_ARGS_DRAFTER, 6), "drafter_batch")
    t_args = {"target_hidden": 1, "context_group_position_ids": 1, "context_group_slot_mapping": 2,
              "context_group_freqs_cos": 1, "context_group_freqs_sin": 1}

    def t48(d):
        t = d.args["target_hidden"].shape[1]
        d2 = resize(d, {"target_hidden": 1}, 48)
        return resize(d2, {k: v for k, v in t_args.items() if k != "target_hidden"}, 48 * ctx.tp) if t else d2
    add("drafter-T48", "drafter", t48, "drafter_context")
    add("drafter-mode", "drafter", lambda d: edit(d, "num_sampled", lambda a: a.__setitem__((1, 0), 2)), "drafter_mode")
    add("drafter-ring", "drafter",
        lambda d: edit(d, "block_tables", lambda a: a.__setitem__((1, 2, 0, 9), a[1, 2, 0, 8])), "drafter_ring")

    def dup_drafter(d):
        a = np.array(d.args["block_tables"])
        a[1, :, 1] = a[1, :, 0]                           # rank 1 rows 0 and 1 both lease 5 (group 0)
        return put(d, block_tables=a)
    add("drafter-lease-unique", "drafter", dup_drafter, "lease_unique")
    add("drafter-padding-publish", "drafter",
        lambda d: edit(d, "context_group_slot_mapping", lambda a: a.__setitem__((g0, 0, -1), 3)), "padding_publish")
    def foreign(d, lease):
        a = np.array(d.args["context_group_slot_mapping"])
        pos = d.args["context_group_position_ids"][0]
        j = int(np.flatnonzero(pos >= 0)[0])
        a[g0, 0, j] = (lease * 6 + (pos[j] // 32) % 6) * 32 + pos[j] % 32
        return put(d, context_group_slot_mapping=a)
    add("drafter-other-live-lease", "drafter", lambda d: foreign(d, 13), "slot_mapping")
    add("drafter-dead-lease", "drafter", lambda d: foreign(d, 40), "slot_mapping")
    add("drafter-query-ceiling", "drafter",
        lambda d: edit(d, "query_group_position_ids", lambda a: a.__setitem__((g0, 120), ctx.max_position)),
        "position_ceiling")
    add("drafter-slot-range", "drafter",
        lambda d: edit(d, "query_group_slot_mapping",
                       lambda a: a.__setitem__((g0, 1, 112), C.DRAFTER_FILLER_BLOCK_BASE * 32)), "slot_range")
    add("drafter-token", "drafter",
        lambda d: edit(d, "last_sampled", lambda a: a.__setitem__((1, 0), ctx.model.vocab_size + 1)), "token_range")
    add("drafter-replication", "drafter",
        lambda d: edit(d, "context_group_position_ids", lambda a: a.__setitem__((3, 0), 1)), "replication")
    add("drafter-missing-tables", "drafter", lambda d: put(d, block_tables=None), "missing_arg")

    # ---- l3_dspark_draft_step_device_state --------------------------------------------------
    add("bootstrap-logit-rows", "bootstrap",
        lambda d: edit(d, "logit_row_indices", lambda a: a.__setitem__((0, 6), -1)), "logit_rows")
    add("bootstrap-lease-range", "bootstrap",
        lambda d: edit(d, "state_slot_ids", lambda a: a.__setitem__((0, 0), 70)), "lease_range")
    add("bootstrap-hidden-dtype", "bootstrap",
        lambda d: put(d, target_hidden=d.args["target_hidden"].astype(np.float32)), "dtype")
    add("bootstrap-qfreq-shape", "bootstrap", lambda d: put(d, query_freqs_cos=d.args["query_freqs_cos"][:, :100]),
        "shape")
    add("bootstrap-block-range", "bootstrap",
        lambda d: edit(d, "block_tables", lambda a: a.__setitem__((0, 0, 0, 0), -2)), "block_range")
    add("bootstrap-B-conflict", "bootstrap", lambda d: resize(d, {"anchor_positions": 1}, 8), "shape")

    # ---- l3_distributed_markov_sample --------------------------------------------------------
    add("markov-mode", "markov", lambda d: edit(d, "num_sampled", lambda a: a.__setitem__((1, 1), 3)), "drafter_mode")
    add("markov-logit-rows", "markov",
        lambda d: edit(d, "logit_row_indices", lambda a: a.__setitem__((1, 7), 8)), "logit_rows")
    add("markov-B-conflict", "markov", lambda d: resize(d, {"last_sampled": 1}, 8), "shape")
    add("markov-missing-hidden", "markov", lambda d: put(d, head_hidden=None), "missing_arg")
    add("markov-string-rows", "markov", lambda d: put(d, logit_row_indices="0..6"), "shape")
    add("markov-hidden-dtype", "markov", lambda d: put(d, head_hidden=d.args["head_hidden"].astype(np.float32)),
        "dtype")
    add("markov-token", "markov",
        lambda d: edit(d, "next_prefill_tokens", lambda a: a.__setitem__((2, 0), -1)), "token_range")
    add("markov-B3", "markov", lambda d: resize(d, B_ARGS_MARKOV, 3), "drafter_batch")
    return E


def d_args_with_dyn(program, sym):
    from twin.abi import get_program
    return [(a.name, a) for a in get_program(program).args if a.dyn == sym and a.role == "input"]


def l_args():
    return [n for n, _ in d_args_with_dyn("l3_prefill_fwd", "L")]
