"""hw: device backends, dispatch records, the lockstep checker, tolerance policies, fault injection.

Public API (see docs/lockstep.md):

    Backend, check_device                      hw.backend      the protocol over lowered dispatches; torch device names
    PyptoBackend, PyptoProgram, load_compiled  hw.pypto        positional binding to compiled PyPTO programs
    Policy, Tolerance, DEFAULT_TABLE           hw.tolerance    the policy as data: (op class, dtype, quant) -> gates
    compare_tensor, compare_pool, Finding      hw.compare      comparators (mapped rows numeric, unmapped bit-identical)
    compose_kind, first_divergent_tap          hw.localize     the policy kind of a golden.compose tap; the first
                                                               divergent tap in dependency order
    MODES, split_fault                         hw.options      strict | continuous; the --inject spec grammar
    RecordStore, Record, content_hash          hw.records      content-addressed dispatch records
    check_run_dir                              hw.run_format   refuses a run directory of another format
    limit_cpu_threads                          hw.threads      one BLAS / torch thread where golden and device share a CPU
    RealLockstep, SelfCheckBackend             hw.real         the lockstep checker against golden's compositions; the
                                                               self-check device (golden with its GEMMs on torch)
    TorchBackend                               hw.torchdev     the independent torch device (imports no golden)

The golden side is golden's own compositions (`golden.compose`, `golden.dspark`) run from
dispatches that `twin.abi.lowering` lowers and validates (`hw.real`); a parity run drives it
through the simulator's scheduler (`twin.functional.parity.build_lockstep`).

Imports only twin.abi and golden (docs/architecture.md, "Import rules"); torch is imported when a
torch device computes, torch_npu only for device "npu", the PyPTO runtime only when a
`PyptoBackend` is built on it.
Nothing here is imported by `import hw`: the names above are `hw`'s own as well
(`from hw import RecordStore`), each importing its module on first use; hw.real's come from
`hw.real` the same way.
"""
from .lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "backend": ("Backend", "check_device"),
    "pypto": ("PyptoBackend", "PyptoProgram", "load_compiled"),
    "tolerance": ("Policy", "Tolerance", "DEFAULT_TABLE"),
    "compare": ("compare_tensor", "compare_pool", "Finding"),
    "localize": ("compose_kind", "first_divergent_tap"),
    "options": ("MODES", "split_fault"),
    "records": ("RecordStore", "Record", "content_hash"),
    "run_format": ("check_run_dir",),
    "threads": ("limit_cpu_threads",),
    "torchdev": ("TorchBackend",),
})
