"""The types every mode shares: requests, what the scheduler hands to lowering, what lowering hands
to an executor, and what comes back.

A `Request` is a serving request with its scheduler-visible run state (upstream `Request`,
scheduler.py).  Batches are the scheduler's view (requests, chunks, anchors, block ids by family,
partitions); a `Dispatch` is one program's arguments ready for a device.  Both are plain frozen
data, so every executor (cost model, golden, device, lockstep) receives exactly the same thing.
A backend answers one dispatch with a `DispatchResult`; an executor answers one scheduler step
(its dispatches) with a `StepResult`.  Living here, in the package everything may import, these
types let the simulator, golden and hw share them without importing each other (docs/architecture.md, "Import rules").
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PLACEHOLDER_TOKEN = -1      # async decode: last token not yet known at schedule time

BlockIds = Mapping[str, tuple[int, ...]]   # family name -> local block ids in table-slot order


class BlockTables(Mapping):
    """A `BlockIds` over one snapshot's tables as the page manager holds them (one tuple per
    family, in `index` order): a read-only view, so a step's items share the tables uncopied."""

    __slots__ = ("_index", "_tables")

    def __init__(self, index: dict[str, int], tables: tuple[tuple[int, ...], ...]):
        self._index, self._tables = index, tables

    def __getitem__(self, family: str) -> tuple[int, ...]:
        return self._tables[self._index[family]]

    def __iter__(self):
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __repr__(self) -> str:
        return repr(dict(self))


# The items are frozen; their __init__ writes the fields through the instance dict in one call
# (a scheduler builds one per running request per step, and a frozen dataclass's generated
# __init__ pays one object.__setattr__ per field).  The field list is the dataclass's, checked
# against these signatures by tests/abi/test_batches.py.
@dataclass(frozen=True, init=False)
class PrefillItem:
    """One request's chunk in a packed prefill (`PrefillRequest`)."""

    request_id: str
    chunk_tokens: tuple[int, ...]
    num_computed: int                 # absolute start position of the chunk
    prompt_len: int
    block_ids: BlockIds
    partition: int
    lease: int | None = None          # K=7: the drafter lease reserved at the first chunk
    generation: int | None = None

    def __init__(self, request_id: str, chunk_tokens: tuple[int, ...], num_computed: int, prompt_len: int,
                 block_ids: BlockIds, partition: int, lease: int | None = None, generation: int | None = None):
        self.__dict__.update(request_id=request_id, chunk_tokens=chunk_tokens, num_computed=num_computed,
                             prompt_len=prompt_len, block_ids=block_ids, partition=partition, lease=lease,
                             generation=generation)

    @property
    def num_tokens(self) -> int:
        return len(self.chunk_tokens)

    @property
    def end(self) -> int:
        return self.num_computed + len(self.chunk_tokens)

    @property
    def terminal(self) -> bool:
        """Only the chunk that completes the prompt samples a token."""
        return self.end >= self.prompt_len


@dataclass(frozen=True)
class PrefillBatch:
    items: tuple[PrefillItem, ...]

    def by_partition(self) -> dict[int, list[PrefillItem]]:
        out: dict[int, list[PrefillItem]] = {}
        for it in self.items:
            out.setdefault(it.partition, []).append(it)
        return out


@dataclass(frozen=True, init=False)
class DecodeItem:
    """One request's verify window (`DecodeRequest` plus the drafter state the runner keeps)."""

    request_id: str
    last_token: int                   # committed token at the anchor (or PLACEHOLDER_TOKEN)
    anchor: int                       # position of the committed token = seq_len - 1
    block_ids: BlockIds
    partition: int
    pending_drafts: tuple[int, ...] = ()   # 7 drafts when speculative, () otherwise
    lease: int | None = None
    generation: int | None = None

    def __init__(self, request_id: str, last_token: int, anchor: int, block_ids: BlockIds, partition: int,
                 pending_drafts: tuple[int, ...] = (), lease: int | None = None, generation: int | None = None):
        self.__dict__.update(request_id=request_id, last_token=last_token, anchor=anchor, block_ids=block_ids,
                             partition=partition, pending_drafts=pending_drafts, lease=lease, generation=generation)

    @property
    def speculative_width(self) -> int:
        return 1 + len(self.pending_drafts)


@dataclass(frozen=True)
class DecodeBatch:
    items: tuple[DecodeItem, ...]
    k: int = 7


@dataclass(frozen=True)
class DrafterItem:
    """One drafter row: a seed after a terminal prefill (num_sampled = 0) or a redraft after a
    verify step (num_sampled = 1)."""

    request_id: str
    partition: int
    lease: int
    generation: int
    anchor: int                       # drafter anchor: last committed input position
    context_positions: tuple[int, ...]   # absolute positions of the context rows
    num_sampled: int                  # 0 seed, 1 decode
    last_sampled: int = 0             # committed token (decode mode)
    next_prefill_token: int = 0       # first sampled token (seed mode)


@dataclass(frozen=True)
class DrafterBatch:
    items: tuple[DrafterItem, ...]


@dataclass(frozen=True)
class Dispatch:
    """One program invocation: positional arguments by name (numpy arrays, global [R, ...]
    layout) plus host-side facts (`meta`) that lowering derived and executors may read."""

    program: str
    args: Mapping[str, Any]
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class DispatchResult:
    """What a backend returns for one dispatch: the program's outputs (by ABI output name), the pools
    it touched (new values, by pool name; the state it was given is never written) and the tagged
    intermediates it can dump (golden.compose's (layer, stage) -> array), which localize a divergence."""

    outputs: dict
    state: dict
    taps: dict = field(default_factory=dict)


# ---- one scheduler step's result (the executor interface: twin.sim.executor) ----------------------
@dataclass
class DispatchTiming:
    kind: str                         # "prefill", "seed", "decode"
    seconds: float
    parts: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


@dataclass
class StepResult:
    step_id: int
    tokens: dict[str, list[int]] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)     # decode: count before scheduler truncation
    drafts: dict[str, int] = field(default_factory=dict)       # num_draft_tokens: 7, or 0 on fallback
    dispatches: list[DispatchTiming] = field(default_factory=list)
    error: str | None = None

    @property
    def seconds(self) -> float:
        return sum(d.seconds for d in self.dispatches)


# ---- requests --------------------------------------------------------------------------------------
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
