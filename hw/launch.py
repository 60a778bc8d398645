"""Launching ranks: spawned local ranks on gloo, torchrun's rank and world size, and rank 0's
verdict (the multi-rank golden check, hw.real.ranks); the serving processes of a split torch
device (`torch_device_ranks`, hw.torchdev).  Torch is imported only when ranks are spawned."""
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


def gloo_problem() -> str | None:
    """Why gloo collectives cannot run here, or None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed"
    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch has no gloo backend (torch.distributed)"
    return None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serving(i, world, device, init_method):
    """Spawned serving process i + 1 of a split torch device."""
    import torch

    from hw.torchdev import serve

    torch.set_num_threads(1)       # the ranks share the machine's cores
    try:
        with process_group("gloo", i + 1, world, init_method):
            serve(device)
    except KeyboardInterrupt:      # Ctrl-C reaches every process; process 0 says what was kept
        pass


@contextmanager
def torch_device_ranks(nproc: int, device: str = "cpu", timeout_s: float = 600.0):
    """This process as process 0 (the host) of `nproc` gloo processes whose others serve the torch
    device's rank slices: under torchrun (WORLD_SIZE > 1) the group torchrun started, whose other
    ranks run `hw.torchdev.serve` themselves; otherwise nproc - 1 spawned local processes.  On
    leaving, the servers are told to stop (or, after an error, terminated) and the group is closed."""
    import datetime
    import time

    import torch.multiprocessing as mp

    from hw.torchdev.workers import host_close

    rank, world = torchrun_rank()
    timeout = datetime.timedelta(seconds=timeout_s)
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        try:
            yield world
            host_close()
        finally:
            dist.destroy_process_group()
        return
    init = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.start_processes(_serving, args=(nproc, device, init), nprocs=nproc - 1, join=False,
                             start_method="spawn")
    import torch.distributed as dist

    ok = False
    try:
        dist.init_process_group("gloo", rank=0, world_size=nproc, init_method=init, timeout=timeout)
        try:
            yield nproc
            host_close()
            ok = True
        finally:
            dist.destroy_process_group()
    finally:
        deadline = time.monotonic() + (30.0 if ok else 0.0)
        try:
            while not ctx.join(timeout=0.5) and time.monotonic() < deadline:
                pass
        except mp.ProcessRaisedException:
            if ok:
                raise
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()


def serve_torchrun_rank(device: str = "cpu") -> int:
    """A torchrun rank > 0 of a split torch device: join the group and serve until the host stops."""
    from hw.torchdev import serve

    rank, world = torchrun_rank()
    with process_group("gloo", rank, world):
        return serve(device)


def _spawned(rank, fn, args, kwargs, init_method):
    import torch

    torch.set_num_threads(1)       # the ranks share the machine's cores
    fn(rank, *args, init_method=init_method, **kwargs)


def run_local_ranks(fn, args: tuple, world: int, out: str, *, kwargs: dict | None = None, port: int | None = None,
                    timeout_s: float = 120.0) -> dict:
    """`fn(rank, *args, init_method=..., **kwargs)` in `world` spawned processes on 127.0.0.1 (gloo),
    each on one torch thread; returns the verdict rank 0 wrote to `out`.  Ranks still alive at the
    deadline are terminated."""
    import time

    import torch.multiprocessing as mp

    if port is None:
        port = _free_port()
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
