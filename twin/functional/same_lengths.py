"""The cost-model executor forced to a golden run's accepted lengths, request by request and step
by step, so the two runs can be compared decision for decision.

`ReplayExecutor(cost, accepted)` times and fills tokens exactly as `CostModelExecutor` does; only
the acceptance model is replaced by the recorded counts (`Recording.accepted`: step id ->
{request id: count}).  A decode request the golden run did not verify at that step means the
schedules already differ: it gets 1 token and is listed in `missing`.
"""
from __future__ import annotations

import numpy as np

from twin.sim.acceptance import AcceptanceModel
from twin.sim.executor import CostModelExecutor


class StepCounts(AcceptanceModel):
    """The counts of the step being executed, in decode order (set by `ReplayExecutor`)."""

    def __init__(self):
        self.pending: list[int] = []

    def counts(self, n, fits, rng):
        return np.asarray(self.pending[:n], np.int64)

    def expected_length(self) -> float:
        return float("nan")

    def to_dict(self):
        return {"kind": "replayed"}


class ReplayExecutor:
    def __init__(self, cost, accepted: dict, **kw):
        self.model = StepCounts()
        self.inner = CostModelExecutor(cost, self.model, **kw)
        self.accepted = accepted
        self.missing: list[tuple[int, str]] = []

    def execute(self, plan):
        if plan.decode is not None:
            want = self.accepted.get(plan.step_id, {})
            counts = []
            for grp in plan.decode_groups:
                for it in grp:
                    c = want.get(it.request_id)
                    if c is None:
                        self.missing.append((plan.step_id, it.request_id))
                    counts.append(c or 1)
            self.model.pending = counts
        return self.inner.execute(plan)
