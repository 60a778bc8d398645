"""Parity runs: the one scheduler driving a lockstep checker.

    lr = build_lockstep(preset="tiny", k=7, max_new=24)          # 4 seeded prompts, 2 slots per partition
    summary = lr.run(steps=40)                                   # summary["verdict"], ["first_divergence"]
    lr.entries, lr.dev, lr.gold                                  # the checker's report lines and sides

The run is a simulation (`twin.sim`: engine, scheduler, worker, prefix cache, leases) whose executor
is `GoldenExecutor` with a lockstep checker (`hw.real.lockstep.RealLockstep`) as its host: each
lowered, validated dispatch runs on the device backend and on golden, is compared, and the device's
outputs are what the scheduler commits.  So every scheduling decision a capacity or functional run
makes happens in parity too; the summary's config carries the run's serving counts (`serving`):
prefix hits (requests, tokens), preemptions, lease reuse, K=7 fallback rows, packed and chunked
prefill, seeding waves.

This module composes twin.sim, golden and hw (docs/architecture.md, "Import rules": the functional
twin is the composition layer); hw and twin.sim never import each other.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass

import numpy as np

from golden.dispatch import Halt
from twin.abi.errors import AbiError
from twin.abi.lowering import LoweringContext
from twin.abi.presets import get_preset
from twin.abi.topology import deployment
from twin.sim.costmodel import DeviceLimits
from twin.abi.batches import Request, Sampling
from twin.sim.run import SimConfig, build, startup_slots

from .executor import GoldenExecutor

PROMPT_LENS = (80, 40, 100, 30, 60, 50, 70, 20)


def seeded_requests(preset: str, *, seed: int = 0, n_requests: int = 4, max_new: int = 24) -> list[Request]:
    """`n_requests` seeded prompts (lengths cycling through PROMPT_LENS), all arriving at t = 0."""
    cfg = get_preset(preset)
    rng = np.random.default_rng(seed)
    return [Request(f"r{i}", rng.integers(2, cfg.vocab_size - 1, PROMPT_LENS[i % len(PROMPT_LENS)]),
                    Sampling(max_new, ignore_eos=True)) for i in range(n_requests)]


def request_rows(requests) -> list[dict]:
    """The requests as JSON rows (what records keep, so a replay re-drives the same workload)."""
    return [{"id": r.request_id, "prompt": [int(t) for t in r.prompt], "max_new_tokens": r.sampling.max_new_tokens,
             "eos_token_id": r.sampling.eos_token_id, "ignore_eos": r.sampling.ignore_eos,
             "stop": [list(s) for s in r.sampling.stop], "arrival": r.arrival, "tag": r.tag} for r in requests]


def requests_from_rows(rows) -> list[Request]:
    return [Request(d["id"], np.asarray(d["prompt"], np.int32),
                    Sampling(d["max_new_tokens"], d["eos_token_id"], d["ignore_eos"], tuple(map(tuple, d["stop"]))),
                    arrival=d["arrival"], tag=d["tag"]) for d in rows]


@dataclass
class ParityRun:
    sim: SimConfig
    checker: object                      # hw.real.lockstep.RealLockstep
    slots: int
    executor: GoldenExecutor | None = None
    serving: dict | None = None

    def __getattr__(self, name):
        # the checker's attributes (entries, dev, gold, crash_after, ...) read and set through the run
        if name in FIELDS:
            raise AttributeError(name)
        return getattr(self.checker, name)

    def __setattr__(self, name, value):
        if name in FIELDS:
            object.__setattr__(self, name, value)
        else:
            setattr(self.checker, name, value)

    def device_only(self, steps: int | None = None) -> int:
        """Serve the same workload with the device alone (no golden, no checks, no records); returns the
        dispatches run.  A run is used once: build another for the lockstep."""
        host = DeviceHost(self.checker, steps)
        dep = self.sim.dep

        def factory(cost, slots_):
            self.executor = GoldenExecutor(dep, slots_, host=lambda ctx: host, cost=cost)
            return self.executor

        self.sim.executor = factory
        self._serve()
        return host.index

    def _serve(self):
        """Drive the engine over the workload until it completes or the host halts it; the recorder."""
        env, eng, _, rec, _ = build(self.sim)
        eng.submit(self.sim.requests)
        try:
            env.run(until=eng.done)
        except Halt:
            pass
        return rec

    def run(self, steps: int | None = None, progress=None) -> dict:
        """Serve the workload until it completes, `steps` dispatches are checked, or (strict) one fails."""
        if steps is not None:
            if steps < 1:
                raise AbiError("steps", steps, ">= 1", where="lockstep")
            self.checker.steps = steps
        self.checker.progress = progress
        self.serving = serving_counts(self._serve(), self.executor)
        return self.checker.finish(self.serving)

    def run_async(self, steps: int | None = None, *, workers=1, backlog: int | None = None, policy: str = "throttle",
                  every: int = 1, progress=None) -> dict:
        """Serve the workload with the device alone in the loop: each dispatch is recorded and its
        check (`check`, every `every`-th dispatch) goes to a pool of checker workers (`hw.real.pool`):
        workers an int (local processes) or a `hw.real.pool.RayWorkers`.  Built with coverage N, every
        dispatch's check is the plan's sites for it and the head (one task), and the summary keeps the
        coverage ledger as a synchronous sampled run's.  The run directory must be fresh.  The
        summary's config gains `checking` (`CheckPool.stats`)."""
        from hw.real.pool import BACKLOG, CheckPool, LocalWorkers
        from hw.report import ReportWriter

        c = self.checker
        if c.recorder is None:
            raise AbiError("run_dir", None if c.dir is None else str(c.dir), "a run directory with records "
                           "(the asynchronous checks read them)", where="lockstep")
        if ReportWriter(c.dir).entries():
            raise AbiError("run_dir", str(c.dir), "a fresh run directory (an asynchronous run does not resume: "
                           "--fresh)", where="lockstep")
        if steps is not None and steps < 1:
            raise AbiError("steps", steps, ">= 1", where="lockstep")
        if c.plan is not None and every != 1:
            raise AbiError("every", every, f"1 with coverage {c.plan.n} (the plan chooses each dispatch's sites)",
                           where="lockstep")
        from hw.real.records import WRITE_AHEAD, RecordThread

        backlog = BACKLOG if backlog is None else backlog
        w = LocalWorkers(workers) if isinstance(workers, int) else workers
        writer = RecordThread(c.recorder, min(backlog, WRITE_AHEAD))
        unit = check if c.checker_golden == "numpy" else functools.partial(check, golden=c.checker_golden)
        try:
            pool = CheckPool(unit, c.dir, w, backlog=backlog, policy=policy, every=every, strict=c.mode == "strict",
                             check_policy=c.policy, write=lambda e: c.report.append(e), writer=writer)
        except BaseException:           # a refused backlog or policy: no writer thread or workers left behind
            try:
                writer.close()
            finally:
                w.close()
            raise
        c.pool, c.steps, c.progress = pool, steps, progress
        try:
            self.serving = serving_counts(self._serve(), self.executor)
            pool.drain()
        finally:
            try:
                writer.close()
            finally:
                pool.close()
        c.entries = pool.entries
        c.config["checking"] = pool.stats()
        return c.finish(self.serving)


FIELDS = ("sim", "checker", "slots", "executor", "serving")


class DeviceHost:
    """The device alone behind the executor: the same parity run with no golden and no checks
    (what `benchmarks/lockstep_overhead.py` measures the lockstep against)."""

    def __init__(self, checker, steps: int | None):
        self.checker, self.backend, self.steps, self.index = checker, checker.backend, steps, 0

    @property
    def seqs(self) -> dict:
        return self.checker.dev.served.seqs

    def admit(self, rid, prompt, max_new_tokens) -> None:
        self.backend.admit(rid, prompt, max_new_tokens)

    def drop(self, rid) -> None:
        self.backend.drop(rid)

    def last_token(self, rid) -> int:
        return self.checker.dev.served.last_token(rid)

    def speculation(self) -> dict:
        return self.checker.dev.served.speculation()

    def dispatch(self, kind, d, items):
        from golden.dispatch import Ran, run_dispatch
        from hw.real.side import install_state, side_state
        from twin.abi.batches import Dispatch

        dev = self.checker.dev
        if d is None:
            return run_dispatch(dev.served, kind, d, items)
        r = self.backend.run(Dispatch(d.program, d.args, {**d.meta, "index": self.index, "kind": kind,
                                                          "items": list(items)}), side_state(dev))
        if r.state:
            install_state(dev, {**side_state(dev), **r.state})
        self.index += 1
        if self.steps is not None and self.index >= self.steps:
            raise Halt(f"{self.index} dispatches run")
        return Ran(r.outputs, list(r.seqs))


def serving_counts(rec, ex: GoldenExecutor) -> dict:
    """What the scheduler did in the run (so far): the decisions a parity run must exercise."""
    p = rec.prefix
    return {"prefix_hit_requests": int(p["hits"]), "prefix_hit_tokens": int(p["hit_tokens"]),
            "preemptions": int(sum(1 for e in rec.events if e[1] == "preempt")),
            "fallback_steps": int(rec.fallbacks), **ex.counts, "leases_reused": ex.leases_reused,
            "dispatches": ex.dispatches}


def build_lockstep(*, preset: str = "tiny", backend: str = "selfcheck", device: str = "cpu", mode: str = "strict",
                   seed: int = 0, golden_mode: str = "device", k: int = 7, requests=None, n_requests: int = 4, max_new: int = 24,
                   slots: int | None = None, total_kv_pages: int | None = None, chunk: int = 64,
                   max_model_len: int = 512, max_num_seqs: int | None = None, max_num_batched_tokens: int = 256,
                   ep: int = 8, fault=None, policy=None, run_dir=None, carry: str = "device", record: bool = True,
                   steps: int | None = None, nproc: int = 1, coverage: int | str | None = None,
                   coverage_seed: int = 0, checker_golden: str = "numpy") -> ParityRun:
    """A parity run on a small preset's deployment (TP4, EP8 by default: two cache partitions).

    requests: `twin.abi.batches.Request`s (a workload spec's or a trace's), default `seeded_requests`.
    slots / total_kv_pages: the KV budget (default 2 slots per partition; total_kv_pages: startup
    admission from upstream's page budget).  backend: "selfcheck" (golden's compositions with torch
    GEMMs, `hw.real.selfcheck`) or "torch" (the independent `hw.torchdev.TorchBackend`), on `device`.  nproc: the torch device's ranks split
    over that many torch.distributed processes, this one process 0 (`hw.launch.torch_device_ranks`
    sets them up); the results, and so the run, are the same bit for bit.  coverage: None checks every dispatch in
    full; N samples (`hw.real.coverage`: every site at least once every N dispatches of its program,
    the permutation of `coverage_seed`; N = 1 checks every site, each from the device's state); "auto"
    checks every site on the first `hw.real.coverage.CALIBRATION` dispatches, then fixes N from the
    checker's and the device's measured rates (`RealLockstep.choose_coverage`).  checker_golden: the
    site checks' golden, numpy, jax or auto (`hw.real.jax_check`); a checker-side choice, so not
    among the arguments that rebuild the run."""
    from hw.real.lockstep import BACKENDS, build_checker

    cfg = get_preset(preset)
    if not cfg.small:
        raise AbiError("preset", preset, "a small preset (tiny or small): the real path runs whole models",
                       where="lockstep")
    if backend not in BACKENDS:
        raise AbiError("backend", backend, f"one of {', '.join(BACKENDS)}", where="lockstep")
    if slots is not None and total_kv_pages is not None:
        raise AbiError("slots", slots, "not together with total_kv_pages (one KV budget)", where="lockstep")
    if coverage is not None:
        from hw.real.coverage import check_coverage

        coverage = check_coverage(coverage, where="lockstep")
        if backend != "selfcheck":
            raise AbiError("coverage", coverage, "none with backend torch (a site check reads the staged meta of "
                           "the self-check device's forward)", where="lockstep")
    if slots is None and total_kv_pages is None:
        slots = 2
    if requests is None:
        requests = seeded_requests(preset, seed=seed, n_requests=n_requests, max_new=max_new)
    requests = list(requests)
    dep = _deployment(cfg, ep=ep, max_model_len=max_model_len, chunk=chunk, max_num_seqs=max_num_seqs, slots=slots,
                      max_num_batched_tokens=max_num_batched_tokens, k=k)
    sim = SimConfig(dep, requests, slots=slots, total_kv_pages=total_kv_pages, seed=seed)
    admitted = startup_slots(sim, DeviceLimits.load())
    # what rebuilds this run (records/config.json): resume checks it, replay re-drives it
    build_args = {"preset": preset, "backend": backend, "device": device, "mode": mode, "seed": seed, "golden_mode": golden_mode, "k": k,
                  "slots": slots, "total_kv_pages": total_kv_pages, "chunk": chunk, "max_model_len": max_model_len,
                  "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens, "ep": ep,
                  "carry": carry, "requests": request_rows(requests), "coverage": coverage,
                  "coverage_seed": coverage_seed,
                  "fault": None if fault is None else fault.spec()}
    checker = build_checker(LoweringContext(dep, admitted), backend=backend, device=device, mode=mode, seed=seed,
                            golden_mode=golden_mode, fault=fault, policy=policy, run_dir=run_dir, carry=carry,
                            record=record, build=build_args, steps=steps,
                            config={"requests": len(requests), "slots_per_partition": admitted}, nproc=nproc,
                            coverage=coverage, coverage_seed=coverage_seed, checker_golden=checker_golden)
    run = ParityRun(sim, checker, admitted)

    def factory(cost, slots_):
        if slots_ != admitted:
            raise AbiError("slots", slots_, f"the {admitted} slots the checker was built for", where="lockstep")
        run.executor = GoldenExecutor(dep, slots_, host=lambda ctx: checker, cost=cost)
        return run.executor

    sim.executor = factory
    return run


def _deployment(cfg, *, ep, max_model_len, chunk, max_num_seqs, slots, max_num_batched_tokens, k):
    """The parity run's deployment (a live run's and a checker worker's plan read it)."""
    return deployment(cfg, ep=ep, max_model_len=max_model_len, long_prefill_token_threshold=chunk,
                      max_num_seqs=max_num_seqs or (ep // 4) * (slots or 4),
                      max_num_batched_tokens=max_num_batched_tokens, num_speculative_tokens=k)


def rebuild(build_args: dict, **kw) -> ParityRun:
    """The parity run `build_args` (records/config.json) describes; kw overrides (policy, record, ...)."""
    b = dict(build_args)
    b["requests"] = requests_from_rows(b["requests"])
    f = b.pop("fault")
    if f is not None and "fault" not in kw:
        from hw.real.faults import RealFault
        kw["fault"] = RealFault(**f)
    return build_lockstep(**{**b, **kw})


def run_case(kind: str, *, seed: int, at: int, layer: int, preset: str = "tiny", max_new: int = 40,
             horizon: int = 60, persistent: bool = False, workers=None, **build) -> dict:
    """One injection: a strict parity run with the device fault (`hw.real.faults.RealFault`), run until
    it stops (the first failure), the workload ends or `horizon` dispatches.  detected: the run failed
    at the dispatch the fault (first) fired at or, persistent, at one after it, and not before;
    localized: the first divergence names the fault's expected (layer, stage).  latency: dispatches
    from the first firing to the detection, both counted (1: detected where it first fired), and
    program_latency the same counted in dispatches of the detecting dispatch's program.  workers: the
    run checked asynchronously on them (`ParityRun.run_async`, throttled so no check is skipped; build
    needs a fresh run_dir)."""
    from hw.real.faults import RealFault

    f = RealFault(kind, at=at, layer=layer, seed=1000 * seed + 10 * at + layer, persistent=persistent)
    lr = build_lockstep(preset=preset, seed=seed, k=7, max_new=max_new, fault=f, **build)
    s = lr.run(horizon) if workers is None else lr.run_async(horizon, workers=workers, policy="throttle")
    fd = s["first_divergence"]
    fails = [e["index"] for e in lr.entries if e["verdict"] == "fail"]
    out = {"kind": kind, "seed": seed, "at": at, "layer": layer, "fired_at": f.fired_at, "fired": f.fired,
           "dispatches": s["dispatches"],
           "expected": None if f.expected is None else [f.expected[0], list(f.expected[1])],
           "got": None if fd is None else [fd["dispatch"], fd["layer"], fd["stage"]]}
    out["false_alarm"] = bool(fails) and (f.fired_at is None or fails[0] < f.fired_at)
    out["detected"] = f.fired_at is not None and bool(fails) and (
        fails[0] >= f.fired_at if persistent else fails[0] == f.fired_at)
    out["localized"] = bool(out["detected"] and fd["layer"] == f.expected[0] and fd["stage"] in f.expected[1])
    if out["detected"]:
        prog = lr.entries[fails[0]]["program"]
        out["latency"] = fails[0] - f.fired_at + 1
        out["program_latency"] = sum(e["program"] == prog for e in lr.entries[f.fired_at:fails[0] + 1])
    return out


def single_dispatch_case(kind: str, *, at: int, layer: int, n: int, plan_seeds, seed: int = 0, preset: str = "tiny",
                         max_new: int = 8, run_dir) -> dict:
    """A fault injected into one dispatch, caught by a sampled check with the plan's probability?

    The run is checked at coverage 1 (every site) with records in `run_dir`; the sites failing at the
    dispatch the fault fired at are the set A it shows at.  For each plan seed, the dispatch's planned
    sites at coverage `n` are checked from the records (`hw.real.site_check.check_recorded`): caught
    when one fails (the drafter site among them) or the head check does.  Returns the measured frequency and the plan's probability
    (`CoveragePlan.hit_probability`, the chance a seed's slot meets A), and the seeds whose outcome
    is not the plan's (caught exactly when the slot meets A): none, unless a site check misjudges."""
    from hw.real.coverage import CoveragePlan
    from hw.real.faults import RealFault
    from hw.real.site_check import check_recorded

    f = RealFault(kind, at=at, layer=layer, seed=1000 * seed + 10 * at + layer)
    lr = build_lockstep(preset=preset, seed=seed, k=7, max_new=max_new, coverage=1, fault=f, run_dir=run_dir,
                        mode="continuous")
    lr.run(at + 1)
    if f.fired_at is None:
        return {"kind": kind, "fired_at": None}
    e = lr.entries[f.fired_at]
    prog, nth = e["program"], e["coverage"]["nth"]
    affected = sorted((prog, *x[:3]) for x in e["sites"] if x[3] == "fail")
    head = any(not h["passed"] for h in e["findings"] if tuple(h["site"] or ())[:1] == ("head",))
    caught, probs, disagree = [], [], []
    for s in plan_seeds:
        plan = CoveragePlan.for_deployment(lr.sim.dep, n, s)
        probs.append(1.0 if head else plan.hit_probability(prog, affected))
        planned = plan.plan(prog, nth)
        r = check_recorded(str(run_dir), f.fired_at, planned)
        caught.append(any(x["verdict"] == "fail" for x in r["sites"]) or any(not h["passed"] for h in r["head"]))
        # each seed's outcome is the plan's: caught exactly when its slot meets A (or the head fails)
        if caught[-1] != (head or bool(set(planned) & set(affected))):
            disagree.append(s)
    return {"kind": kind, "layer": layer, "fired_at": f.fired_at, "program": prog, "n": n, "trials": len(caught),
            "affected_sites": [list(a) for a in affected], "head": head, "caught": sum(caught),
            "disagree_with_plan": disagree,
            "frequency": sum(caught) / len(caught), "plan_probability": float(sum(probs) / len(probs))}


def replay_records(run_dir, *, policy=None, workers=None, checker_golden: str = "numpy") -> list[dict]:
    """Re-judge a recorded run offline: its scheduler re-driven with the recorded device outputs and
    state (no device), golden live on every record (`check_dispatches`), the same checks; returns the
    report entries (one per record).  workers (a `hw.real.pool.RayWorkers` or `LocalWorkers`): the
    records' checks fanned out over them in contiguous chunks (`hw.real.pool.fan_out`), the same
    entries.  checker_golden: the site checks' golden (`hw.real.jax_check`)."""
    from pathlib import Path

    from hw.records import RecordStore
    from hw.real.records import read_config

    run_dir = Path(run_dir)
    read_config(run_dir)
    n = len(RecordStore(run_dir / "records").records())
    unit = functools.partial(check_dispatches, checker_golden=checker_golden)
    if workers is None:
        return unit(run_dir, range(n), policy) if n else []
    from hw.real.pool import fan_out

    return fan_out(unit, run_dir, n, workers, policy)


def check_dispatches(run_dir, indices, policy=None, checker_golden: str = "numpy") -> list[dict]:
    """The report entries of the recorded dispatches `indices` of `run_dir`, each checked on its own
    (`hw.real.replay.Seek`): golden's state and bookkeeping before dispatch i are the records', so an
    entry is the same whichever other dispatches are checked with it, in one call or on another worker.
    Entries come back in dispatch order."""
    from pathlib import Path

    from hw.real.records import read_config
    from hw.real.replay import Seek

    run_dir = Path(run_dir)
    lr = rebuild(read_config(run_dir), policy=policy, record=False, fault=None, checker_golden=checker_golden)
    if lr.checker.auto is not None:
        from hw.real.lockstep import read_coverage_choice

        choice = read_coverage_choice(run_dir)      # the N the run chose (none: it ended calibrating)
        if choice is not None:
            lr.checker.apply_coverage(choice)
    seek = Seek(lr.checker, run_dir, indices)
    lr.run(len(seek.want))
    got = [e["index"] for e in lr.entries]
    if got != seek.want:
        raise AbiError("index", sorted(set(seek.want) - set(got))[:4], "dispatches the re-driven scheduler issues "
                       f"(it issued {got[-1] + 1 if got else 0})", where=f"hw.real replay {run_dir}")
    return list(lr.entries)


def check(run_dir, index: int, sites=None, policy=None, golden: str = "numpy") -> dict:
    """The checker's unit of work: recorded dispatch `index` of `run_dir` re-judged from the records
    alone (paths and ints in, a JSON-able report entry out, so it runs in a worker process or a Ray
    task).  sites: None checks the whole dispatch (re-driving the scheduler to it); a sampled run's
    sites of the dispatch (program, group, layer, stage) check those and the head from the device's
    recorded state (`hw.real.site_check`), the drafter site's too, their sub-layers on `golden`
    (`hw.real.jax_check`)."""
    if sites is None:
        return check_dispatches(run_dir, [index], policy=policy, checker_golden=golden)[0]
    from hw.real.site_check import recorded_view, sampled_entry

    sites = [tuple(s) for s in sites]
    plan = recorded_plan(run_dir)
    sg, about, view = recorded_view(str(run_dir), index, policy, golden)
    wrong = [s for s in sites if s not in plan.sites.get(about["program"], ())]
    if wrong:
        raise AbiError("sites", wrong[:4], f"sites of dispatch {index}'s program {about['program']} in the run's "
                       "coverage plan", where="lockstep check")
    return sampled_entry(sg, view, {"index": int(index), **about}, sites, plan.sites[about["program"]])


_PLANS: dict = {}


def recorded_plan(run_dir):
    """The coverage plan of a run recorded with --coverage (its config's deployment, N and seed);
    cached per process and run config."""
    from hw.real.coverage import CoveragePlan
    from hw.real.records import per_run

    def build(b):
        if b.get("coverage") is None:
            raise AbiError("sites", "a list", f"None: {run_dir} was recorded without --coverage (its records keep "
                           "only the decision taps)", where="lockstep check")
        dep = _deployment(get_preset(b["preset"]), ep=b["ep"], max_model_len=b["max_model_len"], chunk=b["chunk"],
                          max_num_seqs=b["max_num_seqs"], slots=b["slots"],
                          max_num_batched_tokens=b["max_num_batched_tokens"], k=b["k"])
        # the sites are the plan's whatever its N (an auto run's N is chosen during the run)
        n = 1 if b["coverage"] == "auto" else b["coverage"]
        return CoveragePlan.for_deployment(dep, n, b["coverage_seed"])

    return per_run(_PLANS, run_dir, build)
