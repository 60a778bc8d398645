"""Ring heaps: the PyPTO runtime's four scope-depth arenas, per dispatch profile.

Profiles are per program (serving-contract.md §8).  Overrides come from the CLI (`--ring-heap`
for prefill) or the environment (decode and drafter profiles) in one grammar: a scalar byte count
broadcast to all four depths, or four comma-separated counts.  A nonzero entry must be a power of
two and at least 1024; 0 leaves that depth unset, so the runtime's compile-time default applies
(simpler tensormap_and_ringbuffer pto_runtime2_types.h: PTO2_HEAP_SIZE, 256 MiB per ring).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from .constants import GIB
from .errors import ConfigError

DEPTHS = 4
MIN_ENTRY = 1024
RUNTIME_DEFAULT_HEAP = 256 * 1024 * 1024     # PTO2_HEAP_SIZE: what an unset (0) entry gets

DEFAULT_PROFILES: dict[str, tuple[int, ...]] = {
    "prefill": (2 * GIB, 2 * GIB, 4 * GIB, 8 * GIB),   # DSPARK_PREFILL_RING_HEAP (pypto-lib#1073)
    "decode": (1 * GIB, 1 * GIB, 1 * GIB, 4 * GIB),    # split target decode (K=0)
    "drafter": (4 * GIB,) * DEPTHS,                     # fused K=7 decode, drafter, bootstrap
    "markov": (1 * GIB,) * DEPTHS,                      # DSPARK_MARKOV_RING_HEAP, no override
}
ENV_VARS = {"decode": "PYPTO_DSPARK_DECODE_RING_HEAP", "drafter": "PYPTO_DSPARK_DRAFTER_RING_HEAP"}
CLI_FLAGS = {"prefill": "--ring-heap"}


def parse_ring_heap(text: str, *, variable: str) -> tuple[int | None, ...]:
    """Parse '4294967296' or 'a,b,c,d'.  Returns four entries; None where 0 keeps the default."""
    raw = str(text).strip()
    parts = [p.strip() for p in raw.split(",")]
    if len(parts) not in (1, DEPTHS) or any(p == "" for p in parts):
        raise ConfigError(variable, raw, f"one byte count (broadcast to all {DEPTHS} depths) or "
                                         f"{DEPTHS} comma-separated byte counts")
    values = []
    for p in parts:
        try:
            v = int(p, 10)
        except ValueError:
            raise ConfigError(variable, raw, f"integer byte counts; {p!r} is not an integer") from None
        if v < 0:
            raise ConfigError(variable, raw, f"non-negative byte counts; {v} is negative")
        if v != 0 and (v < MIN_ENTRY or v & (v - 1)):
            raise ConfigError(variable, raw, f"0 (runtime default) or a power of two >= {MIN_ENTRY}; "
                                             f"{v} is not")
        values.append(v or None)
    if len(values) == 1:
        values = values * DEPTHS
    return tuple(values)


@dataclass(frozen=True)
class RingHeapProfile:
    program_profile: str
    depths: tuple[int | None, ...]       # None: runtime default for that depth
    source: str                          # "default", an env var or a CLI flag

    def resolved(self) -> tuple[int, ...]:
        """Bytes per depth; an unset (0) entry takes the runtime's compile-time default."""
        return tuple(RUNTIME_DEFAULT_HEAP if v is None else v for v in self.depths)

    @property
    def total(self) -> int:
        return sum(self.resolved())


def resolve_profiles(env: Mapping[str, str] | None = None, ring_heap: str | None = None) -> dict[str, RingHeapProfile]:
    """The four profiles after applying the environment and the prefill CLI override."""
    env = env or {}
    out = {k: RingHeapProfile(k, v, "default") for k, v in DEFAULT_PROFILES.items()}
    if ring_heap is not None:
        out["prefill"] = RingHeapProfile("prefill", parse_ring_heap(ring_heap, variable="--ring-heap"), "--ring-heap")
    for prof, var in ENV_VARS.items():
        if var in env and str(env[var]).strip() != "":
            out[prof] = RingHeapProfile(prof, parse_ring_heap(env[var], variable=var), var)
    return out
