"""Model presets: the DeepSeek-V4-Flash checkpoint config, field for field, plus small twins.

A preset is pure configuration (llama2.c's `Config`): no weights, no run state.  FLASH is the
real model shape; TINY and SMALL keep its structure (two SWA layers, alternating CSA/HCA layers,
hash-routed first layers, four hyper-connection streams, a three-layer DSpark drafter with a
Markov head) at sizes that run a whole forward on a CPU in milliseconds.

Structural constants that the serving ABI freezes (sliding window 128, compress ratios 4 and
128, 32-token pages, 7 drafts) are the same in every preset, so the cache families, the lowering
and the scheduler run unchanged on the small presets.  A model config accepts any shape the
kernels' math supports (any o_groups dividing the heads, any order of SWA / CSA / HCA layers, any
window); what the deployment freezes (o_groups divisible by TP, the 128-token window of the cache
families) is checked by the deployment (`twin.abi.topology`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from .errors import ConfigError

SWA, CSA, HCA = 0, 4, 128
WEIGHT_DTYPES = ("fp8", "bf16", "fp32")    # `dtype`: the checkpoint's linear weights
LAYER_KIND = {SWA: "swa", CSA: "csa", HCA: "hca"}


def flash_compress_ratios(num_layers: int, nextn: int = 1) -> tuple[int, ...]:
    """(0, 0, 4, 128, 4, 128, ..., 4) for the target layers, then 0 for each MTP layer."""
    if num_layers < 3 or num_layers % 2 == 0:
        raise ConfigError("num_hidden_layers", num_layers, "an odd count >= 3 (2 SWA + (CSA, HCA)* + CSA)")
    body = tuple(CSA if (i % 2 == 0) else HCA for i in range(2, num_layers))
    return (SWA, SWA) + body + (SWA,) * nextn


@dataclass(frozen=True)
class ModelConfig:
    """The checkpoint `config.json` of DeepSeek-V4-Flash (DSpark W8A8), field for field."""

    name: str
    hidden_size: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    rms_norm_eps: float
    vocab_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    num_hidden_layers: int
    num_hash_layers: int
    num_nextn_predict_layers: int
    compress_ratios: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    max_position_embeddings: int
    rope_theta: float
    compress_rope_theta: float
    rope_factor: float
    beta_fast: int
    beta_slow: int
    original_max_position_embeddings: int
    bos_token_id: int = 0
    eos_token_id: int = 1
    # checkpoint metadata: the PyPTO kernels run W8A8 INT8 whatever it says; golden's official mode
    # rounds a linear's input to FP8 only when `dtype` says the release's linear weights are FP8
    dtype: str = "fp8"
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp4"
    scale_dtype: str = "fp8"
    max_batch_size: int = 4
    checkpoint_format: str = "w8a8-compressed-tensors"
    # DSpark drafter fields
    dspark_num_layers: int = 3
    dspark_num_drafts: int = 7
    dspark_markov_rank: int = 256
    dspark_target_layer_ids: tuple[int, ...] = (40, 41, 42)
    dspark_noise_token_id: int = 128799
    small: bool = field(default=False, compare=False)

    def __post_init__(self):
        self.validate()

    # ---- derived shape facts -------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def hc_dim(self) -> int:
        return self.hc_mult * self.hidden_size

    @property
    def mix_hc(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.o_groups

    @property
    def o_group_in(self) -> int:
        return self.heads_per_group * self.head_dim

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def index_scale(self) -> float:
        return self.index_head_dim ** -0.5 * self.index_n_heads ** -0.5

    @property
    def target_ratios(self) -> tuple[int, ...]:
        return self.compress_ratios[: self.num_hidden_layers]

    def layers_of(self, ratio: int) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.target_ratios) if r == ratio)

    @property
    def swa_layers(self) -> tuple[int, ...]:
        return self.layers_of(SWA)

    @property
    def csa_layers(self) -> tuple[int, ...]:
        return self.layers_of(CSA)

    @property
    def hca_layers(self) -> tuple[int, ...]:
        return self.layers_of(HCA)

    @property
    def hash_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_hash_layers))

    def layer_kind(self, layer: int) -> str:
        return LAYER_KIND[self.target_ratios[layer]]

    @property
    def grammar_segment_tokens(self) -> int:
        return 808

    @property
    def grammar_segments(self) -> int:
        return math.ceil(self.vocab_size / self.grammar_segment_tokens)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("small")
        d["compress_ratios"] = list(self.compress_ratios)
        d["dspark_target_layer_ids"] = list(self.dspark_target_layer_ids)
        return d

    # ---- validation ---------------------------------------------------------------------
    def validate(self) -> None:
        where = f"preset {self.name}"

        def need(name, ok, allowed):
            if not ok:
                raise ConfigError(name, getattr(self, name), allowed, where=where)

        need("head_dim", self.head_dim > self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0,
             "head_dim > qk_rope_head_dim > 0, rope dims even")
        need("o_groups", self.o_groups >= 1 and self.num_attention_heads % self.o_groups == 0,
             "a divisor of num_attention_heads")
        need("compress_ratios", len(self.compress_ratios) == self.num_hidden_layers + self.num_nextn_predict_layers
             and set(self.compress_ratios) <= {SWA, CSA, HCA},
             "one entry per target and MTP layer, each in {0, 4, 128}")
        need("num_hash_layers", 1 <= self.num_hash_layers <= self.num_hidden_layers, "1..num_hidden_layers")
        need("num_experts_per_tok", 1 <= self.num_experts_per_tok <= self.n_routed_experts,
             "1..n_routed_experts")
        need("hc_mult", self.hc_mult == 4, "4 (the hyper-connection ABI is 4 streams)")
        need("sliding_window", self.sliding_window >= 1, ">= 1")
        need("dtype", self.dtype in WEIGHT_DTYPES, f"one of {WEIGHT_DTYPES}")
        need("scoring_func", self.scoring_func == "sqrtsoftplus", "'sqrtsoftplus'")
        need("dspark_num_drafts", self.dspark_num_drafts == 7, "7 (DSPARK_QUERY_WIDTH)")
        need("dspark_num_layers", self.dspark_num_layers == 3, "3")
        L = self.num_hidden_layers
        need("dspark_target_layer_ids", tuple(self.dspark_target_layer_ids) == (L - 3, L - 2, L - 1),
             f"(L-3, L-2, L-1) = {(L - 3, L - 2, L - 1)}")
        need("dspark_noise_token_id", 0 <= self.dspark_noise_token_id < self.vocab_size, "a token id < vocab_size")
        need("dspark_markov_rank", self.dspark_markov_rank > 0, "> 0")
        need("vocab_size", self.vocab_size % 4 == 0, "a multiple of 4 (the LM head is 4-way vocab-sharded)")
        need("index_head_dim", self.index_head_dim > self.qk_rope_head_dim, "> qk_rope_head_dim")
        if not self.small:
            # the runner's DSparkCacheLayout.validate_runtime Flash-shape check
            for name, want in (("hidden_size", 4096), ("num_hidden_layers", 43), ("num_attention_heads", 64),
                               ("head_dim", 512), ("vocab_size", 129280)):
                need(name, getattr(self, name) == want, f"{want} (the Flash shape)")

    def replace(self, **kw) -> "ModelConfig":
        return replace(self, **kw)


FLASH = ModelConfig(
    name="flash",
    hidden_size=4096, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64,
    q_lora_rank=1024, o_lora_rank=1024, o_groups=8, sliding_window=128, rms_norm_eps=1e-6,
    vocab_size=129280, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
    num_experts_per_tok=6, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0,
    num_hidden_layers=43, num_hash_layers=3, num_nextn_predict_layers=1,
    compress_ratios=flash_compress_ratios(43),
    index_n_heads=64, index_head_dim=128, index_topk=512,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, max_position_embeddings=1_048_576,
    rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0, beta_fast=32, beta_slow=1,
    original_max_position_embeddings=65536,
    dspark_markov_rank=256, dspark_target_layer_ids=(40, 41, 42), dspark_noise_token_id=128799,
)

# Small presets: same structure, CPU sizes.  The vocabularies are multiples of 4 (vocab-sharded
# LM head) and of 808 where practical (grammar segments).
TINY = ModelConfig(
    name="tiny",
    hidden_size=64, num_attention_heads=8, head_dim=32, qk_rope_head_dim=16,
    q_lora_rank=32, o_lora_rank=32, o_groups=4, sliding_window=128, rms_norm_eps=1e-6,
    vocab_size=1616, moe_intermediate_size=32, n_routed_experts=16, n_shared_experts=1,
    num_experts_per_tok=2, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0,
    num_hidden_layers=7, num_hash_layers=1, num_nextn_predict_layers=1,
    compress_ratios=flash_compress_ratios(7),
    index_n_heads=4, index_head_dim=32, index_topk=16,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, max_position_embeddings=16384,
    rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0, beta_fast=32, beta_slow=1,
    original_max_position_embeddings=65536,
    dspark_markov_rank=16, dspark_target_layer_ids=(4, 5, 6), dspark_noise_token_id=1615 - 480,
    small=True,
)

SMALL = ModelConfig(
    name="small",
    hidden_size=256, num_attention_heads=8, head_dim=128, qk_rope_head_dim=32,
    q_lora_rank=128, o_lora_rank=128, o_groups=4, sliding_window=128, rms_norm_eps=1e-6,
    vocab_size=4040, moe_intermediate_size=128, n_routed_experts=32, n_shared_experts=1,
    num_experts_per_tok=4, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0,
    num_hidden_layers=11, num_hash_layers=2, num_nextn_predict_layers=1,
    compress_ratios=flash_compress_ratios(11),
    index_n_heads=8, index_head_dim=64, index_topk=64,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, max_position_embeddings=16384,
    rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0, beta_fast=32, beta_slow=1,
    original_max_position_embeddings=65536,
    dspark_markov_rank=32, dspark_target_layer_ids=(8, 9, 10), dspark_noise_token_id=4039 - 480,
    small=True,
)

PRESETS: dict[str, ModelConfig] = {p.name: p for p in (FLASH, TINY, SMALL)}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError("preset", name, f"one of {sorted(PRESETS)}") from None


def config_field_names() -> list[str]:
    return [f.name for f in fields(ModelConfig) if f.name not in ("name", "small")]
