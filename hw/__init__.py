"""hw: device backends, dispatch records, the lockstep checker, tolerance policies, fault injection.

Public API (see docs/lockstep.md):

    Backend, StepResult, TorchBackend          hw.backend      the protocol over ABI dispatches; torch cpu/cuda/npu
    PyptoBackend, ProgramRunner                hw.pypto        positional binding to compiled PyPTO programs
    GoldenExecutor                             hw.golden_adapter  the golden side, re-synced from the device
    Lockstep, LockstepRun, replay              hw.lockstep     compare, localize, re-sync; resume; offline replay
    Policy, Tolerance, DEFAULT_TABLE           hw.tolerance    the policy as data: (op class, dtype, quant) -> gates
    compare_tensor, compare_pool, Finding      hw.compare      comparators (mapped rows numeric, unmapped bit-identical)
    RecordStore, Record, content_hash          hw.records      content-addressed dispatch records
    Fault, FaultBackend, KINDS                 hw.faults       fault injection
    build_run, parse_fault                     hw.runs         assembling a run (CLI, benchmark, tests)
    spawn_local, worker                        hw.distributed  multi-rank CP/TP/EP with torch.distributed
    compose_kind                               hw.golden_adapter  the policy kind of a golden.compose tap site
    limit_cpu_threads                          hw.threads      one BLAS / torch thread where golden and device share a CPU
    RealLockstep, build_real, TorchNumerics    hw.real         lockstep against golden's real compositions through
                                                               the real lowering (TINY; `--golden real`)

Two golden sides exist: `hw.model` (the reference model the records, resume and all nine fault
kinds run on) and `hw.real` (golden.compose / golden.dspark from lowered, validated dispatches).

Imports only twin.abi and golden (DESIGN.md); torch is imported when a torch backend is built,
torch_npu only for device "npu", a PyPTO runtime only by `PyptoBackend.from_runtime`.  Nothing here
is imported by `import hw`: the names above are `hw`'s own as well (`from hw import RecordStore`),
each importing its module on first use; hw.real's come from `hw.real` the same way.
"""
from .lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "backend": ("Backend", "StepResult", "TorchBackend"),
    "pypto": ("PyptoBackend", "ProgramRunner"),
    "golden_adapter": ("GoldenExecutor", "compose_kind"),
    "lockstep": ("Lockstep", "LockstepRun", "replay"),
    "tolerance": ("Policy", "Tolerance", "DEFAULT_TABLE"),
    "compare": ("compare_tensor", "compare_pool", "Finding"),
    "records": ("RecordStore", "Record", "content_hash"),
    "faults": ("Fault", "FaultBackend", "KINDS"),
    "runs": ("build_run", "parse_fault"),
    "distributed": ("spawn_local", "worker"),
    "threads": ("limit_cpu_threads",),
})
