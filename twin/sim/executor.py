"""The executor interface the engine receives, and the cost-model executor.

`Executor.execute(plan) -> StepResult` runs one step's dispatches (packed prefills, seeding
waves, the decode tile) and returns, per sampled request, the accepted tokens (1..8) and the
duration of each dispatch.  The cost-model executor takes durations from `CostModel` and
acceptance from an `AcceptanceModel`; golden and device executors implement the same method and
return real tokens and measured durations, so the scheduler and the engine never change.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from twin.abi import constants as C
from twin.abi.batches import DispatchTiming, StepResult
from twin.abi.errors import ConfigError
from twin.abi.lowering.decode import owner_member
from twin.abi.lowering.drafter import BOOTSTRAP, context_bucket

from .acceptance import AcceptanceModel, ConditionalAcceptance
from .costmodel import CostModel
from .worker import StepPlan


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...


# ---- one dispatch's virtual time, shared by every executor that reports in the cost model's time ----
# (cost None: an untimed run, every dispatch 0 s)
def prefill_timing(cost: CostModel | None, batch, partitions: int) -> DispatchTiming:
    groups: list[list[tuple[int, int]]] = [[] for _ in range(partitions)]
    for it in batch.items:
        groups[it.partition].append((it.num_tokens, it.num_computed))
    secs, parts = cost.prefill(groups) if cost is not None else (0.0, {})
    return DispatchTiming("prefill", secs, parts, {"requests_per_group": [len(g) for g in groups],
                                                   "tokens_per_group": [sum(n for n, _ in g) for g in groups],
                                                   "requests": [it.request_id for it in batch.items]})


def seed_rows(longest_prompt: int) -> int:
    """A seeding wave's bootstrap drafter context bucket: the band of its longest 128-token tail
    (the prompt's last SLIDING_WINDOW tokens) per TP rank."""
    return context_bucket(BOOTSTRAP, -(-min(C.SLIDING_WINDOW, longest_prompt) // C.TP_SIZE))


# pypto-lib#1213 fault model: an EP16 prefill dispatch hangs with a given probability, drawn from
# its own stream (seed + 1213) so the acceptance draws do not move; the worker step then times out
# (SERVING_WORKER_STEP_TIMEOUT, 1200 s) and the batch aborts.
HANG_ERROR = "TENSOR_WAIT_TIMEOUT: l3_prefill_fwd hang at EP16 (pypto-lib#1213 fault model)"


def hang_probability(p: float, dep) -> float:
    """The hang probability of one prefill dispatch: the fault is reported at EP16 only, so any other
    topology refuses a non-zero `p` rather than quietly running without it."""
    if p and dep.topology.ep != 16:
        raise ConfigError("prefill_hang_probability", p, f"0 at ep={dep.topology.ep}: the pypto-lib#1213 hang "
                          "model is of EP16 prefill dispatches")
    return p


def fault_rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed + 1213)


def prefill_hangs(p: float, rng: np.random.Generator) -> bool:
    """Whether this prefill dispatch hangs (no draw when `p` is 0)."""
    return bool(p) and rng.random() < p


def seed_timing(cost: CostModel | None, wave) -> DispatchTiming:
    """A seeding wave: the bootstrap drafter's context bucket of the wave's longest 128-row tail band."""
    rows = seed_rows(max(it.prompt_len for it in wave))
    secs, parts = cost.seed(rows) if cost is not None else (0.0, {})
    return DispatchTiming("seed", secs, parts, {"requests": [it.request_id for it in wave]})


def decode_timing(cost: CostModel | None, decode_groups, ctxs: list[list[int]], k: int) -> DispatchTiming:
    """The decode tile; ctxs[g][i]: the context length of decode_groups[g][i].  A K=7 row runs on its
    lease's owner rank, a K=0 row round-robin by its ordinal in the group."""
    owners = [[owner_member(k, it.lease, o) for o, it in enumerate(grp)] for grp in decode_groups]
    secs, parts = cost.decode(ctxs, owners) if cost is not None else (0.0, {})
    return DispatchTiming("decode", secs, parts, {"requests_per_group": [len(g) for g in decode_groups]})


@dataclass
class _ReqState:
    prompt_len: int
    committed: int = 0               # committed_count: the next verify anchor
    emitted: int = 0                 # output index of the next token
    script: dict = field(default_factory=dict)
    seed: int = 0


class CostModelExecutor:
    """Virtual time from the cost model; synthetic, deterministic tokens (planted EOS and stop
    tokens from the request's script); acceptance from the acceptance model."""

    def __init__(self, cost: CostModel, acceptance: AcceptanceModel | None = None, *, seed: int = 0,
                 eos_token_id: int | None = None, prefill_hang_probability: float = 0.0,
                 step_timeout: float = 1200.0):
        self.cost = cost
        self.dep = cost.dep
        self.acceptance = acceptance or ConditionalAcceptance()
        self.rng = np.random.default_rng(seed)
        self.state: dict[str, _ReqState] = {}
        self.max_pos = self.dep.limits.max_model_len
        self.vocab = self.dep.model.vocab_size
        self.eos = eos_token_id if eos_token_id is not None else self.dep.model.eos_token_id
        self.hang_p = hang_probability(prefill_hang_probability, self.dep)      # pypto-lib#1213
        self.step_timeout = step_timeout
        self._fault_rng = fault_rng(seed)

    def _tokens(self, st: _ReqState, n: int, pool: list[int] | None = None) -> list[int]:
        base = st.emitted
        toks = self.rng.integers(2, self.vocab, n).tolist() if pool is None else pool
        if st.script:
            for j in range(n):
                t = st.script.get(base + j)
                if t is not None:
                    toks[j] = t
        st.emitted += n
        return toks

    def execute(self, plan: StepPlan) -> StepResult:
        res = StepResult(plan.step_id)
        for rid in plan.finished_ids:
            self.state.pop(rid, None)
        for rid, req in plan.requests.items():
            # a re-admitted request restarts its device state at the prompt (serving-contract §4.7)
            self.state[rid] = _ReqState(req.prompt_len, 0, len(req.outputs), req.script)
        if plan.error:
            res.error = plan.error
            res.dispatches.append(DispatchTiming("error", self.cost.device.dispatch_overhead, meta={"error": plan.error}))
            return res
        cm = self.cost
        G = self.dep.partitions
        for batch in plan.prefill:
            t = prefill_timing(cm, batch, G)
            if prefill_hangs(self.hang_p, self._fault_rng):
                res.error = HANG_ERROR
                res.dispatches.append(DispatchTiming("prefill", self.step_timeout, {"timeout": self.step_timeout},
                                                     {**t.meta, "hang": True}))
                return res
            res.dispatches.append(t)
            for it in batch.items:
                if it.terminal:
                    st = self.state.get(it.request_id)
                    if st is None:
                        st = self.state[it.request_id] = _ReqState(it.prompt_len)
                    st.committed = it.prompt_len
                    res.tokens[it.request_id] = self._tokens(st, 1)
        for wave in plan.seed_waves:
            res.dispatches.append(seed_timing(cm, wave))
        if plan.decode is not None:
            self._decode(plan, res)
        return res

    def _decode(self, plan: StepPlan, res: StepResult) -> None:
        k = self.dep.k
        state = self.state
        ctxs, order = [], []
        for items in plan.decode_groups:
            c = []
            for it in items:
                st = state.get(it.request_id)
                if st is None:
                    st = state[it.request_id] = _ReqState(0)
                c.append(st.committed + 1)
                order.append((it, st))
            ctxs.append(c)
        timing = decode_timing(self.cost, plan.decode_groups, ctxs, k)
        n = len(order)
        if k:
            ceiling = self.max_pos - C.DECODE_SEQ
            fit = [bool(it.pending_drafts) and st.committed <= ceiling for it, st in order]
            counts = self.acceptance.counts(n, np.array(fit, dtype=bool), self.rng)
        else:
            fit = [False] * n
            counts = np.ones(n, dtype=np.int64)
        cl = counts.tolist()
        pool = self.rng.integers(2, self.vocab, sum(cl)).tolist()
        at = 0
        tokens, accepted, drafts = res.tokens, res.accepted, res.drafts
        for (it, st), cnt, f in zip(order, cl, fit):
            rid = it.request_id
            tokens[rid] = self._tokens(st, cnt, pool[at:at + cnt])
            at += cnt
            accepted[rid] = cnt
            drafts[rid] = k if f else 0
            st.committed += cnt
        res.dispatches.append(timing)
