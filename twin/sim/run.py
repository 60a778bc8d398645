"""One simulation run: wire deployment, capacity, scheduler, executor and engine; collect results.

    result = simulate(SimConfig(dep, requests=generate(default_spec())))
    result.summary, result.requests, result.steps, result.risks; result.write("out/")

Capacity comes from `twin.abi`: slots per partition from the HBM account (its `unexplained` line from
a measured boot, `measured`, or upstream's `total_kv_pages`; or from measured per-rank memory), then
`allocate_with_retry` halves them while the pools do not fit the HBM the account leaves free.
"""
from __future__ import annotations

import gc
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pandas as pd
import simpy

from twin.abi.account import hbm_account
from twin.abi.batches import Request
from twin.abi.capacity import admit_slots, allocate_with_retry
from twin.abi.programs import check_slots
from twin.abi.errors import ConfigError
from twin.abi.inputs import integer, number
from twin.abi.outputs import atomic_path

from . import metrics, risk, vllm_result
from .trace import family_capacity, perfetto_trace
from .acceptance import AcceptanceModel, ConditionalAcceptance
from .costmodel import Calibration, CostModel, DeviceLimits, Routing
from .decisions import DecisionLog
from .engine import Engine
from .executor import CostModelExecutor
from .kvcache import KvCacheManager
from .leases import LeaseManager
from .probes import Recorder
from .scheduler import Scheduler, SchedulerConfig, check_max_preemptions



@dataclass
class SimConfig:
    dep: object                                   # twin.abi.Deployment
    requests: list[Request] = field(default_factory=list)
    device: DeviceLimits | None = None
    routing: Routing = field(default_factory=Routing)
    acceptance: AcceptanceModel = field(default_factory=ConditionalAcceptance)
    calibration: Calibration | None = None
    slots: int | None = None                      # override startup admission
    rank_memory: list | None = None               # measured (total, free) bytes per rank
    measured: object | None = None                # twin.abi.Measurement of a boot at this deployment
    total_kv_pages: int | None = None             # upstream's --total-kv-pages
    oom_above_slots: int | None = None            # simulated OOM: allocations above this many slots fail
    async_depth: int = 2
    stop_check: str = "end"
    max_preemptions: int | None = None            # None: upstream (no cap; a livelock is detected and reported)
    slo_ms: dict | None = None                    # goodput SLOs: {"ttft": ms, "tpot": ms, "e2el": ms}
    seed: int = 0
    fixed_tile: bool = True
    until: float | None = None                    # stop at this simulated time (s)
    prefill_hang_probability: float = 0.0         # pypto-lib#1213 fault model, per EP16 prefill dispatch
    step_timeout: float = 1200.0                  # SERVING_WORKER_STEP_TIMEOUT (s): what a hang costs
    # injection points for other executors (the functional twin's golden executor) and scheduler
    # variants: executor(cost_model, slots) -> Executor; scheduler: a Scheduler subclass
    executor: Callable | None = None
    scheduler: type = Scheduler
    # `--max-concurrency`: at most this many unfinished requests sent (a closed loop)
    max_concurrency: int | None = None
    decision_log: bool = False                    # keep every decision (twin/sim/decisions.py)

    def __post_init__(self):
        check_max_preemptions(self.max_preemptions)
        if not 0.0 <= self.prefill_hang_probability <= 1.0:
            raise ConfigError("prefill_hang_probability", self.prefill_hang_probability, "in [0, 1]")
        number(self.step_timeout, "step_timeout", lo=0.0, lo_open=True, unit="(seconds: what a hang costs)")
        for key, ms in (self.slo_ms or {}).items():
            if key not in vllm_result.SLO_METRICS:
                raise ConfigError("slo_ms key", key, f"one of {vllm_result.SLO_METRICS}")
            if not vllm_result.slo_ok(ms):
                raise ConfigError(f"slo_{key}", ms, vllm_result.SLO_RULE)
        if self.max_concurrency is not None:                 # None: an open loop
            integer(self.max_concurrency, "max_concurrency", lo=1)


@dataclass
class SimResult:
    config: SimConfig
    slots: int
    scheduler: Scheduler
    recorder: Recorder
    wall_s: float
    sim_s: float
    requests: pd.DataFrame
    steps: pd.DataFrame
    dispatches: pd.DataFrame
    occupancy: pd.DataFrame
    risks: pd.DataFrame
    risk_summary: pd.DataFrame
    summary: dict
    decisions: list[dict] | None = None           # the decision log, when kept

    def bench_result(self, traffic: dict | None = None, percentiles=vllm_result.DEFAULT_PERCENTILES) -> dict:
        """The `vllm bench serve` result (twin/sim/vllm_result.py).  traffic: the client settings
        vLLM records (`request_rate`, `burstiness`, `model_id`, `label`); defaults: all at once."""
        t = {"request_rate": None, "burstiness": 1.0, "model_id": self.config.dep.model.name, **(traffic or {})}
        return vllm_result.result(self.requests, self.recorder, duration=self.summary["duration_s"],
                                  num_prompts=len(self.requests), max_concurrency=self.config.max_concurrency,
                                  percentiles=percentiles, goodput=self.config.slo_ms, **t)

    def write(self, out: str | Path, *, plots: bool = True, trace: bool = True, traffic: dict | None = None,
              percentiles=vllm_result.DEFAULT_PERCENTILES) -> list[str]:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        files = []
        for name, df in (("requests", self.requests), ("steps", self.steps), ("dispatches", self.dispatches),
                         ("occupancy", self.occupancy), ("risks", self.risks), ("risk_summary", self.risk_summary)):
            with atomic_path(out / f"{name}.csv") as tmp:
                df.to_csv(tmp, index=False)
            files.append(f"{name}.csv")
        metrics.write_json(out / "summary.json", self.summary)
        files.append("summary.json")
        metrics.write_json(out / "vllm_result.json", self.bench_result(traffic, percentiles))
        files.append("vllm_result.json")
        if trace:
            metrics.write_json(out / "trace.json", perfetto_trace(self.recorder, self.steps, self.requests,
                                                                  family_capacity(self.scheduler.kv)), indent=None)
            files.append("trace.json")
        if plots:
            files += metrics.plots(out, self.requests, self.steps, self.occupancy, self.summary["acceptance"],
                                   capacity=family_capacity(self.scheduler.kv), slots=self.slots,
                                   slo=self.config.slo_ms, itl=metrics.completed_itl(self.requests, self.recorder))
        if self.decisions is not None:
            with atomic_path(out / "decisions.jsonl") as tmp, open(tmp, "w") as f:
                for r in self.decisions:
                    f.write(json.dumps(r) + "\n")
            files.append("decisions.jsonl")
        return files


def startup_slots(cfg: SimConfig, device: DeviceLimits) -> int:
    """Slots per partition: `init_kv_cache` admission, then the halving retry on OOM."""
    dep, fits = cfg.dep, (lambda s: True)       # an explicit slot count or per-rank memory: no account
    if cfg.slots is not None:
        slots = check_slots(cfg.slots, "simulate")
    elif cfg.rank_memory is not None:
        slots = admit_slots(dep, rank_memory=cfg.rank_memory)
    else:
        acct = hbm_account(dep, hbm_bytes=device.hbm_bytes, measured=cfg.measured,
                           total_kv_pages=cfg.total_kv_pages, strict=True)
        slots, fits = acct.slots_per_partition, acct.allocates
    limit = cfg.oom_above_slots
    return allocate_with_retry(slots, lambda s: fits(s) and (limit is None or s <= limit))


def budget_source(cfg: SimConfig) -> str:
    """Where startup admission's slots came from (the order `startup_slots` reads them in)."""
    if cfg.slots is not None:
        return "slots"
    if cfg.rank_memory is not None:
        return "rank_memory"
    if cfg.measured is not None:
        return cfg.measured.kind
    return "total_kv_pages" if cfg.total_kv_pages is not None else "account"


def build(cfg: SimConfig, env: simpy.Environment | None = None, *, slots: int | None = None):
    """The wired objects of a run (for tests and notebooks that drive them directly).  slots:
    `startup_slots(cfg, device)` when the caller has already asked it."""
    dep = cfg.dep
    device = cfg.device or DeviceLimits.load()
    if slots is None:
        slots = startup_slots(cfg, device)
    env = env or simpy.Environment()
    kv = KvCacheManager.from_deployment(dep, slots)
    scfg = SchedulerConfig.from_deployment(dep, async_depth=cfg.async_depth, stop_check=cfg.stop_check,
                                           max_preemptions=cfg.max_preemptions)
    sched = cfg.scheduler(scfg, kv, leases=LeaseManager(dep.partitions) if dep.k else None,
                      noise_token=dep.model.dspark_noise_token_id)
    rec = Recorder(env, sched, partitions=dep.partitions, k=dep.k)
    sched.probe = rec
    if cfg.decision_log:
        DecisionLog(sched)
    cost = CostModel(dep, slots, device, cfg.routing, cfg.calibration, seed=cfg.seed, fixed_tile=cfg.fixed_tile)
    ex = cfg.executor(cost, slots) if cfg.executor is not None else CostModelExecutor(
        cost, cfg.acceptance, seed=cfg.seed, prefill_hang_probability=cfg.prefill_hang_probability,
        step_timeout=cfg.step_timeout)
    eng = Engine(env, sched, ex, dep, device, rec, depth=cfg.async_depth, max_concurrency=cfg.max_concurrency)
    return env, eng, sched, rec, slots


def simulate(cfg: SimConfig, progress: Callable[[float, int, int], None] | None = None,
             progress_every: float = 1.0, *, slots: int | None = None) -> SimResult:
    env, eng, sched, rec, slots = build(cfg, slots=slots)
    eng.submit(cfg.requests)
    total = len(cfg.requests)
    if progress:
        def tick():
            while True:
                progress(env.now, len(sched.finished), total)
                yield env.timeout(progress_every)
        env.process(tick())
    t0 = time.perf_counter()
    # the run allocates millions of small, acyclic objects; generational GC passes over them grow
    # with the heap and made wall time superlinear in the request count, so collect once at the end
    with _gc_paused():
        env.run(until=eng.done if cfg.until is None else cfg.until)
    wall = time.perf_counter() - t0
    if progress:
        progress(env.now, len(sched.finished), total)
    return _result(cfg, slots, sched, rec, wall, env.now)


@contextmanager
def _gc_paused():
    gc_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc_on:
            gc.enable()


def _result(cfg: SimConfig, slots: int, sched, rec, wall: float, now: float) -> SimResult:
    """Frames, risk flags and summary of a finished run."""
    req_df = metrics.requests_frame(cfg.requests, rec)
    steps = metrics.steps_frame(rec)
    flags = risk.scan(rec, cfg.dep.topology.ep)
    summ = metrics.summary(req_df, rec, cfg.slo_ms)
    summ.update({"slots_per_partition": slots, "kv_budget_source": budget_source(cfg), "simulated_s": now, "wall_s": wall,
                 "sim_s_per_wall_s": now / wall if wall else None, "steps": len(rec.steps),
                 "risks": {k: int(v) for k, v in flags["risk"].value_counts().items()} if len(flags) else {},
                 "kv_stats": dict(sched.kv.stats)})
    log = getattr(sched, "log", None)
    return SimResult(cfg, slots, sched, rec, wall, now, req_df, steps, metrics.dispatches_frame(rec),
                     metrics.occupancy_frame(rec), flags, risk.summarize(flags), summ,
                     log.done() if log is not None else None)
