"""The wire of a split TorchBackend: process 0 (the host) sends each dispatch to the processes
serving the other rank slices and gathers their results into the one DispatchResult.

Per dispatch, process 0 broadcasts (deployment, slots, program, positional arguments) and
scatters each process its slice of the state pools (and, the first time a program runs, of its
weights, which a serving process keeps); every process runs its ranks (`TorchBackend.run_mine`,
whose collectives are `hw.torchdev.ranks`), and process 0 gathers (outputs, touched pools, taps)
and concatenates them in rank order.  A pool touched on any rank comes back whole, its untouched
slices from the host's own state.  Object collectives (pickled numpy arrays) keep the wire one
call per step of the protocol.
"""
from __future__ import annotations

import numpy as np

from twin.abi.batches import DispatchResult

STOP = "stop"


def _slices(mapping, ranks) -> list[dict]:
    return [{k: np.asarray(v)[ranks.slice_of(p).start:ranks.slice_of(p).stop] for k, v in mapping.items()}
            for p in range(ranks.world)]


def host_run(backend, dispatch, state, weights) -> DispatchResult:
    import torch.distributed as dist

    ranks = backend.ranks
    sent = backend.__dict__.setdefault("_weights_sent", set())
    new = dispatch.program not in sent
    dist.broadcast_object_list([("run", backend.dep, backend.slots, dispatch.program, dict(dispatch.args), new)],
                               src=0)
    states = _slices(state, ranks)
    ws = _slices(weights, ranks) if new else [None] * ranks.world
    mine = [None]
    dist.scatter_object_list(mine, list(zip(states, ws)), src=0)
    sent.add(dispatch.program)
    sl = ranks.slice_of(0)
    res = backend.run_mine(dispatch, states[0], {k: np.asarray(v)[sl.start:sl.stop] for k, v in weights.items()})
    parts = [None] * ranks.world
    dist.gather_object(res, parts, dst=0)
    outputs = {n: np.concatenate([p[0][n] for p in parts]) for n in res[0]}
    taps = {k: np.concatenate([p[2][k] for p in parts]) for k in res[2]}
    touched = {}
    for n in sorted({n for p in parts for n in p[1]}):
        touched[n] = np.concatenate([p[1][n] if n in p[1] else states[i][n] for i, p in enumerate(parts)])
    return DispatchResult(outputs, touched, taps)


def host_close() -> None:
    import torch.distributed as dist

    dist.broadcast_object_list([(STOP,)], src=0)


def receive():
    """A serving process's next dispatch: (deployment, slots, program, args, state slice, weight
    slice or None when this program's weights were sent before), or None when the host says stop."""
    import torch.distributed as dist

    msg = [None]
    dist.broadcast_object_list(msg, src=0)
    if msg[0][0] == STOP:
        return None
    _, dep, slots, program, args, new = msg[0]
    got = [None]
    dist.scatter_object_list(got, None, src=0)
    state, weights = got[0]
    return dep, slots, program, args, state, weights if new else None


def reply(result) -> None:
    """A serving process's (outputs, touched pools, taps), gathered at the host."""
    import torch.distributed as dist

    dist.gather_object(result, None, dst=0)
