"""TorchBackend: the six programs in torch, run from a lowered Dispatch alone.

    be = TorchBackend(deployment, slots, device="cpu")
    res = be.run(dispatch, state, weights)      # or TorchBackend(..., weights=w).run(dispatch, state)
    res.outputs["sampled_ids"], res.state["raw_kv_pool"], res.taps[(3, "attn_out")]

`state` maps the program's STATE arguments (ABI names, the per-rank shapes `bind` gives) to
arrays; `weights` its WEIGHT arguments, or is a function program name -> that mapping (called once
per program: one backend then serves every program of a run).  Only pools the program touches come back in `state`,
as new arrays (the inputs are never written).  Taps are (layer, stage) -> [R, rows, ...] arrays in
golden's stage names.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from twin.abi.batches import DispatchResult
from twin.abi.errors import AbiError
from twin.abi.programs import OUTPUT, get_program

from .args import Args, to_numpy
from .device import torch_device


def _program_runner(name: str):
    if name == "l3_decode_fwd":
        from .decode import run_decode
        return run_decode, None
    if name == "l3_decode_fwd_dspark":
        from .decode_dspark import run_dspark, extents
        return run_dspark, extents
    if name == "l3_prefill_fwd":
        from .prefill import run_prefill, extents
        return run_prefill, extents
    if name == "l3_dspark_drafter":
        from .drafter_program import run_program, extents
        return run_program, extents
    if name == "l3_dspark_draft_step_device_state":
        from .bootstrap import run_bootstrap, extents
        return run_bootstrap, extents
    if name == "l3_distributed_markov_sample":
        from .markov_sample import run_markov, extents
        return run_markov, extents
    raise AbiError("program", name, f"a program TorchBackend implements: {', '.join(IMPLEMENTED)}",
                   where="TorchBackend")


IMPLEMENTED = ("l3_decode_fwd", "l3_prefill_fwd", "l3_decode_fwd_dspark", "l3_dspark_drafter",
               "l3_dspark_draft_step_device_state", "l3_distributed_markov_sample")


class TorchBackend:
    """An independent torch implementation of the device (kernel-math.md numerics)."""

    def __init__(self, deployment, slots: int, device: str = "cpu", *, weights=None):
        self.dep = deployment
        self.slots = slots
        self.device = torch_device(device)
        self.weights = weights
        self._staged: dict = {}
        self.name = f"torch-{self.device.type}"

    def run(self, dispatch, state: Mapping[str, np.ndarray], weights: Mapping | None = None) -> DispatchResult:
        import torch
        weights = self.weights if weights is None else weights
        if weights is None:
            raise AbiError("weights", None, "the program's WEIGHT arguments by ABI name", where=self.name)
        run, extents = _program_runner(dispatch.program)
        if callable(weights):
            if dispatch.program not in self._staged:
                self._staged[dispatch.program] = weights(dispatch.program)
            weights = self._staged[dispatch.program]
        with torch.no_grad():
            a = Args(dispatch, weights, state, self.dep, self.slots, self.device,
                     extents=None if extents is None else extents(dispatch))
            before = {n: a[n].clone() for n in a.state_names}
            outs, taps = run(a, self.dep.model, self.dep)
            taps = dict(taps)
        prog = get_program(dispatch.program)
        outputs = {n: to_numpy(t, prog.arg(n).dtype) for n, t in outs.items()
                   if prog.arg(n).role == OUTPUT}
        touched = {n: to_numpy(a[n], a.bound[n].dtype) for n in a.state_names if not torch.equal(a[n], before[n])}
        return DispatchResult(outputs, touched, {k: v.detach().cpu().numpy() for k, v in taps.items()})
