"""The six programs: counts, upstream order, derivation rules and binding."""
import math

import pytest

from twin.abi import PROGRAMS, AbiError, bind, deployment, get_program, programs_for_k, symbols
from twin.abi.programs import (DRAFTER_HOST_PREPARE, FUSED_INTERNAL_PREPARE, INPUT, MARKOV_FUSED_DROP, OUTPUT,
                               ROLES, STATE, WEIGHT, eval_dim)

FLASH = deployment("flash", ep=16)

COUNTS = {"l3_prefill_fwd": 102, "l3_decode_fwd": 110, "l3_decode_fwd_dspark": 151,
          "l3_dspark_draft_step_device_state": 71, "l3_dspark_drafter": 59, "l3_distributed_markov_sample": 12}


@pytest.mark.parametrize("name,count", COUNTS.items())
def test_argument_counts_at_flash_binding(name, count):
    assert len(bind(name, FLASH)) == count


def test_upstream_order_landmarks():
    pre = get_program("l3_prefill_fwd").names
    # first, last and a few positions the contract numbers explicitly (1-based in the contract)
    assert (pre[0], pre[1], pre[12], pre[40], pre[55], pre[96], pre[101]) == (
        "x_hc", "query_start_loc", "kv_cache", "hca_compress_state_block_table", "ori_slot_mapping_full",
        "logit_row_indices", "sampled_ids")
    dec = get_program("l3_decode_fwd").names
    assert (dec[0], dec[11], dec[79], dec[80], dec[109]) == (
        "embed_weight", "raw_kv_pool", "input_ids", "num_tokens_per_owner", "sampled_ids")
    dr = get_program("l3_dspark_drafter").names
    assert (dr[0], dr[12], dr[31], dr[58]) == ("target_hidden", "block_tables", "kv_caches", "head_hidden")
    mk = get_program("l3_distributed_markov_sample").names
    assert mk == ("head_hidden", "final_norm_weight", "lm_head_weight", "logit_row_indices", "num_sampled",
                  "last_sampled", "next_prefill_tokens", "markov_w1", "markov_w2", "confidence_head_weight",
                  "draft_token_ids", "confidence_probs")


def test_fused_program_is_built_by_upstream_rules():
    fused = get_program("l3_decode_fwd_dspark").names
    dec = get_program("l3_decode_fwd").names
    target = [n for n in dec if n not in FUSED_INTERNAL_PREPARE]
    target.insert(target.index("sampled_ids"), "valid_draft_counts")
    assert len(FUSED_INTERNAL_PREPARE) == 32
    assert list(fused[:79]) == target
    assert fused[79:85] == ("state_slot_ids", "state_generations", "state_tokens", "state_meta",
                            "accepted_token_ids", "accepted_counts")
    assert fused[85:100][0] == "group_state_slot_ids" and fused[99] == "ratio128_rope_sin_table"
    drafter = [n for n in get_program("l3_dspark_drafter").names if n not in DRAFTER_HOST_PREPARE]
    assert len(DRAFTER_HOST_PREPARE) == 15 and len(drafter) == 44
    assert [n[len("draft_"):] for n in fused[100:144]] == drafter
    markov = [n for n in get_program("l3_distributed_markov_sample").names if n not in MARKOV_FUSED_DROP]
    assert [n[len("draft_"):] for n in fused[144:]] == markov


def test_bootstrap_program_is_drafter_then_markov_then_state():
    boot = get_program("l3_dspark_draft_step_device_state")
    assert boot.names[:59] == get_program("l3_dspark_drafter").names
    assert boot.names[59:67] == ("final_norm_weight", "lm_head_weight", "logit_row_indices", "markov_w1",
                                 "markov_w2", "confidence_head_weight", "draft_token_ids", "confidence_probs")
    assert boot.names[67:] == ("state_slot_ids", "state_generations", "state_tokens", "state_meta")
    # seeding binds private scratch, never the live persistent state
    assert all(a.buffer_id.startswith("dspark_seed_") for a in boot.args[67:])


def test_drafter_weights_are_distinct_buffers_but_embedding_and_lm_head_are_shared():
    dr = {a.name: a for a in get_program("l3_dspark_drafter").args}
    assert dr["hc_attn_fn"].buffer_id == "draft_hc_attn_fn"
    assert dr["embedding_weight"].buffer_id == "embed_weight"
    mk = {a.name: a for a in get_program("l3_distributed_markov_sample").args}
    assert mk["lm_head_weight"].buffer_id == "lm_head_weight"
    dec = {a.name: a for a in get_program("l3_decode_fwd").args}
    assert dec["raw_kv_pool"].buffer_id == "kv_cache" and dec["csa_idx_kv_cache"].buffer_id == "idx_kv_cache"


def test_every_arg_has_a_known_role_and_dtype_and_unique_name():
    for p in PROGRAMS.values():
        assert len(set(p.names)) == len(p.names)
        for a in p.args:
            assert a.role in ROLES and a.dtype in ("f32", "bf16", "i8", "i16", "i32", "i64")
            assert a.dims[0] == "R", (p.name, a.name)


def test_modes():
    assert {p.name for p in programs_for_k(0)} == {"l3_prefill_fwd", "l3_decode_fwd"}
    assert {p.name for p in programs_for_k(7)} == {"l3_prefill_fwd", "l3_decode_fwd_dspark",
                                                   "l3_dspark_draft_step_device_state"}


def test_flash_bound_shapes_match_contract_examples():
    b = {x.name: x.shape for x in bind("l3_prefill_fwd", FLASH, slots=2, P=512, Q=3)}
    assert b["x_hc"] == (16, 512, 4, 4096)
    assert b["query_start_loc"] == (16, 4)
    assert b["position_ids_local"] == (16, 128)
    assert b["csa_compress_state_block_table"] == (16, 3, 524288)
    assert b["ori_block_table"] == (16, 3, 32768)
    assert b["lm_head_weight"] == (16, 32320, 4096)
    assert b["routed_w1"] == (16, 43 * 16, 2048, 4096)
    assert b["wo_a"] == (16, 43 * 2, 1024, 4096)
    assert b["hc_attn_fn"] == (16, 43 * 24, 16384)
    assert b["grammar_mask"] == (16, 128, 160, 64)
    # pools: 43 layers x (2 slots x 9 blocks + 64 scratch) pages of 32 rows (max_model_len 1024, chunk 2048:
    # the ori ring is ceil((127 + 1024)/32) + 1 = 37 blocks)
    assert b["kv_cache"] == (16, 43 * (2 * 37 + 64), 32, 1, 512)
    d = {x.name: x.shape for x in bind("l3_decode_fwd", FLASH)}
    assert d["hc_attn_fn"] == (16, 43 * 32, 16384)
    assert d["hca_compress_state_block_table"] == (16, 64, 131072)
    assert d["csa_compress_state_block_table"] == (16, 64, 8)
    assert d["hca_cmp_freqs_cos"] == (16, 64, 32)
    f = {x.name: x.shape for x in bind("l3_decode_fwd_dspark", FLASH)}
    assert f["group_hca_state_block_tables"] == (16, 64, 145) and f["group_csa_state_block_tables"] == (16, 64, 517)
    assert f["swa_rope_cos_table"] == (16, 1024, 64)
    assert f["draft_block_tables"] == (16, 3, 16, 32768)
    ep8 = {x.name: x.shape for x in bind("l3_prefill_fwd", deployment("flash", ep=8))}
    assert ep8["routed_w1"] == (8, 43 * 32, 2048, 4096)


def test_dynamic_axes_bind_as_prefixes():
    for P in (4, 128, 8192):
        b = {x.name: x.shape for x in bind("l3_prefill_fwd", FLASH, P=P)}
        assert b["x_hc"][1] == P and b["input_ids"][1] == P // 4
    with pytest.raises(AbiError, match="P=6"):
        bind("l3_prefill_fwd", FLASH, P=6)
    with pytest.raises(AbiError, match="extent"):
        bind("l3_prefill_fwd", FLASH, X=1)


def test_eval_dim_rejects_unknown_symbols_and_syntax():
    assert eval_dim("NL*(2+3)//5", {"NL": 43}) == 43
    with pytest.raises(AbiError, match="symbol"):
        eval_dim("FOO*2", {})
    with pytest.raises(AbiError):
        eval_dim("__import__('os')", {})


def test_unknown_program_named():
    with pytest.raises(AbiError, match="program='nope'"):
        get_program("nope")


def test_symbols_follow_topology():
    s16, s8 = symbols(FLASH), symbols(deployment("flash", ep=8))
    assert (s16["R"], s16["N_LOCAL"], s8["R"], s8["N_LOCAL"]) == (16, 16, 8, 32)
    assert s16["LOCAL_O_GROUPS"] == 2 and s16["VOCAB_TP"] == 32320
    tiny1 = symbols(deployment("tiny", ep=1, tp=1))
    assert tiny1["R"] == 1 and tiny1["LOCAL_REQ"] == 64 and tiny1["L"] == tiny1["P"]


def test_roles_cover_inputs_outputs_state_weights():
    f = get_program("l3_decode_fwd_dspark")
    roles = {a.name: a.role for a in f.args}
    assert roles["state_tokens"] == STATE and roles["accepted_counts"] == OUTPUT
    assert roles["valid_draft_counts"] == INPUT and roles["embed_weight"] == WEIGHT
    total = sum(math.prod(b.shape[1:]) for b in bind(f, FLASH) if b.arg.role == WEIGHT)
    assert total > 10 * 2**30 // 4   # billions of weight elements per rank: the real shapes
