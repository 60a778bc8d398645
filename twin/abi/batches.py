"""What the scheduler hands to lowering, and what lowering hands to an executor.

Batches are the scheduler's view (requests, chunks, anchors, block ids by family, partitions);
a `Dispatch` is one program's arguments ready for a device.  Both are plain frozen data, so every
executor (cost model, golden, device, lockstep) receives exactly the same thing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

PLACEHOLDER_TOKEN = -1      # async decode: last token not yet known at schedule time

BlockIds = Mapping[str, tuple[int, ...]]   # family name -> local block ids in table-slot order


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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
