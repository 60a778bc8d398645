"""The fleet fidelity's step command (arrays over its scheduled rows) and the integer codes its
request arrays hold for status and finish reason (`FleetSim.write_back` turns them into enums)."""
from __future__ import annotations

from twin.abi.batches import Finish

WAITING, RUNNING, FINISHED = 1, 2, 3
FINISH_CODES = (None, Finish.EOS, Finish.LENGTH, Finish.STOP, Finish.ABORTED, Finish.ERROR, Finish.REJECTED)
EOS, LENGTH, STOP, ABORTED, ERROR, REJECTED = range(1, 7)
NEVER = 1 << 40


class Command:
    """One step command as arrays over its scheduled rows (request index order = dispatch order)."""

    __slots__ = ("step_id", "idx", "num_new", "spec", "start", "prefill", "samples", "ver", "counts",
                 "dispatches", "error", "t_result", "n_prefill",
                 "accepted", "tokens")

    def __init__(self, step_id, idx, num_new, spec, start, prefill, samples, ver):
        self.step_id, self.idx, self.num_new, self.spec, self.start = step_id, idx, num_new, spec, start
        self.prefill, self.samples, self.ver = prefill, samples, ver      # ver: the stale-result check
        self.counts = None
        self.dispatches: list = []
        self.error: str | None = None
        self.t_result = 0.0
        self.n_prefill = 0
        self.accepted = None            # (counts, drafted) of the decode rows, for the recorder
        self.tokens = 0                 # scheduled tokens (num_new + spec over the rows)
