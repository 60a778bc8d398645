"""Geometry of the reference step: pool layouts, ring sizes, sites in dependency order, and what
every compared tensor is (op class, dtype, quantization) so the tolerance policy can be looked up.

Page sizes and ratios come from the ABI (`twin.abi.constants`, the preset's compress ratios); a
pool is laid out as upstream's are: one region per layer of the family, the layer offset added by
the kernel, the slot mapping shared by every layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from twin.abi import constants as C
from twin.abi.errors import AbiError
from twin.abi.presets import CSA, HCA, ModelConfig

PROGRAM_PREFILL = "l3_prefill_fwd"
PROGRAM_DECODE = "l3_decode_fwd"
PROGRAM_FUSED = "l3_decode_fwd_dspark"
PROGRAM_SEED = "l3_dspark_draft_step_device_state"
PROGRAMS = (PROGRAM_PREFILL, PROGRAM_DECODE, PROGRAM_FUSED, PROGRAM_SEED)

CSA_STATE_PAGE, CSA_STATE_PAGES = 2, C.SPLIT_DECODE_CSA_STATE_DEPTH          # 16-position ring
HCA_STATE_PAGE = 8
HCA_STATE_PAGES = math.ceil((HCA + C.DECODE_SEQ) / HCA_STATE_PAGE)         # 17 pages: 136 positions
CMP_PAGE_TOKENS = C.COMPRESSED_BLOCK_TOKENS                                  # source tokens per page
LEASE_BLOCKS = C.DRAFTER_BLOCKS_PER_LEASE
DRAFTS = C.DSPARK_QUERY_WIDTH
ROWS_PER_VERIFY = C.DECODE_SEQ

TARGET_STAGES = ("attn_norm", "qkv", "kv_write", "compress_state", "compress", "attn", "o_proj",
                 "ffn_norm", "route", "experts", "moe_out")
HEAD_STAGES = ("final_norm", "logits", "sample", "verify", "publish")
DRAFT_STAGES = ("ctx_kv", "attn_norm", "qkv", "attn", "o_proj")
MARKOV_STAGES = ("logits", "sample")


def target_layer(i: int) -> str:
    return f"L{i}"


def draft_layer(i: int) -> str:
    return f"D{i}"


@dataclass(frozen=True)
class Geometry:
    """Pool sizes for `slots` concurrent requests of at most `max_len` positions."""

    cfg: ModelConfig
    slots: int = 4
    max_len: int = 512

    def __post_init__(self):
        if not self.cfg.small:
            raise AbiError("preset", self.cfg.name, "a small preset (tiny or small): the reference step runs "
                           "whole models on a CPU", where="hw.model")
        if self.slots < 1:
            raise AbiError("slots", self.slots, ">= 1", where="hw.model")
        if not (C.BLOCK_SIZE <= self.max_len <= self.cfg.max_position_embeddings) or self.max_len % CMP_PAGE_TOKENS:
            raise AbiError("max_len", self.max_len, f"a multiple of {CMP_PAGE_TOKENS} within the preset's positions",
                           where="hw.model")

    @property
    def ori_pages(self) -> int:               # per request
        return self.max_len // C.BLOCK_SIZE

    @property
    def cmp_pages(self) -> int:               # per request (128 source tokens per page)
        return self.max_len // CMP_PAGE_TOKENS

    @cached_property
    def pools(self) -> dict[str, tuple[int, ...]]:
        """name -> shape [layers * pages, rows_per_page, HEAD_DIM] (all f32 holding bf16 values or f32 state)."""
        m, s, HD = self.cfg, self.slots, self.cfg.head_dim
        nc, nh = len(m.csa_layers), len(m.hca_layers)
        return {
            "kv_cache": (m.num_hidden_layers * s * self.ori_pages, C.BLOCK_SIZE, HD),
            "csa_compress_state": (nc * s * CSA_STATE_PAGES, CSA_STATE_PAGE, HD),
            "hca_compress_state": (nh * s * HCA_STATE_PAGES, HCA_STATE_PAGE, HD),
            "csa_cmp_kv": (nc * s * self.cmp_pages, CMP_PAGE_TOKENS // CSA, HD),
            "hca_cmp_kv": (nh * s * self.cmp_pages, CMP_PAGE_TOKENS // HCA, HD),
            "draft_kv": (m.dspark_num_layers * s * LEASE_BLOCKS, C.BLOCK_SIZE, HD),
        }

    def region_rows(self, pool: str) -> int:
        """Flat rows per layer region of a pool."""
        shape = self.pools[pool]
        return shape[0] // len(self.pool_layers(pool)) * shape[1]

    def pool_layers(self, pool: str) -> tuple[str, ...]:
        m = self.cfg
        if pool == "kv_cache":
            return tuple(target_layer(i) for i in range(m.num_hidden_layers))
        if pool.startswith("csa_"):
            return tuple(target_layer(i) for i in m.csa_layers)
        if pool.startswith("hca_"):
            return tuple(target_layer(i) for i in m.hca_layers)
        if pool == "draft_kv":
            return tuple(draft_layer(i) for i in range(m.dspark_num_layers))
        raise AbiError("pool", pool, f"one of {sorted(self.pools)}", where="hw.model")

    def layer_of_row(self, pool: str, row: int) -> str:
        return self.pool_layers(pool)[row // self.region_rows(pool)]

    # ---- sites ----------------------------------------------------------------------------
    def sites(self, program: str) -> tuple[tuple[str, str], ...]:
        """Every (layer, stage) a program runs, in dependency order."""
        m = self.cfg
        out: list[tuple[str, str]] = []
        if program in (PROGRAM_PREFILL, PROGRAM_DECODE, PROGRAM_FUSED):
            for i in range(m.num_hidden_layers):
                ratio = m.target_ratios[i]
                for st in TARGET_STAGES:
                    if st in ("compress_state", "compress") and ratio not in (CSA, HCA):
                        continue
                    out.append((target_layer(i), st))
            heads = HEAD_STAGES if program == PROGRAM_FUSED else HEAD_STAGES[:3]
            out += [("head", st) for st in heads]
        if program in (PROGRAM_FUSED, PROGRAM_SEED):
            for d in range(m.dspark_num_layers):
                out += [(draft_layer(d), st) for st in DRAFT_STAGES]
            out += [("markov", st) for st in MARKOV_STAGES]
        return tuple(out)


# pool -> (program -> writer stage); the layer comes from the row's region
POOL_WRITER = {
    "kv_cache": "kv_write",
    "csa_compress_state": "compress_state",
    "hca_compress_state": "compress_state",
    "csa_cmp_kv": "compress",
    "hca_cmp_kv": "compress",
    "draft_kv": "ctx_kv",
}

# output -> site that produces it
OUTPUT_SITE = {
    "logits": ("head", "logits"),
    "sampled_ids": ("head", "sample"),
    "accepted_counts": ("head", "verify"),
    "dspark_target_hidden": ("L-1", "moe_out"),    # resolved per preset in output_site()
    "draft_tokens": ("markov", "sample"),
}


def output_site(cfg: ModelConfig, name: str) -> tuple[str, str]:
    if name == "dspark_target_hidden":
        return (target_layer(cfg.dspark_target_layer_ids[0]), "moe_out")
    return OUTPUT_SITE[name]


# (op class, dtype, quantization) of every compared tensor: outputs, pools, and tap stages
TENSOR_KIND = {
    "logits": ("logits", "f32", "none"),
    "sampled_ids": ("sample", "i32", "none"),
    "accepted_counts": ("index", "i32", "none"),
    "draft_tokens": ("sample", "i32", "none"),
    "dspark_target_hidden": ("activation", "bf16", "w8a8"),
    "kv_cache": ("kv_pool", "bf16", "none"),
    "csa_compress_state": ("state", "f32", "none"),
    "hca_compress_state": ("state", "f32", "none"),
    "csa_cmp_kv": ("kv_pool", "bf16", "none"),
    "hca_cmp_kv": ("kv_pool", "bf16", "none"),
    "draft_kv": ("kv_pool", "bf16", "none"),
}
STAGE_KIND = {
    "attn_norm": ("norm", "bf16", "none"),
    "ffn_norm": ("norm", "bf16", "none"),
    "final_norm": ("norm", "bf16", "none"),
    "qkv": ("matmul", "bf16", "none"),
    "kv_write": ("matmul", "bf16", "none"),
    "compress_state": ("state", "f32", "none"),
    "compress": ("matmul", "bf16", "none"),
    "ctx_kv": ("matmul", "bf16", "none"),
    "attn": ("attention", "bf16", "none"),
    "o_proj": ("matmul", "bf16", "none"),
    "route": ("route", "i32", "none"),
    "experts": ("moe", "bf16", "w8a8"),
    "moe_out": ("activation", "bf16", "w8a8"),
    "logits": ("logits", "f32", "none"),
    "sample": ("sample", "i32", "none"),
    "verify": ("index", "i32", "none"),
    "publish": ("index", "i32", "none"),
}


def tensor_kind(name: str) -> tuple[str, str, str]:
    """Kind of an output/pool name, or of a tap named "layer/stage"."""
    if name in TENSOR_KIND:
        return TENSOR_KIND[name]
    stage = name.rsplit("/", 1)[-1]
    if stage in STAGE_KIND:
        return STAGE_KIND[stage]
    raise AbiError("tensor", name, f"an output, pool or tap of the reference step ({sorted(TENSOR_KIND)})",
                   where="hw.model.spec")
