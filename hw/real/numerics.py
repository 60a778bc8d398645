"""Golden's numerics with the GEMMs on torch: the device side of the real-golden lockstep.

Golden carries every in-kernel sum in float64 and rounds once (batch-invariant bits); a device
accumulates in FP32 in its own tile order.  `TorchNumerics` keeps golden's rounding points
(BF16 storage, W8A8 quantization, FP32 outputs) and swaps only the accumulator: float GEMMs run as
torch FP32 matmuls on the chosen device, so the lockstep sees real accumulation-order noise
amplified through quantization, routing and sampling, exactly what its tolerances must absorb.
Integer GEMMs (W8A8) are exact integer sums on a device (int32 accumulator), so they run as exact
float64 torch matmuls.  In exact mode both stay float64.

`on_write` lets a device fault (hw.real.faults) change where a paged store lands: every pool write
of the compositions goes through `set_rows`, so a hook sees (pool, slots) and returns the slots
the faulty device uses (one row one slot off, a compressed row never written).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from golden.numerics import Numerics
from twin.abi.errors import AbiError

from ..backend import check_device


@dataclass(frozen=True)
class TorchNumerics(Numerics):
    device: str = "cpu"
    on_write: list = field(default_factory=list, compare=False, hash=False, repr=False)   # hook(pool, slots) -> slots

    def __post_init__(self):
        super().__post_init__()
        check_device(self.device)
        if self.xp is not np:
            raise AbiError("xp", getattr(self.xp, "__name__", self.xp), "numpy (only the GEMMs move to torch)",
                           where="TorchNumerics")

    @property
    def _torch(self):
        import torch
        return torch

    def _t(self, x, dt):
        return self._torch.as_tensor(np.ascontiguousarray(x), device=self.device).to(dt)

    def mm(self, a, b):
        t = self._torch
        dt = t.float64 if self.exact else t.float32
        return (self._t(a, dt) @ self._t(b, dt)).cpu().numpy().astype(np.float64)

    def int_mm(self, a, b):
        # integer-valued operands: a float64 product of int8 values is the exact int32 sum
        t = self._torch
        return (self._t(a, t.float64) @ self._t(b, t.float64)).cpu().numpy()

    def set_rows(self, pool, slots, rows):
        for hook in self.on_write:
            slots = hook(pool, slots)
        return super().set_rows(pool, slots, rows)
