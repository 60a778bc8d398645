"""Golden's one entry for a lowered dispatch: `run_dispatch(served, kind, d, items)`.

A scheduler decides, `twin.abi.lowering` lowers and validates, and golden runs the dispatch on its
run state: packed prefill (`l3_prefill_fwd`, with the 128-row hidden tail each request keeps for
its seed), a seeding wave (`l3_dspark_draft_step_device_state`), the fused K=7 verify + redraft
(`l3_decode_fwd_dspark`) or the K=0 decode (`l3_decode_fwd`).  `Served` holds that run state for
requests a scheduler serves (admitted, preempted and re-admitted, finished), addressed through
`golden.staging.PageMap`; every executor that needs golden's numbers (the functional twin, both
sides of the lockstep) calls this module, so the bookkeeping between a scheduler's items and
golden's compositions is written once.

Before a prefill runs, golden's own lowering of the scheduler's chunks is held to the dispatch's
staged tokens, positions and slot mappings of all seven families; before a decode, each verify
row's stream slot to the request's drafter slot (`golden.staging`), so golden cannot pass while
the dispatch is wrong.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from twin.abi import constants as C
from twin.abi.errors import AbiError

from .dspark import step as S
from .dspark.ring import new_pools
from .dspark.state import new_state, release
from .paged import PREFILL, alloc_caches
from .paged import lower as golden_lower
from .staging import PageMap, check_decode, check_prefill

KINDS = ("prefill", "seed", "decode")


class Halt(Exception):
    """Raised by a dispatch host to end a served run early (a dispatch budget, a strict failure)."""


@dataclass
class Ran:
    """What one dispatch produced: its outputs by name, the requests it ran (in the dispatch's row
    order) and, for a fused K=7 step, golden's acceptance record."""

    outputs: dict
    seqs: list
    accepted: object = None


class Served:
    """Golden's run state for scheduler-driven requests: target caches (one pool per family for
    every partition, `PageMap`), the K=7 device state and drafter pools, and each request's `Seq`
    (its row in the block tables, partition, lease, anchor, tokens, hidden tail).

    golden: a `golden.dspark.step.Golden`; its `max_model_len` and `groups` become the deployment's.
    ctx: the `twin.abi.lowering.LoweringContext` the dispatches are lowered in.
    check: hold every dispatch to golden's own lowering (`golden.staging`).
    draft_policy(seq, drafts) -> drafts may replace the Markov drafts (see `fused_step`)."""

    def __init__(self, golden: S.Golden, ctx, *, check: bool = True, draft_policy=None):
        dep = ctx.deployment
        if golden.cfg.name != dep.model.name:
            raise AbiError("golden.cfg", golden.cfg.name, f"the deployment's preset {dep.model.name!r}",
                           where="golden served run")
        self.k = dep.k
        self.g = replace(golden, max_model_len=dep.limits.max_model_len, groups=dep.partitions)
        self.pages = PageMap(ctx)
        self.check = check
        self.draft_policy = draft_policy
        cfg = self.g.cfg
        self.run = S.Run(alloc_caches(cfg, self.pages.pool_pages, self.g.nm), [], [])
        if self.k:
            self.run.state = new_state(dep.partitions, cfg.dspark_noise_token_id)
            self.run.pools = new_pools(cfg, dep.partitions, self.g.nm)
        self.seqs: dict[str, S.Seq] = {}
        self._free_rows: list[int] = []

    # ---- request lifecycle -------------------------------------------------------------------------
    def admit(self, rid: str, prompt, max_new_tokens: int) -> None:
        """A new request, or one re-admitted after a preemption (fresh state at its prompt)."""
        self.drop(rid)
        row = self._free_rows.pop() if self._free_rows else len(self.run.blocks)
        if row == len(self.run.blocks):
            self.run.blocks.append({})
        s = S.Seq(S.Prompt(rid, tuple(int(t) for t in prompt), max(1, int(max_new_tokens))), row, -1)
        self.seqs[rid] = s
        self.run.seqs.append(s)

    def drop(self, rid: str) -> None:
        """A finished or preempted request: its drafter slot is released and its block-table row freed."""
        s = self.seqs.pop(rid, None)
        if s is None:
            return
        if self.k and s.lease is not None and not s.released:
            self.run.state = release(self.run.state, s.ref)
            s.released = True
        self.run.seqs.remove(s)
        self.run.blocks[s.index] = {}
        self._free_rows.append(s.index)

    def last_token(self, rid: str) -> int:
        return self.seqs[rid].current

    def bind(self, rid: str, partition: int, lease, generation, block_ids) -> S.Seq:
        """The request `rid` as the dispatch addresses it: its partition, lease and pages."""
        s = self.seqs.get(rid)
        if s is None:
            raise AbiError("request_id", rid, "a request announced in new_requests and not finished",
                           where="golden served run")
        if s.group == -1:
            s.group = partition
        elif s.group != partition:
            raise AbiError("partition", partition, f"{rid}'s partition {s.group}", where="golden served run")
        if self.k:
            if s.lease is None:
                s.lease, s.generation = int(lease), int(generation)
            elif (s.lease, s.generation) != (lease, generation):
                raise AbiError("lease", (lease, generation), f"{rid}'s lease {(s.lease, s.generation)}",
                               where="golden served run")
        self.run.blocks[s.index] = self.pages.to_golden(partition, block_ids)
        return s

    def dispatch(self, kind: str, d, items) -> Ran:
        return run_dispatch(self, kind, d, items)

    def speculation(self) -> dict:
        """golden's `dspark_speculation_summary()` over every verify this run state ran."""
        return self.run.counters.summary()


def run_dispatch(served: Served, kind: str, d, items) -> Ran:
    """Run one lowered, validated dispatch `d` of `kind` ("prefill", "seed", "decode") on `served`.

    items: the scheduler's items the dispatch was lowered from: a prefill's `PrefillItem`s, a seeding
    wave's `PrefillItem`s (the terminal chunks; `d` is None when no row of the wave fits the context,
    golden then seeds them without drafts), a decode's `DecodeItem`s (at K=0 with the worker's last
    token in place of a placeholder).  `served.run` is updated (pools are replaced, never mutated)."""
    if kind == "prefill":
        return _prefill(served, d, items)
    if kind == "seed":
        return _seed(served, items)
    if kind == "decode":
        return _decode(served, d, items)
    raise AbiError("kind", kind, f"one of {KINDS}", where="golden.dispatch")


def placement_order(d, items) -> list:
    """A packed prefill's items in the dispatch's row order (partition, then ordinal in it): the
    order of its outputs' rows."""
    place = d.meta["placement"]
    return sorted(items, key=lambda it: (place[it.request_id]["group"], place[it.request_id]["ordinal"]))


def _prefill(sv: Served, d, items) -> Ran:
    items = placement_order(d, items)
    seqs = [sv.bind(it.request_id, it.partition, it.lease, it.generation, it.block_ids) for it in items]
    spans = [S.Span(s.index, it.num_computed, tuple(int(t) for t in it.chunk_tokens), sv.run.blocks[s.index])
             for s, it in zip(seqs, items)]
    if sv.check:
        check_prefill(d, golden_lower(sv.g.cfg, spans, form=PREFILL), items, sv.pages)
    sampled, mh = S.forward_spans(sv.g, sv.run, spans, PREFILL)
    commit_prefill(seqs, items, sampled, mh)
    return Ran({"sampled_ids": np.asarray(sampled, np.int64), "main_hidden": np.asarray(mh, np.float32)}, seqs)


def commit_prefill(seqs, items, sampled, mh) -> None:
    """A packed prefill's per-request bookkeeping from its sampled tokens and captured hidden rows
    (in the dispatch's row order): the rolling 128-row hidden tail each chunk extends (the seed's
    context) and, at a prompt's terminal chunk, the anchor and the first generated token.  Every
    executor that serves a prefill (golden, a device behind the lockstep) commits through this."""
    row = 0
    for s, it, t in zip(seqs, items, sampled):
        a, b = it.num_computed, it.end
        for p, h in zip(range(a, b), mh[row:row + b - a]):
            s.tail[p] = h
        s.tail = {p: h for p, h in s.tail.items() if p > b - 1 - C.SLIDING_WINDOW}
        row += b - a
        if it.terminal:
            s.req = S.Prompt(s.req.request_id, s.req.prompt[:it.prompt_len], s.req.max_new_tokens)
            s.anchor, s.current = b, int(t)
            s.generated.append(s.current)


def _state_outputs(sv: Served, seqs) -> dict:
    st = sv.run.state
    return {"drafts": np.stack([st.tokens[s.group, s.lease] for s in seqs]),
            "state_meta": np.stack([st.meta[s.group, s.lease] for s in seqs])}


def _seed(sv: Served, wave) -> Ran:
    seqs = [sv.seqs[it.request_id] for it in wave]
    S.seed_wave(sv.g, sv.run, seqs)
    return Ran(_state_outputs(sv, seqs), seqs)


def _decode(sv: Served, d, items) -> Ran:
    seqs = [sv.bind(it.request_id, it.partition, it.lease, it.generation, it.block_ids) for it in items]
    if sv.check:
        check_decode(d, items, seqs, sv.k)
    if not sv.k:
        for it, s in zip(items, seqs):
            # split decode runs at the staged position and token, so upstream's re-prefill gap shows
            # up as it does on the device
            s.anchor, s.current = int(it.anchor), int(it.last_token)
        S.plain_step(sv.g, sv.run, seqs)
        return Ran({"sampled_ids": np.array([s.current for s in seqs], np.int64)}, seqs)
    acc = S.fused_step(sv.g, sv.run, seqs, draft_policy=sv.draft_policy)
    out = {"accepted_ids": np.asarray(acc.token_ids, np.int64), "accepted_counts": np.asarray(acc.counts),
           "num_draft_tokens": np.asarray(acc.proposed, np.int64), **_state_outputs(sv, seqs)}
    return Ran(out, seqs, acc)
