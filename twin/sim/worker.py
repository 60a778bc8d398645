"""The worker's plan of a step command: packed prefill dispatches, seeding waves, decode tile.

Pure functions over the ABI batch types, as upstream's worker and runner split a command
(serving-contract §4.6, §4.8, §7.4).  A plan carries the runner's own validation errors
("requests per TP group exceed capacity", "decode batch exceeds local capacity 64"), which the
engine treats as a worker error.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from twin.abi import constants as C
from twin.abi.batches import DecodeBatch, DecodeItem, PrefillBatch, PrefillItem
from twin.abi.lowering.decode import owner_member
from twin.abi.lowering.drafter import seeding_waves


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    prefill: tuple[PrefillBatch, ...]          # dispatches, run one after the other
    seed_waves: tuple[tuple[PrefillItem, ...], ...]
    decode: DecodeBatch | None
    decode_groups: tuple[tuple[DecodeItem, ...], ...]   # per TP group, in stream order
    decode_only: bool
    error: str | None = None
    requests: dict = field(default_factory=dict)       # NewRequestData shipped with this command
    finished_ids: tuple[str, ...] = ()


def prefill_chunk_error(request_id, tokens: int, cap: int) -> str:
    return f"prefill chunk of {request_id!r} has {tokens} tokens > {cap} per partition"


def decode_tile_error(group: int, requests: int) -> str:
    return f"TP group {group} decode batch exceeds local capacity {C.DECODE_BATCH} (got {requests})"


def owner_rank_error(group: int) -> str:
    return f"TP group {group} owner rank over {C.LOCAL_REQUESTS} requests"


def split_prefill(items, max_batch: int, per_partition: int,
                  tokens_per_partition: int = C.PREFILL_TOKENS_PER_GROUP) -> list[PrefillBatch]:
    """`_partitioned_prefill_chunks`: greedy first-fit in order; a request that does not fit the
    current dispatch is deferred to the next dispatch of the same step."""
    pending = [(it, len(it.chunk_tokens)) for it in items]
    for it, n in pending:
        if n > tokens_per_partition:
            raise ValueError(prefill_chunk_error(it.request_id, n, tokens_per_partition))
    out = []
    while pending:
        cur, deferred = [], []
        reqs: dict[int, int] = {}
        toks: dict[int, int] = {}
        for it, n in pending:
            p = it.partition
            if len(cur) < max_batch and reqs.get(p, 0) < per_partition and toks.get(p, 0) + n <= tokens_per_partition:
                cur.append(it)
                reqs[p] = reqs.get(p, 0) + 1
                toks[p] = toks.get(p, 0) + n
            else:
                deferred.append((it, n))
        out.append(PrefillBatch(tuple(cur)))
        pending = deferred
    return out


def dispatch_waves(dispatches) -> list[tuple[PrefillItem, ...]]:
    """The runner seeds once per prefill dispatch, with that dispatch's completed requests."""
    return [tuple(w) for d in dispatches for w in seeding_waves([it for it in d.items if it.terminal])]


def decode_groups(items, partitions: int, k: int) -> tuple[tuple[tuple[DecodeItem, ...], ...], str | None]:
    """Per TP group, in group ordinal order; at K=7 each request's owner rank is lease % 4 and
    holds at most 16 requests."""
    groups: list[list[DecodeItem]] = [[] for _ in range(partitions)]
    for it in items:
        groups[it.partition].append(it)
    error = None
    for g, v in enumerate(groups):
        if len(v) > C.DECODE_BATCH:
            error = error or decode_tile_error(g, len(v))
        if k and error is None:
            owners = [0] * C.TP_SIZE
            for it in v:
                if it.lease is not None:
                    owners[owner_member(k, it.lease, 0)] += 1
            if max(owners) > C.LOCAL_REQUESTS:
                error = owner_rank_error(g)
    return tuple(tuple(v) for v in groups), error


def plan(cmd, dep) -> StepPlan:
    """Split a `StepCommand` the way the worker and runner do (the scheduler's command carries its
    packed-prefill split, made once with the leases; a command without one is split here)."""
    error = cmd.error
    pre = cmd.prefill.items
    dispatches = getattr(cmd, "dispatches", None)
    if dispatches is None:
        dispatches = []
        if pre:
            try:
                dispatches = split_prefill(pre, dep.prefill_batch, dep.prefill_requests_per_partition)
            except ValueError as e:
                error = error or str(e)
    waves = dispatch_waves(dispatches) if dep.k else []
    groups, derr = decode_groups(cmd.decode.items, dep.partitions, dep.k)
    return StepPlan(cmd.step_id, tuple(dispatches), tuple(waves), cmd.decode if cmd.decode.items else None,
                    groups, cmd.decode_only, error or derr, {r.request_id: r for r in cmd.new_requests},
                    cmd.finished_ids)
