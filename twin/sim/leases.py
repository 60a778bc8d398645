"""Drafter leases (K=7): 64 group-local slots per TP group, in upstream's free-list order.

Each group's free list starts as [0..63]; a reservation pops the last entry (so the first
request of a group gets 63) and a release appends.  Every reservation bumps that lease's
generation, which the device state carries so stale rows are never taken for a live request
(serving-contract.md §7.1).  Releasing is idempotent, as `release_finished_requests` is.
"""
from __future__ import annotations

from twin.abi import constants as C


class LeasesExhausted(RuntimeError):
    def __init__(self, group: int):
        self.group = group
        super().__init__(f"drafter leases exhausted for TP group {group}")


class LeaseManager:
    def __init__(self, groups: int, per_group: int = C.DRAFTER_LEASES_PER_GROUP):
        self.per_group = per_group
        self.free = [list(range(per_group)) for _ in range(groups)]
        self.generation = [[0] * per_group for _ in range(groups)]
        self.held: dict[str, tuple[int, int]] = {}

    def reserve(self, rid: str, group: int) -> tuple[int, int]:
        """(lease, generation) for `rid` in `group`; an existing lease is returned unchanged."""
        if rid in self.held:
            g, lease = self.held[rid]
            if g != group:
                raise ValueError(f"request {rid!r} holds lease {lease} in group {g}, not {group}")
            return lease, self.generation[g][lease]
        fl = self.free[group]
        if not fl:
            raise LeasesExhausted(group)
        lease = fl.pop()
        self.generation[group][lease] += 1
        self.held[rid] = (group, lease)
        return lease, self.generation[group][lease]

    def release(self, rid: str) -> None:
        gl = self.held.pop(rid, None)
        if gl is not None:
            self.free[gl[0]].append(gl[1])

    def live(self, group: int) -> int:
        return self.per_group - len(self.free[group])

    def check(self) -> None:
        for g, fl in enumerate(self.free):
            held = [l for (gg, l) in self.held.values() if gg == g]
            assert len(set(fl)) == len(fl) and not set(fl) & set(held), f"group {g}: lease both free and held"
            assert len(fl) + len(held) == self.per_group, f"group {g}: leases leaked"
