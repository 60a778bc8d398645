"""Per-program lowering contract (serving-contract.md §5.8, §6.2-6.4, §7.1-7.4)."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from lowering_batches import Pools, decode_batch, drafter_batch, prefill_batch  # noqa: E402

from twin.abi import constants as C, deployment  # noqa: E402
from twin.abi.batches import DecodeBatch, PrefillBatch  # noqa: E402
from twin.abi.lowering import (Constraint, DispatchError, LoweringContext, from_bf16_bits, lower, lower_bootstrap,  # noqa: E402
                               lower_decode, lower_drafter, lower_fused, lower_markov, lower_prefill, row_mode,
                               seeding_waves, unpack_allowed, validate)
from twin.abi.lowering.grammar import pack_rows, padding_ok  # noqa: E402


def ctx_for(k=7, **kw):
    lim = dict(ep=16, max_model_len=4096, max_num_seqs=64, long_prefill_token_threshold=256,
               max_num_batched_tokens=8192, num_speculative_tokens=k)
    lim.update(kw)
    return LoweringContext(deployment("tiny", **lim), slots=4)


CTX = ctx_for()


def rope(ctx, ratio, pos):
    c, s = ctx.rope_bits(ratio, np.asarray(pos))
    return c


# ---- prefill -----------------------------------------------------------------------------------
def test_packed_prefill_geometry_offsets_and_padding():
    b = prefill_batch(CTX, [(0, 0, 10), (0, 128, 7), (2, 300, 5)])
    emb = np.random.default_rng(0).standard_normal((CTX.model.vocab_size, CTX.model.hidden_size)).astype(np.float32)
    d = lower_prefill(b, CTX, embedding=emb)
    validate(d, CTX)
    P, Q = d.meta["P"], d.meta["Q"]
    assert (P, Q) == (20, 2)                       # align4(17), two requests in group 0
    a = d.args
    assert a["query_start_loc"][0].tolist() == [0, 10, 17] and a["query_start_loc"][8].tolist() == [0, 5, 5]
    assert (a["query_start_loc"][4:8] == 0).all() and (a["query_start_loc"][12:] == 0).all()   # idle groups
    pos = a["position_ids_full"][0]
    assert pos[:17].tolist() == list(range(10)) + list(range(128, 135))
    assert pos[17:].tolist() == [135, 136, 137]   # synthetic, above every live position
    assert a["logit_row_indices"][0, :2].tolist() == [9, 16] and (a["logit_row_indices"][1:4] == -1).all()
    assert a["logit_row_indices"][8, 0] == 4 and d.meta["placement"]["p2"]["sampled_slot"] == (8, 0)
    L = P // 4
    for m in range(4):
        assert np.array_equal(a["position_ids_local"][m], pos[m * L:(m + 1) * L])
    # x_hc: the embedding rows replicated over the 4 HC copies on the group's ranks, zero tail and idle groups
    toks = np.array(b.items[1].chunk_tokens)
    assert np.array_equal(a["x_hc"][3, 10:17, 2], emb[toks]) and (a["x_hc"][:, 17:] == 0).all()
    assert (a["x_hc"][4:8] == 0).all()
    # padding and idle groups publish nothing
    for n in ("ori_slot_mapping_full", "csa_state_slot_mapping_full", "hca_state_slot_mapping_full"):
        assert (a[n][0, 17:] == -1).all() and (a[n][4:8] == -1).all()


def test_prefill_rope_rows_follow_each_profile_rule():
    b = prefill_batch(CTX, [(1, 120, 16)])
    d = lower_prefill(b, CTX)
    pos = np.arange(120, 136)
    a = d.args
    assert np.array_equal(a["swa_freqs_cos"][4, :16], rope(CTX, 0, pos))
    assert np.array_equal(a["compressed_freqs_cos"][4, :16], rope(CTX, 128, pos))
    assert not np.array_equal(a["swa_freqs_cos"][4, 1:16], a["compressed_freqs_cos"][4, 1:16])
    csa = np.where((pos + 1) % 4 == 0, pos - 3, 0)                       # ratio 4: window start p-3
    assert np.array_equal(a["csa_cmp_freqs_cos"][4, :16], rope(CTX, 4, csa))
    assert np.array_equal(a["hca_cmp_freqs_cos"][4, :16], rope(CTX, 128, pos - pos % 128))
    assert (a["swa_freqs_cos"][:4] == 0).all()                           # idle group stays zero


def test_cached_suffix_prefill_writes_the_boundary_into_the_new_compressed_page():
    b = prefill_batch(CTX, [(0, 256, 128)])          # a prefix hit of 256 tokens, then 128 new ones
    d = lower_prefill(b, CTX)
    ids = b.items[0].block_ids
    hca = d.args["hca_cmp_slot_mapping_full"][0, :128]
    assert (hca[:-1] == -1).all() and hca[-1] == ids["cmp_c128"][2]       # p = 383 -> row 2
    csa = d.args["csa_cmp_slot_mapping_full"][0, :128]
    assert csa[3] == ids["cmp_c4"][2] * 32 + (259 // 4) % 32 and (csa[csa >= 0].size == 32)


def test_prefill_rejects_bad_batches():
    with pytest.raises(DispatchError) as e:
        lower_prefill(prefill_batch(CTX, [(0, 0, 300)]), CTX)
    assert e.value.rule == "chunk_tokens"
    b = prefill_batch(CTX, [(0, 0, 10)])
    it = b.items[0]
    bad = PrefillBatch((it.__class__(**{**it.__dict__, "block_ids": {**it.block_ids, "ori": (3, 3)}}),))
    with pytest.raises(DispatchError) as e:
        lower_prefill(bad, CTX)
    assert (e.value.rule, e.value.arg) == ("block_repeat", "block_ids[ori]")
    with pytest.raises(DispatchError) as e:
        lower_prefill(prefill_batch(CTX, [(0, 4000, 200)]), CTX)
    assert e.value.rule == "position_ceiling"


# ---- split decode -------------------------------------------------------------------------------
def test_split_decode_round_robin_at_k0_noise_scratch_and_fallback():
    ctx = ctx_for(k=0)
    b = decode_batch(ctx, [(0, 100, False, None)] * 6, k=0)
    d = lower_decode(b, ctx)
    validate(d, ctx)
    slots = [d.meta["placement"][f"d{o}"]["stream_slot"] for o in range(6)]
    assert slots == [(o % 4) * 16 + o // 4 for o in range(6)]
    a = d.args
    assert a["num_tokens_per_owner"][:4].tolist() == [16, 16, 8, 8] and (a["num_tokens_per_owner"][4:] == 0).all()
    # K=0: row 0 is the committed token, rows 1..7 the noise token; only row 0 publishes
    r = slots[0] * 8
    assert (a["position_ids"][0, r:r + 8] == np.arange(100, 108)).all()
    assert (a["swa_slot_mapping"][0, r + 1:r + 8] == -1).all() and a["swa_slot_mapping"][0, r] >= 0
    assert a["input_ids"][0, 1] == ctx.noise_token
    assert a["csa_kv_seq_lens"][0, 0] == 101
    # an inactive slot: positions 0..7, scratch pages num_blocks + s, no writes
    s = 63
    assert (a["position_ids"][0, s * 8:s * 8 + 8] == np.arange(8)).all()
    assert (a["hca_compress_state_block_table"][0, s] == ctx.num_blocks["hca_state"] + s).all()
    assert a["hca_cmp_block_table"][3, 15, 0] == ctx.num_blocks["cmp_c128"] + s
    for n in ("swa_slot_mapping", "hca_state_slot_mapping", "csa_state_slot_mapping", "csa_cmp_slot_mapping"):
        assert (a[n][0, s * 8:] == -1).all() and (a[n][4:] == -1).all()
    # logit entries packed densely: one per fallback request
    assert a["logit_row_indices"][0, :3].tolist() == [0, 8, -1]


def test_split_decode_speculative_rows_publish_all_eight_with_the_transaction_ring():
    b = decode_batch(CTX, [(0, 1001, True, 6), (0, 4090, True, 10)], k=7)
    d = lower_decode(b, CTX)
    validate(d, CTX)
    p = d.meta["placement"]["d0"]
    assert p["rank"] == 2 and p["local_row"] == 0           # lease 6 -> owner rank 6 % 4
    s = p["stream_slot"] * 8
    a = d.args
    assert (a["swa_slot_mapping"][0, s:s + 8] >= 0).all() and (a["csa_state_slot_mapping"][0, s:s + 8] >= 0).all()
    assert np.array_equal(a["input_ids"][2, 1:8], b.items[0].pending_drafts)
    assert a["csa_kv_seq_lens"][2, 0] == 1009
    # csa_cmp only at boundaries (p+1) % 4 == 0 inside the window 1001..1008
    live = np.flatnonzero(a["csa_cmp_slot_mapping"][0, s:s + 8] >= 0)
    assert ((1001 + live + 1) % 4 == 0).all() and live.size == 2
    # the window does not fit under max_position=4096: fallback, one row, clamped positions
    q = d.meta["placement"]["d1"]["stream_slot"] * 8
    assert d.meta["requests"]["d1"]["commit"] == 1
    assert a["position_ids"][0, q + 7] == CTX.max_position - 1
    assert (a["swa_slot_mapping"][0, q + 1:q + 8] == -1).all()
    assert a["hca_cmp_freqs_cos"][0, p["stream_slot"]].dtype == np.float32


def test_split_decode_capacities_and_grammar_path():
    with pytest.raises(DispatchError) as e:
        lower_decode(decode_batch(CTX, [(0, 10, True, 4 * i) for i in range(17)], k=7), CTX)
    assert e.value.rule == "lease_range"          # 16 leases per residue: an owner can never overflow
    with pytest.raises(DispatchError) as e:
        lower_decode(decode_batch(CTX, [(0, 10, True, 5), (0, 20, True, 5)], k=7), CTX)
    assert e.value.rule == "lease_unique"
    with pytest.raises(DispatchError) as e:
        lower_decode(decode_batch(CTX, [(0, 10, True, 5)]), CTX, grammar={"d0": Constraint(np.ones((1, 1616), bool))})
    assert e.value.rule == "grammar_path"
    ctx0 = LoweringContext(ctx_for(k=0).deployment, slots=64)
    with pytest.raises(DispatchError) as e:
        lower_decode(decode_batch(ctx0, [(0, 10, False, None)] * 65, k=0), ctx0)
    assert e.value.rule == "group_requests"


# ---- fused K=7 --------------------------------------------------------------------------------
def test_fused_descriptors_and_valid_draft_counts_at_the_group_ordinal():
    b = decode_batch(CTX, [(1, 500, True, 7), (1, 900, True, 2), (1, 40, True, 11)], k=7)
    allowed = np.zeros((8, CTX.model.vocab_size), bool)
    allowed[:, [3, 808, 1615]] = True
    d = lower_fused(b, CTX, grammar={"d2": Constraint(allowed, valid_drafts=2)})
    validate(d, CTX)
    a, pm = d.args, d.meta["placement"]
    assert (pm["d0"]["rank"], pm["d2"]["rank"], pm["d2"]["local_row"]) == (7, 7, 1)      # leases 7, 11 -> member 3
    assert a["group_state_slot_ids"][4, pm["d2"]["stream_slot"]] == 11
    assert a["state_slot_ids"][7, :3].tolist() == [7, 11, -1]
    assert a["num_tokens_per_owner"][4:8].tolist() == [0, 0, 8, 16]
    # valid_draft_counts: 7 by default, v at the group ordinal (2) on all four ranks of group 1
    assert (a["valid_draft_counts"][4:8, 2] == 2).all() and (a["valid_draft_counts"][4:8, :2] == 7).all()
    # mask rows at (owner, local_row*8 + offset), offsets 0..v; others stay plain (-1)
    rows = a["grammar_mask"][7, 8:11]
    assert (row_mode(rows) == 0).all() and (row_mode(a["grammar_mask"][7, 11:]) == -1).all()
    assert np.array_equal(unpack_allowed(rows, CTX.model.vocab_size), allowed[:3])
    # state rings at the ring period depth; drafter tables: lease rings, filler for padding rows
    assert a["group_csa_state_block_tables"].shape[-1] == CTX.ring_period("csa_state")
    assert d.meta["B"] == 4
    assert a["draft_block_tables"][7, 1, 1, 0] == 11 * 6 + 7 % 6 and a["draft_block_tables"][7, 0, 2, 0] == 384


def test_lower_dispatches_by_batch_type_and_k():
    assert lower(decode_batch(CTX, [(0, 9, True, 1)]), CTX).program == "l3_decode_fwd_dspark"
    ctx0 = ctx_for(k=0)
    assert lower(decode_batch(ctx0, [(0, 9, False, None)], k=0), ctx0).program == "l3_decode_fwd"
    assert lower(prefill_batch(CTX, [(0, 0, 4)]), CTX).program == "l3_prefill_fwd"
    assert lower(drafter_batch(CTX, [(0, 3, 200, 0)], seed=True), CTX).program == "l3_dspark_draft_step_device_state"


# ---- drafter -----------------------------------------------------------------------------------
def test_drafter_redraft_staging_contract():
    b = drafter_batch(CTX, [(0, 5, 300, 3), (0, 9, 1000, 8), (0, 1, 77, 1), (2, 0, 20, 2)])
    for prog in ("l3_dspark_drafter", "l3_dspark_draft_step_device_state"):
        d = lower_drafter(b, CTX, program=prog)
        validate(d, CTX)
    a = d.args
    assert (d.meta["B"], d.meta["T_MAIN"]) == (4, 32)
    assert a["num_sampled"][1].tolist() == [1, 1, 1, 0]              # leases 5, 9, 1 all on member 1
    assert a["anchor_positions"][1, :3].tolist() == [300, 1000, 77]
    ctxpos = a["context_group_position_ids"][0]
    T = 32
    assert ctxpos[T:T + 3].tolist() == [298, 299, 300] and ctxpos[T + 8:T + 16].tolist() == list(range(993, 1001))
    assert (ctxpos[:T] == -1).all()                                    # member 0 owns nothing
    slot = a["context_group_slot_mapping"][2, 1, T + 2]               # replicated on every rank of the group
    assert slot == (5 * 6 + (300 // 32 + 7) % 6) * 32 + 300 % 32
    q = a["query_group_position_ids"][0]
    assert q[112:119].tolist() == list(range(301, 308)) and (q[:112] == -1).all()
    assert (a["query_group_slot_mapping"][0][:, :112] == -1).all()
    assert (a["block_tables"][1, :, 3] >= 384).all()                  # the padding row reads the filler ring
    assert a["logit_row_indices"][1, :22].tolist() == list(range(21)) + [-1]
    m = lower_markov(b, CTX)
    validate(m, CTX)
    assert np.array_equal(m.args["logit_row_indices"], a["logit_row_indices"])


def test_seeding_waves_and_the_complete_tail_rule():
    b = drafter_batch(CTX, [(0, 5, 300, 0), (0, 9, 600, 0), (1, 2, 90, 0)], seed=True)
    waves = seeding_waves(b.items)
    assert [[i.request_id for i in w] for w in waves] == [["r0", "r2"], ["r1"]]
    d = lower_bootstrap(type(b)(tuple(waves[0])), CTX)
    validate(d, CTX)
    a = d.args
    assert d.meta["T_MAIN"] == 32 and a["num_sampled"][0, 0] == 0 and a["next_prefill_tokens"][0, 0] == 11
    cp = a["context_group_position_ids"][0]
    assert cp[:32].tolist() == list(range(173, 205)) and cp[96:128].tolist() == list(range(269, 301))
    assert a["context_group_position_ids"][4, :23].tolist() == list(range(0, 23))    # a 91-row tail: bands of 23
    assert a["state_slot_ids"][0, 0] == 5 and a["state_slot_ids"][4, 0] == 2
    with pytest.raises(DispatchError) as e:
        lower_bootstrap(b, CTX)
    assert e.value.rule == "seed_wave"
    short = drafter_batch(CTX, [(0, 5, 300, 0)], seed=True)
    it = short.items[0]
    cut = type(short)((it.__class__(**{**it.__dict__, "context_positions": it.context_positions[10:]}),))
    with pytest.raises(DispatchError) as e:
        lower_bootstrap(cut, CTX)
    assert e.value.rule == "seed_tail"
    with pytest.raises(DispatchError) as e:
        lower_drafter(drafter_batch(CTX, [(0, 5, 4090, 1)]), CTX)
    assert e.value.rule == "position_ceiling"


# ---- grammar -------------------------------------------------------------------------------------
def test_grammar_packing_round_trips_and_keeps_padding_and_header():
    rng = np.random.default_rng(3)
    allowed = rng.random((3, 129280)) < 0.01
    words = pack_rows(allowed, 160)
    assert words.shape == (3, 160, 64) and words.dtype == np.int16
    assert np.array_equal(unpack_allowed(words, 129280), allowed)
    assert (row_mode(words) == 0).all() and padding_ok(words).all()
    # XGrammar's int32 bitmask gives the same rows
    bits = np.zeros((3, 4040 * 32), np.uint8)
    bits[:, :129280] = allowed
    xg = np.packbits(bits, axis=-1, bitorder="little").view("<i4")
    assert np.array_equal(Constraint(xg).allowed(129280), allowed)
    with pytest.raises(DispatchError) as e:
        pack_rows(np.zeros((1, 129280), bool), 160)
    assert e.value.rule == "grammar_empty"
    plain = np.full((160, 64), -1, np.int16)
    assert padding_ok(plain[None]).all() and row_mode(plain[None])[0] == -1
