"""hw.torchdev: an independent torch implementation of the device programs (TorchBackend).

Written from kernel-math.md and the positional ABI (`twin.abi`) only: it imports nothing from
`golden`, so a lockstep against it can catch a golden bug.  One module per kernel family
(numerics, rmsnorm, rope, hyper, qkv, compressor, indexer, attention, o_proj, moe, head), the
per-layer composition across ranks (layers), one module per program (decode, prefill), the
argument binding (args, paged), the backend (backend, device), and the ranks a process holds with
their collectives (ranks) and the wire of a run split over processes (workers).
"""
from .backend import TorchBackend, serve
from .ranks import Ranks

__all__ = ["Ranks", "TorchBackend", "serve"]
