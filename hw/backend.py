"""The backend protocol over ABI dispatches, and the torch backend.

A backend runs one `Dispatch` against the run state it is given (the pools, by name) and returns
a `StepResult`: the program's outputs, the state it touched (new values, whole pools) and the
tagged intermediates it can dump (`taps`, keyed by (layer, stage)).  It never mutates the state
it was given: state goes in and comes out, so the lockstep can hold the device's and the golden's
side by side and a record can store both.

`TorchBackend(device)` runs on "cpu", "cuda[:n]" or "npu[:n]"; torch is imported when the
backend is built and torch_npu only when an NPU is asked for.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Protocol, runtime_checkable

import numpy as np

from twin.abi.batches import Dispatch
from twin.abi.errors import AbiError

from .model.spec import PROGRAM_FUSED, PROGRAM_SEED, PROGRAMS, Geometry
from .model.weights import Weights

DEVICE_RE = re.compile(r"^(cpu|cuda|npu)(:\d+)?$")
TARGET_POOLS = ("kv_cache", "csa_compress_state", "hca_compress_state", "csa_cmp_kv", "hca_cmp_kv")


@dataclass
class StepResult:
    outputs: dict
    state: dict                                        # touched pools, new values
    taps: dict = field(default_factory=dict)           # (layer, stage) -> array
    mapped: dict = field(default_factory=dict)         # pool -> flat rows the dispatch maps (golden side)
    resyncs: list = field(default_factory=list)        # golden side: decisions adopted from the device


@runtime_checkable
class Backend(Protocol):
    name: str

    def run(self, dispatch: Dispatch, state: Mapping[str, np.ndarray]) -> StepResult: ...


def touched_pools(program: str) -> tuple[str, ...]:
    if program not in PROGRAMS:
        raise AbiError("program", program, f"one of {list(PROGRAMS)}", where="hw backend")
    if program == PROGRAM_SEED:
        return ("draft_kv",)
    return TARGET_POOLS + (("draft_kv",) if program == PROGRAM_FUSED else ())


def check_device(device: str, *, available: bool = True) -> str:
    """A torch device name; with `available`, also one whose runtime is installed and visible here
    (torch, torch_npu for npu, a CUDA device for cuda), so a missing backend is a clear refusal."""
    if not isinstance(device, str) or not DEVICE_RE.match(device):
        raise AbiError("device", device, "'cpu', 'cuda[:n]' or 'npu[:n]'", where="TorchBackend")
    if not available:
        return device
    try:
        import torch
    except ModuleNotFoundError:
        raise AbiError("device", device, "a backend whose runtime is installed: torch is missing "
                       "(pip install -e \".[torch]\")", where="TorchBackend") from None
    if device.startswith("npu"):
        try:
            import torch_npu  # noqa: F401  (registers the "npu" device with torch)
        except ModuleNotFoundError:
            raise AbiError("device", device, "'cpu' or 'cuda' here: torch_npu is not installed "
                           "(pip install -e \".[npu]\" on an Ascend host)", where="TorchBackend") from None
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise AbiError("device", device, "a device torch can see (torch.cuda.is_available() is False)",
                       where="TorchBackend")
    return device


class TorchBackend:
    """Runs dispatches with torch implementations of the kernels on one device."""

    def __init__(self, geo: Geometry, weights: Weights, device: str = "cpu", *, cpu_threads: int | None = 1):
        check_device(device)
        import torch

        if device == "cpu" and cpu_threads:
            # small per-op work: intra-op threads only contend (and stall badly on a shared 2-core runner)
            torch.set_num_threads(cpu_threads)
        from .model.torch_step import TorchStep

        self.device = device
        self.name = f"torch:{device}"
        self.geo = geo
        self.step = TorchStep(geo, weights, torch.device(device))

    def run(self, dispatch: Dispatch, state: Mapping[str, np.ndarray], hooks: dict | None = None) -> StepResult:
        pools = {k: state[k] for k in touched_pools(dispatch.program)}
        outputs, new, taps = self.step.run(dispatch.program, dict(dispatch.args), pools, hooks=hooks)
        return StepResult(outputs, new, taps)
