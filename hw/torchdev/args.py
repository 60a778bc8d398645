"""A dispatch's positional arguments as torch tensors on the device, by ABI name and role.

Inputs come from `Dispatch.args`, weights from the caller's weight mapping (ABI names), state
pools from the state mapping (ABI names, the per-rank shapes `twin.abi.programs.bind` gives).
BF16 arguments arrive as uint16 bit patterns (or any 2-byte bfloat16 array: the same bits) and
are widened exactly to FP32; state pools keep their storage dtype and are written in place on
the device copy.  `layer(name, i)` views one layer's slice of a stacked argument ("NL*X" or
"NL, ..." in the ABI shape; also NC / NH / DL stacks).

Inputs are the dispatch's whole [R, ...] arrays (a rank may read another's: the group leader's
logit rows); weights and pools are this process's rank slice (`ranks.mine`, `hw.torchdev.ranks`)
and read by global rank through `Local`.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from twin.abi.errors import AbiError
from twin.abi.programs import STATE, WEIGHT, bind, symbols

TORCH = {"f32": torch.float32, "i8": torch.int8, "i16": torch.int16, "i32": torch.int32, "i64": torch.int64,
         "bf16": torch.bfloat16}
NUMPY = {"f32": np.float32, "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64, "bf16": np.uint16}
STACKS = ("NL", "NC", "NH", "DL")


def to_torch(a, dtype: str, device, *, keep_bf16: bool = False) -> torch.Tensor:
    a = np.asarray(a)
    if dtype == "bf16":
        bits = torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).to(device).view(torch.bfloat16)
        return bits if keep_bf16 else bits.to(torch.float32)
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=NUMPY[dtype])).to(device)
    return t.to(torch.float32) if dtype == "i8" and not keep_bf16 else t


def to_numpy(t: torch.Tensor, dtype: str) -> np.ndarray:
    t = t.detach().to("cpu")
    if dtype == "bf16":
        return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    return t.to(TORCH[dtype]).contiguous().numpy()


class Local:
    """A weight or pool of this process's ranks, indexed by global rank (t[r - lo])."""

    def __init__(self, t: torch.Tensor, ranks):
        self.t, self.ranks = t, ranks
        self.shape = (ranks.R, *t.shape[1:])

    def __getitem__(self, key):
        if isinstance(key, tuple):
            return self.ranks.of(self.t, key[0])[key[1:]]
        return self.ranks.of(self.t, key)


class Args:
    """The bound arguments of one dispatch on one torch device (weights and pools: `ranks.mine`)."""

    def __init__(self, dispatch, weights: Mapping, state: Mapping, dep, slots: int, device, extents=None,
                 ranks=None):
        from .ranks import Ranks

        self.program = dispatch.program
        self.ranks = Ranks(dep.ranks) if ranks is None else ranks
        n_mine = len(self.ranks.mine)
        self.bound = {b.name: b for b in bind(dispatch.program, dep, slots, **(extents or {}))}
        self._syms = symbols(dep, slots, **(extents or {}))
        self.device = device
        self.t: dict[str, torch.Tensor] = {}
        self.state_names = []
        for name, b in self.bound.items():
            role = b.arg.role
            if role == WEIGHT:
                src, where = weights, "weights"
            elif role == STATE:
                src, where = state, "state"
                self.state_names.append(name)
            elif name in dispatch.args:
                src, where = dispatch.args, "dispatch"
            else:
                continue                     # scratch and outputs belong to the device
            if name not in src:
                raise AbiError(name, "missing", f"an array of shape {b.shape} in the {where}", where=self.program)
            a = np.asarray(src[name])
            shape = tuple(b.shape) if src is dispatch.args else (n_mine, *b.shape[1:])
            if tuple(a.shape) != shape:
                how = "bind" if shape == tuple(b.shape) else "bind, this process's ranks"
                raise AbiError(name, tuple(a.shape), f"shape {shape} ({how})", where=self.program)
            # pools are written in place: on a copy, never the caller's arrays
            self.t[name] = to_torch(a.copy() if role == STATE else a, b.dtype, device, keep_bf16=role == STATE)
        self._layer_cache: dict = {}

    def __getitem__(self, name: str):
        t = self.t[name]
        return t if self.bound[name].arg.role not in (WEIGHT, STATE) else Local(t, self.ranks)

    def __contains__(self, name: str) -> bool:
        return name in self.t

    def layer(self, name: str, i: int) -> torch.Tensor:
        """[R, ...] one layer's slice of a stacked argument (i counts within its stack)."""
        key = name
        if key not in self._layer_cache:
            t, dims = self.t[name], self.bound[name].arg.dims
            head = dims[1]
            if head in STACKS:
                self._layer_cache[key] = t
            else:
                stack = head.split("*")[0].strip()
                if stack not in STACKS:
                    raise AbiError(name, head, "a stacked argument (NL / NC / NH / DL)", where=self.program)
                n = {"NL": self.n("NL"), "NC": self.n("NC"), "NH": self.n("NH"), "DL": self.n("DL")}[stack]
                self._layer_cache[key] = t.reshape(t.shape[0], n, t.shape[1] // n, *t.shape[2:])
        t = self._layer_cache[key][:, i]
        return t if self.bound[name].arg.role not in (WEIGHT, STATE) else Local(t, self.ranks)

    def n(self, sym: str) -> int:
        return self._syms[sym]

    def pools(self) -> dict[str, torch.Tensor]:
        return {n: self.t[n] for n in self.state_names}
