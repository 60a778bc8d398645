"""The golden executor: the simulator's executor interface with golden's numerics behind it.

`GoldenExecutor.execute(plan) -> StepResult` takes the worker's plan of one step command, lowers
every dispatch with `twin.abi.lowering` and validates it, then runs golden's compositions on the
same tokens, positions and pages: packed prefill (with the 128-row tail capture), the seeding waves
(bootstrap drafter), and the fused K=7 step (or the K=0 single-row decode).  It returns the real
accepted tokens, so the scheduler commits golden's outputs.

Pages: the scheduler's ids are partition-local; golden keeps one pool per family holding every
partition, page `p * num_blocks + id`.  Prefix-cache hits therefore read exactly the pages another
request wrote, and a page the scheduler evicted is really overwritten.

Every prefill dispatch is cross-checked against golden's own lowering (`agreement`): the tokens,
positions and all seven slot mappings golden writes through must be the ones the dispatch stages.
"""
from __future__ import annotations

from dataclasses import replace

from golden.dspark import step as S
from golden.paged import PREFILL
from golden.dspark.ring import new_pools
from golden.dspark.state import new_state, release
from twin.abi import constants as C
from twin.abi.batches import PLACEHOLDER_TOKEN, DrafterBatch, DrafterItem
from twin.abi.errors import AbiError
from twin.abi.lowering import LoweringContext, lower, lower_bootstrap, validate
from twin.abi.batches import DispatchTiming, StepResult
from twin.sim.executor import decode_timing, prefill_timing, seed_timing
from twin.sim.worker import StepPlan

from .agreement import check_decode, check_prefill
from .pages import PageMap


class GoldenExecutor:
    """Real tokens from golden for a scheduler-driven run.

    golden: a `golden.dspark.step.Golden` (config, target and drafter weights, numerics); its
    `max_model_len` and `groups` are taken from the deployment.  cost: an optional
    `twin.sim.CostModel` that times each dispatch (virtual time for the SimPy engine); without it
    every dispatch takes 0 s.  draft_policy(seq, drafts) -> drafts may replace the Markov drafts
    (tests drive long acceptances with it); the drafter still runs and writes its caches."""

    def __init__(self, dep, slots: int, golden: S.Golden, *, cost=None, draft_policy=None, check: bool = True):
        if golden.cfg.name != dep.model.name:
            raise AbiError("golden.cfg", golden.cfg.name, f"the deployment's preset {dep.model.name!r}",
                           where="GoldenExecutor")
        self.dep, self.k = dep, dep.k
        self.ctx = LoweringContext(dep, slots)
        self.g = replace(golden, max_model_len=dep.limits.max_model_len, groups=dep.partitions)
        self.pages = PageMap(self.ctx)
        self.cost = cost
        self.draft_policy = draft_policy
        self.check = check
        cfg = golden.cfg
        from golden.paged import alloc_caches
        self.run = S.Run(alloc_caches(cfg, self.pages.pool_pages, self.g.nm), [], [])
        if self.k:
            self.run.state = new_state(dep.partitions, cfg.dspark_noise_token_id)
            self.run.pools = new_pools(cfg, dep.partitions, self.g.nm)
        self.seqs: dict[str, S.Seq] = {}
        self._free_rows: list[int] = []
        self.dispatches = 0                     # lowered and validated dispatches, all programs

    # ---- request lifecycle -------------------------------------------------------------------------
    def _admit(self, rid: str, req) -> None:
        """NewRequestData: a new request, or a re-admitted one after a preemption (fresh state)."""
        self._drop(rid)
        row = self._free_rows.pop() if self._free_rows else len(self.run.blocks)
        if row == len(self.run.blocks):
            self.run.blocks.append({})
        prompt = tuple(int(t) for t in req.prompt)
        s = S.Seq(S.Request(rid, prompt, max(1, req.max_new_tokens)), row, -1)
        self.seqs[rid] = s
        self.run.seqs.append(s)

    def _drop(self, rid: str) -> None:
        """A finished or preempted request: release its drafter slot and its block-table row."""
        s = self.seqs.pop(rid, None)
        if s is None:
            return
        if self.k and s.lease is not None and not s.released:
            self.run.state = release(self.run.state, s.ref)
            s.released = True
        self.run.seqs.remove(s)
        self.run.blocks[s.index] = {}
        self._free_rows.append(s.index)

    def _seq(self, rid: str, partition: int, lease, generation, block_ids) -> S.Seq:
        s = self.seqs.get(rid)
        if s is None:
            raise AbiError("request_id", rid, "a request announced in new_requests and not finished",
                           where="golden executor")
        if s.group == -1:
            s.group = partition
        elif s.group != partition:
            raise AbiError("partition", partition, f"{rid}'s partition {s.group}", where="golden executor")
        if self.k:
            if s.lease is None:
                s.lease, s.generation = int(lease), int(generation)
            elif (s.lease, s.generation) != (lease, generation):
                raise AbiError("lease", (lease, generation), f"{rid}'s lease {(s.lease, s.generation)}",
                               where="golden executor")
        self.run.blocks[s.index] = self.pages.to_golden(partition, block_ids)
        return s

    # ---- execute -----------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        res = StepResult(plan.step_id)
        for rid in plan.finished_ids:
            self._drop(rid)
        for rid, req in plan.requests.items():
            self._admit(rid, req)
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

    def _prefill(self, batch, res: StepResult) -> None:
        d = self._lowered(batch)
        place = d.meta["placement"]
        items = sorted(batch.items, key=lambda it: (place[it.request_id]["group"], place[it.request_id]["ordinal"]))
        seqs = [self._seq(it.request_id, it.partition, it.lease, it.generation, it.block_ids) for it in items]
        spans = [S.Span(s.index, it.num_computed, tuple(int(t) for t in it.chunk_tokens), self.run.blocks[s.index])
                 for s, it in zip(seqs, items)]
        if self.check:
            check_prefill(d, self.g.cfg, spans, self.pages, items)
        sampled, mh = S._forward(self.g, self.run, spans, PREFILL)
        row = 0
        for i, (s, it) in enumerate(zip(seqs, items)):
            a, b = it.num_computed, it.end
            for p, h in zip(range(a, b), mh[row:row + b - a]):
                s.tail[p] = h
            s.tail = {p: h for p, h in s.tail.items() if p > b - 1 - C.SLIDING_WINDOW}   # rolling, 128 rows
            row += b - a
            if it.terminal:
                s.req = S.Request(s.req.request_id, s.req.prompt[:it.prompt_len], s.req.max_new_tokens)
                s.anchor, s.current = b, int(sampled[i])
                s.generated.append(s.current)
                res.tokens[it.request_id] = [s.current]
        res.dispatches.append(prefill_timing(self.cost, batch, self.dep.partitions))

    def _seed(self, wave, res: StepResult) -> None:
        seqs = [self.seqs[it.request_id] for it in wave]
        rows = []
        for s, it in zip(seqs, wave):
            a = it.prompt_len - 1
            if a + C.DSPARK_QUERY_WIDTH >= self.ctx.max_position:
                continue                      # the seed block would not fit: no drafts, no dispatch row
            ctx_pos = tuple(range(max(0, a + 1 - C.SLIDING_WINDOW), a + 1))
            rows.append(DrafterItem(it.request_id, it.partition, s.lease, s.generation, a, ctx_pos, 0,
                                    next_prefill_token=s.current))
        if rows:
            self._lowered(DrafterBatch(tuple(rows)))
        S.seed_wave(self.g, self.run, seqs)
        res.dispatches.append(seed_timing(self.cost, wave))

    def _decode(self, plan: StepPlan, res: StepResult) -> None:
        items = [it for grp in plan.decode_groups for it in grp]
        seqs = [self._seq(it.request_id, it.partition, it.lease, it.generation, it.block_ids) for it in items]
        batch = plan.decode
        if not self.k:
            # the worker substitutes its cached last sample for a placeholder before lowering (§4.9)
            items = [replace(it, last_token=s.current) if it.last_token == PLACEHOLDER_TOKEN else it
                     for it, s in zip(items, seqs)]
            batch = replace(batch, items=tuple(items))
        d = self._lowered(batch)
        if self.check:
            check_decode(d, items, seqs, self.k)
        if self.k:
            timing = self._time_decode(plan)
            acc = S.fused_step(self.g, self.run, seqs, draft_policy=self.draft_policy)
            for i, s in enumerate(seqs):
                c = int(acc.counts[i])
                rid = s.req.request_id
                res.tokens[rid] = [int(t) for t in acc.token_ids[i, :c]]
                res.accepted[rid] = c
                res.drafts[rid] = int(acc.proposed[i])
        else:
            for it, s in zip(items, seqs):
                # split decode runs at the staged position and token, so upstream's re-prefill gap
                # shows up as it does on the device
                s.anchor, s.current = int(it.anchor), int(it.last_token)
            timing = self._time_decode(plan)
            S.plain_step(self.g, self.run, seqs)
            for s in seqs:
                res.tokens[s.req.request_id] = [s.current]
                res.accepted[s.req.request_id] = 1
                res.drafts[s.req.request_id] = 0
        res.dispatches.append(timing)

    def _time_decode(self, plan: StepPlan) -> DispatchTiming:
        """Timed before the step, at each request's context as it enters the verify (its anchor + 1),
        as the cost-model executor times it."""
        ctxs = [[self.seqs[it.request_id].anchor + 1 for it in grp] for grp in plan.decode_groups]
        return decode_timing(self.cost, plan.decode_groups, ctxs, self.k)

    # ---- results -----------------------------------------------------------------------------------
    def speculation(self) -> dict:
        """golden's `dspark_speculation_summary()` over every verify this executor ran."""
        return self.run.counters.summary()
