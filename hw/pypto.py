"""PyptoBackend: binds a dispatch's arguments positionally to a compiled PyPTO program.

The argument list is `twin.abi.programs`' ordered list for the dispatch's program; each argument
comes from the dispatch (inputs and per-dispatch tensors), the run state (pools, by buffer
identity) or the weights (by buffer identity), and outputs and scratch the caller did not supply
are allocated zeroed.  Every argument's shape is checked against `bind(program, deployment,
slots, **extents)` and its dtype against the ABI before anything reaches the runtime, with an
error that names the argument, what was given and what the ABI wants.

The runtime is reached through a `ProgramRunner`: `run(compiled_as, args, names)` with `args` the
positional arrays (written in place, as device buffers are) and `names` the ABI names, for
diagnostics.  `PyptoBackend.from_runtime()` adapts an installed PyPTO runtime; tests use a fake
runner that checks names, order, shapes and dtypes.
"""
from __future__ import annotations

import importlib
from typing import Mapping, Protocol

import ml_dtypes
import numpy as np

from twin.abi.batches import Dispatch
from twin.abi.errors import AbiError
from twin.abi.programs import OUTPUT, SCRATCH, STATE, WEIGHT, bind, get_program
from twin.abi.topology import Deployment

from .backend import StepResult

NP_DTYPE = {"f32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16), "i8": np.dtype(np.int8),
            "i16": np.dtype(np.int16), "i32": np.dtype(np.int32), "i64": np.dtype(np.int64)}
RUNTIME_MODULES = ("pypto.runtime", "pypto")


class ProgramRunner(Protocol):
    def run(self, compiled_as: str, args: list, names: tuple[str, ...]) -> None: ...


class PyptoBackend:
    def __init__(self, dep: Deployment, runner: ProgramRunner, *, slots: int = 1,
                 weights: Mapping[str, np.ndarray] | None = None, name: str = "pypto"):
        self.dep, self.runner, self.slots = dep, runner, slots
        self.weights = weights or {}
        self.name = name

    @classmethod
    def from_runtime(cls, dep: Deployment, *, slots: int = 1, weights=None, device_id: int = 0) -> "PyptoBackend":
        """Attach an installed PyPTO runtime (see docs/lockstep.md): it must offer
        `load_program(name, device_id)` returning a callable taking the positional arrays."""
        for mod in RUNTIME_MODULES:
            try:
                rt = importlib.import_module(mod)
                break
            except ModuleNotFoundError:
                continue
        else:
            raise AbiError("PyPTO runtime", None, f"an importable module among {RUNTIME_MODULES} "
                           "(install the PyPTO runtime on the device host)", where="PyptoBackend.from_runtime")
        return cls(dep, _RuntimeRunner(rt, device_id), slots=slots, weights=weights, name=f"pypto:{device_id}")

    def positional(self, d: Dispatch, state: Mapping[str, np.ndarray]) -> list:
        prog = get_program(d.program)
        extents = dict(d.meta.get("extents", {}))
        bound = bind(prog, self.dep, self.slots, **extents)
        extra = set(d.args) - set(prog.names)
        if extra:
            raise AbiError("argument", sorted(extra)[0], f"an argument of {prog.name}", where=prog.name)
        out = []
        for b in bound:
            a = b.arg
            want = NP_DTYPE[a.dtype]
            if a.name in d.args:
                v = d.args[a.name]
            elif a.role == STATE and a.buffer_id in state:
                v = np.array(state[a.buffer_id])            # the device writes it: never the caller's array
            elif a.role == STATE and a.name in state:
                v = np.array(state[a.name])
            elif a.role == WEIGHT and (a.buffer_id in self.weights or a.name in self.weights):
                v = self.weights.get(a.buffer_id, self.weights.get(a.name))
            elif a.role in (OUTPUT, SCRATCH):
                v = np.zeros(b.shape, want)
            else:
                raise AbiError("argument", a.name, "supplied by the dispatch, the state or the weights "
                               f"(role {a.role}, buffer {a.buffer_id})", where=prog.name)
            if tuple(np.shape(v)) != b.shape:
                raise AbiError(a.name, list(np.shape(v)), f"shape {list(b.shape)} ({a.shape})", where=prog.name)
            if np.asarray(v).dtype != want:
                raise AbiError(a.name, str(np.asarray(v).dtype), f"dtype {a.dtype} ({want})", where=prog.name)
            out.append(v)
        return out

    def run(self, d: Dispatch, state: Mapping[str, np.ndarray]) -> StepResult:
        prog = get_program(d.program)
        args = self.positional(d, state)
        self.runner.run(prog.compiled_as, args, prog.names)
        outputs = {a.name: args[i] for i, a in enumerate(prog.args) if a.role == OUTPUT}
        new_state = {a.buffer_id: args[i] for i, a in enumerate(prog.args) if a.role == STATE}
        return StepResult(outputs, new_state)


class _RuntimeRunner:
    def __init__(self, rt, device_id: int):
        self.rt, self.device_id, self.loaded = rt, device_id, {}

    def run(self, compiled_as: str, args: list, names: tuple[str, ...]) -> None:
        if compiled_as not in self.loaded:
            self.loaded[compiled_as] = self.rt.load_program(compiled_as, self.device_id)
        self.loaded[compiled_as](*args)
