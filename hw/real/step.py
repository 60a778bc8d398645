"""One checked dispatch, as the lockstep and its records hold it: the dispatch with the requests it
serves, and what the device side produced for it."""
from __future__ import annotations

from dataclasses import dataclass, field

from twin.abi.batches import Dispatch

# the taps that are decisions (expert routes, the indexer's top-k): recorded on every dispatch, since
# the golden re-syncs from them
DECISION_STAGES = ("moe_indices", "idx_topk")


@dataclass
class DeviceStep:
    """What the device side produced for one dispatch: outputs, the taps of its last target forward,
    the sampled tokens of each target forward and the drafter's routes (what the golden re-syncs from)."""

    outputs: dict
    taps: dict
    sampled: list
    draft_routes: list
    site: dict = field(default_factory=dict)        # sampled mode: what a site check reads (hw.real.site_check)


@dataclass
class RealDispatch:
    index: int
    kind: str                          # prefill | seed | decode
    dispatch: Dispatch
    rows: list                         # block-table rows of its requests, in the order the sides run them
    items: list = field(default_factory=list)


@dataclass
class DeviceResult:
    """A device backend's result for one dispatch (the fields of twin.abi.batches.DispatchResult),
    with the decisions the checker re-syncs golden from."""

    outputs: dict
    state: dict
    taps: dict = field(default_factory=dict)
    sampled: list = field(default_factory=list)        # each target forward's sampled tokens
    draft_routes: list = field(default_factory=list)   # each drafter MoE call's experts
    seqs: list = field(default_factory=list)           # the requests in the dispatch's row order
