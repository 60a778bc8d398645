"""TorchBackend: the six programs in torch, run from a lowered Dispatch alone.

    be = TorchBackend(deployment, slots, device="cpu")
    res = be.run(dispatch, state, weights)      # or TorchBackend(..., weights=w).run(dispatch, state)
    res.outputs["sampled_ids"], res.state["raw_kv_pool"], res.taps[(3, "attn_out")]

`ranks` (`hw.torchdev.ranks`) splits the deployment's ranks over torch.distributed processes
(`hw.torchdev.workers`); the result is the same, bit for bit.

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


# program -> (module, its runner); each module but decode's says its extents
RUNNERS = {"l3_decode_fwd": ("decode", "run_decode"), "l3_decode_fwd_dspark": ("decode_dspark", "run_dspark"),
           "l3_prefill_fwd": ("prefill", "run_prefill"), "l3_dspark_drafter": ("drafter_program", "run_program"),
           "l3_dspark_draft_step_device_state": ("bootstrap", "run_bootstrap"),
           "l3_distributed_markov_sample": ("markov_sample", "run_markov")}
IMPLEMENTED = tuple(RUNNERS)


def _program_runner(name: str):
    if name not in RUNNERS:
        raise AbiError("program", name, f"a program TorchBackend implements: {', '.join(IMPLEMENTED)}",
                       where="TorchBackend")
    from importlib import import_module

    module, runner = RUNNERS[name]
    m = import_module(f"{__package__}.{module}")
    return getattr(m, runner), getattr(m, "extents", None)


class TorchBackend:
    """An independent torch implementation of the device (kernel-math.md numerics).

    ranks: the deployment's ranks this process holds (`hw.torchdev.ranks`): all of them by
    default; `Ranks.split(R, rank, world)` under torch.distributed, where process 0 is the host
    (`run` sends each dispatch to the others and returns the whole DispatchResult) and the others
    serve (`serve`)."""

    def __init__(self, deployment, slots: int, device: str = "cpu", *, weights=None, ranks=None):
        from .ranks import Ranks

        self.dep = deployment
        self.slots = slots
        self.device = torch_device(device)
        self.weights = weights
        self.ranks = Ranks(deployment.ranks) if ranks is None else ranks
        if self.ranks.R != deployment.ranks:
            raise AbiError("ranks", self.ranks.R, f"the deployment's {deployment.ranks} ranks", where="TorchBackend")
        self._staged: dict = {}
        self.name = f"torch-{self.device.type}"

    def _weights(self, program: str, weights):
        weights = self.weights if weights is None else weights
        if weights is None:
            raise AbiError("weights", None, "the program's WEIGHT arguments by ABI name", where=self.name)
        if callable(weights):
            if program not in self._staged:
                self._staged[program] = weights(program)
            weights = self._staged[program]
        return weights

    def run(self, dispatch, state: Mapping[str, np.ndarray], weights: Mapping | None = None) -> DispatchResult:
        _program_runner(dispatch.program)               # a program not implemented is refused here
        weights = self._weights(dispatch.program, weights)
        if self.ranks.world == 1:
            return DispatchResult(*self.run_mine(dispatch, state, weights))
        if self.ranks.rank != 0:
            raise AbiError("ranks", self.ranks.rank, "process 0 (the host) runs dispatches; the others serve",
                           where=self.name)
        from .workers import host_run
        return host_run(self, dispatch, state, weights)

    def run_mine(self, dispatch, state: Mapping, weights: Mapping):
        """(outputs, touched pools, taps) of the ranks this process holds; state and weights are
        their slices ([len(ranks.mine), ...])."""
        import torch
        run, extents = _program_runner(dispatch.program)
        with torch.no_grad():
            a = Args(dispatch, weights, state, self.dep, self.slots, self.device,
                     extents=None if extents is None else extents(dispatch), ranks=self.ranks)
            before = {n: a.t[n].clone() for n in a.state_names}
            outs, taps = run(a, self.dep.model, self.dep)
            taps = dict(taps)
        prog = get_program(dispatch.program)
        outputs = {n: to_numpy(t, prog.arg(n).dtype) for n, t in outs.items()
                   if prog.arg(n).role == OUTPUT}
        touched = {n: to_numpy(a.t[n], a.bound[n].dtype) for n in a.state_names if not torch.equal(a.t[n], before[n])}
        return outputs, touched, {k: v.detach().cpu().numpy() for k, v in taps.items()}

    def close(self) -> None:
        """Release the serving processes (the host of a split run); a no-op in one process."""
        if self.ranks.world > 1 and self.ranks.rank == 0:
            from .workers import host_close
            host_close()


def serve(device: str = "cpu") -> int:
    """A serving process's loop (torch.distributed initialized, rank > 0): run each dispatch the
    host sends on this process's ranks until it says stop; returns the dispatches served."""
    import torch.distributed as dist

    from twin.abi.batches import Dispatch

    from .ranks import Ranks
    from .workers import Server

    server, backend, weights, n = Server(), None, {}, 0
    while (msg := server.receive()) is not None:
        dep, slots, program, args, state, w = msg
        if backend is None:
            backend = TorchBackend(dep, slots, device, ranks=Ranks.split(dep.ranks, dist.get_rank(),
                                                                         dist.get_world_size()))
        if w is not None:
            weights[program] = w
        server.reply(backend.run_mine(Dispatch(program, args), state, weights[program]))
        n += 1
    return n
