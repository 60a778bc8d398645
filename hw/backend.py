"""The backend protocol over lowered dispatches, and the check of a torch device name.

A backend receives one lowered, validated `Dispatch` (the program's positional ABI arguments) and
the run state it may read (the pools, by name), runs it, and returns a `DispatchResult`
(`twin.abi.batches`): the program's outputs, the state it touched (new values) and the tagged
intermediates it can dump (`taps`, keyed by (layer, stage)).  It never mutates the state it was
given: state goes in and comes out, so a checker can hold the device's and the golden's side by
side and a record can store both.
"""
from __future__ import annotations

import re
from typing import Mapping, Protocol, runtime_checkable

import numpy as np

from twin.abi.batches import Dispatch, DispatchResult
from twin.abi.errors import AbiError

DEVICE_RE = re.compile(r"^(cpu|cuda|npu)(:\d+)?$")


@runtime_checkable
class Backend(Protocol):
    name: str

    def run(self, dispatch: Dispatch, state: Mapping[str, np.ndarray]) -> DispatchResult: ...


def check_device(device: str, *, available: bool = True) -> str:
    """A torch device name; with `available`, also one whose runtime is installed and visible here
    (torch, torch_npu for npu, a CUDA device for cuda), so a missing backend is a clear refusal."""
    if not isinstance(device, str) or not DEVICE_RE.match(device):
        raise AbiError("device", device, "'cpu', 'cuda[:n]' or 'npu[:n]'", where="torch device")
    if not available:
        return device
    try:
        import torch
    except ModuleNotFoundError:
        raise AbiError("device", device, "a backend whose runtime is installed: torch is missing "
                       "(pip install -e \".[torch]\")", where="torch device") from None
    if device.startswith("npu"):
        try:
            import torch_npu  # noqa: F401  (registers the "npu" device with torch)
        except ModuleNotFoundError:
            raise AbiError("device", device, "'cpu' or 'cuda' here: torch_npu is not installed "
                           "(pip install -e \".[npu]\" on an Ascend host)", where="torch device") from None
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise AbiError("device", device, "a device torch can see (torch.cuda.is_available() is False)",
                       where="torch device")
    return device
