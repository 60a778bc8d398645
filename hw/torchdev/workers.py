"""The wire of a split TorchBackend: process 0 (the host) sends each dispatch to the processes
serving the other rank slices and gathers their results into the one DispatchResult.

Per dispatch, process 0 broadcasts (deployment, slots, program, positional arguments) and
scatters each process its pool slices and, the first time a program runs, its weight slices
(which a serving process keeps); every process runs its ranks (`TorchBackend.run_mine`, whose
collectives are `hw.torchdev.ranks`), and process 0 gathers (outputs, touched pools, taps) and
concatenates them in rank order.  A pool touched on any rank comes back whole, its untouched
slices from the host's own state.

Pools travel as row deltas: a serving process keeps the slices it last held, the host keeps a
mirror of them, and each direction sends only the rows (last-axis vectors) whose bytes differ,
copied verbatim (a pool it has not held, or of another shape, travels whole).  A dispatch writes
a few pages of pools that are mostly untouched, so the wire carries those pages, the positional
arguments and the taps.  Object collectives (pickled numpy arrays) keep it one call per step.
"""
from __future__ import annotations

import numpy as np

from twin.abi.batches import DispatchResult

STOP = "stop"


def encode(held, new) -> tuple:
    """`new` as a delta against `held` (what the other side has): ("rows", index, rows), or
    ("whole", new) when there is nothing comparable."""
    new = np.asarray(new)
    if held is None or held.shape != new.shape or held.dtype != new.dtype or new.ndim == 0:
        return ("whole", np.ascontiguousarray(new))
    a = np.ascontiguousarray(held).reshape(-1, new.shape[-1]).view(np.uint8)
    b = np.ascontiguousarray(new).reshape(-1, new.shape[-1])
    idx = np.flatnonzero((a != b.view(np.uint8)).any(axis=-1))
    return ("rows", idx, b[idx])


def decode(held, msg) -> np.ndarray:
    """The array `encode(held, new)` describes (a new array; `held` is not written)."""
    if msg[0] == "whole":
        return np.array(msg[1], copy=True)
    out = np.array(held, copy=True)
    out.reshape(-1, out.shape[-1])[msg[1]] = msg[2]
    return out


def _slice(a, s: range):
    return np.asarray(a)[s.start:s.stop]


def host_run(backend, dispatch, state, weights) -> DispatchResult:
    import torch.distributed as dist

    ranks = backend.ranks
    sent = backend.__dict__.setdefault("_weights_sent", set())
    mirror = backend.__dict__.setdefault("_mirror", [{} for _ in range(ranks.world)])
    new = dispatch.program not in sent
    dist.broadcast_object_list([("run", backend.dep, backend.slots, dispatch.program, dict(dispatch.args), new)],
                               src=0)
    states = [{k: _slice(v, ranks.slice_of(p)) for k, v in state.items()} for p in range(ranks.world)]
    wire = [None] + [({k: encode(mirror[p].get(k), v) for k, v in states[p].items()},
                      {k: _slice(v, ranks.slice_of(p)) for k, v in weights.items()} if new else None)
                     for p in range(1, ranks.world)]
    dist.scatter_object_list([None], wire, src=0)
    sent.add(dispatch.program)
    res = backend.run_mine(dispatch, states[0], {k: _slice(v, ranks.slice_of(0)) for k, v in weights.items()})
    parts = [None] * ranks.world
    dist.gather_object(res, parts, dst=0)
    for p in range(1, ranks.world):
        outs, touched, taps = parts[p]
        touched = {k: decode(states[p][k], m) for k, m in touched.items()}
        mirror[p].update({k: np.array(v, copy=True) for k, v in states[p].items()})
        mirror[p].update(touched)
        parts[p] = outs, touched, taps
    outputs = {n: np.concatenate([p[0][n] for p in parts]) for n in res[0]}
    taps = {k: np.concatenate([p[2][k] for p in parts]) for k in res[2]}
    touched = {}
    for n in sorted({n for p in parts for n in p[1]}):
        touched[n] = np.concatenate([p[1][n] if n in p[1] else states[i][n] for i, p in enumerate(parts)])
    return DispatchResult(outputs, touched, taps)


def host_close() -> None:
    import torch.distributed as dist

    dist.broadcast_object_list([(STOP,)], src=0)


class Server:
    """A serving process's end of the wire: the pool slices it holds between dispatches."""

    def __init__(self):
        self.held: dict = {}

    def receive(self):
        """The next dispatch: (deployment, slots, program, args, pool slices, weight slices or None
        when this program's were sent before), or None when the host says stop."""
        import torch.distributed as dist

        msg = [None]
        dist.broadcast_object_list(msg, src=0)
        if msg[0][0] == STOP:
            return None
        _, dep, slots, program, args, new = msg[0]
        got = [None]
        dist.scatter_object_list(got, None, src=0)
        pools, weights = got[0]
        for k, m in pools.items():
            self.held[k] = decode(self.held.get(k), m)
        return dep, slots, program, args, {k: self.held[k] for k in pools}, weights if new else None

    def reply(self, result) -> None:
        """(outputs, touched pools as deltas against the slices received, taps), gathered at the host."""
        import torch.distributed as dist

        outputs, touched, taps = result
        wire = {k: encode(self.held[k], v) for k, v in touched.items()}
        self.held.update(touched)
        dist.gather_object((outputs, wire, taps), None, dst=0)
