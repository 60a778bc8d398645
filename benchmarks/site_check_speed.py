"""The site checker's unit of work on NumPy and on the JAX path, side by side in one run; prints JSON.

A sampled lockstep run (every site every dispatch, K=0, records kept) is recorded on a small preset;
then one recorded decode dispatch's target sites are re-judged from its records (the checker pool's
unit, `twin.functional.parity.check`) with --checker-golden numpy and jax, alternating, best of
--reps rounds: wall and CPU seconds per dispatch and per site, the JAX path's first call apart
(trace + compile of every sub-layer structure the dispatch meets, less one steady call: the compile
cost), and whether the two entries agree (the same verdicts per site, the same entry but for the
checker's own note).  The head check and the record reads are the same work on both sides.
Threads: one BLAS and one XLA thread (a checker worker's).

    python benchmarks/site_check_speed.py [--preset small] [--steps 6] [--requests 4] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def _timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def _compare(d, e, reps: int, check) -> dict:
    """Recorded dispatch e's target sites re-judged on NumPy and on JAX, alternating."""
    sites = [(e["program"], g, layer, stage) for g, layer, stage, _ in e["sites"]]
    i = e["index"]
    out = {"dispatch": i, "requests": e["rows"], "sites": len(sites)}
    got = {}
    first, w, c = _timed(lambda: check(d, i, sites, golden="jax"))
    out["jax_first_call"] = {"wall_s": w, "cpu_s": c}
    best = {g: {"wall_s": float("inf"), "cpu_s": float("inf")} for g in ("numpy", "jax")}
    for _ in range(reps):
        for g in ("numpy", "jax"):
            got[g], w, c = _timed(lambda: check(d, i, sites, golden=g))
            best[g] = {"wall_s": min(best[g]["wall_s"], w), "cpu_s": min(best[g]["cpu_s"], c)}
    for b in best.values():
        b.update(wall_per_site_ms=1e3 * b["wall_s"] / len(sites), cpu_per_site_ms=1e3 * b["cpu_s"] / len(sites))
    out["best"] = best
    out["numpy_over_jax_cpu"] = best["numpy"]["cpu_s"] / best["jax"]["cpu_s"]
    out["jax_compile_s"] = {"wall": out["jax_first_call"]["wall_s"] - best["jax"]["wall_s"],
                            "cpu": out["jax_first_call"]["cpu_s"] - best["jax"]["cpu_s"]}
    jx = dict(got["jax"])
    note = jx.pop("checker")
    out["agree"] = {"verdict": jx["verdict"] == got["numpy"]["verdict"], "sites": jx["sites"] == got["numpy"]["sites"],
                    "entry_but_note": jx == got["numpy"], "first_call_entry": first == got["jax"],
                    "sites_to_numpy": len(note.get("numpy", ()))}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", choices=("tiny", "small"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    from hw.threads import limit_xla_threads

    limit_xla_threads()
    from golden.blas import single_threaded_blas
    from golden.heap import retain_heap
    from hw.real.jax_check import jax_device
    from twin.functional.parity import build_lockstep, check

    retain_heap()
    out = {"preset": a.preset, "load_before": os.getloadavg()}
    with single_threaded_blas(), tempfile.TemporaryDirectory() as d:
        lr = build_lockstep(preset=a.preset, seed=0, k=0, max_new=max(8, a.steps), n_requests=a.requests,
                            coverage=1, run_dir=d, mode="continuous")
        lr.run(a.steps)
        # the last decode dispatch and the prefill dispatch of the most rows
        picks = {"decode": [x for x in lr.entries if x["program"] == "l3_decode_fwd"][-1],
                 "prefill": max((x for x in lr.entries if x["program"] == "l3_prefill_fwd"), key=lambda x: x["rows"])}
        out["backend"] = jax_device()[1]
        for name, e in picks.items():
            out[name] = _compare(d, e, a.reps, check)
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
