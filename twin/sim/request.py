"""A serving request and its scheduler-visible state (upstream `Request`, scheduler.py).

Config (prompt, sampling parameters) and run state (outputs, computed tokens, placeholders,
partition, flags) live on one object because the scheduler mutates the run state in place, as
upstream does; timestamps are written by the engine's probes, never read by scheduling logic.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Finish(str, enum.Enum):
    EOS = "eos"
    LENGTH = "length"
    STOP = "stop"
    ABORTED = "aborted"
    ERROR = "error"            # a worker error aborted the batch (serving-contract §4.11)
    REJECTED = "rejected"      # refused at admission (prompt too long, nothing left to generate)


@dataclass(frozen=True)
class Sampling:
    """Greedy sampling parameters (DSpark serving has no temperature ABI)."""

    max_new_tokens: int
    eos_token_id: int | None = None
    ignore_eos: bool = False
    stop: tuple[tuple[int, ...], ...] = ()      # stop strings, as token sequences (no tokenizer here)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: np.ndarray                  # int32 token ids
    sampling: Sampling
    arrival: float = 0.0
    # the cost model writes synthetic outputs; `script` plants chosen tokens at output indices
    # (e.g. an EOS or a stop sequence) so a workload can drive every finish path
    script: dict[int, int] = field(default_factory=dict)
    tag: str = ""                       # shared-prefix group or trace label

    # ---- run state -------------------------------------------------------------------------
    status: Status = Status.WAITING
    outputs: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_placeholders: int = 0
    partition: int | None = None
    terminal_prefill_in_flight: bool = False
    incarnation: int = 0                # bumped by preemption: stale results are discarded
    finish: Finish | None = None
    finish_detail: str = ""
    max_new_tokens: int = 0             # capped at admission to max_seq_len - prompt_len
    lease: int | None = None
    generation: int | None = None
    hashes: dict | None = None          # per page size: chained prompt page hashes
    cached_tokens: int = 0              # prefix hit of the current incarnation
    num_preemptions: int = 0
    dropped_tokens: int = 0             # accepted by the device but truncated by a finish
    discarded_tokens: int = 0           # in a result that arrived after the finish or a preemption
    preempted_in_pass: int = -1

    def __post_init__(self):
        self.prompt = np.asarray(self.prompt, dtype=np.int32)
        self.prompt_len = int(self.prompt.shape[0])
        if not self.max_new_tokens:
            self.max_new_tokens = self.sampling.max_new_tokens

    @property
    def capped(self) -> bool:
        """Admission lowered max_new_tokens to the context left under max_seq_len."""
        return self.max_new_tokens < self.sampling.max_new_tokens

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.outputs) + self.num_placeholders

    @property
    def num_new_tokens_needed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_prefill(self) -> bool:
        return self.num_computed < self.prompt_len

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, prompt={self.prompt_len}, out={len(self.outputs)}/"
                f"{self.max_new_tokens}, computed={self.num_computed}, ph={self.num_placeholders}, "
                f"{self.status.value}{'/' + self.finish.value if self.finish else ''})")
