"""Asynchronous checking: the device side records each dispatch and hands its check to a pool of
checker workers, never waiting on the golden unless the backlog is full.

    writer = RecordThread(lockstep.recorder, 8)          # hw.real.records: records hashed and written off-thread
    pool = CheckPool(unit, run_dir, LocalWorkers(1), backlog=32, policy="throttle", write=report.append,
                     writer=writer)
    lockstep.pool = pool            # RealLockstep.dispatch: device step, record captured, check submitted
    ...; pool.drain(); pool.stats()

unit(run_dir, index, sites, policy) -> report entry is the checker's unit of work
(`twin.functional.parity.check`): it re-judges recorded dispatch `index` from the records alone, so
checks run in any order, on any worker.  With a coverage plan (`hw.real.coverage`) a dispatch's
check is its planned sites and the head, one task per dispatch; without, the whole dispatch.  The device side records the golden's state as the device's own (no golden runs beside
it), so each check re-syncs golden from the device's recorded state before its dispatch; a failure
found asynchronously is reported with its dispatch index, and the run is not re-synced
retroactively (the device has moved on).

A submitted check is handed to the workers once the writer has its record on disk, up to `ahead`
checks per worker (the workers' own attribute): local processes are handed two each, so one check
waits in the executor's queue for each running one and a process goes from one check to the next
by itself instead of idling until the device side's next call collects the result (the device side
only looks in between its dispatches).  A check already handed over is not cancelled: a run that
ends on an error waits for those at close.

Backlog: the checks submitted and not finished.  When it is full (`backlog` checks), the policy
decides: `throttle` makes the device side wait for one check to finish; `skip-oldest` drops the
oldest check not yet handed to a worker (counted, and marked "skipped" per dispatch), and waits
like throttle only when every unfinished check is already with a worker.  Entries are written in
dispatch order as their results arrive (a result waits for the checks submitted before it).

Workers: `LocalWorkers(n)` (processes, `concurrent.futures`, spawned so no worker inherits the
device side's threads) or `RayWorkers()` (tasks on the Ray cluster `ray.init` connected to).
"""
from __future__ import annotations

import functools
import time
from collections import deque
from types import SimpleNamespace

from golden.dispatch import Halt
from twin.abi.errors import AbiError

POLICIES = ("throttle", "skip-oldest")
# checks pending at most by default.  A pending check holds only its dispatch index (its record is on
# disk, or among the few captures the writer holds: hw.real.records.WRITE_AHEAD), so the bound costs
# no memory; it absorbs the burst of prefill checks at a run's start, each several times a decode
# check's cost (on SMALL at coverage 16 with one worker the backlog peaks at 11 to 14, while the checker
# process starts).
BACKLOG = 32


def timed(unit, *args) -> dict:
    """unit(*args), its entry holding the seconds it took on its worker under "check_s" (the checker's
    throughput, --coverage auto's measurement; the pool takes it out before the entry is written)."""
    t0 = time.perf_counter()
    out = unit(*args)
    return {**out, "check_s": time.perf_counter() - t0}


def in_worker(fn, *args):
    """A check on a checker worker: one torch, one OpenBLAS and one XLA compute thread, as the CLI's
    and the tests' own process runs golden (a worker is one core's worth of checking, whichever
    golden, `hw.real.jax_check`, its site checks run on)."""
    from hw.threads import limit_cpu_threads, limit_xla_threads

    limit_cpu_threads(1)
    limit_xla_threads()
    return fn(*args)


def lowest_priority() -> str:
    """This process gets only CPU time nothing else on the machine wants: SCHED_IDLE where the kernel
    has it, else nice 19.  Returns which."""
    import os

    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return "SCHED_IDLE"
    except (AttributeError, OSError):
        os.nice(19 - os.nice(0))
        return "nice 19"


def checker_process() -> None:
    """A local checker process's settings: the lowest CPU priority, and glibc's freed heap kept for
    reuse as the CLI's own process does (`golden.heap`: golden's temporaries otherwise arrive as
    fresh pages, a spawned process inheriting nothing of its parent's)."""
    from golden.heap import retain_heap

    lowest_priority()
    retain_heap()


class LocalWorkers:
    """n checker processes on this machine, each one thread at the lowest CPU priority
    (`checker_process`): a check never takes a core from the device side, whose own threads the
    entry point sets (the CLI and the benchmark: one torch and one OpenBLAS thread on cpu), so
    device and checkers never oversubscribe the cores; a checker starved of CPU shows as a full
    backlog, which the backlog policy then handles (and reports)."""

    kind = "local"
    ahead = 2               # checks handed over per process: one running, one in the executor's queue

    def __init__(self, n: int):
        if n < 1:
            raise AbiError("check_workers", n, ">= 1", where="hw.real pool")
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.n = n
        self.ex = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"),
                                      initializer=checker_process)

    def start(self, fn, *args):
        return self.ex.submit(in_worker, fn, *args)

    def wait(self, handles: list, block: bool) -> list:
        from concurrent.futures import FIRST_COMPLETED, wait

        if not block:
            return [h for h in handles if h.done()]
        done, _ = wait(handles, return_when=FIRST_COMPLETED)
        return list(done)

    @staticmethod
    def result(h):
        return h.result()

    def close(self) -> None:
        self.ex.shutdown(wait=True, cancel_futures=True)


class RayWorkers:
    """Ray tasks on the cluster this process is connected to (`ray.init` first); n: how many run at
    once (default: the cluster's CPUs)."""

    kind = "ray"

    def __init__(self, n: int | None = None):
        import ray

        self.ray = ray
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.n = n or cpus
        # a Ray task starts wherever a CPU is free, so a second task per worker queues only where the
        # workers are every CPU of the cluster; fewer workers than CPUs get one each, or 2n would run
        self.ahead = 2 if self.n >= cpus else 1
        self._task = None

    def start(self, fn, *args):
        if self._task is None:
            self._task = self.ray.remote(num_cpus=1, max_retries=0)(in_worker)
        return self._task.remote(fn, *args)

    def wait(self, handles: list, block: bool) -> list:
        done, _ = self.ray.wait(handles, num_returns=1 if block else len(handles), timeout=None if block else 0)
        return done

    def result(self, h):
        return self.ray.get(h)

    def close(self) -> None:
        pass


class CheckPool:
    """Bounded, ordered asynchronous checks of the recorded dispatches of `run_dir`.

    unit(run_dir, index, sites, policy) -> entry; workers: `LocalWorkers` or `RayWorkers` (any object
    with their `kind`, `n`, `ahead`, `start`, `wait`, `result` and `close`);
    write(entry): called in dispatch order; every: submit every `every`-th dispatch's check (the
    others are "not sampled"); strict: the device side halts once a failing check comes back."""

    def __init__(self, unit, run_dir, workers, *, backlog: int = BACKLOG, policy: str = "throttle", write=None,
                 every: int = 1, strict: bool = False, check_policy=None, writer=None):
        if backlog < 1:
            raise AbiError("backlog", backlog, ">= 1", where="hw.real pool")
        if policy not in POLICIES:
            raise AbiError("backlog_policy", policy, f"one of {POLICIES}", where="hw.real pool")
        if every < 1:
            raise AbiError("every", every, ">= 1", where="hw.real pool")
        self.unit, self.run_dir, self.workers = unit, str(run_dir), workers
        self.timed = functools.partial(timed, unit)
        self.backlog, self.policy, self.write, self.every, self.strict = backlog, policy, write, every, strict
        self.check_policy = check_policy
        # hw.real.records.RecordThread: records written off the device side's thread, a check handed to
        # the workers once its record is on disk (None: `dispatch` writes each record before it returns)
        self.writer = writer
        self.pending: deque[int] = deque()          # submitted, not handed to a worker
        self.sites: dict[int, list | None] = {}     # a pending check's sites (None: the whole dispatch)
        self.running: dict = {}                     # handle -> index: handed to the workers (running or queued)
        self.slots = workers.n * workers.ahead      # checks with the workers at most
        self.done: dict[int, dict | None] = {}      # index -> entry (None: skipped)
        self.order: list[int] = []                  # submitted indices, in dispatch order
        self.written = 0
        self.entries: list[dict] = []
        self.status: list[str] = []                 # per dispatch: pass | fail | skipped | not sampled
        self.programs: list[str] = []
        self.high_water = 0
        # timings (kept out of stats, so the summary holds no wall-clock numbers)
        self.waited_s = 0.0                         # the device side's time blocked on a full backlog
        self.drain_s = 0.0                          # the run's end waiting for the last checks
        self.record_s = 0.0                         # the device side's time writing dispatch records
        self.check_s = 0.0                          # the workers' own time in the site checks finished
        self.checked_sites = 0                      # the target site checks they held
        self.n_sites: dict[int, int] = {}           # a handed-over check's target sites
        self.failed_at: int | None = None

    # ---- the device side ----------------------------------------------------------------------------
    def dispatch(self, lr, rd):
        """`RealLockstep.dispatch` with a pool: the device runs the dispatch, its record is captured
        for the writer (or, without one, written; the golden's state recorded as the device's), and
        its check is submitted."""
        step = lr.last_step = lr.device_step(rd)
        mirror = SimpleNamespace(dev=lr.dev, gold=lr.dev, last_step=step)
        sites = None
        if lr.plan is not None:
            # sampled: this dispatch's sites of the plan, one task; the record keeps the taps they read
            sites = [list(x) for x in lr.planned(rd.dispatch.program)[1]]
        t0 = time.perf_counter()
        # what the record keeps follows the verdict and the sites a report line holds (group, layer, stage,
        # verdict); the check is yet to run
        entry = {"verdict": "pass"}
        if sites is not None:
            entry["sites"] = [[*s[1:], "queued"] for s in sites]
        if self.writer is None:
            lr.recorder.record(mirror, rd, entry)
        else:
            self.writer.put(lr.recorder.capture(mirror, rd, entry))
        self.record_s += time.perf_counter() - t0
        self.programs.append(rd.dispatch.program)
        if rd.index % self.every == 0:
            self.status.append("pending")
            self.submit(rd.index, sites)
        else:
            self.status.append("not sampled")
        self.pump(block=False)
        if lr.progress:
            state = self.status[rd.index]
            lr.progress({"index": rd.index, "program": rd.dispatch.program,
                         "verdict": "queued" if state == "pending" else state})
        if (lr.steps is not None and lr.index >= lr.steps) or (self.strict and self.failed_at is not None):
            raise Halt(f"{lr.index} dispatches run")
        return lr.last_ran

    def submit(self, index: int, sites=None) -> None:
        """Queue dispatch `index`'s check (sites: the sampled sites it checks, None the whole dispatch)."""
        while len(self.pending) + len(self.running) >= self.backlog:
            if self.policy == "skip-oldest" and self.pending:
                old = self.pending.popleft()
                self.sites.pop(old, None)
                self.done[old] = None
                self.status[old] = "skipped"
                self._flush()
            else:
                t0 = time.perf_counter()
                self.pump(block=True)
                self.waited_s += time.perf_counter() - t0
        self.pending.append(index)
        self.sites[index] = sites
        self.order.append(index)
        self.high_water = max(self.high_water, len(self.pending) + len(self.running))
        self._start()

    # ---- the results ----------------------------------------------------------------------------------
    def _recorded(self, i: int) -> bool:
        return self.writer is None or i < self.writer.written

    def _start(self) -> None:
        while self.pending and len(self.running) < self.slots and self._recorded(self.pending[0]):
            i = self.pending.popleft()
            sites = self.sites.pop(i)
            self.n_sites[i] = sum(s[2] != "drafter" for s in sites or ())
            self.running[self.workers.start(self.timed, self.run_dir, i, sites, self.check_policy)] = i

    def pump(self, block: bool) -> None:
        """Collect finished checks (block: wait for at least one) and start pending ones."""
        if block and not self.running and self.pending and self.writer is not None:
            self.writer.wait(self.pending[0] + 1)          # the oldest check waits on its record
            self._start()
        if self.running:
            for h in self.workers.wait(list(self.running), block):
                i = self.running.pop(h)
                e = self.done[i] = self.workers.result(h)
                secs, n = e.pop("check_s", None), self.n_sites.pop(i)
                if n and secs is not None:
                    self.check_s += secs
                    self.checked_sites += n
                self.status[i] = e["verdict"]
                if e["verdict"] == "fail" and self.failed_at is None:
                    self.failed_at = i
        self._start()
        self._flush()

    def _flush(self) -> None:
        while self.written < len(self.order) and self.order[self.written] in self.done:
            e = self.done.pop(self.order[self.written])
            if e is not None:
                self.entries.append(e)
                if self.write is not None:
                    self.write(e)
            self.written += 1

    def settle(self) -> float:
        """Wait for every submitted check; returns the seconds waited."""
        t0 = time.perf_counter()
        while self.pending or self.running:
            self.pump(block=True)
        return time.perf_counter() - t0

    def drain(self) -> None:
        """Wait for every submitted check (the run's end); drain_s: how long that took."""
        self.drain_s = self.settle()

    def close(self) -> None:
        self.workers.close()

    def stats(self) -> dict:
        """What the summary reports: the policy, the backlog's high-water mark, the skipped checks
        and, per dispatch, whether (and how) it was checked."""
        return {"workers": {"kind": self.workers.kind, "n": self.workers.n}, "backlog": self.backlog,
                "policy": self.policy, "every": self.every, "backlog_high_water": self.high_water,
                "submitted": len(self.order), "checked": len(self.entries),
                "skipped": [i for i, s in enumerate(self.status) if s == "skipped"],
                "first_failure": self.failed_at,
                "per_dispatch": [{"index": i, "program": p, "checked": s}
                                 for i, (p, s) in enumerate(zip(self.programs, self.status))]}


def fan_out(unit_many, run_dir, n: int, workers, check_policy=None) -> list[dict]:
    """Offline replay on a pool: recorded dispatches 0..n-1 of `run_dir` split into one contiguous
    chunk per worker, each checked by unit_many(run_dir, indices, policy) -> entries (each entry
    depends on the records alone, so the chunks' entries joined in dispatch order are the serial
    replay's)."""
    if n < 1:
        return []
    k = min(n, workers.n)
    bounds = [round(j * n / k) for j in range(k + 1)]
    handles = [workers.start(unit_many, str(run_dir), list(range(a, b)), check_policy)
               for a, b in zip(bounds, bounds[1:])]
    out: list[dict] = []
    for h in handles:
        out += workers.result(h)
    return out
