"""PyptoBackend: runs a lowered dispatch on a compiled PyPTO program, through the PyPTO runtime's
own calling convention (hw-native-sys/pypto, `pypto.runtime`).

A compiled program is what `@pl.jit` gives: `kernel.compile(*tensors)` returns a
`CompiledProgram` whose `output_dir` holds the artifacts and `compiled_meta.json` (its parameters in
order: name, direction In / Out / InOut, shape, dtype).  Two ways to run it, both positional:

    ChipWorker(config=RunConfig(platform=..., device_id=...)).run(compiled, *tensors, config=RunConfig(...))
    execute_compiled(work_dir, tensors, platform=..., device_id=...)

Tensors are host torch tensors, contiguous, in parameter order; the runtime writes the program's
`pl.Out` / `pl.InOut` tensors in place.  Ring-heap sizes (the runtime's four scope-depth arenas)
travel in the per-call `RunConfig` (`ring_heap`, four byte counts); `execute_compiled` takes none,
so on that path the runtime reads them from `PTO2_RING_HEAP` and the backend refuses to run unless
that variable holds the program's profile.  Platform "a2a3" is the Ascend NPU, "a2a3sim" the
runtime's CPU simulator.

`PyptoBackend.run(dispatch, state)` binds the dispatch positionally: the argument list is
`twin.abi.programs.bind`'s for the dispatch's program, each argument taken from the dispatch (by
name), the run state (pools, by buffer identity or name) or the weights (by buffer identity or
name); outputs and scratch nobody supplied are allocated zeroed.  Before the runtime sees anything
it checks the argument count and order against the compiled parameters, and every argument's dtype,
shape and (for block tables) frozen table depth against the ABI and the compiled program, with an
error naming the argument.  It returns a `DispatchResult` with the outputs and the state the program
wrote (copies: the caller's state is never written).
"""
from __future__ import annotations

import importlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from twin.abi.batches import Dispatch, DispatchResult
from twin.abi.errors import AbiError
from twin.abi.programs import DYNAMIC_AXES, OUTPUT, SCRATCH, STATE, WEIGHT, Program, bind, get_program
from twin.abi.ringheap import parse_ring_heap, resolve_profiles
from twin.abi.topology import Deployment

# ABI dtype -> (numpy storage dtype, pypto DataType's name as compiled_meta.json writes it)
DTYPES = {"f32": (np.dtype(np.float32), "fp32"), "bf16": (np.dtype(ml_dtypes.bfloat16), "bfloat16"),
          "i8": (np.dtype(np.int8), "int8"), "i16": (np.dtype(np.int16), "int16"),
          "i32": (np.dtype(np.int32), "int32"), "i64": (np.dtype(np.int64), "int64")}
NP_DTYPE = {k: v[0] for k, v in DTYPES.items()}
PLATFORMS = ("a2a3", "a2a3sim", "a5", "a5sim")        # pypto RunConfig.__post_init__
META_FILE, META_SCHEMA = "compiled_meta.json", 1       # pypto.ir.compiled_program's L2 sidecar
RING_ENV = "PTO2_RING_HEAP"                            # the runtime's ring-heap sizes when no RunConfig carries them
# block-table depths the kernels are compiled with (twin.abi.programs.symbols): a table of another
# depth is read with the wrong row stride, so it is refused by name before anything runs
TABLE_DEPTHS = ("ORI_DEPTH", "CMP_DEPTH", "HCA_STATE_DEPTH", "CSA_STATE_DEPTH", "SPLIT_CSA_DEPTH",
                "RING_HCA_STATE", "RING_CSA_STATE")
# which ABI roles a program writes, so the runtime must hand them back (direction Out or InOut)
WRITTEN = (OUTPUT, STATE, SCRATCH)
RUNTIME_MODULE = "pypto.runtime"


@dataclass(frozen=True)
class Param:
    """One parameter of a compiled program, as compiled_meta.json states it."""

    name: str
    direction: str                   # "In", "Out" or "InOut" (pypto ParamDirection)
    shape: tuple[int, ...] | None    # None: a scalar; a negative extent is a dynamic dimension
    dtype: str


@dataclass(frozen=True)
class PyptoProgram:
    """A compiled PyPTO program bound to one ABI program: `compiled` (a CompiledProgram, run on a
    ChipWorker) or only its `work_dir` (run with execute_compiled), and its parameters."""

    program: Program
    params: tuple[Param, ...]
    work_dir: Path
    platform: str | None
    compiled: Any = None


def _bad_meta(path: Path, detail: str) -> AbiError:
    return AbiError("compiled program", str(path), f"a {META_FILE} of schema {META_SCHEMA} as pypto's compile writes "
                    f"it (recompile the program): {detail}", where="PyptoBackend")


def read_meta(work_dir) -> tuple[tuple[Param, ...], str | None]:
    """The parameters and platform of a compiled program's `compiled_meta.json` (the fields pypto's
    `CompiledProgram.from_dir` reads: schema, params[name, direction, shape, dtype], platform)."""
    path = Path(work_dir) / META_FILE
    try:
        meta = json.loads(path.read_text())
    except OSError as e:
        raise _bad_meta(path, f"it cannot be read ({e.strerror})") from None
    except ValueError as e:
        raise _bad_meta(path, f"not JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("schema") != META_SCHEMA:
        raise _bad_meta(path, f"schema {meta.get('schema') if isinstance(meta, dict) else None!r}")
    raw = meta.get("params")
    if not isinstance(raw, list):
        raise _bad_meta(path, "'params' is not a list")
    params = []
    for i, p in enumerate(raw):
        ok = (isinstance(p, dict) and isinstance(p.get("name"), str) and p.get("direction") in ("In", "Out", "InOut")
              and isinstance(p.get("dtype"), str)
              and (p.get("shape") is None or (isinstance(p["shape"], list)
                                              and all(type(d) is int for d in p["shape"]))))
        if not ok:
            raise _bad_meta(path, f"params[{i}] is not {{name, direction In|Out|InOut, shape, dtype}}")
        params.append(Param(p["name"], p["direction"], None if p["shape"] is None else tuple(p["shape"]), p["dtype"]))
    platform = meta.get("platform")
    return tuple(params), platform if isinstance(platform, str) else None


def _dynamic_axes(arg) -> set[int]:
    """Axes whose extent changes per dispatch (they mention P, L, Q, B or T_MAIN)."""
    return {i for i, d in enumerate(arg.dims) if set(re.findall(r"[A-Za-z_]\w*", d)) & set(DYNAMIC_AXES)}


def load_compiled(program: str, compiled, dep: Deployment, *, slots: int = 1) -> PyptoProgram:
    """Bind a compiled PyPTO program (a `CompiledProgram`, or the work directory of one) to the ABI
    program `program`, checking its parameters against the ABI's ordered arguments: the count, each
    position's name, dtype and direction, and every extent the ABI fixes (frozen table depths among
    them); extents that vary per dispatch are checked at each dispatch."""
    prog = get_program(program)
    work_dir = Path(compiled if isinstance(compiled, (str, os.PathLike)) else compiled.output_dir)
    params, platform = read_meta(work_dir)
    where = f"{prog.name} compiled at {work_dir}"
    if not isinstance(compiled, (str, os.PathLike)):
        names = list(getattr(compiled, "param_names", [p.name for p in params]))
        if names != [p.name for p in params]:
            raise AbiError("param_names", names[:4], f"the order of {work_dir / META_FILE}'s params", where=where)
        platform = getattr(compiled, "platform", platform)
    # pypto _coerce_args: a program takes exactly its parameters, in order
    if len(params) != len(prog.args):
        raise AbiError("parameters", len(params), f"{len(prog.args)}, the ABI's arguments of {prog.name}", where=where)
    bound = bind(prog, dep, slots)
    for i, (p, b) in enumerate(zip(params, bound)):
        a = b.arg
        if p.name != a.name:
            raise AbiError(f"parameter {i}", p.name, f"{a.name!r}, the ABI's argument at position {i}", where=where)
        if p.dtype != DTYPES[a.dtype][1]:
            raise AbiError(a.name, p.dtype, f"dtype {DTYPES[a.dtype][1]} (ABI {a.dtype})", where=where)
        if a.role in WRITTEN and p.direction == "In":
            raise AbiError(a.name, p.direction, f"direction Out or InOut: the program writes this {a.role}",
                           where=where)
        if p.shape is None or len(p.shape) != len(b.shape):
            raise AbiError(a.name, None if p.shape is None else list(p.shape), f"a tensor of rank {len(b.shape)} "
                           f"({a.shape})", where=where)
        _check_depth(a, p.shape, b.shape, where)
        fixed = [j for j in range(len(b.shape)) if j not in _dynamic_axes(a)]
        if any(p.shape[j] >= 0 and p.shape[j] != b.shape[j] for j in fixed):
            raise AbiError(a.name, list(p.shape), f"shape {list(b.shape)} ({a.shape}; the axes that vary per "
                           "dispatch may be dynamic)", where=where)
    return PyptoProgram(prog, params, work_dir, platform, None if isinstance(compiled, (str, os.PathLike)) else compiled)


def _check_depth(arg, shape, want, where: str) -> None:
    depth = arg.dims[-1]
    if depth in TABLE_DEPTHS and shape[-1] != want[-1]:
        raise AbiError(arg.name, list(shape), f"table depth {want[-1]}, the frozen depth {depth} of this deployment "
                       "(the kernel reads exactly that many columns)", where=where)


def ring_heap(program: Program, env: Mapping[str, str] | None = None) -> list[int]:
    """The program's ring-heap profile as RunConfig's `ring_heap`: four byte counts, one per scope
    depth (0 leaves a depth at the runtime's default), from twin.abi.ringheap with its overrides."""
    prof = resolve_profiles(os.environ if env is None else env)[program.ring_heap]
    return [0 if v is None else int(v) for v in prof.depths]


class PyptoBackend:
    """Runs dispatches on compiled PyPTO programs (`programs`: ABI program name -> `PyptoProgram`,
    from `load_compiled`) through a PyPTO runtime module (`pypto.runtime`, or one with its API)."""

    def __init__(self, dep: Deployment, programs: Mapping[str, PyptoProgram], runtime, *, platform: str = "a2a3sim",
                 device_id: int = 0, slots: int = 1, weights: Mapping[str, np.ndarray] | None = None,
                 env: Mapping[str, str] | None = None):
        if platform not in PLATFORMS:
            raise AbiError("platform", platform, f"one of {PLATFORMS} (a2a3: the NPU, a2a3sim: the runtime's CPU "
                           "simulator)", where="PyptoBackend")
        if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
            raise AbiError("device_id", device_id, "an integer >= 0", where="PyptoBackend")
        for name, p in programs.items():
            if not isinstance(p, PyptoProgram) or p.program.name != name:
                raise AbiError("program", name, "a PyptoProgram loaded for it (hw.pypto.load_compiled)",
                               where="PyptoBackend")
            # pypto ChipWorker._check_binding: a program runs on the platform it was compiled for
            if p.platform is not None and p.platform != platform:
                raise AbiError(f"{name} platform", p.platform, f"{platform!r}, the backend's (compile it for that "
                               "platform)", where="PyptoBackend")
        self.dep, self.programs, self.rt, self.slots = dep, dict(programs), runtime, slots
        self.platform, self.device_id = platform, device_id
        self.weights = weights or {}
        self.env = os.environ if env is None else env
        self.name = f"pypto:{platform}:{device_id}"
        self.worker = None
        if any(p.compiled is not None for p in self.programs.values()):
            self.worker = runtime.ChipWorker(config=runtime.RunConfig(platform=platform, device_id=device_id))

    @classmethod
    def from_runtime(cls, dep: Deployment, programs: Mapping[str, PyptoProgram], **kw) -> "PyptoBackend":
        """On the installed PyPTO runtime (`pypto.runtime`; docs/lockstep.md says how to build it)."""
        try:
            rt = importlib.import_module(RUNTIME_MODULE)
        except ModuleNotFoundError:
            raise AbiError("PyPTO runtime", RUNTIME_MODULE, "an importable pypto.runtime (build pypto, simpler / "
                           "pto-isa and ptoas from source: docs/lockstep.md)", where="PyptoBackend.from_runtime") from None
        return cls(dep, programs, rt, **kw)

    # ---- binding -----------------------------------------------------------------------------------
    def positional(self, d: Dispatch, state: Mapping[str, np.ndarray]) -> list:
        """The dispatch's arguments as arrays in the ABI's positional order, each checked for dtype,
        shape and table depth against `bind` at the dispatch's extents (`meta["extents"]`)."""
        prog = get_program(d.program)
        bound = bind(prog, self.dep, self.slots, **dict(d.meta.get("extents", {})))
        extra = set(d.args) - set(prog.names)
        if extra:
            raise AbiError("argument", sorted(extra)[0], f"an argument of {prog.name}", where=prog.name)
        out = []
        for b in bound:
            a = b.arg
            want = NP_DTYPE[a.dtype]
            if a.name in d.args:
                v = d.args[a.name]
            elif a.role == STATE and (a.buffer_id in state or a.name in state):
                v = np.array(state[a.buffer_id if a.buffer_id in state else a.name])   # the device writes it
            elif a.role == WEIGHT and (a.buffer_id in self.weights or a.name in self.weights):
                v = self.weights.get(a.buffer_id, self.weights.get(a.name))
            elif a.role in (OUTPUT, SCRATCH):
                v = np.zeros(b.shape, want)
            else:
                raise AbiError("argument", a.name, "supplied by the dispatch, the state or the weights "
                               f"(role {a.role}, buffer {a.buffer_id})", where=prog.name)
            shape = tuple(np.shape(v))
            if len(shape) == len(b.shape):
                _check_depth(a, shape, b.shape, prog.name)
            if shape != b.shape:
                raise AbiError(a.name, list(shape), f"shape {list(b.shape)} ({a.shape})", where=prog.name)
            if np.asarray(v).dtype != want:
                raise AbiError(a.name, str(np.asarray(v).dtype), f"dtype {a.dtype} ({want})", where=prog.name)
            out.append(v)
        return out

    def _compiled_for(self, d: Dispatch) -> PyptoProgram:
        try:
            return self.programs[d.program]
        except KeyError:
            raise AbiError("program", d.program, f"one this backend has compiled: {sorted(self.programs)}",
                           where="PyptoBackend") from None

    # ---- running -----------------------------------------------------------------------------------
    def run(self, d: Dispatch, state: Mapping[str, np.ndarray]) -> DispatchResult:
        pp = self._compiled_for(d)
        args = self.positional(d, state)
        for p, a, v in zip(pp.params, pp.program.args, args):
            # the compiled program's static extents, at this dispatch's shapes
            if any(w >= 0 and w != s for w, s in zip(p.shape, np.shape(v))):
                raise AbiError(a.name, list(np.shape(v)), f"the compiled program's shape {list(p.shape)} (negative: "
                               f"dynamic) at {pp.work_dir}", where=pp.program.name)
        tensors = [_to_torch(v) for v in args]
        if pp.compiled is not None:
            cfg = self.rt.RunConfig(platform=self.platform, device_id=self.device_id,
                                    ring_heap=ring_heap(pp.program, self.env))
            self.worker.run(pp.compiled, *tensors, config=cfg)
        else:
            self._check_ring_env(pp.program)
            self.rt.execute_compiled(pp.work_dir, tensors, platform=self.platform, device_id=self.device_id)
        outputs, new_state = {}, {}
        for a, t in zip(pp.program.args, tensors):
            if a.role == OUTPUT:
                outputs[a.name] = _to_numpy(t, NP_DTYPE[a.dtype])
            elif a.role == STATE:
                new_state[a.buffer_id] = _to_numpy(t, NP_DTYPE[a.dtype])
        return DispatchResult(outputs, new_state)

    def _check_ring_env(self, program: Program) -> None:
        want = resolve_profiles(self.env)[program.ring_heap].depths
        got = self.env.get(RING_ENV)
        if got is None or parse_ring_heap(got, variable=RING_ENV) != want:
            sizes = ",".join(str(v or 0) for v in want)
            raise AbiError(RING_ENV, got, f"{sizes}, the {program.ring_heap} ring-heap profile (execute_compiled "
                           "takes no RunConfig: the runtime sizes its rings from this variable)", where=program.name)


def _to_torch(v):
    """A contiguous host torch tensor with the array's bytes (pypto's `_coerced_to_orch_args` takes
    contiguous CPU tensors only); bf16 goes through its 16-bit pattern (NumPy has no native bf16)."""
    import torch

    a = np.ascontiguousarray(v)
    if a.dtype == NP_DTYPE["bf16"]:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _to_numpy(t, dtype: np.dtype) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(dtype)
    return t.numpy()
