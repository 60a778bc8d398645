"""twin.sim: the SimPy twin of DSpark serving, for capacity and admission (docs/simulation.md).

The scheduler, the grouped prefix cache and the leases are plain objects (no SimPy) that a
wall-clock loop with a golden or device executor can drive as well; the SimPy engine adds time.
It imports only `twin.abi`; executors are injected, never imported (docs/architecture.md, "Import rules").
"""
from .acceptance import AcceptanceModel, ConditionalAcceptance, ExecutorTokens, ForcedAcceptance, parse_acceptance
from .costmodel import Calibration, CostModel, DeviceLimits, Routing
from .engine import Engine
from twin.abi.batches import DispatchTiming, Finish, Request, Sampling, Status, StepResult

from .executor import CostModelExecutor, Executor
from .kvcache import KVCacheCapacityError, KvCacheManager
from .leases import LeaseManager, LeasesExhausted
from .loop import run_sync
from .probes import Recorder
from .run import SimConfig, SimResult, build, simulate, startup_slots
from .scheduler import Scheduler, SchedulerConfig, SchedulerProbe, StepCommand
from .worker import StepPlan, plan
from .workload import LengthDist, WorkloadSpec, default_spec, documented_run, generate, load_jsonl, save_jsonl

__all__ = [
    "AcceptanceModel", "ConditionalAcceptance", "ExecutorTokens", "ForcedAcceptance", "parse_acceptance",
    "Calibration", "CostModel", "DeviceLimits", "Routing", "Engine", "CostModelExecutor", "DispatchTiming",
    "Executor", "StepResult", "KVCacheCapacityError", "KvCacheManager", "LeaseManager", "LeasesExhausted", "run_sync",
    "Recorder", "Finish", "Request", "Sampling", "Status", "SimConfig", "SimResult", "build", "simulate",
    "startup_slots", "Scheduler", "SchedulerConfig", "SchedulerProbe", "StepCommand", "StepPlan", "plan",
    "LengthDist", "WorkloadSpec", "default_spec", "documented_run", "generate", "load_jsonl", "save_jsonl",
]
