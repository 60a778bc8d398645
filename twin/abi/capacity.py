"""Startup admission (upstream `init_kv_cache`): the formulas, whatever the budget's source.

    budget_r = total_r x utilization - (total_r - free_r)          per rank (L3 worker)
    kv_budget = min_r budget_r
    slots = min(64, (kv_budget - scratch) // bytes_per_slot)      per partition
    one max-length request plus the scratch pages must fit, or the server fails at startup.
    with --total-kv-pages instead: slots = min(64, pages // ori blocks per request), no budget.
    allocation failure halves the slots and retries, down to one.

The per-rank HBM account that predicts `total - free` is in hbm.py and account.py.
"""
from __future__ import annotations

from typing import Callable, Sequence

from . import constants as C
from .caches import FamilySizing, size_families
from .errors import CapacityError, ConfigError
from .topology import Deployment


def family_sizing(dep: Deployment) -> dict[str, FamilySizing]:
    return size_families(dep.model, dep.limits.max_model_len, dep.limits.max_prefill_tokens_per_request)


def bytes_per_slot(dep: Deployment) -> int:
    """Bytes of one max-length request across the seven families."""
    return sum(f.bytes_per_slot for f in family_sizing(dep).values())


def scratch_bytes(dep: Deployment) -> int:
    """64 kernel padding pages per family, per partition replica."""
    return sum(f.scratch_bytes for f in family_sizing(dep).values())


def kv_budget(total: int, used: int, utilization: float) -> int:
    """One rank's KV budget: total x utilization - what is in use before KV sizing."""
    return int(total * utilization) - used


def admit_slots(dep: Deployment, *, rank_memory: Sequence[tuple[int, int]] | None = None,
                total_kv_pages: int | None = None) -> int:
    """Slots per partition from measured (total, free) bytes per rank, or from a page count."""
    sizing = family_sizing(dep)
    if total_kv_pages is not None:
        ori = sizing["ori"].max_blocks_per_seq
        if isinstance(total_kv_pages, bool) or not isinstance(total_kv_pages, int) or total_kv_pages < ori:
            raise CapacityError("total_kv_pages", total_kv_pages,
                                f"an integer >= ori blocks per request = {ori} (one maximum ring)")
        return min(C.DECODE_BATCH, total_kv_pages // ori)
    if not rank_memory:
        raise ConfigError("rank_memory", rank_memory, "one (total, free) pair per rank")
    util = dep.limits.npu_memory_utilization
    return slots_from_budget(dep, min(kv_budget(total, total - free, util) for total, free in rank_memory))


def slots_from_budget(dep: Deployment, kv_budget: int) -> int:
    per_slot, scratch = bytes_per_slot(dep), scratch_bytes(dep)
    if kv_budget < scratch + per_slot:
        raise CapacityError(
            "kv_budget", kv_budget,
            f">= scratch {scratch:,} + one max-length request {per_slot:,} bytes: cannot fit one capacity slot "
            f"(lower --max-model-len or the prefill chunk, shrink the prefill --ring-heap, or raise "
            f"--npu-memory-utilization)")
    return min(C.DECODE_BATCH, (kv_budget - scratch) // per_slot)


def allocate_with_retry(slots: int, try_allocate: Callable[[int], bool]) -> int:
    """`_alloc_kv_cache_with_retry`: allocate every family atomically; on OOM free everything,
    halve the slot count and retry, down to 1; failing at one slot fails the startup."""
    if slots < 1:
        raise ConfigError("slots", slots, ">= 1")
    while True:
        if try_allocate(slots):
            return slots
        if slots == 1:
            raise CapacityError("slots", 1, "an allocation that fits: KV cache allocation failed at the "
                                                 "one-slot minimum")
        slots //= 2
