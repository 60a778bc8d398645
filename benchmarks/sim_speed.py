"""Simulator speed, both fidelities side by side, printed as JSON (docs/simulation.md, "Speed").

1. Saturated 16-NPU load: FLASH, EP16, K=7, max_model_len 1024, 128-token chunks, 256 running
   requests allowed (64 per TP group); a burst, so the queue keeps the engine full.  Reports, per
   fidelity (`exact`, the default, and `fleet`), simulated seconds per wall second and per CPU
   second over the saturated steps (>= 240 running; preemptions keep the running set just under
   256) and overall, and microseconds per request-step (target >= 250 sim s per s on one core).
2. Growth of wall and CPU time from 1,000 to 10,000 requests at the same load shape (target
   linear: a 10x request count costs ~10x).
3. Agreement: the fleet fidelity's summary metrics relative to the exact one's on the same
   1,000-request workload (throughputs, TTFT / TPOT / E2EL mean, p50, p99, preemptions).
4. With `--baseline REF`: one fidelity (`--fidelity`, exact unless fleet is named) of the `twin`
   package as committed at git REF, side by side with the working tree, in alternating
   subprocesses (`--repeat` rounds), so a before/after ratio comes from one run on one machine
   under the same load.
5. With `--baseline REF --instructions N`: instead of timing, the instructions each side executes
   in `simulate` on the N-request burst, counted by valgrind's callgrind (instrumentation switched
   on around the call only): a before/after ratio that does not move with the machine's load
   (it does not see cache misses; ~25 s per 1,000 requests per side).  Each side compiles the
   fleet kernels afresh (an empty numba cache).

6. The fleet fidelity's compiled kernels (twin/sim/fleet_kernels.py, numba): their first-call
   cost in a fresh process, cold (compiled, empty cache) and cached (loaded from numba's cache),
   as `kernels_first_call`; the timed runs above start after a small warm-up run, so they
   exclude it.

7. The exact fidelity's decision log (`SimConfig.decision_log`): the small run again with the
   log kept, its CPU time against the run without (`decision_log`).

8. With `--digest`: no timing; a hash per run of the summary and the request, step, dispatch and
   occupancy frames (the 2,000-request burst and tests/sim/fleet_workloads.py's four agreement
   workloads, one fidelity), to show that a speed change left the results bit-identical.

    python benchmarks/sim_speed.py [--quick] [--fidelity exact|fleet|both] [--baseline f938e96 [--repeat 3]]
    python benchmarks/sim_speed.py --fidelity fleet --baseline f938e96 --instructions 1000
    python benchmarks/sim_speed.py --fidelity fleet --digest
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
SATURATED = 240          # running requests (of 256 allowed) that count as a saturated step


def dep():
    from twin.abi import deployment

    return deployment("flash", ep=16, max_model_len=1024, long_prefill_token_threshold=128, max_num_seqs=256,
                      max_num_batched_tokens=8192, num_speculative_tokens=7)


def workload(n: int, seed: int = 0):
    from twin.sim.workload import LengthDist, WorkloadSpec, generate

    # a burst: 256 requests run from the first steps and the rest queue behind them, so the engine
    # stays saturated until the queue drains; prompt + output stay under ~70% of max_model_len so
    # pinned rings have spare pages (tighter packing is a capacity study, not a speed one)
    return generate(WorkloadSpec(num_requests=n, arrival="burst",
                                 prompt=LengthDist("uniform", 192, 128, 64, 320),
                                 output=LengthDist("uniform", 320, 160, 160, 400), eos_fraction=0.2, seed=seed))


def fid_kw(fidelity: str) -> dict:
    """SimConfig's fidelity argument: passed only when it is not the default (older refs, run by
    --baseline, have no fidelity field)."""
    return {"fidelity": fidelity} if fidelity != "exact" else {}


_warm: set[str] = set()


def warm_up(fidelity: str) -> None:
    """Two 20-request runs, as the timed one and at one slot per partition (so it preempts):
    imports, and every fleet kernel a timed run calls (with each argument layout it passes),
    loaded from numba's cache or compiled, before the timing starts.  Kernels that Python first
    calls at a preemption (`commit_rows`, `release_pages`) would otherwise load inside the timed
    run (~10 ms, ~34M instructions), or compile there (seconds) where the cache is empty."""
    if fidelity in _warm:           # once per process and fidelity: later runs find it all loaded
        return
    _warm.add(fidelity)
    _warm_runs(fidelity)


def _warm_runs(fidelity: str) -> None:
    from twin.sim.run import SimConfig, simulate

    for slots in (None, 1):
        simulate(SimConfig(dep(), workload(20), slots=slots, **fid_kw(fidelity)))


def run(n: int, fidelity: str = "exact", decision_log: bool = False) -> dict:
    import numpy as np

    from twin.sim.run import SimConfig, simulate

    # a small run first, so neither side's timing includes imports or the fleet kernels' first
    # call (loaded from numba's cache, or compiled: `compile_times` reports that cost)
    warm_up(fidelity)
    cfg = SimConfig(dep(), workload(n), **fid_kw(fidelity), **({"decision_log": True} if decision_log else {}))
    c0 = time.process_time()
    res = simulate(cfg)
    cpu = time.process_time() - c0
    st = res.steps
    wall = np.asarray(res.recorder.wall)
    cpu_steps = np.asarray(getattr(res.recorder, "cpu", []))
    busy = np.flatnonzero(st.running.to_numpy() >= SATURATED)
    out = {"fidelity": fidelity, "requests": n, "engine_wall_s": res.wall_s, "cpu_s": cpu, "simulated_s": res.sim_s,
           "sim_s_per_wall_s": res.sim_s / res.wall_s, "sim_s_per_cpu_s": res.sim_s / cpu, "steps": len(st),
           "mean_running": float(st.running.mean()), "max_running": int(st.running.max()),
           "completed": res.summary["completed"], "failed": res.summary["failed"],
           "preemptions": res.summary["preemptions"], "risks": res.summary["risks"],
           "kv_stats": res.summary["kv_stats"], "summary": _metrics(res.summary)}
    if len(busy) > 1:
        # speed over the saturated steps only: simulated, wall and CPU time between their schedule calls
        t = st.t.to_numpy()
        nxt = busy[busy + 1 < len(st)]
        sim_s = float((t[nxt + 1] - t[nxt]).sum())
        wall_s = float((wall[nxt + 1] - wall[nxt]).sum())
        mean_run = float(st.running.to_numpy()[busy].mean())
        sat = {"threshold_running": SATURATED, "steps": len(nxt), "mean_running": mean_run,
               "mean_live_in_system": float((st.running + st.waiting).to_numpy()[busy].mean()),
               "simulated_s": sim_s, "wall_s": wall_s, "sim_s_per_wall_s": sim_s / wall_s,
               "wall_us_per_request_step": 1e6 * wall_s / (len(nxt) * mean_run)}
        if len(cpu_steps) == len(st):
            cpu_s = float((cpu_steps[nxt + 1] - cpu_steps[nxt]).sum())
            sat.update({"cpu_s": cpu_s, "sim_s_per_cpu_s": sim_s / cpu_s if cpu_s else None,
                        "cpu_us_per_request_step": 1e6 * cpu_s / (len(nxt) * mean_run)})
        out["saturated"] = sat
    return out


AGREE = ("request_throughput", "output_token_throughput", "preemptions", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms",
         "tpot_mean_ms", "tpot_p50_ms", "tpot_p99_ms", "e2el_mean_ms", "e2el_p50_ms", "e2el_p99_ms")


def _metrics(s: dict) -> dict:
    out = {k: s[k] for k in ("completed", "failed", "request_throughput", "output_token_throughput", "preemptions")}
    out.update({f"{k}_{q}": s[k][q] for k in ("ttft", "tpot", "e2el") for q in ("mean_ms", "p50_ms", "p99_ms")})
    return out


def scaling(a: dict, b: dict) -> dict:
    out = {"requests": [a["requests"], b["requests"]], "request_ratio": b["requests"] / a["requests"],
           "wall_ratio": b["engine_wall_s"] / a["engine_wall_s"], "cpu_ratio": b["cpu_s"] / a["cpu_s"],
           "engine_wall_s": [a["engine_wall_s"], b["engine_wall_s"]], "cpu_s": [a["cpu_s"], b["cpu_s"]],
           "target": "wall_ratio ~= cpu_ratio ~= request_ratio (linear)"}
    sa, sb = a.get("saturated"), b.get("saturated")
    if sa and sb:
        out["wall_per_request_step_ratio"] = sb["wall_us_per_request_step"] / sa["wall_us_per_request_step"]
        if "cpu_us_per_request_step" in sa and "cpu_us_per_request_step" in sb:
            out["cpu_per_request_step_ratio"] = sb["cpu_us_per_request_step"] / sa["cpu_us_per_request_step"]
    return out


def agreement(exact: dict, fleet: dict) -> dict:
    """fleet / exact - 1 per summary metric (tests/sim/test_fleet.py states the tolerances)."""
    a, b = exact["summary"], fleet["summary"]
    out = {"same_completed_failed": (a["completed"], a["failed"]) == (b["completed"], b["failed"])}
    out.update({k: (b[k] / a[k] - 1.0) if a[k] else None for k in AGREE})
    return out


def in_subprocess(root: str, n: int, fidelity: str = "exact") -> dict:
    """`run(n)` with the `twin` package found first under `root` (a checkout or an extracted ref)."""
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(n), "--root", root,
                          "--fidelity", fidelity],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def instructions(root: str, n: int, fidelity: str) -> dict:
    """Instructions in `simulate` (callgrind, switched on around the call) with `twin` from `root`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        # the same string hashes; each side's fleet kernels compiled in its warm-up into an empty
        # numba cache (both sides alike: a kernel loaded from a cache and one compiled with its
        # caller are not set up alike, so a warm cache on one side only could bias the ratio)
        env = {**os.environ, "PYTHONPATH": root, "PYTHONHASHSEED": "0", "NUMBA_CACHE_DIR": os.path.join(tmp, "numba")}
        res = subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                              sys.executable, os.path.abspath(__file__), "--worker", str(n), "--root", root,
                              "--fidelity", fidelity, "--count"], env=env, capture_output=True, text=True, check=True)
        with open(out) as f:
            total = next(int(line.split()[1]) for line in f if line.startswith("totals:"))
    got = json.loads(res.stdout.strip().splitlines()[-1])
    return {"instructions": total, "steps": got["steps"], "simulated_s": got["simulated_s"],
            "package": got["package"]}


def count_worker(n: int, fidelity: str) -> dict:
    """`simulate` with callgrind's instrumentation on around it (callgrind_control toggles it)."""
    from twin.sim.run import SimConfig, simulate

    warm_up(fidelity)
    cfg = SimConfig(dep(), workload(n), **fid_kw(fidelity))
    toggle = ["callgrind_control", "-i"]
    subprocess.run([*toggle, "on", str(os.getpid())], capture_output=True, check=True)
    res = simulate(cfg)
    subprocess.run([*toggle, "off", str(os.getpid())], capture_output=True, check=True)
    return {"steps": len(res.steps), "simulated_s": res.sim_s}


def first_call_worker() -> dict:
    """In a fresh process: CPU seconds to import the fleet kernels, and the first and the second
    fleet warm-up run (`warm_up`: the first call of each kernel loads it from numba's cache or compiles it)."""
    importlib.import_module("twin.sim.run")          # the simulator's own import stays outside the timings
    t0 = time.process_time()
    importlib.import_module("twin.sim.fleet_kernels")
    t1 = time.process_time()
    _warm_runs("fleet")
    t2 = time.process_time()
    _warm_runs("fleet")             # the same two runs, every kernel now loaded
    t3 = time.process_time()
    return {"import_s": t1 - t0, "first_run_s": t2 - t1, "second_run_s": t3 - t2,
            "kernels_first_call_s": (t2 - t1) - (t3 - t2)}


def compile_times() -> dict:
    """The fleet kernels' first-call cost in a fresh process, with an empty numba cache (`cold`:
    compiled) and again with the cache that run wrote (`cached`: loaded), NUMBA_CACHE_DIR set to a
    scratch directory so the checkout's own cache is neither used nor touched."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "NUMBA_CACHE_DIR": tmp, "PYTHONPATH": ROOT}
        for mode in ("cold", "cached"):
            got = subprocess.run([sys.executable, os.path.abspath(__file__), "--first-call"], env=env,
                                 capture_output=True, text=True, check=True)
            out[mode] = json.loads(got.stdout)
    return out


def _extract(ref: str, tmp: str) -> None:
    """The `twin` package as it is at git `ref`, into `tmp` (the baseline side of a comparison)."""
    arch = subprocess.run(["git", "-C", ROOT, "archive", ref, "twin"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=arch, check=True)


def compare_instructions(ref: str, n: int, fidelity: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        _extract(ref, tmp)
        base, cur = instructions(tmp, n, fidelity), instructions(ROOT, n, fidelity)
    assert cur["package"].startswith(ROOT) and not base["package"].startswith(ROOT), "wrong package measured"
    return {"baseline_ref": ref, "fidelity": fidelity, "requests": n, "baseline": base, "current": cur,
            "instruction_ratio": cur["instructions"] / base["instructions"],
            "same_run": (base["steps"], base["simulated_s"]) == (cur["steps"], cur["simulated_s"])}


def digests(fidelity: str) -> dict:
    """sha256 (16 hex digits) of each run's summary (less its wall times) and result frames."""
    import dataclasses
    import hashlib

    import pandas as pd

    from twin.sim.run import SimConfig, simulate

    sys.path.insert(0, os.path.join(ROOT, "tests", "sim"))
    from fleet_workloads import WORKLOADS

    runs = {"burst2000": SimConfig(dep(), workload(2000))}
    runs.update({name: make() for name, make in WORKLOADS.items()})
    out = {}
    for name, cfg in runs.items():
        res = simulate(dataclasses.replace(cfg, fidelity=fidelity))
        h = hashlib.sha256(json.dumps({k: v for k, v in res.summary.items() if k not in ("wall_s", "sim_s_per_wall_s")},
                                      sort_keys=True, default=str).encode())
        for frame in (res.requests, res.steps, res.dispatches, res.occupancy):
            h.update(pd.util.hash_pandas_object(frame.astype(str), index=True).values.tobytes())
        out[name] = h.hexdigest()[:16]
    return out


def compare(ref: str, sizes: tuple[int, ...], repeat: int, fidelity: str = "exact") -> dict:
    """Baseline (the package at git `ref`) and the working tree, alternating, same sizes."""
    with tempfile.TemporaryDirectory() as tmp:
        _extract(ref, tmp)
        rows = {n: {"baseline": [], "current": []} for n in sizes}
        for _ in range(repeat):
            for n in sizes:
                rows[n]["baseline"].append(in_subprocess(tmp, n, fidelity))
                rows[n]["current"].append(in_subprocess(ROOT, n, fidelity))
    out = {"baseline_ref": ref, "fidelity": fidelity, "repeat": repeat, "sizes": {}}
    for n, r in rows.items():
        def best(side, key, sub=None):
            vals = [(x[sub][key] if sub else x[key]) for x in r[side] if (not sub or x.get(sub))]
            if not vals:
                return None
            return max(vals) if key.startswith("sim_s") else min(vals)     # best of the rounds
        b_sat = best("baseline", "sim_s_per_wall_s", "saturated")
        c_sat = best("current", "sim_s_per_wall_s", "saturated")
        b_us = best("baseline", "wall_us_per_request_step", "saturated")
        c_us = best("current", "wall_us_per_request_step", "saturated")
        b_satc = best("baseline", "sim_s_per_cpu_s", "saturated")
        c_satc = best("current", "sim_s_per_cpu_s", "saturated")
        b_cpu, c_cpu = best("baseline", "cpu_s"), best("current", "cpu_s")
        b_wall, c_wall = best("baseline", "engine_wall_s"), best("current", "engine_wall_s")
        assert all(x["package"].startswith(ROOT) for x in r["current"]), "working tree not measured"
        assert not any(x["package"].startswith(ROOT) for x in r["baseline"]), "baseline not measured"
        same = all(x["kv_stats"] == y["kv_stats"] and x["preemptions"] == y["preemptions"]
                   and x["summary"] == y["summary"] for x, y in zip(r["baseline"], r["current"]))
        out["sizes"][str(n)] = {
            "baseline": {"saturated_sim_s_per_wall_s": b_sat, "saturated_sim_s_per_cpu_s": b_satc,
                         "wall_us_per_request_step": b_us, "cpu_s": b_cpu, "engine_wall_s": b_wall},
            "current": {"saturated_sim_s_per_wall_s": c_sat, "saturated_sim_s_per_cpu_s": c_satc,
                        "wall_us_per_request_step": c_us, "cpu_s": c_cpu, "engine_wall_s": c_wall},
            "speedup_saturated": c_sat / b_sat if b_sat and c_sat else None,
            "speedup_saturated_cpu": c_satc / b_satc if b_satc and c_satc else None,
            "speedup_cpu": b_cpu / c_cpu, "speedup_engine_wall": b_wall / c_wall,
            "same_results": same}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run, not the measurement)")
    ap.add_argument("--fidelity", default="both", choices=("exact", "fleet", "both"))
    ap.add_argument("--baseline", metavar="REF", help="also measure the twin package at this git ref, side by side")
    ap.add_argument("--repeat", type=int, default=1, help="alternating rounds for --baseline (best of each side)")
    ap.add_argument("--instructions", type=int, metavar="N",
                    help="with --baseline: count instructions (callgrind) on an N-request burst instead of timing")
    ap.add_argument("--digest", action="store_true", help="hash each run's results instead of timing")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--first-call", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, args.root or ROOT)
    if args.first_call:
        print(json.dumps(first_call_worker()))
        return
    if args.worker:
        import twin

        got = count_worker(args.worker, args.fidelity) if args.count else run(args.worker, args.fidelity)
        print(json.dumps({**got, "package": os.path.dirname(twin.__file__)}))
        return
    fid = "exact" if args.fidelity == "both" else args.fidelity      # a comparison or digest runs one
    if args.digest:
        print(json.dumps({"benchmark": "sim_speed", "fidelity": fid, "digests": digests(fid)}, indent=2))
        return
    if args.instructions:
        if not args.baseline:
            ap.error("--instructions N needs --baseline REF")
        if args.instructions < 1:
            ap.error(f"--instructions {args.instructions}: a request count >= 1")
        print(json.dumps({"benchmark": "sim_speed", "instructions": compare_instructions(
            args.baseline, args.instructions, fid)}, indent=2))
        return
    small, big = (200, 2000) if args.quick else (1000, 10000)
    if args.baseline:
        print(json.dumps({"benchmark": "sim_speed", "cpu_count": os.cpu_count(),
                          "comparison": compare(args.baseline, (small, big), args.repeat, fid)}, indent=2))
        return
    fids = ("exact", "fleet") if args.fidelity == "both" else (args.fidelity,)
    res = {f: (run(small, f), run(big, f)) for f in fids}
    out = {"benchmark": "sim_speed", "cpu_count": os.cpu_count(), "target_sim_s_per_wall_s": 250,
           "fidelities": {}}
    for f, (a, b) in res.items():
        sat = b.get("saturated") or {}
        out["fidelities"][f] = {
            "saturated_sim_s_per_wall_s": sat.get("sim_s_per_wall_s"),
            "saturated_sim_s_per_cpu_s": sat.get("sim_s_per_cpu_s"),
            "wall_us_per_request_step": sat.get("wall_us_per_request_step"),
            "cpu_us_per_request_step": sat.get("cpu_us_per_request_step"),
            "overall_sim_s_per_cpu_s": [a["sim_s_per_cpu_s"], b["sim_s_per_cpu_s"]],
            "scaling": scaling(a, b), "saturated": sat, "runs": [
                {k: v for k, v in x.items() if k not in ("saturated", "summary")} for x in (a, b)]}
    if "exact" in res:
        # the decision log's cost: the small run again with the log kept
        on = run(small, "exact", decision_log=True)
        off = res["exact"][0]
        out["fidelities"]["exact"]["decision_log"] = {
            "requests": small, "cpu_s_off": off["cpu_s"], "cpu_s_on": on["cpu_s"],
            "cpu_ratio": on["cpu_s"] / off["cpu_s"], "steps": [off["steps"], on["steps"]]}
    if "fleet" in res:
        out["fidelities"]["fleet"]["kernels_first_call"] = compile_times()
    if len(res) == 2:
        ex, fl = out["fidelities"]["exact"], out["fidelities"]["fleet"]
        out["fleet_over_exact"] = {
            "saturated_speedup_wall": fl["saturated_sim_s_per_wall_s"] / ex["saturated_sim_s_per_wall_s"],
            "saturated_speedup_cpu": (fl["saturated_sim_s_per_cpu_s"] / ex["saturated_sim_s_per_cpu_s"]
                                      if fl["saturated_sim_s_per_cpu_s"] and ex["saturated_sim_s_per_cpu_s"] else None),
            "cpu_speedup": [x["cpu_s"] / y["cpu_s"] for x, y in zip(res["exact"], res["fleet"])],
            "agreement": {str(small): agreement(res["exact"][0], res["fleet"][0]),
                          str(big): agreement(res["exact"][1], res["fleet"][1])}}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
