"""The runner's per-request row checks, applied before anything is lowered (serving-contract.md §6).

Every check raises `DispatchError(program, argument, rule, ...)`; nothing is clamped or dropped.
"""
from __future__ import annotations

import math

import numpy as np

from .. import constants as C
from ..caches import FAMILY_NAMES
from .context import DispatchError, LoweringContext


def block_rows(program: str, rid: str, block_ids, ctx: LoweringContext, end: int) -> dict[str, np.ndarray]:
    """All seven families present and non-empty, ids in [0, num_blocks), none repeated in a row,
    rolling rows no longer than the ring period, full-history rows covering `end` positions."""
    missing = [f for f in FAMILY_NAMES if f not in block_ids or len(block_ids[f]) == 0]
    if missing:
        raise DispatchError(program, f"block_ids[{missing[0]}]", "block_ids", f"request {rid}: absent or empty",
                            f"all seven families {FAMILY_NAMES}, each non-empty")
    extra = set(block_ids) - set(FAMILY_NAMES)
    if extra:
        raise DispatchError(program, "block_ids", "block_ids", sorted(extra), f"family names {FAMILY_NAMES}")
    out = {}
    for f in FAMILY_NAMES:
        ids = np.asarray(block_ids[f], dtype=np.int64)
        nb = ctx.num_blocks[f]
        arg = f"block_ids[{f}]"
        if ((ids < 0) | (ids >= nb)).any():
            bad = int(ids[(ids < 0) | (ids >= nb)][0])
            raise DispatchError(program, arg, "block_range", f"request {rid}: id {bad}",
                                f"ids in [0, {nb}) (ids >= num_blocks are reserved for kernel padding)")
        if np.unique(ids).size != ids.size:
            raise DispatchError(program, arg, "block_repeat", f"request {rid}: {ids.tolist()[:12]}",
                                "no physical block repeated within one request's row")
        fam = ctx.families[f]
        if fam.rolling:
            if ids.size > ctx.ring_period(f):
                raise DispatchError(program, arg, "ring_period", f"request {rid}: {ids.size} pages",
                                    f"at most the ring period {ctx.ring_period(f)}")
        else:
            need = math.ceil(end / C.COMPRESSED_BLOCK_TOKENS)
            if ids.size < need:
                raise DispatchError(program, arg, "table_coverage", f"request {rid}: {ids.size} pages",
                                    f">= ceil({end}/128) = {need} pages to cover the positions written")
        out[f] = ids
    return out


def partition(program: str, rid: str, p: int, ctx: LoweringContext) -> int:
    if not isinstance(p, (int, np.integer)) or not 0 <= p < ctx.partitions:
        raise DispatchError(program, "partition", "partition", f"request {rid}: {p}",
                            f"a cache partition in [0, {ctx.partitions})")
    return int(p)


def token(program: str, arg: str, rid: str, t: int, ctx: LoweringContext) -> int:
    if not 0 <= int(t) < ctx.model.vocab_size:
        raise DispatchError(program, arg, "token_range", f"request {rid}: {t}",
                            f"a token id in [0, {ctx.model.vocab_size})")
    return int(t)


def lease(program: str, rid: str, lease_id, generation, required: bool = True):
    if lease_id is None or generation is None:
        if required:
            raise DispatchError(program, "lease", "lease_missing", f"request {rid}: lease={lease_id}, "
                                f"generation={generation}", "a drafter lease and generation (K=7)")
        return None
    if not 0 <= int(lease_id) < C.DRAFTER_LEASES_PER_GROUP:
        raise DispatchError(program, "lease", "lease_range", f"request {rid}: {lease_id}",
                            f"a group-local lease in [0, {C.DRAFTER_LEASES_PER_GROUP})")
    if int(generation) < 1:
        raise DispatchError(program, "generation", "generation", f"request {rid}: {generation}",
                            ">= 1 (every reservation bumps the generation)")
    return int(lease_id), int(generation)


def unique_leases(program: str, per_group: dict[int, list]):
    for g, items in per_group.items():
        seen: dict[int, str] = {}
        for it in items:
            if it.lease in seen:
                raise DispatchError(program, "lease", "lease_unique",
                                    f"group {g}: lease {it.lease} for {seen[it.lease]!r} and {it.request_id!r}",
                                    "one live request per lease in a group")
            seen[it.lease] = it.request_id


def unique_requests(program: str, items):
    seen = set()
    for it in items:
        if it.request_id in seen:
            raise DispatchError(program, "request_id", "request_repeat", it.request_id,
                                "each request at most once per dispatch")
        seen.add(it.request_id)
