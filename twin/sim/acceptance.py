"""Speculative acceptance models: how many of a verify window's 8 rows a step commits (1..8).

DSpark acceptance is a linear chain (serving-contract §7.5): the step commits the committed
token's successor plus the longest matching prefix of the 7 drafts.  Three ways to decide it:

- `ConditionalAcceptance`: per-position conditional probabilities a_i = P(draft i accepted |
  drafts < i accepted), the shape vLLM's accepted-per-position counters measure;
- `ForcedAcceptance`: a fixed length, like SGLang's SIMULATE_ACC_LEN, so a device run and a
  simulation can follow the same lengths;
- `ExecutorTokens`: the executor returns real accepted tokens (golden, device); no sampling.

A window that does not fit under the position ceiling falls back to one token (§7.5).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from twin.abi import constants as C
from twin.abi.errors import ConfigError

K = C.DSPARK_QUERY_WIDTH

# Prior: decaying conditional acceptance with ~3.4 of 7 drafts accepted per verify, between the
# community DSpark port (3.20) and NVIDIA's reported 3.75 (anchors.md A.4).  Calibrate it from a
# run's per-position counters.
DEFAULT_RATES = (0.90, 0.85, 0.80, 0.75, 0.70, 0.65, 0.60)


class AcceptanceModel:
    """Counts for one decode step: `counts(n, fits, rng)` -> int array in [1, 8] (1 where the
    window does not fit)."""

    def counts(self, n: int, fits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError

    def expected_length(self) -> float:
        raise NotImplementedError

    def to_dict(self) -> dict:
        raise NotImplementedError


@dataclass(frozen=True)
class ConditionalAcceptance(AcceptanceModel):
    rates: tuple[float, ...] = DEFAULT_RATES

    def __post_init__(self):
        if len(self.rates) != K:
            raise ConfigError("acceptance rates", list(self.rates), f"{K} per-position conditional probabilities")
        if not all(0.0 <= r <= 1.0 for r in self.rates):
            raise ConfigError("acceptance rates", list(self.rates), "each in [0, 1]")

    def counts(self, n, fits, rng):
        ok = rng.random((n, K)) < np.asarray(self.rates)
        run = np.cumprod(ok, axis=1).sum(axis=1)
        return np.where(fits, 1 + run, 1).astype(np.int64)

    def expected_length(self) -> float:
        return 1.0 + float(np.cumprod(self.rates).sum())

    def to_dict(self):
        return {"kind": "conditional", "rates": list(self.rates), "expected_length": self.expected_length()}


@dataclass(frozen=True)
class ForcedAcceptance(AcceptanceModel):
    length: int

    def __post_init__(self):
        if not 1 <= self.length <= K + 1:
            raise ConfigError("forced acceptance length", self.length, f"1..{K + 1}")

    def counts(self, n, fits, rng):
        return np.where(fits, self.length, 1).astype(np.int64)

    def expected_length(self) -> float:
        return float(self.length)

    def to_dict(self):
        return {"kind": "forced", "length": self.length}


@dataclass(frozen=True)
class ExecutorTokens(AcceptanceModel):
    """Marker: the executor supplies accepted tokens itself (golden or device executors)."""

    def counts(self, n, fits, rng):
        raise ConfigError("acceptance", "executor", "an executor that returns accepted tokens (not the cost model)")

    def expected_length(self) -> float:
        return float("nan")

    def to_dict(self):
        return {"kind": "executor"}


def parse_acceptance(spec: str | None) -> AcceptanceModel:
    """'default', 'forced:4', 'rates:0.9,0.8,...' (7 values), or 'executor'."""
    if spec in (None, "", "default"):
        return ConditionalAcceptance()
    kind, _, arg = spec.partition(":")
    try:
        value = int(arg) if kind == "forced" else tuple(float(x) for x in arg.split(",")) if kind == "rates" else None
    except ValueError:
        raise ConfigError("acceptance", spec, "forced:<1..8> or rates:<7 comma-separated floats>") from None
    if kind == "forced":
        return ForcedAcceptance(value)
    if kind == "rates":
        return ConditionalAcceptance(value)
    if kind == "executor":
        return ExecutorTokens()
    raise ConfigError("acceptance", spec, "'default', 'forced:<n>', 'rates:<a1,...,a7>' or 'executor'")
