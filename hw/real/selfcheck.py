"""The self-check device: golden's own compositions with every GEMM on torch, as a backend.

This is not an independent implementation: it runs golden's code (`golden.dispatch.run_dispatch`)
with `TorchNumerics` (FP32 accumulation in torch's tile order, on cpu, cuda or npu) in place of
golden's float64 sums.  It checks the lockstep machinery itself (tolerances, re-syncs, the
localizer, records, faults) against real accumulation noise; it cannot catch a golden bug, which
is what an independent device (`TorchBackend`, `PyptoBackend`) is for.  Its name says so.

Protocol (hw.backend): `run(dispatch, state) -> DeviceResult` with `outputs` (by output name),
`state` (the touched arrays, new values, by `hw.real.records.side_state` name) and `taps`
((layer, stage) -> array of the dispatch's last target forward).  The dispatch's meta carries the
scheduler's `kind` and `items` (what golden's bookkeeping reads).  Beyond the protocol it follows
the request lifecycle (`admit`, `drop`), because golden's bookkeeping lives per request, and it is
where device faults (`hw.real.faults`) are injected: only the device breaks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from golden.dispatch import run_dispatch

from .side import install_state, side_state
from .step import DeviceResult


@dataclass
class Staged:
    """A dispatch as the device sees it: index, kind, the lowered dispatch, the scheduler's items and
    the block-table rows of its requests in the order the sides run them (faults address them)."""

    index: int
    kind: str
    dispatch: object
    items: list
    rows: list = field(default_factory=list)


class SelfCheckBackend:
    def __init__(self, side, device: str, fault=None):
        self.side, self.device, self.fault = side, device, fault
        self.name = f"selfcheck:golden+torch-gemm:{device}"
        if fault is not None:
            fault.attach(side)

    def admit(self, rid, prompt, max_new_tokens) -> None:
        self.side.served.admit(rid, prompt, max_new_tokens)

    def drop(self, rid) -> None:
        self.side.served.drop(rid)

    def run(self, dispatch, state: Mapping[str, np.ndarray]) -> DeviceResult:
        side, f = self.side, self.fault
        before = side_state(side)
        if any(state[k] is not v for k, v in before.items()):
            install_state(side, dict(state))
            before = side_state(side)
        meta = dispatch.meta
        staged = Staged(meta["index"], meta["kind"], dispatch, list(meta["items"]))
        if f is not None:
            f.arm(staged.index)
        side.par.reset()
        ran = run_dispatch(side.served, staged.kind, dispatch, staged.items)
        staged.rows = [s.index for s in ran.seqs]
        out = ran.outputs
        if f is not None:
            out = f.after(side, staged, out, ran.accepted)
        calls = list(side.par.calls)
        after = side_state(side)
        return DeviceResult(dict(out), {k: v for k, v in after.items() if before.get(k) is not v},
                               calls[-1][1] if calls else {}, [c[2] for c in calls], list(side.par.draft_routes),
                               list(ran.seqs))
