"""Where the KV budget comes from: a measured boot, turned into the `unexplained` line of the HBM
account and carried to every other setting.

A measurement is one figure of a real boot at the deployment it booted: the per-rank free or used
HBM in bytes when `init_kv_cache` read it (the minimum free / maximum used over ranks), or the slots
per partition it admitted.  Bytes fix the used-before-KV figure exactly; a slot count fixes it to an
interval (between that many slots' worth of budget and one more).  Either way

    unexplained = used_before_kv(measured) - itemized(measured deployment)

and at any other max-model-len, chunk, K or EP the account adds `unexplained` to that setting's
itemized lines: bytes per slot are exact, only the budget is measured.  With no measurement the
account uses `MEASURED_BOOT`, the one boot recorded in the upstream sources.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from . import constants as C
from .capacity import bytes_per_slot, kv_budget, scratch_bytes, slots_from_budget
from .errors import CapacityError, ConfigError
from .hbm import itemized_lines, used_before_kv
from .topology import Deployment, deployment

FREE, USED, SLOTS = "measured_free_bytes", "measured_used_bytes", "measured_slots"
KINDS = (FREE, USED, SLOTS)
NOMINAL_HBM = 64 * C.GIB            # Ascend 910B / A3 die; what the runtime reports as total is not known


@dataclass(frozen=True)
class Measurement:
    """One figure of a real boot (kind in KINDS), at the deployment it booted."""

    kind: str
    value: int
    source: str = "command line"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError("kind", self.kind, f"one of {KINDS}")

    def used_interval(self, dep: Deployment, hbm_bytes: int) -> tuple[int | None, int]:
        """[lo, hi] of the per-rank bytes in use before KV sizing; lo None when unbounded (64 slots
        is the cap, so any larger budget admits it too)."""
        if self.kind == FREE:
            return hbm_bytes - self.value, hbm_bytes - self.value
        if self.kind == USED:
            return self.value, self.value
        cap = kv_budget(hbm_bytes, 0, dep.limits.npu_memory_utilization)
        per, scratch = bytes_per_slot(dep), scratch_bytes(dep)
        hi = cap - (scratch + self.value * per)
        lo = None if self.value == C.DECODE_BATCH else cap - (scratch + (self.value + 1) * per) + 1
        return lo, hi


@dataclass(frozen=True)
class Boot:
    """A measured boot: its deployment, HBM per rank, prefill ring heap and the measured figure."""

    deployment: Deployment
    measurement: Measurement
    hbm_bytes: int = NOMINAL_HBM
    ring_heap: str | None = None

    def unexplained(self, env: Mapping[str, str] | None = None) -> "Remainder":
        itemized = used_before_kv(itemized_lines(self.deployment, env, self.ring_heap))
        lo, hi = self.measurement.used_interval(self.deployment, self.hbm_bytes)
        return Remainder(None if lo is None else lo - itemized, hi - itemized, self)


@dataclass(frozen=True)
class Remainder:
    """The unexplained per-rank bytes a boot implies: an interval [lo, hi], lo None if unbounded."""

    lo: int | None
    hi: int
    boot: Boot

    @property
    def point(self) -> int:
        """The account's value: the interval's midpoint; when the lower end is open (a boot at the
        64-slot cap), 0 if the interval allows it (the itemized lines may explain everything), else
        its upper end."""
        if self.lo is None:
            return min(self.hi, 0)
        return (self.lo + self.hi) // 2


# The one measured boot in the upstream sources (serving-contract §9.4): the accuracy test's K=7
# server command on EP16 / TP4 / DP4, prefill ring heap 2, 2, 4, 8 GiB, default utilization 0.9.
MEASURED_BOOT = Boot(
    deployment("flash", ep=16, max_model_len=1024, long_prefill_token_threshold=128, max_num_seqs=8,
               max_num_batched_tokens=8192, num_speculative_tokens=7, enable_prefix_caching=False),
    Measurement(SLOTS, 37, "pypto-serving tests/test_deepseek_dspark_accuracy.py: \"the K=7 boot measured 37 KV "
                           "slots of headroom on a clean device\""),
    ring_heap="2147483648,2147483648,4294967296,8589934592",
)


def slots_or_zero(dep: Deployment, budget: int) -> int:
    try:
        return slots_from_budget(dep, budget)
    except CapacityError:
        return 0


def budget_interval(dep: Deployment, slots: int) -> tuple[int, int | None]:
    """The KV budgets that admit exactly `slots` per partition: [lo, hi], hi None at the 64 cap."""
    if not 1 <= slots <= C.DECODE_BATCH:
        raise ConfigError("slots", slots, f"1..{C.DECODE_BATCH} slots per partition")
    per, scratch = bytes_per_slot(dep), scratch_bytes(dep)
    lo = scratch + slots * per
    return lo, None if slots == C.DECODE_BATCH else lo + per - 1


def validate_measurement(m: Measurement, hbm_bytes: int) -> None:
    """A measured figure must be one a boot at `dep` can report."""
    if m.kind == SLOTS:
        if not 1 <= m.value <= C.DECODE_BATCH:
            raise ConfigError(m.kind, m.value, f"an integer 1..{C.DECODE_BATCH} (slots per partition a boot "
                                             "admitted)")
        return
    if not 0 < m.value < hbm_bytes:
        raise ConfigError(m.kind, m.value, f"an integer byte count 1..{hbm_bytes - 1:,} (a part of the per-rank "
                                         f"HBM, {hbm_bytes:,} bytes: --hbm-gib)")
