"""Startup admission and the per-rank HBM account (upstream `init_kv_cache`).

    budget_r = total_r x utilization - (total_r - free_r)          per rank (L3 worker)
    kv_budget = min_r budget_r
    slots = min(64, (kv_budget - scratch) // bytes_per_slot)      per partition
    one max-length request plus the scratch pages must fit, or the server fails at startup.

The HBM account predicts `total - free` before KV sizing from the ABI itself: every weight,
device scratch and drafter buffer of the programs the mode compiles (deduplicated by device
buffer), plus the ring-heap arena.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from . import constants as C
from .caches import FamilySizing, size_families
from .errors import CapacityError, ConfigError
from .programs import OUTPUT, SCRATCH, STATE, WEIGHT, bind, programs_for_k
from .ringheap import DEPTHS, resolve_profiles
from .topology import Deployment


def family_sizing(dep: Deployment) -> dict[str, FamilySizing]:
    return size_families(dep.model, dep.limits.max_model_len, dep.limits.max_prefill_tokens_per_request)


def bytes_per_slot(dep: Deployment) -> int:
    """Bytes of one max-length request across the seven families."""
    return sum(f.bytes_per_slot for f in family_sizing(dep).values())


def scratch_bytes(dep: Deployment) -> int:
    """64 kernel padding pages per family, per partition replica."""
    return sum(f.scratch_bytes for f in family_sizing(dep).values())


def admit_slots(dep: Deployment, *, rank_memory: Sequence[tuple[int, int]] | None = None,
                total_kv_pages: int | None = None) -> int:
    """Slots per partition from measured (total, free) bytes per rank, or from a page count."""
    sizing = family_sizing(dep)
    if total_kv_pages is not None:
        slots = total_kv_pages // sizing["ori"].max_blocks_per_seq
        if slots < 1:
            raise CapacityError("total_kv_pages", total_kv_pages,
                                f">= ori.max_blocks_per_seq = {sizing['ori'].max_blocks_per_seq}")
        return slots
    if not rank_memory:
        raise ConfigError("rank_memory", rank_memory, "one (total, free) pair per rank")
    util = dep.limits.npu_memory_utilization
    kv_budget = min(int(total * util) - (total - free) for total, free in rank_memory)
    return slots_from_budget(dep, kv_budget)


def slots_from_budget(dep: Deployment, kv_budget: int) -> int:
    per_slot, scratch = bytes_per_slot(dep), scratch_bytes(dep)
    if kv_budget < scratch + per_slot:
        raise CapacityError(
            "kv_budget", kv_budget,
            f">= scratch {scratch:,} + one max-length request {per_slot:,} bytes: cannot fit one capacity slot "
            f"(lower --max-model-len or the prefill chunk, or raise --npu-memory-utilization)")
    return min(C.DECODE_BATCH, (kv_budget - scratch) // per_slot)


def allocate_with_retry(slots: int, try_allocate: Callable[[int], bool]) -> int:
    """`_alloc_kv_cache_with_retry`: halve the slot count on OOM, down to 1."""
    if slots < 1:
        raise ConfigError("slots", slots, ">= 1")
    while True:
        if try_allocate(slots):
            return slots
        if slots == 1:
            raise CapacityError("slots", 1, "an allocation that fits: OOM even at one slot")
        slots //= 2


def ring_heap_arena(dep: Deployment, env: Mapping[str, str] | None = None, ring_heap: str | None = None) -> int:
    """Resident arena bytes per rank: per scope depth, the largest heap of the programs this mode
    compiles.  Upstream prewarms the prefill arena before KV sizing; whether decode arenas share
    it is not stated, so the twin assumes one arena sized for the largest profile at each depth."""
    profiles = resolve_profiles(env, ring_heap)
    used = {p.ring_heap for p in programs_for_k(dep.k)}
    per_depth = [max(profiles[u].resolved()[d] for u in used) for d in range(DEPTHS)]
    return sum(per_depth)


@dataclass
class HbmAccount:
    """Per-rank HBM account of a deployment at startup admission."""

    deployment: Deployment
    hbm_bytes: int
    blocks_per_request: dict[str, int]
    page_bytes: dict[str, int]
    bytes_per_slot: int
    scratch_bytes: int
    slots_per_partition: int
    kv_budget: int
    breakdown: dict[str, int] = field(default_factory=dict)
    weights_by_buffer: dict[str, int] = field(default_factory=dict)
    error: str | None = None          # why not even one slot fits (slots_per_partition is then 0)

    @property
    def fits(self) -> bool:
        return self.error is None

    @property
    def used_before_kv(self) -> int:
        return sum(v for k, v in self.breakdown.items() if k not in ("kv_pools", "kv_scratch_pages"))

    @property
    def total_used(self) -> int:
        return sum(self.breakdown.values())

    def to_dict(self) -> dict:
        d = self.deployment
        return {
            "preset": d.model.name, "ep": d.topology.ep, "tp": d.topology.tp, "partitions": d.partitions,
            "k": d.k, "max_model_len": d.limits.max_model_len,
            "max_prefill_tokens_per_request": d.limits.max_prefill_tokens_per_request,
            "npu_memory_utilization": d.limits.npu_memory_utilization, "hbm_bytes_per_rank": self.hbm_bytes,
            "blocks_per_request": self.blocks_per_request, "page_bytes": self.page_bytes,
            "bytes_per_slot": self.bytes_per_slot, "scratch_bytes": self.scratch_bytes,
            "kv_budget_bytes": self.kv_budget, "slots_per_partition": self.slots_per_partition,
            "max_live_max_length_requests": self.slots_per_partition * d.partitions,
            "per_rank_bytes": dict(self.breakdown), "per_rank_used_bytes": self.total_used,
            "fits": self.fits, "error": self.error,
        }


def device_buffers(dep: Deployment, slots: int = 1) -> dict[str, dict[str, int]]:
    """Distinct device buffers of the mode's programs, by category, in bytes per rank."""
    cats: dict[str, dict[str, int]] = {"target_weights": {}, "drafter_weights": {}, "device_scratch": {},
                                       "drafter_pools": {}}
    for prog in programs_for_k(dep.k):
        for b in bind(prog, dep, slots):
            a = b.arg
            if a.role == WEIGHT:
                cat = "drafter_weights" if a.buffer_id.startswith("draft_") else "target_weights"
            elif a.role in (SCRATCH, OUTPUT):
                cat = "device_scratch"
            elif a.role == STATE and a.pool in ("drafter", "device_state"):
                cat = "drafter_pools"
            else:
                continue     # KV pools are sized by admission; host slots live in host memory
            cur = cats[cat].get(a.buffer_id, 0)
            cats[cat][a.buffer_id] = max(cur, b.nbytes_per_rank)
    return cats


def hbm_account(dep: Deployment, *, hbm_bytes: int = 64 * C.GIB, env: Mapping[str, str] | None = None,
                ring_heap: str | None = None, strict: bool = False) -> HbmAccount:
    """Predict startup admission on `hbm_bytes` per rank and account every byte.  When not even
    one slot fits, `strict` raises the startup error; otherwise the account carries it."""
    sizing = family_sizing(dep)
    bufs = device_buffers(dep)
    breakdown = {k: sum(v.values()) for k, v in bufs.items()}
    breakdown["ring_heaps"] = ring_heap_arena(dep, env, ring_heap)
    used = sum(breakdown.values())
    kv_budget = int(hbm_bytes * dep.limits.npu_memory_utilization) - used
    error = None
    try:
        slots = slots_from_budget(dep, kv_budget)
    except CapacityError as e:
        if strict:
            raise
        slots, error = 0, str(e)
    breakdown["kv_pools"] = slots * bytes_per_slot(dep)
    breakdown["kv_scratch_pages"] = scratch_bytes(dep)
    return HbmAccount(
        deployment=dep, hbm_bytes=hbm_bytes,
        blocks_per_request={k: f.max_blocks_per_seq for k, f in sizing.items()},
        page_bytes={k: f.family.page_bytes for k, f in sizing.items()},
        bytes_per_slot=bytes_per_slot(dep), scratch_bytes=scratch_bytes(dep), slots_per_partition=slots,
        kv_budget=kv_budget, breakdown=breakdown,
        weights_by_buffer={**bufs["target_weights"], **bufs["drafter_weights"]}, error=error,
    )
