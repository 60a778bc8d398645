"""One functional run: the simulator (same scheduler, same engine, same report) with the golden
executor producing the tokens, and the cost model still timing every dispatch.

    res = functional_simulate(dep, requests, golden_model("tiny"), slots=2)
    res.tokens            # request id -> generated tokens (what the scheduler committed)
    res.sim               # the twin.sim.SimResult: summary, requests, steps, risks ...
    res.schedule          # per step: which requests were prefilled (start, tokens) or decoded
    res.write("out/")     # the cost-model run's files + tokens.jsonl + acceptance.json

`schedule` is recorded from the worker plans, i.e. the decisions themselves; the same recorder
wraps any executor, so a cost-model run and a golden run can be compared step by step.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from golden.checkpoint import SyntheticCheckpoint
from golden.dspark import step as S
from golden.dspark.variants import drafter_variant
from golden.dspark.weights import DrafterCheckpoint
from twin.abi.outputs import write_text
from twin.abi.presets import get_preset
from twin.sim.run import SimConfig, SimResult, simulate

from .acceptance import acceptance_vector
from .executor import GoldenExecutor
from .replay import scheduler_for


def golden_model(preset: str = "tiny", *, seed: int = 0, nm: str = "device", drafter: str = "device") -> S.Golden:
    """Seeded synthetic target and drafter weights of a small preset (golden.checkpoint); drafter:
    "device" (pypto-lib's kernels) or "v4.1" (the released model's, golden.dspark.variants)."""
    cfg = get_preset(preset)
    variant = drafter_variant(drafter)
    return S.Golden(cfg, SyntheticCheckpoint(cfg, seed), DrafterCheckpoint(variant.moe_cfg(cfg), seed), nm=nm,
                    drafter=variant)


def decisions(plan) -> tuple:
    """What the scheduler decided in one step command, as the worker received it."""
    pre = tuple(tuple((it.request_id, it.num_computed, it.num_tokens, it.terminal) for it in b.items)
                for b in plan.prefill)
    dec = tuple(tuple((it.request_id, it.anchor) for it in g) for g in plan.decode_groups)
    return (plan.step_id, pre, dec, tuple(sorted(plan.requests)), tuple(plan.finished_ids))


class Recording:
    """Wraps an executor: records each step's decisions and each result's accepted counts."""

    def __init__(self, inner):
        self.inner = inner
        self.schedule: list[tuple] = []
        self.accepted: dict[int, dict[str, int]] = {}

    def execute(self, plan):
        self.schedule.append(decisions(plan))
        res = self.inner.execute(plan)
        self.accepted[plan.step_id] = dict(res.accepted)
        return res


@dataclass
class FunctionalResult:
    sim: SimResult
    executor: GoldenExecutor
    schedule: list
    accepted: dict                      # step id -> {request id: tokens the verify accepted}
    tokens: dict = field(default_factory=dict)

    @property
    def acceptance(self) -> dict:
        return acceptance_vector(self.executor.speculation())

    def write(self, out, *, plots: bool = True) -> list[str]:
        files = self.sim.write(out, plots=plots)
        return files + write_outputs(out, self.sim.config.requests, self.sim.scheduler, self.executor)


def write_outputs(out, requests, sched, executor: GoldenExecutor) -> list[str]:
    """What a golden run adds to the simulator's report: `tokens.jsonl` (one request per line: id,
    prompt_len, finish, the tokens the scheduler committed) and `acceptance.json` (golden's
    per-position acceptance, for `simulate --acceptance-from`)."""
    out = Path(out)
    lines = []
    for r in requests:
        req = sched.requests.get(r.request_id, r)
        lines.append(json.dumps({"id": r.request_id, "prompt_len": req.prompt_len,
                                 "finish": req.finish.value if req.finish else None,
                                 "tokens": [int(t) for t in req.outputs]}) + "\n")
    write_text(out / "tokens.jsonl", "".join(lines))
    write_text(out / "acceptance.json", json.dumps(acceptance_vector(executor.speculation()), indent=2))
    return ["tokens.jsonl", "acceptance.json"]


def functional_config(dep, requests, golden: S.Golden, *, recompute: str = "prompt", draft_policy=None,
                      check: bool = True, **sim_kw):
    """A SimConfig whose executor is golden's (wrapped in a `Recording`), and the holder the
    factory fills in when `simulate` builds the run."""
    holder: dict = {}
    factory = golden_factory(dep, golden, holder, draft_policy=draft_policy, check=check)
    return SimConfig(dep, list(requests), executor=factory, scheduler=scheduler_for(recompute), **sim_kw), holder


def golden_factory(dep, golden: S.Golden, holder: dict, **kw):
    """The `SimConfig.executor` factory: a `GoldenExecutor` (kw: draft_policy, check) wrapped in a
    `Recording`; both land in `holder` ("executor", "recording") when `simulate` builds the run."""
    def factory(cost, slots):
        holder["executor"] = ex = GoldenExecutor(dep, slots, golden, cost=cost, **kw)
        holder["recording"] = Recording(ex)
        return holder["recording"]
    return factory


def functional_simulate(dep, requests, golden: S.Golden, *, recompute: str = "prompt", draft_policy=None,
                        check: bool = True, **sim_kw) -> FunctionalResult:
    cfg, holder = functional_config(dep, requests, golden, recompute=recompute, draft_policy=draft_policy,
                                    check=check, **sim_kw)
    sim = simulate(cfg)
    rec = holder["recording"]
    tokens = {r.request_id: list(r.outputs) for r in cfg.requests}
    return FunctionalResult(sim, holder["executor"], rec.schedule, rec.accepted, tokens)
