"""hw.real: lockstep against golden's real compositions, on parity runs driven by the one scheduler.

`twin.functional.parity` serves a workload with the simulator's scheduler; every dispatch it lowers
and validates goes to this package's checker (`RealLockstep`, the executor's host), which runs it on
the device backend and on golden (`golden.dispatch.run_dispatch`), compares, localizes and re-syncs:

    golden   golden's NumPy numerics (device or exact mode): every in-kernel sum carried in float64
    device   `SelfCheckBackend`: the same compositions with every golden GEMM (`nm.mm`, `nm.int_mm`, so
             W8A8 too) run by torch with FP32 accumulation in torch's own tile order (`TorchNumerics`);
             a self-check of the lockstep, not an independent implementation

Public API:
    TorchNumerics(mode, device=...)            hw.real.numerics   golden Numerics whose GEMMs run on torch
    SelfCheckBackend(side, device, fault)      hw.real.selfcheck  the self-check device behind the Backend protocol
    Side, TapPar, side_state, install_state,   hw.real.side       one side's served run state; full taps; its
    POOL_KIND                                                     arrays by name; each pool's policy kind
    RealFault, REAL_KINDS, KERNEL_KINDS,       hw.real.faults     device-side faults (13 kinds) and where they
    EXPECTED_STAGES, sweep_layers                                 must localize; the layers a kind sweeps
    RealLockstep, build_checker,               hw.real.lockstep   compare, localize, re-sync (tie, route, index,
    parse_real_fault                                              sample, draft, tokens, hidden), report; records
                                                                  and resume with a run_dir (record=True)
    RealDispatch, DeviceStep, DeviceResult,    hw.real.step       one checked dispatch; the device's step of it; a
    DECISION_STAGES                                               backend's result with its decisions
    RealRecorder                               hw.real.records    dispatch records (hw.records.RecordStore)
    restore, fast_forward, Seek                hw.real.replay     resume; offline replay of records (any chosen
                                                                  records, each checked on its own)
    CheckPool, LocalWorkers, RayWorkers,       hw.real.pool       asynchronous checks on a bounded pool of
    fan_out, POLICIES                                             worker processes or Ray tasks
    CoveragePlan, choose_n                     hw.real.coverage   sampled checking: which sites each dispatch
                                                                  checks; the N a checker keeps up at
    check_recorded, SiteGolden, DispatchView   hw.real.site_check one layer's stages from the device's recorded
                                                                  state (the sampled lockstep's unit of work)
    JaxSites, check_choice, jax_device, GOLDENS hw.real.jax_check the site checks' golden: NumPy, or the JAX
                                                                  path where admissible; its backend
    DistPar                                    hw.real.dist_par   golden.ranks' par as processes, one per rank
    rank_forward, spawn_local                  hw.real.ranks      the target forward over real collectives,
                                                                  checked on rank 0 (torchrun -m hw.real.ranks)

Each name is also `hw.real`'s own (`from hw.real import RealLockstep`), importing its module on
first use.  Only twin.abi, golden and hw are imported (docs/architecture.md, "Import rules"); torch
when a device side computes.
"""
from ..lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "numerics": ("TorchNumerics",),
    "selfcheck": ("SelfCheckBackend",),
    "side": ("Side", "TapPar", "side_state", "install_state", "POOL_KIND"),
    "faults": ("RealFault", "REAL_KINDS", "KERNEL_KINDS", "EXPECTED_STAGES", "sweep_layers"),
    "lockstep": ("RealLockstep", "build_checker", "parse_real_fault"),
    "step": ("RealDispatch", "DeviceStep", "DeviceResult", "DECISION_STAGES"),
    "records": ("RealRecorder",),
    "replay": ("restore", "fast_forward", "Seek"),
    "pool": ("CheckPool", "LocalWorkers", "RayWorkers", "fan_out", "POLICIES"),
    "coverage": ("CoveragePlan", "choose_n"),
    "site_check": ("check_recorded", "SiteGolden", "DispatchView"),
    "jax_check": ("JaxSites", "check_choice", "jax_device", "GOLDENS"),
    "dist_par": ("DistPar",),
    "ranks": ("rank_forward", "spawn_local"),
})
