"""Launching ranks for the multi-rank check (hw.real.ranks): spawned local
ranks on gloo, torchrun's rank and world size, and rank 0's verdict.  Torch is imported only when
ranks are spawned."""
from __future__ import annotations

import json
import os
from contextlib import contextmanager


@contextmanager
def process_group(backend: str, rank: int, world: int, init_method: str | None = None):
    """torch.distributed's default group for the block (torchrun's env:// unless init_method)."""
    import torch.distributed as dist

    dist.init_process_group(backend, rank=rank, world_size=world, init_method=init_method or "env://")
    try:
        yield
    finally:
        dist.destroy_process_group()


def _spawned(rank, fn, args, kwargs, init_method):
    import torch

    torch.set_num_threads(1)       # the ranks share the machine's cores
    fn(rank, *args, init_method=init_method, **kwargs)


def run_local_ranks(fn, args: tuple, world: int, out: str, *, kwargs: dict | None = None, port: int | None = None,
                    timeout_s: float = 120.0) -> dict:
    """`fn(rank, *args, init_method=..., **kwargs)` in `world` spawned processes on 127.0.0.1 (gloo),
    each on one torch thread; returns the verdict rank 0 wrote to `out`.  Ranks still alive at the
    deadline are terminated."""
    import socket
    import time

    import torch.multiprocessing as mp

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    ctx = mp.start_processes(_spawned, args=(fn, args, kwargs or {}, f"tcp://127.0.0.1:{port}"), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"{world} ranks did not finish within {timeout_s}s")
    with open(out) as fh:
        return json.load(fh)


def write_verdict(res: dict | None, out: str | None) -> dict | None:
    """Rank 0's verdict, also written as JSON to `out` when given (spawned ranks hand it back that way)."""
    if res is not None and out:
        with open(out, "w") as fh:
            json.dump(res, fh, indent=2)
    return res


def torchrun_rank() -> tuple[int, int]:
    """(rank, world size) as torchrun sets them (a plain run is rank 0 of 1)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def verdict_status(res: dict | None) -> int:
    """Rank 0 prints its verdict; the exit status is 1 when it failed (other ranks return None)."""
    if res is None:
        return 0
    print(json.dumps(res, indent=2))
    return 0 if res["verdict"] == "pass" else 1
