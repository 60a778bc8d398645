"""hw.real: lockstep against golden's real compositions, through the real lowering.

The reference path (`hw.golden_adapter`, `hw.model`) compares a torch device against a simplified
model.  This path drives `golden.compose.forward` (via `golden.dspark.step`: packed prefill, the
seeding waves, the fused K=7 step, the K=0 decode) from batches that `twin.abi.lowering` lowers and
validates, on two sides:

    golden   golden's NumPy numerics (device or exact mode): every in-kernel sum carried in float64
    device   the same compositions with every golden GEMM (`nm.mm`, `nm.int_mm`, so W8A8 too) run by
             torch on a torch device with FP32 accumulation in torch's own tile order (`TorchNumerics`)

Public API:
    TorchNumerics(mode, device=...)            hw.real.numerics   golden Numerics whose GEMMs run on torch
    Side, TapPar                               hw.real.side       one side's weights + run state; full taps
    Stream, RealDispatch                       hw.real.stream     requests -> batches -> lower + validate
    RealFault, REAL_KINDS, ISSUE8_KINDS,       hw.real.faults     device-side faults (13 kinds) and where they
    EXPECTED_STAGES, run_case, sweep_layers                       must localize; one injected run; the layers
                                                                  a kind sweeps
    RealLockstep, build_real, parse_real_fault hw.real.lockstep   compare, localize, re-sync (route, index,
                                                                  sample, draft, tokens, hidden), report;
                                                                  carry="device" | "golden"; records and
                                                                  resume with a run_dir (record=True)
    POOL_KIND                                  hw.real.lockstep   pool name -> its tolerance policy kind
    RealRecorder                               hw.real.records    dispatch records (hw.records.RecordStore)
    replay, restore                            hw.real.replay     offline replay of records; resume
    DistPar                                    hw.real.dist_par   golden.ranks' par as processes, one per rank
    rank_forward, spawn_local                  hw.real.ranks      the target forward over real collectives,
                                                                  checked on rank 0 (torchrun -m hw.real.ranks)

Each name is also `hw.real`'s own (`from hw.real import build_real`), importing its module on first
use, except `replay`: import it from `hw.real.replay` (once that module is loaded, the package's
attribute `replay` is the module).  Only twin.abi, golden and hw are imported (DESIGN.md); torch
when a device side computes.
"""
from ..lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "numerics": ("TorchNumerics",),
    "side": ("Side", "TapPar"),
    "stream": ("Stream", "RealDispatch"),
    "faults": ("RealFault", "REAL_KINDS", "ISSUE8_KINDS", "EXPECTED_STAGES", "run_case", "sweep_layers"),
    "lockstep": ("RealLockstep", "build_real", "parse_real_fault", "POOL_KIND"),
    "records": ("RealRecorder",),
    "replay": ("restore",),
    "dist_par": ("DistPar",),
    "ranks": ("rank_forward", "spawn_local"),
})
