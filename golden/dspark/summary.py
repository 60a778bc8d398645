"""Speculation counters, as upstream's `dspark_speculation_summary()` reports them (§7.5).

Counted per verify step before any scheduler truncation: a fallback step (no drafts pending or the
window does not fit) is a verify step that proposes 0 drafts.  Per draft position j (1..7) the
acceptance is the fraction of steps that proposed drafts in which draft j was accepted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from twin.abi import constants as C

K = C.DSPARK_QUERY_WIDTH


@dataclass
class SpeculationCounters:
    requests: set = field(default_factory=set)
    verify_steps: int = 0
    proposed_drafts: int = 0
    matched_drafts: int = 0
    accepted_tokens: int = 0
    fallback_steps: int = 0
    speculative_steps: int = 0
    accepted_at: np.ndarray = field(default_factory=lambda: np.zeros(K, np.int64))
    per_request: dict = field(default_factory=dict)

    def record(self, request_ids, acc) -> None:
        """acc: an `Accepted` (golden.dspark.state) for the requests in `request_ids` order."""
        for i, rid in enumerate(request_ids):
            c, m, p = int(acc.counts[i]), int(acc.matched[i]), int(acc.proposed[i])
            self.requests.add(rid)
            self.verify_steps += 1
            self.proposed_drafts += p
            self.matched_drafts += m
            self.accepted_tokens += c
            if p == 0:
                self.fallback_steps += 1
            else:
                self.speculative_steps += 1
                self.accepted_at[:m] += 1
            r = self.per_request.setdefault(rid, dict(verify_steps=0, proposed=0, matched=0, accepted=0,
                                                      fallback_steps=0))
            r["verify_steps"] += 1
            r["proposed"] += p
            r["matched"] += m
            r["accepted"] += c
            r["fallback_steps"] += int(p == 0)

    def summary(self) -> dict:
        steps = max(self.verify_steps, 1)
        spec = max(self.speculative_steps, 1)
        return {
            "requests": len(self.requests),
            "verify_steps": self.verify_steps,
            "proposed_drafts": self.proposed_drafts,
            "matched_drafts": self.matched_drafts,
            "accepted_tokens": self.accepted_tokens,
            "fallback_steps": self.fallback_steps,
            "mean_accepted_length": self.accepted_tokens / steps,
            "acceptance_per_position": [float(a) / spec for a in self.accepted_at],
        }

    def progress_line(self) -> str:
        s = self.summary()
        return (f"DSpark speculation progress: requests={s['requests']} verifies={s['verify_steps']} "
                f"matched={s['matched_drafts']} proposed={s['proposed_drafts']} accepted={s['accepted_tokens']} "
                f"mean_len={s['mean_accepted_length']:.3f} fallbacks={s['fallback_steps']}")
