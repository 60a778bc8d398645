"""The per-rank HBM account of a deployment at startup admission: the itemized lines (hbm.py), the
`unexplained` line from a measured boot (budget.py), the KV budget, the slots, and what the same
remainder predicts at other settings.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Mapping

from . import constants as C
from .budget import (MEASURED_BOOT, NOMINAL_HBM, SLOTS, Boot, Measurement, Remainder, budget_interval,
                     slots_or_zero, validate_measurement)
from .capacity import admit_slots, allocate_with_retry, bytes_per_slot, family_sizing, kv_budget, scratch_bytes, slots_from_budget
from .errors import CapacityError, ConfigError
from .hbm import AFTER, BEFORE, SOURCES, Line, device_buffers, itemized_lines, used_before_kv
from .topology import Deployment

ACCOUNT, PAGES = "account", "total_kv_pages"
# (max_model_len, chunk) settings the report predicts slots at, besides the deployment's own
PREDICTION_SETTINGS = ((1024, 128), (1024, 8192), (16384, 8192), (1_048_576, 128), (1_048_576, 8192))


@lru_cache(maxsize=1)
def default_remainder() -> Remainder:
    # the boot passes its own --ring-heap and no decode/drafter overrides: env cannot change it
    return MEASURED_BOOT.unexplained()


@dataclass
class HbmAccount:
    """Per-rank HBM account of a deployment at startup admission."""

    deployment: Deployment
    hbm_bytes: int
    lines: list[Line]                     # itemized (before and after KV sizing) and `unexplained`
    remainder: Remainder
    budget_source: str                    # ACCOUNT, PAGES or a measurement kind
    budget_detail: str
    kv_budget: int                        # the point budget (with PAGES: what the account predicts)
    kv_budget_interval: tuple[int | None, int | None]
    slots_per_partition: int
    error: str | None = None              # why not even one slot fits (slots_per_partition is then 0)
    env: Mapping[str, str] | None = None
    ring_heap: str | None = None
    weights_by_buffer: dict[str, int] = field(default_factory=dict)
    requested_slots: int = 0              # before the halving retry (upstream's `requested` in its log line)

    @property
    def fits(self) -> bool:
        return self.error is None

    @property
    def bytes_per_slot(self) -> int:
        return bytes_per_slot(self.deployment)

    @property
    def scratch_bytes(self) -> int:
        return scratch_bytes(self.deployment)

    @property
    def blocks_per_request(self) -> dict[str, int]:
        return {k: f.max_blocks_per_seq for k, f in family_sizing(self.deployment).items()}

    @property
    def page_bytes(self) -> dict[str, int]:
        return {k: f.family.page_bytes for k, f in family_sizing(self.deployment).items()}

    @property
    def used_before_kv(self) -> int:
        return used_before_kv(self.lines)

    @property
    def breakdown(self) -> dict[str, int]:
        """Per-rank bytes once the pools are allocated: the lines resident at KV sizing, then the pools."""
        out = {ln.name: ln.nbytes for ln in self.lines if ln.when == BEFORE}
        out["kv_pools"] = self.slots_per_partition * self.bytes_per_slot
        out["kv_scratch_pages"] = self.scratch_bytes if self.fits else 0
        return out

    @property
    def after_kv_sizing(self) -> dict[str, int]:
        return {ln.name: ln.nbytes for ln in self.lines if ln.when == AFTER}

    @property
    def total_used(self) -> int:
        return sum(self.breakdown.values())

    @property
    def headroom(self) -> int:
        """HBM left once the pools are allocated, for everything allocated after KV sizing."""
        return self.hbm_bytes - self.total_used

    @property
    def after_fits(self) -> bool:
        """Whether the lines allocated after KV sizing fit in that headroom (else a later dispatch OOMs)."""
        return sum(self.after_kv_sizing.values()) <= self.headroom

    def allocates(self, slots: int) -> bool:
        """Whether the pools for `slots` fit in the HBM left physically free at KV sizing (the test a
        device allocation passes or fails; the halving retry acts on it)."""
        return self.used_before_kv + slots * self.bytes_per_slot + self.scratch_bytes <= self.hbm_bytes

    def predictions(self) -> list[dict]:
        """Slots the same remainder predicts at other (max_model_len, chunk) settings."""
        d, out = self.deployment, []
        for mml, chunk in PREDICTION_SETTINGS:
            if (mml, chunk) == (d.limits.max_model_len, d.limits.long_prefill_token_threshold):
                continue
            try:
                other = d.replace(limits=d.limits.replace(max_model_len=mml, long_prefill_token_threshold=chunk))
            except ConfigError:
                continue                   # a setting this preset or topology cannot serve
            out.append({"max_model_len": mml, "chunk": chunk, **_slots_at(other, self.hbm_bytes, self.remainder,
                                                                          self.env, self.ring_heap)})
        return out

    def to_dict(self) -> dict:
        d = self.deployment
        return {
            "preset": d.model.name, "ep": d.topology.ep, "tp": d.topology.tp, "partitions": d.partitions,
            "k": d.k, "max_model_len": d.limits.max_model_len,
            "max_prefill_tokens_per_request": d.limits.max_prefill_tokens_per_request,
            "npu_memory_utilization": d.limits.npu_memory_utilization, "hbm_bytes_per_rank": self.hbm_bytes,
            "blocks_per_request": self.blocks_per_request, "page_bytes": self.page_bytes,
            "bytes_per_slot": self.bytes_per_slot, "scratch_bytes": self.scratch_bytes,
            "budget_source": self.budget_source, "budget_detail": self.budget_detail,
            "kv_budget_bytes": self.kv_budget, "kv_budget_interval_bytes": list(self.kv_budget_interval),
            "unexplained_bytes": self.remainder.point,
            "unexplained_interval_bytes": [self.remainder.lo, self.remainder.hi],
            "requested_slots_per_partition": self.requested_slots, "slots_per_partition": self.slots_per_partition,
            "max_live_max_length_requests": self.slots_per_partition * d.partitions,
            "per_rank_bytes": self.breakdown, "per_rank_used_bytes": self.total_used,
            "per_rank_after_kv_sizing_bytes": self.after_kv_sizing, "headroom_after_kv_bytes": self.headroom,
            "after_kv_sizing_fits": self.after_fits,
            "lines": [{"name": ln.name, "bytes": ln.nbytes, "when": ln.when, "source": ln.source}
                      for ln in self.lines],
            "predictions": self.predictions(),
            "fits": self.fits, "error": self.error,
        }


def _budgets(dep: Deployment, hbm_bytes: int, remainder: Remainder, env, ring_heap) -> tuple[int, int, int | None]:
    """(point, lo, hi) KV budget at `dep`: HBM x utilization - itemized - unexplained."""
    util, itemized = dep.limits.npu_memory_utilization, used_before_kv(itemized_lines(dep, env, ring_heap))
    return (kv_budget(hbm_bytes, itemized + remainder.point, util), kv_budget(hbm_bytes, itemized + remainder.hi, util),
            None if remainder.lo is None else kv_budget(hbm_bytes, itemized + remainder.lo, util))


def _slots_at(dep: Deployment, hbm_bytes: int, remainder: Remainder, env, ring_heap) -> dict:
    point, lo, hi = _budgets(dep, hbm_bytes, remainder, env, ring_heap)
    return {"slots": slots_or_zero(dep, point), "slots_min": slots_or_zero(dep, lo),
            "slots_max": C.DECODE_BATCH if hi is None else slots_or_zero(dep, hi), "kv_budget_bytes": point}


def hbm_account(dep: Deployment, *, hbm_bytes: int = NOMINAL_HBM, env: Mapping[str, str] | None = None,
                ring_heap: str | None = None, measured: Measurement | None = None,
                total_kv_pages: int | None = None, strict: bool = False) -> HbmAccount:
    """Predict startup admission on `hbm_bytes` per rank and account every byte.

    measured: a figure of a boot at `dep` (it fixes the `unexplained` line); otherwise the line
    comes from MEASURED_BOOT.  total_kv_pages: upstream's knob, slots = pages // ori blocks, capped at
    64, no budget check.  The requested slots then go through the halving retry against the HBM left
    physically free (`allocates`).  When not even one slot fits, `strict` raises the startup error;
    otherwise the account carries it."""
    if measured is not None and total_kv_pages is not None:
        raise ConfigError("total_kv_pages", total_kv_pages, "None when a measured figure fixes the budget")
    if measured is not None:
        validate_measurement(measured, hbm_bytes)
        remainder = Boot(dep, measured, hbm_bytes, ring_heap).unexplained(env)
        source, detail = measured.kind, f"{measured.kind}={measured.value:,} at this deployment ({measured.source})"
    else:
        remainder = default_remainder()
        b = MEASURED_BOOT
        source = PAGES if total_kv_pages is not None else ACCOUNT
        detail = (f"itemized lines + unexplained from the measured boot ({b.measurement.kind}="
                  f"{b.measurement.value} at max_model_len {b.deployment.limits.max_model_len}, chunk "
                  f"{b.deployment.limits.long_prefill_token_threshold}, K={b.deployment.k}, "
                  f"EP{b.deployment.topology.ep}; {b.measurement.source})")
        if total_kv_pages is not None:
            detail = f"total_kv_pages={total_kv_pages:,} // ori blocks per request, capped at 64 (budget unused)"
    lines = itemized_lines(dep, env, ring_heap)
    lines.insert(next(i for i, ln in enumerate(lines) if ln.when == AFTER),
                 Line("unexplained", remainder.point, BEFORE, SOURCES["unexplained"]))
    point, lo, hi = _budgets(dep, hbm_bytes, remainder, env, ring_heap)
    interval: tuple[int | None, int | None] = (lo, hi)
    error = None
    try:
        if total_kv_pages is not None:
            slots = admit_slots(dep, total_kv_pages=total_kv_pages)
        elif measured is not None and measured.kind == SLOTS:
            slots, interval = measured.value, budget_interval(dep, measured.value)
        else:
            slots = slots_from_budget(dep, point)
    except CapacityError as e:
        if strict or total_kv_pages is not None:
            raise
        slots, error = 0, str(e)
    bufs = device_buffers(dep)
    acct = HbmAccount(dep, hbm_bytes, lines, remainder, source, detail, point, interval, slots, error, env,
                      ring_heap, {**bufs["target_weights"], **bufs["drafter_weights"]}, requested_slots=slots)
    if slots and not (measured is not None and measured.kind == SLOTS):     # a measured count was allocated
        try:
            acct.slots_per_partition = allocate_with_retry(slots, acct.allocates)
        except CapacityError as e:
            if strict:
                raise
            acct.slots_per_partition, acct.error = 0, str(e)
    return acct
