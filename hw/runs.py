"""Assembling a lockstep run: preset -> geometry, weights, workload, device backend (optionally
fault-injected), golden, policy.  The CLI, the benchmark and the tests all build runs here."""
from __future__ import annotations

from pathlib import Path

from twin.abi.presets import get_preset

from .faults import Fault, FaultBackend, split_fault
from .golden_adapter import GoldenExecutor
from .lockstep import LockstepRun
from .model.spec import Geometry
from .model.weights import synthetic_weights
from .model.workload import Workload, initial_pools
from .tolerance import Policy


def parse_fault(spec: str) -> Fault:
    """'KIND', 'KIND@AT' or 'KIND@AT:LAYER' (AT a dispatch index, LAYER an index within the family)."""
    kind, at, layer = split_fault(spec)
    return Fault(kind, at=at, layer=layer, seed=at)


def build_run(run_dir, *, preset: str = "tiny", device: str = "cpu", mode: str = "strict", seed: int = 0,
              fault: Fault | None = None, policy: Policy | None = None, record: bool = True, slots: int = 4,
              max_len: int = 512, n_requests: int = 6, device_backend=None) -> LockstepRun:
    cfg = get_preset(preset)
    geo = Geometry(cfg, slots=slots, max_len=max_len)
    w = synthetic_weights(cfg, seed)
    if device_backend is None:
        from .backend import TorchBackend

        device_backend = TorchBackend(geo, w, device)
    dev = FaultBackend(device_backend, geo, fault) if fault else device_backend
    config = {"preset": cfg.name, "seed": seed, "slots": slots, "max_len": max_len, "requests": n_requests,
              "fault": None if fault is None else {"kind": fault.kind, "at": fault.at, "layer": fault.layer}}
    return LockstepRun(Path(run_dir), geo, w, dev, GoldenExecutor(geo, w),
                       lambda: Workload(geo, n_requests=n_requests, seed=seed), initial_pools(geo, seed),
                       policy=policy, mode=mode, config=config, record=record)
