"""The decision log: every scheduling decision of a run, as plain records (off by default).

One record per `schedule()` that sent a command and one per applied result, in the order they
happened:

- ``{"kind": "schedule", "step", "items", "hits", "preempted", "finished", "leases", "waves",
  "taken", "freed"}``: the scheduled items ``[request, "P"|"D", start, new tokens, partition,
  rows]`` (rows: KV positions reserved, new tokens plus the speculative ones) in scheduled order,
  the admissions ``[request, hit tokens, partition, cold fallback]``, the preemptions ``[victim,
  by]``, the finished ids the command carries, the leases ``[request, lease, generation]`` taken
  in dispatch order, the seeding waves per dispatch, and the page ids taken from and returned to
  each free queue (``"family/partition": [ids]``) while scheduling;
- ``{"kind": "apply", "step", "finished", "discarded", "taken", "freed"}``: the requests that
  finished and the stale results discarded when that step's result was applied (stop strings
  included), and the pages moved meanwhile;
- ``{"kind": "error", "step", "steps", "error", "finished", "taken", "freed"}``: a worker error
  aborted the batch of `step` and the in-flight ones (`steps`), ending `finished`;
- ``{"kind": "stall" | "abort", "step", "finished", "taken", "freed"}``: the engine ended a stall,
  or a client aborted a request, after command `step`.

Every page move happens inside a record, so replaying every record's `taken` and `freed` gives
each free queue's used pages at every record's end.  Integers and strings only, so two runs
compare with ``==``.
"""
from __future__ import annotations

import json
from pathlib import Path

from .kvcache import PageLog


class DecisionLog:
    def __init__(self, scheduler):
        self.sched = scheduler
        self.kv = scheduler.kv
        self.pages = self.kv.log = PageLog(self.kv.twins)
        scheduler.log = self
        self.records: list[dict] = []
        self._open: dict | None = None
        self._pending: dict = {"hits": [], "preempted": []}

    def _close(self) -> None:
        if self._open is not None:
            self._open.update(self.pages.cut(self.kv.names))
            self.records.append(self._open)
            self._open = None

    # ---- scheduler hooks -------------------------------------------------------------------
    def begin_schedule(self) -> None:
        self._close()                  # a pass that sends nothing leaves its decisions to the next

    def admitted(self, req, hit: int, fallback: bool) -> None:
        self._pending["hits"].append([req.request_id, hit, req.partition, fallback])

    def preempted(self, victim, by) -> None:
        self._pending["preempted"].append([victim.request_id, by.request_id])

    def command(self, cmd, leases, waves) -> None:
        if not cmd.scheduled:                        # nothing sent: its moves go with the next record
            return
        rec = {"kind": "schedule", "step": cmd.step_id,
               "items": [[s.req.request_id, "P" if s.prefill else "D", s.start, s.num_new, s.req.partition,
                          s.num_new + s.spec] for s in cmd.scheduled],
               **self._pending, "finished": list(cmd.finished_ids),
               "leases": [list(x) for x in leases], "waves": [[it.request_id for it in w] for w in waves]}
        self._pending = {"hits": [], "preempted": []}
        self._open = rec
        self._close()

    def begin_apply(self, step: int) -> None:
        self._close()
        self._open = {"kind": "apply", "step": step, "finished": [], "discarded": []}

    def begin_event(self, kind: str, step: int, **detail) -> None:
        """A record for what happens outside schedule and apply (a worker error, a stall, an abort)."""
        self._close()
        self._open = {"kind": kind, "step": step, **detail, "finished": []}

    def finished(self, req) -> None:
        if self._open is not None and self._open["kind"] != "schedule":
            self._open["finished"].append(req.request_id)

    def discarded(self, req) -> None:
        if self._open is not None:
            self._open["discarded"].append(req.request_id)

    # ---- output ------------------------------------------------------------------------------
    def done(self) -> list[dict]:
        self._close()
        return self.records

    def write(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for r in self.done():
                f.write(json.dumps(r) + "\n")
