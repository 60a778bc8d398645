"""A stand-in for `pypto.runtime` with the same calling convention, enforcing the checks the real
runtime makes (hw-native-sys/pypto; each check names the function it mirrors).  The "device" writes
every Out / InOut tensor in place: flat element 0 becomes the parameter's position + 1, so a test
sees which tensor the runtime took for which parameter and that the writes come back.

    kernel = jit(params)                       # a @pl.jit kernel: [(name, direction, dynamic axes)]
    compiled = kernel.compile(*tensors, out_dir=d, platform="a2a3sim")   # CompiledProgram + compiled_meta.json
    ChipWorker(config=RunConfig(platform="a2a3sim")).run(compiled, *tensors, config=RunConfig(ring_heap=...))
    execute_compiled(d, tensors, platform="a2a3sim", device_id=0)
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

META = "compiled_meta.json"
TORCH_TO_PYPTO = {torch.float32: "fp32", torch.bfloat16: "bfloat16", torch.int8: "int8", torch.int16: "int16",
                  torch.int32: "int32", torch.int64: "int64"}
RING_DEPTH = 4                     # pypto runner._RING_DEPTH


@dataclass
class RunConfig:
    platform: str = "a2a3sim"
    device_id: int = 0
    ring_task_window: object = None
    ring_heap: object = None
    ring_dep_pool: object = None

    def __post_init__(self):
        # pypto RunConfig.__post_init__
        if self.platform not in ("a2a3sim", "a2a3", "a5sim", "a5"):
            raise ValueError(f"Invalid platform {self.platform!r}. Expected 'a2a3sim', 'a2a3', 'a5sim', or 'a5'.")
        # pypto RunConfig._validate_ring_overrides: a scalar, or exactly one entry per scope-depth ring;
        # each a power of two >= 1024 (a 0 list entry keeps that ring's default)
        v = self.ring_heap
        if v is None:
            return
        entries = list(v) if isinstance(v, (list, tuple)) else [v]
        if isinstance(v, (list, tuple)) and len(entries) != RING_DEPTH:
            raise ValueError(f"ring_heap must have {RING_DEPTH} entries (one per scope-depth ring), got {len(entries)}")
        for e in entries:
            zero_ok = isinstance(v, (list, tuple)) and e == 0
            if not zero_ok and not (type(e) is int and e >= 1024 and e & (e - 1) == 0):
                raise ValueError(f"ring_heap entries must be a power of 2 >= 1024 (bytes per ring), got {e!r}")


def write_meta(out_dir: Path, params: list[dict], platform: str) -> None:
    """pypto CompiledProgram._write_meta: schema 1, params (name, direction, shape, dtype), platform."""
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"schema": 1, "params": params, "num_return_types": 0, "platform": platform, "backend_type": "Ascend910B"}
    (out_dir / META).write_text(json.dumps(meta, indent=2))


def read_params(work_dir) -> list[dict]:
    return json.loads((Path(work_dir) / META).read_text())["params"]


class CompiledProgram:
    def __init__(self, output_dir, platform: str):
        self.output_dir, self.platform = Path(output_dir), platform

    @classmethod
    def from_dir(cls, output_dir, *, platform: str | None = None) -> "CompiledProgram":
        """pypto CompiledProgram.from_dir: the sidecar rebuilds the call signature."""
        meta = json.loads((Path(output_dir) / META).read_text())
        return cls(output_dir, platform or meta["platform"])

    @property
    def param_names(self) -> list[str]:
        return [p["name"] for p in read_params(self.output_dir)]

    @property
    def output_indices(self) -> list[int]:
        return [i for i, p in enumerate(read_params(self.output_dir)) if p["direction"] == "Out"]


class jit:
    """A @pl.jit kernel: `compile(*tensors)` specializes on the sample tensors' shapes and dtypes (their
    contents are not read), dynamic axes stay dynamic (-1), as JITFunction.compile does."""

    def __init__(self, params: list[tuple[str, str, set]]):
        self.params = params

    def compile(self, *tensors, out_dir, platform: str = "a2a3sim") -> CompiledProgram:
        if len(tensors) != len(self.params):
            raise TypeError(f"kernel expects {len(self.params)} arguments, got {len(tensors)}")
        meta = [{"name": n, "direction": d, "dtype": TORCH_TO_PYPTO[t.dtype],
                 "shape": [-1 if i in dyn else s for i, s in enumerate(t.shape)]}
                for (n, d, dyn), t in zip(self.params, tensors)]
        write_meta(Path(out_dir), meta, platform)
        return CompiledProgram(out_dir, platform)


CALLS: list[dict] = []             # every dispatch that reached the "device"


def _device(params: list[dict], args: tuple, **facts) -> None:
    # pypto _coerce_args: exactly the parameters (in-place style)
    if len(args) != len(params):
        raise TypeError(f"CompiledProgram expects {len(params)} (in-place) arguments, got {len(args)}. "
                        f"Parameters: {[p['name'] for p in params]}")
    for i, (p, t) in enumerate(zip(params, args)):
        # pypto _coerced_to_orch_args: host tensors must be torch tensors, contiguous, on the CPU
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"Argument at position {i} must be torch.Tensor, DeviceTensor or ctypes scalar, "
                            f"got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"Tensor at position {i} is not contiguous.")
        if t.device.type != "cpu":
            raise ValueError(f"Tensor at position {i} is on {t.device}, expected CPU.")
        # pypto _validate_device_tensor: dtype and the static extents of the parameter
        if TORCH_TO_PYPTO.get(t.dtype) != p["dtype"]:
            raise TypeError(f"Parameter {p['name']!r} expects dtype {p['dtype']}, got {t.dtype}")
        if len(t.shape) != len(p["shape"]) or any(w >= 0 and w != s for w, s in zip(p["shape"], t.shape)):
            raise TypeError(f"Parameter {p['name']!r} expects shape {p['shape']}, got {list(t.shape)}")
    CALLS.append({**facts, "names": [p["name"] for p in params], "args": args})
    for i, (p, t) in enumerate(zip(params, args)):
        if p["direction"] in ("Out", "InOut") and t.numel():
            t.view(-1)[0] = i + 1          # the device writes in place


class ChipWorker:
    def __init__(self, config: RunConfig | None = None):
        self.config = config or RunConfig()

    @property
    def platform(self) -> str:
        return self.config.platform

    def run(self, compiled: CompiledProgram, *args, config: RunConfig | None = None):
        # pypto ChipWorker._check_binding
        if compiled.platform != self.platform:
            raise ValueError(f"CompiledProgram.platform={compiled.platform!r} does not match "
                             f"ChipWorker.platform={self.platform!r}.")
        rc = config if config is not None else RunConfig()
        _device(read_params(compiled.output_dir), args, path="ChipWorker.run", work_dir=compiled.output_dir,
                platform=self.platform, device_id=self.config.device_id, ring_heap=rc.ring_heap)


def execute_compiled(work_dir, args, *, platform: str, device_id: int) -> None:
    """pypto runner.execute_compiled: ordered args in compiled_meta.json's params order; no ring_* kwarg."""
    RunConfig(platform=platform)            # the same platform names
    _device(read_params(work_dir), tuple(args), path="execute_compiled", work_dir=Path(work_dir),
            platform=platform, device_id=device_id, ring_heap=os.environ.get("PTO2_RING_HEAP"))
