"""Topology and serving limits, validated as upstream's `_validate_dspark_topology` does.

The production topology is TP4 attention groups with EP = ranks in {8, 16} and DP = EP/4
scheduler partitions.  Small presets may also run on reduced topologies (one TP group of 4 ranks,
or a single rank) so that whole models run on a CPU; FLASH never may.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from . import constants as C
from .errors import ConfigError
from .presets import ModelConfig

PRODUCTION_TOPOLOGIES = ((4, 8), (4, 16))              # (tp, ep)
SMALL_PRESET_TOPOLOGIES = ((1, 1), (4, 4)) + PRODUCTION_TOPOLOGIES


@dataclass(frozen=True)
class Topology:
    """Ranks, TP groups and expert parallelism.  `dp` is the number of cache partitions."""

    tp: int = 4
    ep: int = 16
    dp: int | None = None
    devices: tuple[int, ...] | None = None

    @property
    def ranks(self) -> int:
        return self.ep

    @property
    def partitions(self) -> int:
        return self.ep // self.tp

    def group_ranks(self, g: int) -> range:
        return range(self.tp * g, self.tp * (g + 1))

    def validate(self, model: ModelConfig) -> "Topology":
        allowed = SMALL_PRESET_TOPOLOGIES if model.small else PRODUCTION_TOPOLOGIES
        where = "topology"
        if self.tp not in {t for t, _ in allowed}:
            raise ConfigError("tp", self.tp, "4" + (" (or 1 for a single-rank small preset)" if model.small else ""),
                              where=where)
        eps = sorted({e for t, e in allowed if t == self.tp})
        if self.ep not in eps:
            extra = "" if model.small else " (smaller topologies are for the small presets only)"
            raise ConfigError("ep", self.ep, f"one of {eps} with tp={self.tp}{extra}", where=where)
        dp = self.ep // self.tp
        if self.dp is not None and self.dp != dp:
            raise ConfigError("dp", self.dp, f"ep/tp = {dp}", where=where)
        if self.devices is not None and len(self.devices) != self.ep:
            raise ConfigError("devices", list(self.devices), f"exactly ep={self.ep} device ids", where=where)
        if self.devices is not None and len(set(self.devices)) != len(self.devices):
            raise ConfigError("devices", list(self.devices), "distinct device ids", where=where)
        if model.n_routed_experts % self.ep:
            raise ConfigError("ep", self.ep, f"a divisor of n_routed_experts={model.n_routed_experts}",
                              where=where)
        if model.o_groups % self.tp:
            raise ConfigError("o_groups", model.o_groups, f"a multiple of tp={self.tp} (each TP rank projects "
                              "whole output groups)", where=f"preset {model.name} on this topology")
        return self

    def experts_per_rank(self, model: ModelConfig) -> int:
        return model.n_routed_experts // self.ep


@dataclass(frozen=True)
class ServingLimits:
    """The serving CLI flags that shape the ABI, with upstream's defaults."""

    max_model_len: int = 1024
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 4096
    long_prefill_token_threshold: int = 2048
    num_speculative_tokens: int = 7
    block_size: int = C.BLOCK_SIZE
    temperature: float = 0.0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    npu_memory_utilization: float = 0.90

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @property
    def max_prefill_tokens_per_request(self) -> int:
        """min(8192, max_num_batched_tokens, long_prefill_token_threshold if chunked)."""
        m = min(C.MAX_PREFILL_TOKENS_PER_REQUEST, self.max_num_batched_tokens)
        if self.enable_chunked_prefill:
            m = min(m, self.long_prefill_token_threshold)
        return m

    @property
    def speculative_prefix_cache_replay_tokens(self) -> int:
        return C.SPEC_REPLAY_TOKENS if self.k > 0 else 0

    @property
    def rows_per_decode_request(self) -> int:
        return 1 + self.k

    def validate(self, model: ModelConfig, topo: Topology) -> "ServingLimits":
        where = "serving limits"
        if self.block_size != C.BLOCK_SIZE:
            raise ConfigError("block_size", self.block_size, f"{C.BLOCK_SIZE}", where=where)
        cap = C.DECODE_BATCH * topo.partitions
        if not 1 <= self.max_num_seqs <= cap:
            raise ConfigError("max_num_seqs", self.max_num_seqs,
                              f"1..{cap} (64 decode requests per TP group x {topo.partitions} partitions)",
                              where=where)
        ceiling = min(C.MAX_MODEL_LEN_CEILING, model.max_position_embeddings)
        if not 1 <= self.max_model_len <= ceiling:
            raise ConfigError("max_model_len", self.max_model_len,
                              f"1..{ceiling} (<= 1,048,576 and <= max_position_embeddings="
                              f"{model.max_position_embeddings})", where=where)
        if self.num_speculative_tokens not in C.SUPPORTED_K:
            raise ConfigError("num_speculative_tokens", self.num_speculative_tokens,
                              "0 (target only) or 7 (DSPARK_QUERY_WIDTH)", where=where)
        if self.temperature != 0:
            raise ConfigError("temperature", self.temperature,
                              "0 only: DSpark serving is greedy (there is no temperature ABI)", where=where)
        if self.max_num_batched_tokens < self.rows_per_decode_request:
            raise ConfigError("max_num_batched_tokens", self.max_num_batched_tokens,
                              f">= {self.rows_per_decode_request} (one decode request costs 1+K tokens)",
                              where=where)
        if self.long_prefill_token_threshold < 1:
            raise ConfigError("long_prefill_token_threshold", self.long_prefill_token_threshold, ">= 1",
                              where=where)
        if not 0 < self.npu_memory_utilization <= 1:
            raise ConfigError("npu_memory_utilization", self.npu_memory_utilization, "in (0, 1]", where=where)
        return self

    def replace(self, **kw) -> "ServingLimits":
        return replace(self, **kw)


@dataclass(frozen=True)
class Deployment:
    """A validated (preset, topology, limits) triple: what an ABI binding is taken for."""

    model: ModelConfig
    topology: Topology = field(default_factory=Topology)
    limits: ServingLimits = field(default_factory=ServingLimits)

    def __post_init__(self):
        if self.model.sliding_window != C.SLIDING_WINDOW:
            raise ConfigError("sliding_window", self.model.sliding_window,
                              f"{C.SLIDING_WINDOW} (the window the serving cache families freeze)",
                              where=f"preset {self.model.name} deployed")
        self.topology.validate(self.model)
        self.limits.validate(self.model, self.topology)

    @property
    def ranks(self) -> int:
        return self.topology.ranks

    @property
    def partitions(self) -> int:
        return self.topology.partitions

    @property
    def k(self) -> int:
        return self.limits.k

    @property
    def prefill_batch(self) -> int:
        return min(self.limits.max_num_seqs, self.partitions * C.PREFILL_REQUESTS_PER_GROUP)

    @property
    def prefill_requests_per_partition(self) -> int:
        return min(self.limits.max_num_seqs, C.PREFILL_REQUESTS_PER_GROUP)

    def replace(self, **kw) -> "Deployment":
        return replace(self, **kw)


def deployment(preset: str | ModelConfig = "flash", *, ep: int | None = None, tp: int = 4,
               devices: Sequence[int] | None = None, **limits) -> Deployment:
    """Convenience constructor: `deployment("flash", ep=16, max_model_len=1024)`."""
    from .presets import get_preset

    model = get_preset(preset) if isinstance(preset, str) else preset
    if ep is None:
        ep = 16
    topo = Topology(tp=tp, ep=ep, devices=tuple(devices) if devices is not None else None)
    return Deployment(model, topo, ServingLimits(**limits))
