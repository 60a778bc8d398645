"""Which torch device runs the programs: cpu, cuda[:i], or npu[:i] (torch_npu, imported only then)."""
from __future__ import annotations

from twin.abi.errors import AbiError

KINDS = ("cpu", "cuda", "npu")


def torch_device(spec: str):
    import torch
    kind = str(spec).split(":")[0]
    if kind not in KINDS:
        raise AbiError("device", spec, f"one of {KINDS} (optionally with :index)", where="TorchBackend")
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  registers the npu device with torch
        except ImportError:
            raise AbiError("device", spec, "npu with torch_npu installed", where="TorchBackend") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise AbiError("device", spec, "cuda with a visible CUDA device", where="TorchBackend")
    return torch.device(spec)
