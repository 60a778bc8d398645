"""The six upstream programs as ordered argument lists: the positional ABI.

Each argument has a name, a symbolic shape, a dtype, a role and (for host slots bound as a
compact prefix) a dynamic axis.  `bind` turns the symbols into concrete shapes for a deployment,
a slot count and the extents of one dispatch.  Symbols are the ones of serving-contract.md §5:
R ranks, P packed prefill rows, L = P/TP rank-band rows, Q request rows per group, B drafter
batch, T_MAIN drafter context rows; everything else comes from the preset and the topology.

`l3_prefill_fwd`, `l3_decode_fwd`, `l3_dspark_drafter` and `l3_distributed_markov_sample` are
stated argument by argument.  `l3_decode_fwd_dspark` and `l3_dspark_draft_step_device_state` are
built from them by upstream's own construction rules (§5.4, §5.7), so the six lists cannot drift
apart.
"""
from __future__ import annotations

import ast
import math
import numbers
import operator
from dataclasses import dataclass, replace
from functools import cached_property

from . import constants as C
from .caches import DTYPE_BYTES, size_families
from .errors import AbiError
from .topology import Deployment

WEIGHT, STATE, INPUT, SCRATCH, OUTPUT = "weight", "state", "input", "scratch", "output"
ROLES = (WEIGHT, STATE, INPUT, SCRATCH, OUTPUT)
F32, BF16, I8, I16, I32, I64 = "f32", "bf16", "i8", "i16", "i32", "i64"
DYNAMIC_AXES = ("P", "L", "Q", "B", "T_MAIN")


@dataclass(frozen=True)
class Arg:
    name: str
    shape: str                  # symbolic, e.g. "R, P, HC, D"
    dtype: str
    role: str
    dyn: str | None = None      # dynamic axis bound as a compact prefix
    pool: str | None = None     # cache family of a pool tensor
    buffer: str | None = None   # device buffer identity (defaults to the name)

    @property
    def buffer_id(self) -> str:
        return self.buffer or self.name

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(s.strip() for s in self.shape.split(","))


def A(name, shape, dtype, role, *, dyn=None, pool=None, buffer=None) -> Arg:
    return Arg(name, shape, dtype, role, dyn, pool, buffer)


_PREFILL = (
    A("x_hc", "R, P, HC, D", F32, INPUT, dyn="P"),
    A("query_start_loc", "R, Q+1", I32, INPUT, dyn="Q"),
    A("hc_attn_fn", "R, NL*MIX_HC_PRE, HC_DIM", F32, WEIGHT, buffer="prefill_hc_attn_fn"),
    A("hc_attn_scale", "R, NL*3", F32, WEIGHT),
    A("hc_attn_base", "R, NL*MIX_HC", F32, WEIGHT),
    A("attn_norm_w", "R, NL*D", BF16, WEIGHT),
    A("wq_a", "R, NL, D, Q_LORA", BF16, WEIGHT),
    A("wq_b", "R, NL, Q_LORA, H*HEAD_DIM", I8, WEIGHT),
    A("wq_b_scale", "R, NL*H*HEAD_DIM", F32, WEIGHT),
    A("wkv", "R, NL*D, HEAD_DIM", BF16, WEIGHT),
    A("gamma_cq", "R, NL*Q_LORA", BF16, WEIGHT),
    A("gamma_ckv", "R, NL*HEAD_DIM", BF16, WEIGHT),
    A("kv_cache", "R, NL*N_ORI, 32, 1, HEAD_DIM", BF16, STATE, pool="ori"),
    A("attn_sink", "R, NL*H", F32, WEIGHT),
    A("wo_a", "R, NL*LOCAL_O_GROUPS, O_LORA, O_GROUP_IN", BF16, WEIGHT, buffer="prefill_wo_a"),
    A("wo_b", "R, NL*LOCAL_O_GROUPS, D, O_LORA", I8, WEIGHT, buffer="prefill_wo_b"),
    A("wo_b_scale", "R, NL*D", F32, WEIGHT),
    A("hca_cmp_kv", "R, NH*N_CMP_C128, 1, 1, HEAD_DIM", BF16, STATE, pool="cmp_c128"),
    A("csa_cmp_kv", "R, NC*N_CMP_C4, 32, 1, HEAD_DIM", BF16, STATE, pool="cmp_c4"),
    A("hca_cmp_wkv", "R, NH*HEAD_DIM, D", BF16, WEIGHT),
    A("hca_cmp_wgate", "R, NH*HEAD_DIM, D", BF16, WEIGHT),
    A("hca_cmp_ape", "R, NH*128, HEAD_DIM", F32, WEIGHT),
    A("hca_cmp_norm_w", "R, NH*HEAD_DIM", BF16, WEIGHT),
    A("hca_compress_state", "R, NH*N_HCA_STATE, 8, 2*HEAD_DIM", F32, STATE, pool="hca_state"),
    A("csa_cmp_wkv", "R, NC*2*HEAD_DIM, D", BF16, WEIGHT),
    A("csa_cmp_wgate", "R, NC*2*HEAD_DIM, D", BF16, WEIGHT),
    A("csa_cmp_ape", "R, NC*4, 2*HEAD_DIM", F32, WEIGHT),
    A("csa_cmp_norm_w", "R, NC*HEAD_DIM", BF16, WEIGHT),
    A("csa_compress_state", "R, NC*N_CSA_STATE, 2, 4*HEAD_DIM", F32, STATE, pool="csa_state"),
    A("csa_hadamard_idx", "R, NC*IDX_HEAD_DIM, IDX_HEAD_DIM", BF16, WEIGHT),
    A("csa_idx_wq_b", "R, NC*Q_LORA, IDX_N_HEADS*IDX_HEAD_DIM", I8, WEIGHT),
    A("csa_idx_wq_b_scale", "R, NC*IDX_N_HEADS*IDX_HEAD_DIM", F32, WEIGHT),
    A("csa_weights_proj", "R, NC*D, IDX_N_HEADS", BF16, WEIGHT, buffer="prefill_csa_weights_proj"),
    A("csa_inner_wkv", "R, NC*2*IDX_HEAD_DIM, D", BF16, WEIGHT),
    A("csa_inner_wgate", "R, NC*2*IDX_HEAD_DIM, D", BF16, WEIGHT),
    A("csa_inner_ape", "R, NC*4, 2*IDX_HEAD_DIM", F32, WEIGHT),
    A("csa_inner_norm_w", "R, NC*IDX_HEAD_DIM", BF16, WEIGHT),
    A("csa_inner_compress_state", "R, NC*N_CSA_INNER_STATE, 2, 4*IDX_HEAD_DIM", F32, STATE, pool="csa_inner_state"),
    A("idx_kv_cache", "R, NC*N_IDX, 32, 1, IDX_HEAD_DIM", I8, STATE, pool="idx"),
    A("idx_kv_scale", "R, NC*N_IDX, 32, 1, 1", F32, STATE, pool="idx"),
    A("hca_compress_state_block_table", "R, Q, HCA_STATE_DEPTH", I32, INPUT, dyn="Q"),
    A("csa_compress_state_block_table", "R, Q, CSA_STATE_DEPTH", I32, INPUT, dyn="Q"),
    A("csa_inner_compress_state_block_table", "R, Q, CSA_STATE_DEPTH", I32, INPUT, dyn="Q"),
    A("swa_freqs_cos", "R, P, ROPE", BF16, INPUT, dyn="P"),
    A("swa_freqs_sin", "R, P, ROPE", BF16, INPUT, dyn="P"),
    A("compressed_freqs_cos", "R, P, ROPE", BF16, INPUT, dyn="P"),
    A("compressed_freqs_sin", "R, P, ROPE", BF16, INPUT, dyn="P"),
    A("hca_cmp_freqs_cos", "R, P, ROPE", BF16, INPUT, dyn="P"),
    A("hca_cmp_freqs_sin", "R, P, ROPE", BF16, INPUT, dyn="P"),
    A("csa_cmp_freqs_cos", "R, P, ROPE", BF16, INPUT, dyn="P"),
    A("csa_cmp_freqs_sin", "R, P, ROPE", BF16, INPUT, dyn="P"),
    A("ori_block_table", "R, Q, ORI_DEPTH", I32, INPUT, dyn="Q"),
    A("hca_cmp_block_table", "R, Q, CMP_DEPTH", I32, INPUT, dyn="Q"),
    A("csa_cmp_block_table", "R, Q, CMP_DEPTH", I32, INPUT, dyn="Q"),
    A("idx_block_table", "R, Q, CMP_DEPTH", I32, INPUT, dyn="Q"),
    A("ori_slot_mapping_full", "R, P", I64, INPUT, dyn="P"),
    A("position_ids_local", "R, L", I32, INPUT, dyn="L"),
    A("position_ids_full", "R, P", I32, INPUT, dyn="P"),
    A("input_ids", "R, L", I64, INPUT, dyn="L"),
    A("hca_cmp_slot_mapping_full", "R, P", I64, INPUT, dyn="P"),
    A("hca_state_slot_mapping_full", "R, P", I64, INPUT, dyn="P"),
    A("csa_cmp_slot_mapping_full", "R, P", I64, INPUT, dyn="P"),
    A("csa_idx_slot_mapping_full", "R, P", I64, INPUT, dyn="P"),
    A("csa_state_slot_mapping_full", "R, P", I64, INPUT, dyn="P"),
    A("csa_inner_state_slot_mapping_full", "R, P", I64, INPUT, dyn="P"),
    A("hc_ffn_fn", "R, NL*MIX_HC_PRE, HC_DIM", F32, WEIGHT, buffer="prefill_hc_ffn_fn"),
    A("hc_ffn_scale", "R, NL*3", F32, WEIGHT),
    A("hc_ffn_base", "R, NL*MIX_HC", F32, WEIGHT),
    A("norm_w", "R, NL*D", BF16, WEIGHT),
    A("gate_w", "R, NL*N_EXPERTS, D", F32, WEIGHT),
    A("gate_bias", "R, NL*N_EXPERTS", F32, WEIGHT),
    A("tid2eid", "R, NL*VOCAB, TOPK", I32, WEIGHT),
    A("routed_w1", "R, NL*N_LOCAL, MOE_INTER, D", I8, WEIGHT),
    A("routed_w1_scale", "R, NL*N_LOCAL, MOE_INTER", F32, WEIGHT),
    A("routed_w3", "R, NL*N_LOCAL, MOE_INTER, D", I8, WEIGHT),
    A("routed_w3_scale", "R, NL*N_LOCAL, MOE_INTER", F32, WEIGHT),
    A("routed_w2", "R, NL*N_LOCAL, D, MOE_INTER", I8, WEIGHT),
    A("routed_w2_scale", "R, NL*N_LOCAL, D", F32, WEIGHT),
    A("shared_w1", "R, NL, MOE_INTER, D", I8, WEIGHT),
    A("shared_w1_scale", "R, NL*MOE_INTER", F32, WEIGHT),
    A("shared_w3", "R, NL, MOE_INTER, D", I8, WEIGHT),
    A("shared_w3_scale", "R, NL*MOE_INTER", F32, WEIGHT),
    A("shared_w2", "R, NL, D, MOE_INTER", I8, WEIGHT),
    A("shared_w2_scale", "R, NL*D", F32, WEIGHT),
    A("o_proj_wo_a_full", "R, O_GROUPS, O_LORA, O_GROUP_IN", BF16, SCRATCH),
    A("o_proj_wo_b_full", "R, O_GROUPS, D, O_LORA", I8, SCRATCH),
    A("attn_stage", "R, P, HC, D", F32, SCRATCH, dyn="P"),
    A("x_mixed", "R, P, D", BF16, SCRATCH, dyn="P"),
    A("post_ffn", "R, P, HC", F32, SCRATCH, dyn="P"),
    A("comb_ffn", "R, P, HC*HC", F32, SCRATCH, dyn="P"),
    A("ffn_out", "R, L, D", BF16, SCRATCH, dyn="L"),
    A("hc_head_fn", "R, HC, HC_DIM", F32, WEIGHT),
    A("hc_head_scale", "R, 1", F32, WEIGHT),
    A("hc_head_base", "R, HC", F32, WEIGHT),
    A("final_norm_w", "R, D", BF16, WEIGHT),
    A("lm_head_weight", "R, VOCAB_TP, D", BF16, WEIGHT),
    A("logit_row_indices", "R, LOCAL_ROWS", I32, INPUT),
    A("dspark_target_hidden", "R, L, TARGET_HIDDEN", BF16, OUTPUT, dyn="L"),
    A("x_out", "R, P, D", BF16, OUTPUT, dyn="P"),
    A("logits", "R, LOGIT_ROWS, VOCAB_TP", F32, OUTPUT),
    A("grammar_mask", "R, LOGIT_ROWS, GRAMMAR_SEG, GRAMMAR_WORDS", I16, INPUT),
    A("sampled_ids", "R, LOGIT_ROWS, SAMPLED_PAD", I32, OUTPUT),
)

_DECODE = (
    A("embed_weight", "R, VOCAB, D", BF16, WEIGHT),
    A("hc_attn_fn", "R, NL*MIX_HC_PAD, HC_DIM", F32, WEIGHT),
    A("hc_attn_scale", "R, NL*3", F32, WEIGHT),
    A("hc_attn_base", "R, NL*MIX_HC", F32, WEIGHT),
    A("attn_norm_w", "R, NL*D", BF16, WEIGHT),
    A("wq_a", "R, NL, D, Q_LORA", BF16, WEIGHT),
    A("wq_b", "R, NL, Q_LORA, H*HEAD_DIM", I8, WEIGHT),
    A("wq_b_scale", "R, NL*H*HEAD_DIM", F32, WEIGHT),
    A("wkv", "R, NL*D, HEAD_DIM", BF16, WEIGHT),
    A("gamma_cq", "R, NL*Q_LORA", BF16, WEIGHT),
    A("gamma_ckv", "R, NL*HEAD_DIM", BF16, WEIGHT),
    A("raw_kv_pool", "R, NL*N_ORI, 32, 1, HEAD_DIM", BF16, STATE, pool="ori", buffer="kv_cache"),
    A("freqs_cos", "R, LOCAL_ROWS, ROPE", BF16, INPUT),
    A("freqs_sin", "R, LOCAL_ROWS, ROPE", BF16, INPUT),
    A("compressed_freqs_cos", "R, LOCAL_ROWS, ROPE", BF16, INPUT),
    A("compressed_freqs_sin", "R, LOCAL_ROWS, ROPE", BF16, INPUT),
    A("swa_slot_mapping", "R, DECODE_TOKENS", I64, INPUT),
    A("swa_indices", "R, LOCAL_ROWS, W", I32, INPUT),
    A("swa_lens", "R, LOCAL_ROWS", I32, INPUT),
    A("position_ids_local", "R, LOCAL_ROWS", I32, INPUT),
    A("position_ids", "R, DECODE_TOKENS", I32, INPUT),
    A("csa_cmp_freqs_cos", "R, DECODE_TOKENS, ROPE", BF16, INPUT),
    A("csa_cmp_freqs_sin", "R, DECODE_TOKENS, ROPE", BF16, INPUT),
    A("csa_cmp_wkv", "R, NC*2*HEAD_DIM, D", BF16, WEIGHT),
    A("csa_cmp_wgate", "R, NC*2*HEAD_DIM, D", BF16, WEIGHT),
    A("csa_cmp_ape", "R, NC*4, 2*HEAD_DIM", F32, WEIGHT),
    A("csa_cmp_norm_w", "R, NC*HEAD_DIM", BF16, WEIGHT),
    A("csa_compress_state", "R, NC*N_CSA_STATE, 2, 4*HEAD_DIM", F32, STATE, pool="csa_state"),
    A("csa_compress_state_block_table", "R, DECODE_BATCH, SPLIT_CSA_DEPTH", I32, INPUT),
    A("csa_idx_wq_b", "R, NC*Q_LORA, IDX_N_HEADS*IDX_HEAD_DIM", I8, WEIGHT),
    A("csa_idx_wq_b_scale", "R, NC*IDX_N_HEADS*IDX_HEAD_DIM", F32, WEIGHT),
    A("csa_weights_proj", "R, NC*D, IDX_N_HEADS", BF16, WEIGHT),
    A("csa_hadamard_idx", "R, NC*IDX_HEAD_DIM, IDX_HEAD_DIM", BF16, WEIGHT),
    A("csa_inner_wkv", "R, NC*2*IDX_HEAD_DIM, D", BF16, WEIGHT),
    A("csa_inner_wgate", "R, NC*2*IDX_HEAD_DIM, D", BF16, WEIGHT),
    A("csa_inner_ape", "R, NC*4, 2*IDX_HEAD_DIM", F32, WEIGHT),
    A("csa_inner_norm_w", "R, NC*IDX_HEAD_DIM", BF16, WEIGHT),
    A("csa_inner_compress_state", "R, NC*N_CSA_INNER_STATE, 2, 4*IDX_HEAD_DIM", F32, STATE, pool="csa_inner_state"),
    A("csa_inner_compress_state_block_table", "R, DECODE_BATCH, SPLIT_CSA_DEPTH", I32, INPUT),
    A("csa_cmp_kv", "R, NC*N_CMP_C4, 32, 1, HEAD_DIM", BF16, STATE, pool="cmp_c4"),
    A("csa_cmp_block_table", "R, LOCAL_REQ, CMP_DEPTH", I32, INPUT),
    A("csa_idx_kv_cache", "R, NC*N_IDX, 32, 1, IDX_HEAD_DIM", I8, STATE, pool="idx", buffer="idx_kv_cache"),
    A("csa_idx_kv_scale", "R, NC*N_IDX, 32, 1, 1", F32, STATE, pool="idx", buffer="idx_kv_scale"),
    A("csa_idx_block_table", "R, LOCAL_REQ, CMP_DEPTH", I32, INPUT),
    A("csa_ori_slot_mapping", "R, DECODE_TOKENS", I64, INPUT),
    A("csa_window_swa_indices", "R, LOCAL_ROWS, W", I32, INPUT),
    A("csa_window_swa_lens", "R, LOCAL_ROWS", I32, INPUT),
    A("csa_cmp_slot_mapping", "R, DECODE_TOKENS", I64, INPUT),
    A("csa_idx_slot_mapping", "R, DECODE_TOKENS", I64, INPUT),
    A("csa_state_slot_mapping", "R, DECODE_TOKENS", I64, INPUT),
    A("csa_inner_state_slot_mapping", "R, DECODE_TOKENS", I64, INPUT),
    A("csa_kv_seq_lens", "R, LOCAL_REQ", I32, INPUT),
    A("hca_cmp_freqs_cos", "R, DECODE_BATCH, ROPE//2", F32, INPUT),
    A("hca_cmp_freqs_sin", "R, DECODE_BATCH, ROPE//2", F32, INPUT),
    A("hca_cmp_wkv", "R, NH*HEAD_DIM, D", BF16, WEIGHT),
    A("hca_cmp_wgate", "R, NH*HEAD_DIM, D", BF16, WEIGHT),
    A("hca_cmp_ape", "R, NH*128, HEAD_DIM", F32, WEIGHT),
    A("hca_cmp_norm_w", "R, NH*HEAD_DIM", BF16, WEIGHT),
    A("hca_compress_state", "R, NH*N_HCA_STATE, 8, 2*HEAD_DIM", F32, STATE, pool="hca_state"),
    A("hca_compress_state_block_table", "R, DECODE_BATCH, HCA_STATE_DEPTH", I32, INPUT),
    A("hca_cmp_kv", "R, NH*N_CMP_C128, 1, 1, HEAD_DIM", BF16, STATE, pool="cmp_c128"),
    A("hca_cmp_block_table", "R, LOCAL_REQ, CMP_DEPTH", I32, INPUT),
    A("hca_ori_slot_mapping", "R, DECODE_TOKENS", I64, INPUT),
    A("hca_window_swa_indices", "R, LOCAL_ROWS, W", I32, INPUT),
    A("hca_window_swa_lens", "R, LOCAL_ROWS", I32, INPUT),
    A("hca_cmp_slot_mapping", "R, DECODE_TOKENS", I64, INPUT),
    A("hca_state_slot_mapping", "R, DECODE_TOKENS", I64, INPUT),
    A("hca_kv_seq_lens", "R, LOCAL_REQ", I32, INPUT),
    A("attn_sink", "R, NL*H", F32, WEIGHT),
    A("wo_a", "R, NL*LOCAL_O_GROUPS, O_LORA, O_GROUP_IN", BF16, WEIGHT),
    A("wo_b", "R, NL*LOCAL_O_GROUPS, D, O_LORA", I8, WEIGHT),
    A("wo_b_scale", "R, NL*D", F32, WEIGHT),
    A("hc_ffn_fn", "R, NL*MIX_HC_PAD, HC_DIM", F32, WEIGHT),
    A("hc_ffn_scale", "R, NL*3", F32, WEIGHT),
    A("hc_ffn_base", "R, NL*MIX_HC", F32, WEIGHT),
    A("norm_w", "R, NL*D", BF16, WEIGHT),
    A("gate_w", "R, NL*N_EXPERTS, D", F32, WEIGHT),
    A("gate_bias", "R, NL*N_EXPERTS", F32, WEIGHT),
    A("tid2eid", "R, NL*VOCAB, TOPK", I32, WEIGHT),
    A("input_ids", "R, LOCAL_ROWS", I64, INPUT),
    A("num_tokens_per_owner", "R", I32, INPUT),
    A("hc_head_fn", "R, HC, HC_DIM", F32, WEIGHT),
    A("hc_head_scale", "R, 1", F32, WEIGHT),
    A("hc_head_base", "R, HC", F32, WEIGHT),
    A("final_norm_w", "R, D", BF16, WEIGHT),
    A("lm_head_weight", "R, VOCAB_TP, D", BF16, WEIGHT),
    A("logit_row_indices", "R, LOCAL_ROWS", I32, INPUT),
    A("routed_w1", "R, NL*N_LOCAL, MOE_INTER, D", I8, WEIGHT),
    A("routed_w1_scale", "R, NL*N_LOCAL, MOE_INTER", F32, WEIGHT),
    A("routed_w3", "R, NL*N_LOCAL, MOE_INTER, D", I8, WEIGHT),
    A("routed_w3_scale", "R, NL*N_LOCAL, MOE_INTER", F32, WEIGHT),
    A("routed_w2", "R, NL*N_LOCAL, D, MOE_INTER", I8, WEIGHT),
    A("routed_w2_scale", "R, NL*N_LOCAL, D", F32, WEIGHT),
    A("shared_w1", "R, NL, MOE_INTER, D", I8, WEIGHT),
    A("shared_w1_scale", "R, NL*MOE_INTER", F32, WEIGHT),
    A("shared_w3", "R, NL, MOE_INTER, D", I8, WEIGHT),
    A("shared_w3_scale", "R, NL*MOE_INTER", F32, WEIGHT),
    A("shared_w2", "R, NL, D, MOE_INTER", I8, WEIGHT),
    A("shared_w2_scale", "R, NL*D", F32, WEIGHT),
    A("hidden_workspace", "R, LOCAL_ROWS, D", BF16, SCRATCH),
    A("x_ping", "R, LOCAL_ROWS, HC, D", F32, SCRATCH),
    A("x_pong", "R, LOCAL_ROWS, HC, D", F32, SCRATCH),
    A("x_attn_active", "R, LOCAL_ROWS, HC, D", F32, SCRATCH),
    A("x_moe_next", "R, LOCAL_ROWS, HC, D", F32, SCRATCH),
    A("pre_hc_hidden_out", "R, LOCAL_ROWS, HC, D", F32, SCRATCH),
    A("dspark_target_hidden", "R, LOCAL_ROWS, TARGET_HIDDEN", BF16, OUTPUT),
    A("x_out", "R, LOCAL_ROWS, D", BF16, OUTPUT),
    A("logits", "R, LOGIT_ROWS, VOCAB_TP", F32, OUTPUT),
    A("grammar_mask", "R, LOGIT_ROWS, GRAMMAR_SEG, GRAMMAR_WORDS", I16, INPUT),
    A("sampled_ids", "R, LOGIT_ROWS, SAMPLED_PAD", I32, OUTPUT),
)

_DRAFTER = (
    A("target_hidden", "R, T_MAIN, TARGET_HIDDEN", BF16, INPUT, dyn="T_MAIN"),
    A("initial_hidden", "R, LOCAL_ROWS, HC, D", F32, SCRATCH),
    A("intermediate_hidden", "R, DL, LOCAL_ROWS, HC, D", F32, SCRATCH),
    A("main_proj_weight", "R, D, TARGET_HIDDEN", BF16, WEIGHT),
    A("main_norm_weight", "R, D", BF16, WEIGHT),
    A("num_sampled", "R, B", I32, INPUT, dyn="B"),
    A("last_sampled", "R, B", I64, INPUT, dyn="B"),
    A("next_prefill_tokens", "R, B", I64, INPUT, dyn="B"),
    A("embedding_weight", "R, VOCAB, D", BF16, WEIGHT),
    A("context_group_position_ids", "R, TP*T_MAIN", I32, INPUT, dyn="T_MAIN"),
    A("context_group_slot_mapping", "R, DL, TP*T_MAIN", I64, INPUT, dyn="T_MAIN"),
    A("anchor_positions", "R, B", I32, INPUT, dyn="B"),
    A("block_tables", "R, DL, B, ORI_DEPTH", I32, INPUT, dyn="B"),
    A("query_group_position_ids", "R, DRAFT_GROUP_QROWS", I32, INPUT),
    A("query_group_slot_mapping", "R, DL, DRAFT_GROUP_QROWS", I64, INPUT),
    A("context_group_freqs_cos", "R, TP*T_MAIN, ROPE", BF16, INPUT, dyn="T_MAIN"),
    A("context_group_freqs_sin", "R, TP*T_MAIN, ROPE", BF16, INPUT, dyn="T_MAIN"),
    A("query_freqs_cos", "R, DRAFT_QROWS, ROPE", BF16, INPUT),
    A("query_freqs_sin", "R, DRAFT_QROWS, ROPE", BF16, INPUT),
    A("query_group_freqs_cos", "R, DRAFT_GROUP_QROWS, ROPE", BF16, INPUT),
    A("query_group_freqs_sin", "R, DRAFT_GROUP_QROWS, ROPE", BF16, INPUT),
    A("hc_attn_fn", "R, DL*MIX_HC, HC_DIM", F32, WEIGHT),
    A("hc_attn_scale", "R, DL*3", F32, WEIGHT),
    A("hc_attn_base", "R, DL*MIX_HC", F32, WEIGHT),
    A("attn_norm_w", "R, DL*D", BF16, WEIGHT),
    A("wq_a", "R, DL, D, Q_LORA", BF16, WEIGHT),
    A("wq_b", "R, DL, Q_LORA, H*HEAD_DIM", I8, WEIGHT),
    A("wq_b_scale", "R, DL*H*HEAD_DIM", F32, WEIGHT),
    A("wkv", "R, DL*D, HEAD_DIM", BF16, WEIGHT),
    A("gamma_cq", "R, DL*Q_LORA", BF16, WEIGHT),
    A("gamma_ckv", "R, DL*HEAD_DIM", BF16, WEIGHT),
    A("kv_caches", "R, DL, DRAFT_POOL_BLOCKS, BLOCK, 1, HEAD_DIM", BF16, STATE, pool="drafter"),
    A("attn_sink", "R, DL*H", F32, WEIGHT),
    A("wo_a", "R, DL*LOCAL_O_GROUPS, O_LORA, O_GROUP_IN", BF16, WEIGHT),
    A("wo_b", "R, DL*LOCAL_O_GROUPS, D, O_LORA", I8, WEIGHT),
    A("wo_b_scale", "R, DL*D", F32, WEIGHT),
    A("hc_ffn_fn", "R, DL*MIX_HC, HC_DIM", F32, WEIGHT),
    A("hc_ffn_scale", "R, DL*3", F32, WEIGHT),
    A("hc_ffn_base", "R, DL*MIX_HC", F32, WEIGHT),
    A("ffn_norm_w", "R, DL*D", BF16, WEIGHT),
    A("gate_w", "R, DL*N_EXPERTS, D", F32, WEIGHT),
    A("gate_bias", "R, DL*N_EXPERTS", F32, WEIGHT),
    A("tid2eid", "R, DL*VOCAB, TOPK", I32, WEIGHT),
    A("routed_w1", "R, DL*N_LOCAL, MOE_INTER, D", I8, WEIGHT),
    A("routed_w1_scale", "R, DL*N_LOCAL, MOE_INTER", F32, WEIGHT),
    A("routed_w3", "R, DL*N_LOCAL, MOE_INTER, D", I8, WEIGHT),
    A("routed_w3_scale", "R, DL*N_LOCAL, MOE_INTER", F32, WEIGHT),
    A("routed_w2", "R, DL*N_LOCAL, D, MOE_INTER", I8, WEIGHT),
    A("routed_w2_scale", "R, DL*N_LOCAL, D", F32, WEIGHT),
    A("shared_w1", "R, DL, MOE_INTER, D", I8, WEIGHT),
    A("shared_w1_scale", "R, DL*MOE_INTER", F32, WEIGHT),
    A("shared_w3", "R, DL, MOE_INTER, D", I8, WEIGHT),
    A("shared_w3_scale", "R, DL*MOE_INTER", F32, WEIGHT),
    A("shared_w2", "R, DL, D, MOE_INTER", I8, WEIGHT),
    A("shared_w2_scale", "R, DL*D", F32, WEIGHT),
    A("hc_head_fn", "R, HC, HC_DIM", F32, WEIGHT),
    A("hc_head_scale", "R, 1", F32, WEIGHT),
    A("hc_head_base", "R, HC", F32, WEIGHT),
    A("head_hidden", "R, B, QW, D", BF16, OUTPUT, dyn="B"),
)

_MARKOV = (
    A("head_hidden", "R, B, QW, D", BF16, INPUT, dyn="B"),
    A("final_norm_weight", "R, D", BF16, WEIGHT),
    A("lm_head_weight", "R, VOCAB_TP, D", BF16, WEIGHT),
    A("logit_row_indices", "R, LOCAL_ROWS", I32, INPUT),
    A("num_sampled", "R, B", I32, INPUT, dyn="B"),
    A("last_sampled", "R, B", I64, INPUT, dyn="B"),
    A("next_prefill_tokens", "R, B", I64, INPUT, dyn="B"),
    A("markov_w1", "R, VOCAB, MARKOV_RANK", BF16, WEIGHT),
    A("markov_w2", "R, VOCAB, MARKOV_RANK", BF16, WEIGHT),
    A("confidence_head_weight", "R, 1, D+MARKOV_RANK", F32, WEIGHT),
    A("draft_token_ids", "R, B, QW", I32, OUTPUT, dyn="B"),
    A("confidence_probs", "R, B, QW", F32, OUTPUT, dyn="B"),
)


# ---- derived programs -------------------------------------------------------------------------
# Names the fused kernel derives on device from persistent state (serving-contract.md §5.4 part 1).
FUSED_INTERNAL_PREPARE = (
    "freqs_cos", "freqs_sin", "compressed_freqs_cos", "compressed_freqs_sin", "swa_slot_mapping",
    "swa_indices", "swa_lens", "position_ids_local", "position_ids", "csa_cmp_freqs_cos",
    "csa_cmp_freqs_sin", "csa_compress_state_block_table", "csa_inner_compress_state_block_table",
    "csa_ori_slot_mapping", "csa_window_swa_indices", "csa_window_swa_lens", "csa_cmp_slot_mapping",
    "csa_idx_slot_mapping", "csa_state_slot_mapping", "csa_inner_state_slot_mapping", "csa_kv_seq_lens",
    "hca_cmp_freqs_cos", "hca_cmp_freqs_sin", "hca_compress_state_block_table", "hca_ori_slot_mapping",
    "hca_window_swa_indices", "hca_window_swa_lens", "hca_cmp_slot_mapping", "hca_state_slot_mapping",
    "hca_kv_seq_lens", "input_ids", "logit_row_indices",
)
# The drafter's host-staged prepare tensors, built on device as bridge tensors in the fused step.
DRAFTER_HOST_PREPARE = (
    "target_hidden", "num_sampled", "last_sampled", "next_prefill_tokens", "context_group_position_ids",
    "context_group_slot_mapping", "anchor_positions", "query_group_position_ids",
    "query_group_slot_mapping", "context_group_freqs_cos", "context_group_freqs_sin", "query_freqs_cos",
    "query_freqs_sin", "query_group_freqs_cos", "query_group_freqs_sin",
)
MARKOV_FUSED_DROP = ("head_hidden", "logit_row_indices", "num_sampled", "last_sampled", "next_prefill_tokens")
MARKOV_BOOTSTRAP_DROP = ("head_hidden", "num_sampled", "last_sampled", "next_prefill_tokens")
# Arguments of the drafter and markov ABIs that are the target's own buffers.
_SHARED_WITH_TARGET = {"embedding_weight": "embed_weight", "lm_head_weight": "lm_head_weight"}

_VALID_DRAFT_COUNTS = A("valid_draft_counts", "R, DECODE_BATCH", I32, INPUT)
_PERSISTENT_STATE = (
    A("state_slot_ids", "R, LOCAL_REQ", I32, INPUT),
    A("state_generations", "R, LOCAL_REQ", I32, INPUT),
    A("state_tokens", "R, LEASES, QW1", I64, STATE, pool="device_state"),
    A("state_meta", "R, LEASES, META", I32, STATE, pool="device_state"),
)
_ACCEPT_OUTPUTS = (
    A("accepted_token_ids", "R, LOCAL_REQ, QW1", I32, OUTPUT),
    A("accepted_counts", "R, LOCAL_REQ", I32, OUTPUT),
)
_DEVICE_PREPARE = (
    A("group_state_slot_ids", "R, DECODE_BATCH", I32, INPUT),
    A("group_state_generations", "R, DECODE_BATCH", I32, INPUT),
    A("group_ori_block_tables", "R, DECODE_BATCH, ORI_DEPTH", I32, INPUT),
    A("group_hca_cmp_block_tables", "R, DECODE_BATCH, CMP_DEPTH", I32, INPUT),
    A("group_csa_cmp_block_tables", "R, DECODE_BATCH, CMP_DEPTH", I32, INPUT),
    A("group_idx_block_tables", "R, DECODE_BATCH, CMP_DEPTH", I32, INPUT),
    A("group_hca_state_block_tables", "R, DECODE_BATCH, RING_HCA_STATE", I32, INPUT),
    A("group_csa_state_block_tables", "R, DECODE_BATCH, RING_CSA_STATE", I32, INPUT),
    A("group_csa_inner_state_block_tables", "R, DECODE_BATCH, RING_CSA_STATE", I32, INPUT),
    A("swa_rope_cos_table", "R, MAX_SEQ, ROPE", BF16, WEIGHT),
    A("swa_rope_sin_table", "R, MAX_SEQ, ROPE", BF16, WEIGHT),
    A("ratio4_rope_cos_table", "R, MAX_SEQ, ROPE", BF16, WEIGHT),
    A("ratio4_rope_sin_table", "R, MAX_SEQ, ROPE", BF16, WEIGHT),
    A("ratio128_rope_cos_table", "R, MAX_SEQ, ROPE", BF16, WEIGHT),
    A("ratio128_rope_sin_table", "R, MAX_SEQ, ROPE", BF16, WEIGHT),
)


def _drafter_buffers(args, prefix_names: bool = False) -> tuple[Arg, ...]:
    """Drafter and markov arguments live in their own buffers (draft_*), except the shared
    target embedding and LM-head shard."""
    out = []
    for a in args:
        buf = _SHARED_WITH_TARGET.get(a.name, "draft_" + a.name)
        name = ("draft_" + a.name) if prefix_names else a.name
        out.append(replace(a, name=name, buffer=buf))
    return tuple(out)


def _fused() -> tuple[Arg, ...]:
    target = []
    for a in _DECODE:
        if a.name == "sampled_ids":
            target.append(_VALID_DRAFT_COUNTS)
        if a.name not in FUSED_INTERNAL_PREPARE:
            target.append(a)
    drafter = [a for a in _drafter_buffers(_DRAFTER, True) if a.name[len("draft_"):] not in DRAFTER_HOST_PREPARE]
    markov = [a for a in _drafter_buffers(_MARKOV, True) if a.name[len("draft_"):] not in MARKOV_FUSED_DROP]
    return tuple(target) + _PERSISTENT_STATE + _ACCEPT_OUTPUTS + _DEVICE_PREPARE + tuple(drafter) + tuple(markov)


def _bootstrap() -> tuple[Arg, ...]:
    markov = [a for a in _drafter_buffers(_MARKOV) if a.name not in MARKOV_BOOTSTRAP_DROP]
    # prefill seeding binds private zeroed scratch to the state args, never the live state
    seed_state = tuple(replace(a, buffer="dspark_seed_" + a.name, role=SCRATCH if a.role == STATE else a.role,
                               pool=None) for a in _PERSISTENT_STATE)
    return _drafter_buffers(_DRAFTER) + tuple(markov) + seed_state


@dataclass(frozen=True)
class Program:
    name: str
    compiled_as: str
    args: tuple[Arg, ...]
    ring_heap: str              # ring-heap profile name (see ringheap.py)
    modes: tuple[int, ...]      # K values whose executor compiles it

    def __post_init__(self):
        names = [a.name for a in self.args]
        dup = {n for n in names if names.count(n) > 1}
        assert not dup, f"{self.name}: duplicate argument names {sorted(dup)}"

    def __len__(self) -> int:
        return len(self.args)

    @cached_property
    def index(self) -> dict[str, int]:
        return {a.name: i for i, a in enumerate(self.args)}

    def arg(self, name: str) -> Arg:
        try:
            return self.args[self.index[name]]
        except KeyError:
            raise AbiError("argument", name, f"an argument of {self.name}", where=self.name) from None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args)


PROGRAMS: dict[str, Program] = {p.name: p for p in (
    Program("l3_prefill_fwd", "dspark_prefill", _PREFILL, "prefill", (0, 7)),
    Program("l3_decode_fwd", "dspark_decode", _DECODE, "decode", (0,)),
    Program("l3_decode_fwd_dspark", "dspark_decode_one_l2", _fused(), "drafter", (7,)),
    Program("l3_dspark_draft_step_device_state", "dspark_draft_step_device_state_bootstrap", _bootstrap(),
            "drafter", (7,)),
    Program("l3_dspark_drafter", "dspark_drafter", _drafter_buffers(_DRAFTER), "drafter", ()),
    Program("l3_distributed_markov_sample", "dspark_markov", _drafter_buffers(_MARKOV), "markov", ()),
)}
# the K=7 legacy split programs (drafter, markov) are pinned by tests but not compiled by the
# newest executor: their `modes` are empty.


def get_program(name: str) -> Program:
    try:
        return PROGRAMS[name]
    except KeyError:
        raise AbiError("program", name, f"one of {list(PROGRAMS)}") from None


def programs_for_k(k: int) -> tuple[Program, ...]:
    return tuple(p for p in PROGRAMS.values() if k in p.modes)


# ---- binding ------------------------------------------------------------------------------------
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def eval_dim(expr: str, symbols: dict[str, int]) -> int:
    """Evaluate one symbolic dimension (names, integers, + - * //) against a symbol table."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in symbols:
                raise AbiError("symbol", node.id, f"one of {sorted(symbols)}", where=f"shape {expr!r}")
            return symbols[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise AbiError("shape", expr, "names, integers and + - * //")
    return int(ev(ast.parse(expr, mode="eval")))


DYNAMIC_MAX = {"P": C.PREFILL_TOKENS_PER_GROUP, "Q": C.PREFILL_REQUESTS_PER_GROUP,
               "B": C.DRAFTER_MAX_BATCH, "T_MAIN": C.DRAFTER_CONTEXT_BUCKETS[-1]}


def check_slots(slots, where: str) -> int:
    """Capacity slots per partition, the unit every pool is sized in: an int in 1..64 (one slot per
    request of a TP group's decode tile)."""
    if isinstance(slots, bool) or not isinstance(slots, numbers.Integral) or not 1 <= slots <= C.DECODE_BATCH:
        raise AbiError("slots", slots, f"an int in 1..{C.DECODE_BATCH} (capacity slots per partition)", where=where)
    return int(slots)


def symbols(dep: Deployment, slots: int = 1, **extents: int) -> dict[str, int]:
    """The symbol table of a binding.  `slots` sizes the pools; `extents` sets P, Q, B, T_MAIN
    (default: their maxima; L follows P)."""
    check_slots(slots, "bind")
    m, topo, lim = dep.model, dep.topology, dep.limits
    bad = set(extents) - set(DYNAMIC_MAX)
    if bad:
        raise AbiError("extent", sorted(bad)[0], f"one of {sorted(DYNAMIC_MAX)}", where="bind")
    ext = {**DYNAMIC_MAX, **extents}
    tp = topo.tp
    if ext["P"] % tp:
        raise AbiError("P", ext["P"], f"a multiple of tp={tp} (TP-aligned packed rows)", where="bind")
    sizing = size_families(m, lim.max_model_len, lim.max_prefill_tokens_per_request)
    s = {
        "R": topo.ranks, "TP": tp, "P": ext["P"], "L": ext["P"] // tp, "Q": ext["Q"], "B": ext["B"],
        "T_MAIN": ext["T_MAIN"],
        "NL": m.num_hidden_layers, "NC": len(m.csa_layers), "NH": len(m.hca_layers), "DL": m.dspark_num_layers,
        "D": m.hidden_size, "HC": m.hc_mult, "HC_DIM": m.hc_dim, "MIX_HC": m.mix_hc, "MIX_HC_PRE": m.mix_hc,
        "MIX_HC_PAD": math.ceil(m.mix_hc / 32) * 32, "Q_LORA": m.q_lora_rank, "HEAD_DIM": m.head_dim,
        "ROPE": m.qk_rope_head_dim, "H": m.num_attention_heads, "O_LORA": m.o_lora_rank, "O_GROUPS": m.o_groups,
        "O_GROUP_IN": m.o_group_in, "LOCAL_O_GROUPS": m.o_groups // tp, "N_EXPERTS": m.n_routed_experts,
        "N_LOCAL": topo.experts_per_rank(m), "MOE_INTER": m.moe_intermediate_size,
        "TOPK": m.num_experts_per_tok, "IDX_N_HEADS": m.index_n_heads, "IDX_HEAD_DIM": m.index_head_dim,
        "MARKOV_RANK": m.dspark_markov_rank, "VOCAB": m.vocab_size, "VOCAB_TP": m.vocab_size // tp,
        "TARGET_HIDDEN": 3 * m.hidden_size, "W": m.sliding_window, "MAX_SEQ": lim.max_model_len,
        "LOGIT_ROWS": C.PREFILL_LOGIT_ROWS, "SAMPLED_PAD": C.SAMPLED_IDS_PAD,
        "GRAMMAR_SEG": m.grammar_segments, "GRAMMAR_WORDS": C.GRAMMAR_WORDS_PER_SEGMENT,
        "DECODE_BATCH": C.DECODE_BATCH, "LOCAL_REQ": C.DECODE_BATCH // tp,
        "LOCAL_ROWS": C.DECODE_BATCH // tp * C.DECODE_SEQ, "DECODE_TOKENS": C.DECODE_TOKENS,
        "QW": C.DSPARK_QUERY_WIDTH, "QW1": C.DECODE_SEQ, "META": len(C.STATE_META_FIELDS),
        "LEASES": C.DRAFTER_LEASES_PER_GROUP, "DRAFT_POOL_BLOCKS": C.DRAFTER_POOL_BLOCKS, "BLOCK": C.BLOCK_SIZE,
        "DRAFT_QROWS": C.DECODE_BATCH // tp * C.DSPARK_QUERY_WIDTH,
        "DRAFT_GROUP_QROWS": C.DECODE_BATCH * C.DSPARK_QUERY_WIDTH,
        "SPLIT_CSA_DEPTH": C.SPLIT_DECODE_CSA_STATE_DEPTH,
        "ORI_DEPTH": sizing["ori"].frozen_depth, "CMP_DEPTH": sizing["cmp_c4"].frozen_depth,
        "HCA_STATE_DEPTH": sizing["hca_state"].frozen_depth, "CSA_STATE_DEPTH": sizing["csa_state"].frozen_depth,
        "RING_HCA_STATE": sizing["hca_state"].max_blocks_per_seq,
        "RING_CSA_STATE": sizing["csa_state"].max_blocks_per_seq,
    }
    for name, fs in sizing.items():
        s["N_" + name.upper()] = fs.pool_pages(slots)
    return s


@dataclass(frozen=True)
class BoundArg:
    arg: Arg
    shape: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.arg.name

    @property
    def dtype(self) -> str:
        return self.arg.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.arg.dtype]

    @property
    def nbytes_per_rank(self) -> int:
        return math.prod(self.shape[1:]) * DTYPE_BYTES[self.arg.dtype]


def bind(program: str | Program, dep: Deployment, slots: int = 1, **extents: int) -> tuple[BoundArg, ...]:
    """Concrete shapes of every argument, in positional order."""
    prog = get_program(program) if isinstance(program, str) else program
    syms = symbols(dep, slots, **extents)
    return tuple(BoundArg(a, tuple(eval_dim(d, syms) for d in a.dims)) for a in prog.args)
