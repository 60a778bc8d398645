"""The golden executor: the simulator's executor interface with golden's numerics behind it.

`GoldenExecutor.execute(plan) -> StepResult` takes the worker's plan of one step command, lowers
every dispatch with `twin.abi.lowering` and validates it, and hands each lowered dispatch to its
host: `golden.dispatch.Served` (golden alone, the functional twin), or a lockstep checker that runs
the dispatch on a device and on golden and compares them (`hw.real.lockstep`).  The host returns
the dispatch's outputs (packed prefill's samples, a seeding wave's drafts, the fused K=7 step's or
the K=0 decode's accepted tokens), which the scheduler commits.

Pages: the scheduler's ids are partition-local; golden keeps one pool per family holding every
partition (`golden.staging.PageMap`), so prefix-cache hits read exactly the pages another request
wrote, and a page the scheduler evicted is really overwritten.
"""
from __future__ import annotations

from dataclasses import replace

from golden.dispatch import Served, placement_order
from twin.abi import constants as C
from twin.abi.batches import PLACEHOLDER_TOKEN, DrafterBatch, DrafterItem
from twin.abi.lowering import LoweringContext, lower, lower_bootstrap, validate
from twin.abi.batches import DispatchTiming, StepResult
from twin.sim.executor import decode_timing, prefill_timing, seed_timing
from twin.sim.worker import StepPlan


class GoldenExecutor:
    """Real tokens for a scheduler-driven run.

    golden: a `golden.dspark.step.Golden` (config, target and drafter weights, numerics), served by
    a `golden.dispatch.Served` (kw: check, draft_policy); or host: a ready host built on this
    executor's `LoweringContext` (host(ctx) -> an object with admit, drop, last_token, dispatch,
    speculation and `seqs`, request id -> golden.dspark.step.Seq), e.g. a lockstep checker.  cost: an optional `twin.sim.CostModel` that times each
    dispatch (virtual time for the SimPy engine); without it every dispatch takes 0 s."""

    def __init__(self, dep, slots: int, golden=None, *, host=None, cost=None, draft_policy=None,
                 check: bool = True):
        self.dep, self.k = dep, dep.k
        self.ctx = LoweringContext(dep, slots)
        self.host = host(self.ctx) if host is not None else Served(golden, self.ctx, check=check,
                                                                   draft_policy=draft_policy)
        self.cost = cost
        self.dispatches = 0                     # lowered and validated dispatches, all programs
        self.leases_reused = 0                  # K=7 leases reserved again after another request held them
        self._held: dict[str, tuple] = {}
        # what the scheduler's decisions made the executor run (parity runs report them)
        self.counts = {"packed_prefills": 0, "prefill_chunks": 0, "seeding_waves": 0, "fallback_rows": 0}

    # ---- execute -----------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        res = StepResult(plan.step_id)
        for rid in plan.finished_ids:
            self.host.drop(rid)
        for rid, req in plan.requests.items():
            self.host.admit(rid, req.prompt, req.max_new_tokens)
        if plan.error:
            res.error = plan.error
            res.dispatches.append(DispatchTiming("error", 0.0, meta={"error": plan.error}))
            return res
        for batch in plan.prefill:
            self._prefill(batch, res)
        for wave in plan.seed_waves:
            self._seed(wave, res)
        if plan.decode is not None:
            self._decode(plan, res)
        return res

    def _lowered(self, batch, **kw):
        d = lower(batch, self.ctx, **kw) if not isinstance(batch, DrafterBatch) else lower_bootstrap(batch, self.ctx)
        validate(d, self.ctx)
        self.dispatches += 1
        return d

    def _count_lease(self, it) -> None:
        """A lease whose generation is past 1 was held by an earlier request (upstream's free list)."""
        if self.k and it.lease is not None and self._held.get(it.request_id) != (it.lease, it.generation):
            self._held[it.request_id] = (it.lease, it.generation)
            self.leases_reused += int(it.generation) > 1

    def _prefill(self, batch, res: StepResult) -> None:
        d = self._lowered(batch)
        for it in batch.items:
            self._count_lease(it)
        sampled = self.host.dispatch("prefill", d, batch.items).outputs["sampled_ids"]
        order = placement_order(d, batch.items)
        self.counts["packed_prefills"] += len(order) > 1
        for i, it in enumerate(order):
            self.counts["prefill_chunks"] += not it.terminal or it.num_computed > 0
            if it.terminal:
                res.tokens[it.request_id] = [int(sampled[i])]
        res.dispatches.append(prefill_timing(self.cost, batch, self.dep.partitions))

    def _seed(self, wave, res: StepResult) -> None:
        rows = []
        for it in wave:
            a = it.prompt_len - 1
            if a + C.DSPARK_QUERY_WIDTH >= self.ctx.max_position:
                continue                      # the seed block would not fit: no drafts, no dispatch row
            ctx_pos = tuple(range(max(0, a + 1 - C.SLIDING_WINDOW), a + 1))
            rows.append(DrafterItem(it.request_id, it.partition, it.lease, it.generation, a, ctx_pos, 0,
                                    next_prefill_token=self.host.last_token(it.request_id)))
        d = self._lowered(DrafterBatch(tuple(rows))) if rows else None
        self.counts["seeding_waves"] += 1
        self.host.dispatch("seed", d, wave)
        res.dispatches.append(seed_timing(self.cost, wave))

    def _decode(self, plan: StepPlan, res: StepResult) -> None:
        items = [it for grp in plan.decode_groups for it in grp]
        batch = plan.decode
        if not self.k:
            # the worker substitutes its cached last sample for a placeholder before lowering (§4.9)
            items = [replace(it, last_token=self.host.last_token(it.request_id))
                     if it.last_token == PLACEHOLDER_TOKEN else it for it in items]
            batch = replace(batch, items=tuple(items))
        # timed before the step, at each request's context as it enters the verify (its anchor + 1),
        # as the cost-model executor times it
        anchor = (lambda it: self.host.seqs[it.request_id].anchor) if self.k else (lambda it: it.anchor)
        timing = decode_timing(self.cost, plan.decode_groups, [[anchor(it) + 1 for it in grp]
                                                                for grp in plan.decode_groups], self.k)
        d = self._lowered(batch)
        ran = self.host.dispatch("decode", d, items)
        out = ran.outputs
        for i, it in enumerate(items):
            rid = it.request_id
            if self.k:
                c = int(out["accepted_counts"][i])
                res.tokens[rid] = [int(t) for t in out["accepted_ids"][i, :c]]
                res.accepted[rid] = c
                res.drafts[rid] = int(out["num_draft_tokens"][i])
                self.counts["fallback_rows"] += res.drafts[rid] == 0
            else:
                res.tokens[rid] = [int(out["sampled_ids"][i])]
                res.accepted[rid] = 1
                res.drafts[rid] = 0
        res.dispatches.append(timing)

    # ---- results -----------------------------------------------------------------------------------
    def speculation(self) -> dict:
        """golden's `dspark_speculation_summary()` over every verify this executor ran."""
        return self.host.speculation()
