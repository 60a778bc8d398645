"""twin.functional: the simulator's scheduler driving golden with real tokens (docs/functional.md).

One system, not three: the same scheduler, lowering and ABI as the capacity twin, with a numeric
executor in place of the cost model: golden alone, or the lockstep checker (`hw.real`) running each
dispatch on a device and on golden (parity runs).  It composes `twin.sim`, `golden` and `hw`, which
may not import each other (docs/architecture.md, "Import rules").

    GoldenExecutor(dep, slots, golden, cost=None, draft_policy=None)   .execute(plan) -> StepResult
    functional_simulate(dep, requests, golden, recompute="prompt"|"replay") -> FunctionalResult
    golden_model(preset, seed=0, nm="device", drafter="device")           synthetic target + drafter
    sequential_greedy(golden, prompt, n) / reference_outputs(...)          the independent oracle
    first_difference(outputs, reference) -> (request, position, got, want) | None
    acceptance_vector(summary), load_acceptance(path)                     export for the cost model
    ReplayExecutor(cost_executor, accepted)                              cost model at golden's lengths
    build_lockstep(preset, ..., requests=None, slots=2) -> ParityRun       a parity run: the scheduler driving
                                                                         the lockstep checker (hw.real)
    replay_records(run_dir, workers=None), run_case(kind, seed=, at=, layer=)   offline re-judging; one injected fault
    check(run_dir, index) -> entry, check_dispatches(run_dir, indices)   one recorded dispatch re-judged from the records
    ParityRun.run_async(steps, workers=1, backlog=None, policy="throttle")  checks on a worker pool (hw.real.pool)
    single_dispatch_case(kind, at=, layer=, n=, plan_seeds=, run_dir=)   one firing against the coverage plan
"""
from .acceptance import acceptance_vector, conditional_rates, load_acceptance
from .executor import GoldenExecutor
from .oracle import first_difference, reference_outputs, sequential_greedy
from .parity import (ParityRun, build_lockstep, check, check_dispatches, replay_records, run_case,
                     single_dispatch_case)
from .replay import ReplayScheduler, scheduler_for
from .run import FunctionalResult, Recording, decisions, functional_config, functional_simulate, golden_model
from .same_lengths import ReplayExecutor

__all__ = ["acceptance_vector", "conditional_rates", "load_acceptance", "GoldenExecutor", "first_difference",
           "reference_outputs", "sequential_greedy", "ReplayScheduler", "scheduler_for", "FunctionalResult",
           "Recording", "decisions", "functional_config", "functional_simulate", "golden_model", "ReplayExecutor",
           "ParityRun", "build_lockstep", "check", "check_dispatches", "replay_records", "run_case",
           "single_dispatch_case"]
