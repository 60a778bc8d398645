"""Simulator speed, printed as JSON (docs/simulation.md explains the fields).

1. Saturated 16-NPU load: FLASH, EP16, K=7, max_model_len 1024, 128-token chunks, 256 running
   requests allowed (64 per TP group); a burst, so the queue keeps the engine full.  Reports
   simulated seconds per wall second over the saturated steps (>= 240 running; preemptions keep
   the running set just under 256, see the report) and overall (target >= 250 on one core).
2. Growth of wall time from 1,000 to 10,000 requests at the same load shape (target linear:
   a 10x request count costs ~10x wall time).
3. With `--baseline REF`: the same measurement of the `twin` package as committed at git REF,
   side by side with the working tree, in alternating subprocesses (`--repeat` rounds), so a
   before/after ratio comes from one run on one machine under the same load.

    python benchmarks/sim_speed.py [--quick] [--baseline f938e96 [--repeat 3]]
"""
from __future__ import annotations

import argparse
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


def run(n: int) -> dict:
    import numpy as np

    from twin.sim.run import SimConfig, simulate

    cfg = SimConfig(dep(), workload(n))
    c0 = time.process_time()
    res = simulate(cfg)
    cpu = time.process_time() - c0
    st = res.steps
    wall = np.asarray(res.recorder.wall)
    busy = np.flatnonzero(st.running.to_numpy() >= SATURATED)
    out = {"requests": n, "engine_wall_s": res.wall_s, "cpu_s": cpu, "simulated_s": res.sim_s,
           "sim_s_per_wall_s": res.sim_s / res.wall_s, "steps": len(st),
           "mean_running": float(st.running.mean()), "max_running": int(st.running.max()),
           "completed": res.summary["completed"], "failed": res.summary["failed"],
           "preemptions": res.summary["preemptions"], "risks": res.summary["risks"],
           "kv_stats": res.summary["kv_stats"]}
    if len(busy) > 1:
        # speed over the saturated steps only: simulated and wall time between their schedule calls
        t = st.t.to_numpy()
        spans = [(t[i + 1] - t[i], wall[i + 1] - wall[i]) for i in busy if i + 1 < len(st)]
        sim_s, wall_s = float(sum(x for x, _ in spans)), float(sum(y for _, y in spans))
        out["saturated"] = {"threshold_running": SATURATED, "steps": len(spans),
                            "mean_running": float(st.running.to_numpy()[busy].mean()),
                            "mean_live_in_system": float((st.running + st.waiting).to_numpy()[busy].mean()),
                            "simulated_s": sim_s, "wall_s": wall_s, "sim_s_per_wall_s": sim_s / wall_s,
                            "wall_us_per_request_step": 1e6 * wall_s / (len(spans) * float(st.running.to_numpy()[busy].mean()))}
    return out


def in_subprocess(root: str, n: int) -> dict:
    """`run(n)` with the `twin` package found first under `root` (a checkout or an extracted ref)."""
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(n), "--root", root],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def compare(ref: str, sizes: tuple[int, ...], repeat: int) -> dict:
    """Baseline (the package at git `ref`) and the working tree, alternating, same sizes."""
    with tempfile.TemporaryDirectory() as tmp:
        arch = subprocess.run(["git", "-C", ROOT, "archive", ref, "twin"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=arch, check=True)
        rows = {n: {"baseline": [], "current": []} for n in sizes}
        for _ in range(repeat):
            for n in sizes:
                rows[n]["baseline"].append(in_subprocess(tmp, n))
                rows[n]["current"].append(in_subprocess(ROOT, n))
    out = {"baseline_ref": ref, "repeat": repeat, "sizes": {}}
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
        b_cpu, c_cpu = best("baseline", "cpu_s"), best("current", "cpu_s")
        b_wall, c_wall = best("baseline", "engine_wall_s"), best("current", "engine_wall_s")
        assert all(x["package"].startswith(ROOT) for x in r["current"]), "working tree not measured"
        assert not any(x["package"].startswith(ROOT) for x in r["baseline"]), "baseline not measured"
        same = all(x["kv_stats"] == y["kv_stats"] and x["preemptions"] == y["preemptions"]
                   for x, y in zip(r["baseline"], r["current"]))
        out["sizes"][str(n)] = {
            "baseline": {"saturated_sim_s_per_wall_s": b_sat, "wall_us_per_request_step": b_us, "cpu_s": b_cpu,
                         "engine_wall_s": b_wall},
            "current": {"saturated_sim_s_per_wall_s": c_sat, "wall_us_per_request_step": c_us, "cpu_s": c_cpu,
                        "engine_wall_s": c_wall},
            "speedup_saturated": c_sat / b_sat if b_sat and c_sat else None,
            "speedup_cpu": b_cpu / c_cpu, "speedup_engine_wall": b_wall / c_wall,
            "same_results": same}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run, not the measurement)")
    ap.add_argument("--baseline", metavar="REF", help="also measure the twin package at this git ref, side by side")
    ap.add_argument("--repeat", type=int, default=1, help="alternating rounds for --baseline (best of each side)")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, args.root or ROOT)
    if args.worker:
        import twin

        print(json.dumps({**run(args.worker), "package": os.path.dirname(twin.__file__)}))
        return
    small, big = (200, 2000) if args.quick else (1000, 10000)
    if args.baseline:
        print(json.dumps({"benchmark": "sim_speed", "cpu_count": os.cpu_count(),
                          "comparison": compare(args.baseline, (small, big), args.repeat)}, indent=2))
        return
    a, b = run(small), run(big)
    out = {"benchmark": "sim_speed", "cpu_count": os.cpu_count(), "target_sim_s_per_wall_s": 250,
           "saturated": b.get("saturated")}
    out["scaling"] = {"small": a, "large": b, "request_ratio": big / small,
                      "wall_ratio": b["engine_wall_s"] / a["engine_wall_s"],
                      "wall_per_request_ratio": (b["engine_wall_s"] / big) / (a["engine_wall_s"] / small),
                      "wall_per_request_step_ratio": (b["saturated"]["wall_us_per_request_step"]
                                                      / a["saturated"]["wall_us_per_request_step"])
                      if a.get("saturated") and b.get("saturated") else None,
                      "target": "wall_ratio ~= request_ratio (linear)"}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
