"""A wall-clock driver: the scheduler and an executor with no SimPy and no virtual time.

The functional twin runs this loop with a golden executor (real accepted tokens), the lockstep
checker with a device executor; the capacity twin wraps the same scheduler in the SimPy engine.
Requests are all submitted up front; at depth 2 the next step is executed before the previous
result is applied, exactly the order the async engine dispatches in.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Iterable

from twin.abi.batches import Request

from .scheduler import Scheduler, StepCommand
from .worker import plan


def run_sync(scheduler: Scheduler, executor, dep, requests: Iterable[Request], *, depth: int = 1,
             on_step: Callable[[StepCommand, object], None] | None = None, max_steps: int | None = None) -> int:
    """Run until every request has finished (or the scheduler reports a livelock); returns the
    number of steps applied."""
    for r in requests:
        scheduler.add_request(r)
    inflight: deque = deque()
    steps = 0
    while scheduler.has_work or inflight:
        if max_steps is not None and steps >= max_steps:
            break
        if len(inflight) < depth and scheduler.has_work:
            cmd = scheduler.schedule()
            if cmd.scheduled:
                scheduler.advance_after_schedule(cmd)
                inflight.append((cmd, executor.execute(plan(cmd, dep))))
                continue
        if inflight:
            cmd, res = inflight.popleft()
            steps += 1
            if res.error:                       # the failed batch and every in-flight batch abort
                scheduler.fail_inflight([cmd, *(c for c, _ in inflight)], res.error)
                inflight.clear()
            else:
                scheduler.check_stop(scheduler.update_from_output(cmd, res.tokens))
            if on_step:
                on_step(cmd, res)
            if scheduler.livelock() is not None:
                break                           # upstream never ends; `scheduler.livelock()` says why
        else:
            scheduler.break_stall()
    return steps
