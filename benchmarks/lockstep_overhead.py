"""Lockstep overhead: a parity run's wall time over the device-only run of the same workload, side by
side in one process, printed as JSON.  Targets on CPU: at most 2 (synchronous), at most 1.2
(asynchronous, sampled).

All runs serve the same seeded workload through the simulator's scheduler (`twin.functional.parity`):

  device-only  the self-check device (golden's compositions with every GEMM on torch) runs every
               dispatch the scheduler issues and the scheduler commits its outputs
  lockstep     --mode sync: the same, plus golden on every dispatch re-synced from the device, every
               comparison, the content-addressed dispatch records and the JSONL report (what
               `dspark-twin lockstep` pays)
               --mode async: the device side records every dispatch and submits every
               `--check-every`-th dispatch's whole-dispatch check to `--check-workers` local checker
               processes (`hw.real.pool`, what `dspark-twin lockstep --async` pays); its wall time
               runs until the last check is back, and `device_side_s` until the device finished
               --mode async --coverage N: sampled, every dispatch's planned sites and its head as one
               check from the records (what `dspark-twin lockstep --async --coverage N` pays)

The asynchronous device side captures each record and a thread of its own hashes and writes it
(`hw.real.records.RecordThread`): `record_s` is the device side's time capturing (and waiting on a
full record queue, `record_waited_s`), `record_thread_s` the writer thread's (`record_thread_cpu_s`
its CPU).  The device thread's wall time splits into `device_thread_cpu_s` (its CPU; device-only's
is its `cpu_s`), `device_thread_preempted_s` (runnable, waiting for a core other jobs held) and
`device_thread_blocked_s` (asleep: on the backlog, the record queue, the drain, or the GIL and any
other lock, `device_thread_gil_s`, the rest once the first three are taken out), so a device side
slowed by the GIL shows apart from one slowed by a loaded machine.  Its checkers are one
thread each at the lowest CPU priority (`hw.real.pool.lowest_priority`); the device side is one torch
and one OpenBLAS thread (`threads`).  `load_average` is the machine's (1, 5, 15 minutes) at the start
and the end: other processes' load falls on the asynchronous run's second core first.
`--flash-layer` adds the checker's unit of work at FLASH scale: one FLASH-shaped layer for one rank's
128 decode rows in NumPy against its GEMMs alone (`benchmarks/golden_speed.py`'s measurement).

The two runs alternate in `--rounds` short rounds, ABBA (device-only then lockstep, then lockstep
then device-only, ...), so a machine whose load drifts during the benchmark weighs on both sides
alike; `ratio` is the ratio of the median wall times (`ratio_cpu` of the median CPU seconds), and
`rounds` lists every round's pair with its own ratio.  Wall and process CPU seconds are both
printed (the asynchronous mode's CPU is the device process's; its checker processes run on the
other cores).  The asynchronous figures (`async`) are the round whose lockstep wall time is the
median's; `rounds` holds each round's backlog high-water mark, skipped checks and waits.

    python benchmarks/lockstep_overhead.py --preset tiny --dispatches 40
    python benchmarks/lockstep_overhead.py --preset small --dispatches 64 --mode async --check-every 16
    python benchmarks/lockstep_overhead.py --preset small --dispatches 64 --mode async --coverage 16
"""
from __future__ import annotations

import os

# one BLAS thread, as torch gets one intra-op thread: on a small preset the golden's GEMMs are tiny and
# OpenBLAS's spinning worker threads only burn CPU against the device side (set before numpy loads)
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

TARGET = {"sync": 2.0, "async": 1.2}


def _build(preset: str, n: int, seed: int, **kw):
    from twin.functional.parity import build_lockstep

    return build_lockstep(preset=preset, seed=seed, max_new=max(8, n), **kw)


def device_only(preset: str, n: int, seed: int) -> tuple[tuple[float, float], int]:
    run = _build(preset, n, seed, record=False)
    t0, c0 = time.perf_counter(), time.process_time()
    done = run.device_only(n)
    return (time.perf_counter() - t0, time.process_time() - c0), done


def lockstep(preset: str, n: int, seed: int, coverage: int | None = None) -> tuple[tuple[float, float], dict]:
    tmp = tempfile.mkdtemp(prefix="lockstep-bench-")
    try:
        run = _build(preset, n, seed, run_dir=tmp, coverage=coverage)
        t0, c0 = time.perf_counter(), time.process_time()
        s = run.run(n)
        return (time.perf_counter() - t0, time.process_time() - c0), s
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _thread_usage() -> tuple[float, float | None]:
    """This thread's CPU seconds and, where the kernel keeps scheduler statistics, its seconds spent
    runnable but waiting for a core (`/proc/thread-self/schedstat`)."""
    try:
        with open("/proc/thread-self/schedstat") as fh:
            queued = int(fh.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        queued = None
    return time.thread_time(), queued


def _blocked(wall: float, d0, d1) -> dict:
    """The device thread's wall time that was neither its CPU nor a wait for a core: asleep, on the
    backlog (`device_waited_s`), the record queue (`record_waited_s`), the drain (`drain_s`) or the
    GIL (the rest)."""
    if d0[1] is None or d1[1] is None:
        return {"device_thread_preempted_s": None, "device_thread_blocked_s": None}
    queued = d1[1] - d0[1]
    return {"device_thread_preempted_s": round(queued, 4),
            "device_thread_blocked_s": round(wall - (d1[0] - d0[0]) - queued, 4)}


def checked_async(preset: str, n: int, seed: int, *, every: int, workers: int, backlog: int | None,
                  policy: str, coverage: int | None = None) -> tuple[tuple[float, float], dict, dict]:
    tmp = tempfile.mkdtemp(prefix="lockstep-bench-")
    try:
        run = _build(preset, n, seed, run_dir=tmp, coverage=coverage)
        k0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        d0 = _thread_usage()
        t0, c0 = time.perf_counter(), time.process_time()
        s = run.run_async(n, workers=workers, backlog=backlog, policy=policy, every=every)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        d1 = _thread_usage()
        # the checker processes' CPU (start-up included), counted once the pool has shut them down
        k1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        pool = run.checker.pool
        timing = {"checker_cpu_s": round(k1.ru_utime + k1.ru_stime - k0.ru_utime - k0.ru_stime, 4),
                  "device_side_s": round(wall - pool.drain_s, 4),
                  "device_waited_s": round(pool.waited_s, 4),
                  "drain_s": round(pool.drain_s, 4),
                  "record_s": round(pool.record_s, 4),
                  "record_waited_s": round(pool.writer.waited_s, 4),
                  "record_thread_s": round(pool.writer.busy_s, 4),
                  "record_thread_cpu_s": round(pool.writer.cpu_s, 4),
                  "device_thread_cpu_s": round(d1[0] - d0[0], 4),
                  **_blocked(wall, d0, d1)}
        if timing["device_thread_blocked_s"] is not None:
            timing["device_thread_gil_s"] = round(timing["device_thread_blocked_s"] - timing["device_waited_s"]
                                                  - timing["record_waited_s"] - timing["drain_s"], 4)
        return (wall, cpu), s, timing
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--preset", default="tiny")
    p.add_argument("--dispatches", type=int, default=40)
    p.add_argument("--rounds", type=int, default=5,
                   help="alternating device-only / lockstep pairs, ABBA order (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=("sync", "async"), default="sync")
    p.add_argument("--check-every", type=int, default=None,
                   help="async: check every N-th dispatch whole (default 16; not with --coverage)")
    p.add_argument("--coverage", type=int, default=None,
                   help="sampled: every site checked at least once every N dispatches of its program, the head "
                        "every dispatch")
    p.add_argument("--check-workers", type=int, default=1, help="async: checker processes (default 1)")
    p.add_argument("--backlog", type=int, default=None, help="async: checks pending at most (default: the pool's, 32)")
    p.add_argument("--backlog-policy", choices=("throttle", "skip-oldest"), default="throttle")
    p.add_argument("--flash-layer", action="store_true",
                   help="also time one FLASH-shaped layer's check for one rank's rows against its GEMMs alone")
    a = p.parse_args(argv)
    for flag, v in (("--dispatches", a.dispatches), ("--rounds", a.rounds), ("--check-every", a.check_every),
                    ("--check-workers", a.check_workers), ("--backlog", a.backlog), ("--coverage", a.coverage)):
        if v is not None and v < 1:
            p.error(f"{flag}={v}: allowed: an integer >= 1")
    if a.coverage is not None and a.check_every is not None:
        p.error(f"--check-every={a.check_every}: allowed: unset with --coverage (the plan chooses each dispatch's "
                "sites)")
    every = 1 if a.coverage is not None else a.check_every or 16
    if a.preset not in ("tiny", "small"):
        p.error(f"--preset={a.preset!r}: allowed: tiny or small (FLASH does not run whole on a CPU)")
    import torch

    from hw.threads import limit_cpu_threads

    torch.set_num_threads(1)
    limit_cpu_threads(1)
    load0 = [round(x, 2) for x in os.getloadavg()]
    device_only(a.preset, 2, a.seed)                        # warm-up: imports, allocator, kernels
    rounds, runs = [], []
    for r in range(a.rounds):
        pair = {}
        for side in ("device_only", "lockstep") if r % 2 == 0 else ("lockstep", "device_only"):
            if side == "device_only":
                t, n_dev = device_only(a.preset, a.dispatches, a.seed)
            elif a.mode == "sync":
                (t, summary), timing = lockstep(a.preset, a.dispatches, a.seed, a.coverage), None
            else:
                t, summary, timing = checked_async(a.preset, a.dispatches, a.seed, every=every,
                                                   workers=a.check_workers, backlog=a.backlog,
                                                   policy=a.backlog_policy, coverage=a.coverage)
            pair[side] = {"wall_s": round(t[0], 4), "cpu_s": round(t[1], 4)}
        row = {"order": "AB" if r % 2 == 0 else "BA", **pair,
               "ratio_wall": round(pair["lockstep"]["wall_s"] / pair["device_only"]["wall_s"], 3)}
        if timing is not None:
            ck = summary["config"]["checking"]
            row.update(backlog_high_water=ck["backlog_high_water"], checked=ck["checked"],
                       skipped=len(ck["skipped"]), device_waited_s=timing["device_waited_s"],
                       record_thread_cpu_s=timing["record_thread_cpu_s"])
        rounds.append(row)
        runs.append((pair["lockstep"]["wall_s"], r, summary, timing))
    med = {k: {side: round(statistics.median(x[side][k] for x in rounds), 4) for side in ("device_only", "lockstep")}
           for k in ("wall_s", "cpu_s")}
    # the round whose lockstep wall time is the median's (the lower middle one of an even count)
    _, _, summary, timing = sorted(runs, key=lambda x: (x[0], x[1]))[(len(runs) - 1) // 2]
    out = {"benchmark": "lockstep_overhead", "preset": a.preset, "device": "cpu", "backend": summary["config"]["device"],
           "dispatches": summary["dispatches"], "device_only_dispatches": n_dev, "rounds_run": a.rounds,
           "verdict": summary["verdict"], "programs": {k: v["dispatches"] for k, v in summary["programs"].items()},
           **med, "statistic": "median over the rounds",
           "ratio_wall": round(med["wall_s"]["lockstep"] / med["wall_s"]["device_only"], 3),
           "ratio_cpu": round(med["cpu_s"]["lockstep"] / med["cpu_s"]["device_only"], 3), "mode": a.mode,
           "target_ratio": TARGET[a.mode], "rounds": rounds}
    out["ratio"] = out["ratio_wall"]
    if a.mode == "async":
        ck = summary["config"]["checking"]
        out["dispatches"] = len(ck["per_dispatch"])            # the device's; the summary counts the checked
        out["async"] = {"check_every": every, "coverage": a.coverage, "workers": ck["workers"], "backlog": ck["backlog"],
                        "policy": ck["policy"], "backlog_high_water": ck["backlog_high_water"],
                        "submitted": ck["submitted"], "checked": ck["checked"], "skipped": len(ck["skipped"]),
                        **timing,
                        "ratio_device_side": round(timing["device_side_s"] / med["wall_s"]["device_only"], 3),
                        "unit": "the whole dispatch (every site of the sampled dispatch)" if a.coverage is None else
                        "the dispatch's planned sites and its head, from the records"}
        if a.coverage is not None:
            cv = summary["coverage"]
            out["async"]["sites"] = {p: {"sites": c["sites"], "checked": c["checked"]} for p, c in cv["programs"].items()}
    out["meets_target"] = out["ratio"] <= TARGET[a.mode]
    out["threads"] = {"device_torch": torch.get_num_threads(), "checker": "one each, lowest CPU priority"}
    if a.flash_layer:
        from golden_speed import flash_layer           # this script's directory is on sys.path

        f = flash_layer(min(a.rounds, 2), requests=(16,))[0]
        out["flash_layer_check"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in f.items()}
    out["load_average"] = {"start": load0, "end": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
