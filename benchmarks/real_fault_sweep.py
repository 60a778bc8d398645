"""Fault detection and localization on the real-golden lockstep (hw.real), printed as JSON.

Every kind of `hw.real.faults` is injected over seeds x dispatch indices x layers
(`hw.real.faults.sweep_layers`), each injection a strict parity run through the scheduler
(`twin.functional.parity.run_case`) that stops at its first failure.  Per kind: injections, how many fired (a kind fires at the first
dispatch >= AT that can host it; the five weight/store kinds only at AT exactly), detection rate
(failed at the dispatch it fired at, never before) and localization rate (the first divergence
names the expected layer and stage), with every miss listed.  The target is 100 % detection and
>= 90 % localization; `ok` says whether each kind meets it.

    python benchmarks/real_fault_sweep.py                       # TINY: 3 seeds x 3 dispatch indices
    python benchmarks/real_fault_sweep.py --preset small --seeds 0 --ats 0,6

`--coverage N` runs the sampled lockstep instead (`hw.real.coverage`: every site checked at least once
every N dispatches of its program, each from the device's state): every kind injected persistently
(it fires on every dispatch >= AT that can host it) at each layer of `--layers`; per injection the
detection latency in dispatches from the first firing (1: that dispatch) and in dispatches of the
detecting program, which the plan bounds by N for a fault that shows on every dispatch of it.
With `--single-seeds M`, each kind is also injected into one dispatch and caught or not
by the planned sites of M plan seeds (checked from the records), against the plan's probability.

    python benchmarks/real_fault_sweep.py --preset small --coverage 16 --seeds 0 --ats 5 --single-seeds 64

`--clean` instead runs clean parity runs (continuous mode, the default policy, four seeded requests
of `--max-new` tokens each, served to completion) per preset and seed and reports
false alarms plus the measurement behind the policy's depth-scaled tie margins: per layer depth, the
largest golden-score gap of a route the device chose differently, the residual stream's largest
per-row rel-L2 divergence (the `attn_in` taps; the head's `hidden`), the largest greedy-sample gap,
and the margin the policy gives at that depth.

    python benchmarks/real_fault_sweep.py --clean --presets tiny,small --seeds 0,1,2 --max-new 100
"""
from __future__ import annotations

import os

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402


def clean(presets, seeds, max_new: int) -> dict:
    import numpy as np

    from twin.functional.parity import build_lockstep
    from hw.tolerance import Policy
    from twin.abi.presets import get_preset

    policy, runs = Policy(), []
    gap, xrel, sample = {}, {}, {}
    for preset in presets:
        head = get_preset(preset).num_hidden_layers
        for seed in seeds:
            c0 = time.process_time()
            lr = build_lockstep(preset=preset, seed=seed, k=7, max_new=max_new, mode="continuous")
            check = lr.check

            def measured(rd, check=check, lr=lr, head=head):
                e = check(rd)
                dc, gc = lr.dev.par.calls, lr.gold.par.calls
                if dc and gc:
                    dt, gt = dc[-1][1], gc[-1][1]
                    for site in gt:
                        if site[1] == "attn_in" or site == ("head", "hidden"):
                            a, b = (np.asarray(t[site], np.float64).reshape(len(gt[site]), -1) for t in (dt, gt))
                            d = head if site[0] == "head" else site[0]
                            n = np.maximum(np.linalg.norm(b, axis=1), 1e-30)
                            r = float((np.linalg.norm(a - b, axis=1) / n).max())
                            xrel[d] = max(xrel.get(d, 0.0), r)
                    gl, dl = (np.asarray(t[("head", "logits")], np.float64) for t in (gt, dt))
                    for r in np.flatnonzero(gl.argmax(-1) != dl.argmax(-1)):
                        g = (gl[r].max() - gl[r, dl[r].argmax()]) / max(1.0, abs(gl[r].max()))
                        sample[head] = max(sample.get(head, 0.0), float(g))
                return e
            lr.check = measured
            s = lr.run(10_000)
            for d, g in lr.gold.par.route_gaps:
                gap[d] = max(gap.get(d, 0.0), g)
            runs.append({"preset": preset, "seed": seed, "verdict": s["verdict"], "dispatches": s["dispatches"],
                         "programs": {k: v["dispatches"] for k, v in s["programs"].items()},
                         "false_alarms": [[e["index"], e["first_divergence"]["layer"], e["first_divergence"]["stage"]]
                                          for e in lr.entries if e["verdict"] == "fail"],
                         "resyncs": s["resyncs"], "cpu_s": round(time.process_time() - c0, 1),
                         "worst": {k: {m: v[m] for m in ("max_row_rel_l2", "min_cosine") if m in v}
                                   for k, v in s["worst_metrics"].items() if "/i32/" not in k}})
    depths = sorted(set(gap) | set(xrel) | set(sample))
    d = np.array([x for x in depths if x in xrel and x > 0], float)
    slope, icept = np.polyfit(d, [xrel[int(x)] for x in d], 1)
    per = {str(x): {"route_gap": round(gap.get(x, 0.0), 5), "sample_gap": round(sample.get(x, 0.0), 5),
                    "residual_row_rel_l2": round(xrel.get(x, 0.0), 5),
                    "route_margin": round(policy.lookup("route", "i32", depth=x).tie_tol, 5),
                    "sample_margin": round(policy.lookup("sample", "i32", depth=x).tie_tol, 5)} for x in depths}
    worst = max([gap[x] / per[str(x)]["route_margin"] for x in gap] + [sample[x] / per[str(x)]["sample_margin"]
                                                                       for x in sample])
    return {"mode": "clean", "max_new": max_new, "runs": runs, "depth": per,
            "residual_fit": {"intercept": round(float(icept), 5), "per_layer": round(float(slope), 5)},
            "worst_gap_over_margin": round(float(worst), 3),
            "all_clean": all(not r["false_alarms"] for r in runs)}


def sampled(a, cfg, seeds, ats) -> dict:
    """Persistent injections under the coverage plan, and (--single-seeds) single-dispatch ones."""
    import tempfile

    from hw.real.faults import LAYERLESS, sweep_layers
    from twin.functional.parity import run_case, single_dispatch_case

    t0, c0 = time.perf_counter(), time.process_time()
    kinds, singles = {}, []
    for kind in a.kinds.split(","):
        layers = sweep_layers(cfg, kind) if a.layers == "sweep" else (sweep_layers(cfg, kind)[0],)
        cases = [run_case(kind, seed=s, at=at, layer=l, preset=a.preset, max_new=a.max_new, horizon=a.horizon,
                          persistent=True, coverage=a.coverage, coverage_seed=s)
                 for s in seeds for at in ats for l in layers]
        fired = [c for c in cases if c["fired_at"] is not None]
        det = [c for c in fired if c["detected"]]
        print(f"{kind}: {len(fired)}/{len(cases)} fired, {len(det)} detected, "
              f"{sum(c['localized'] for c in det)} localized", file=sys.stderr, flush=True)
        kinds[kind] = {"injections": len(cases), "fired": len(fired), "detected": len(det),
                       "localized": sum(c["localized"] for c in det), "false_alarms": sum(c["false_alarm"] for c in cases),
                       "latency": [c["latency"] for c in det], "program_latency": [c["program_latency"] for c in det],
                       "max_program_latency": max((c["program_latency"] for c in det), default=None),
                       "ok": bool(fired) and len(det) == len(fired) and all(c["localized"] for c in det)
                       and all(c["program_latency"] <= a.coverage for c in det),
                       "cases": [{k: c.get(k) for k in ("seed", "at", "layer", "fired_at", "detected", "localized",
                                                        "latency", "program_latency", "expected", "got")}
                                 for c in cases]}
        if a.single_seeds:
            with tempfile.TemporaryDirectory() as d:
                layer = 0 if kind in LAYERLESS else layers[0]
                r = single_dispatch_case(kind, at=ats[0], layer=layer, n=a.coverage, seed=seeds[0],
                                         plan_seeds=range(a.single_seeds), preset=a.preset, run_dir=d)
            if r["fired_at"] is not None:
                p, m = r["plan_probability"], r["trials"]
                r["sigma"] = round(abs(r["frequency"] - p) / max((p * (1 - p) / m) ** 0.5, 1e-12), 2)
            singles.append(r)
            print(f"{kind} once: {r.get('caught')}/{r.get('trials')} caught, plan p = {r.get('plan_probability')}",
                  file=sys.stderr, flush=True)
    return {"preset": a.preset, "coverage": a.coverage, "seeds": seeds, "ats": ats, "max_new": a.max_new,
            "horizon": a.horizon, "wall_s": round(time.perf_counter() - t0, 1),
            "cpu_s": round(time.process_time() - c0, 1), "all_ok": all(k["ok"] for k in kinds.values()),
            "persistent": kinds, "single_dispatch": singles}


def main(argv=None) -> dict:
    from hw.real.faults import REAL_KINDS, sweep_layers
    from twin.functional.parity import run_case
    from twin.abi.presets import get_preset

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--ats", default="0,5,12", help="dispatch indices to arm the fault at")
    ap.add_argument("--kinds", default=",".join(REAL_KINDS))
    ap.add_argument("--max-new", type=int, default=40, help="tokens per request (40 reach a ratio-128 boundary)")
    ap.add_argument("--horizon", type=int, default=60, help="dispatches a run may take to fire")
    ap.add_argument("--clean", action="store_true", help="clean runs and the depth measurement instead")
    ap.add_argument("--presets", default="tiny,small", help="with --clean")
    ap.add_argument("--coverage", type=int, default=None, metavar="N",
                    help="sampled lockstep at coverage N, faults persistent (see above)")
    ap.add_argument("--layers", default="sweep", choices=("sweep", "first"),
                    help="with --coverage: every sweep layer of a kind, or its first only")
    ap.add_argument("--single-seeds", type=int, default=0, metavar="M",
                    help="with --coverage: single-dispatch injections judged over M plan seeds")
    a = ap.parse_args(argv)

    def ints(flag, text):
        try:
            vals = [int(x) for x in text.split(",")]
        except ValueError:
            ap.error(f"{flag}={text!r}: allowed: comma-separated integers >= 0")
        if any(v < 0 for v in vals):
            ap.error(f"{flag}={text!r}: allowed: comma-separated integers >= 0")
        return vals

    seeds, ats = ints("--seeds", a.seeds), ints("--ats", a.ats)
    bad = [k for k in a.kinds.split(",") if k not in REAL_KINDS]
    if bad:
        ap.error(f"--kinds: {bad[0]!r} is not a fault kind; allowed: {', '.join(REAL_KINDS)}")
    for flag, v in (("--max-new", a.max_new), ("--horizon", a.horizon)):
        if v < 1:
            ap.error(f"{flag}={v}: allowed: an integer >= 1")
    if a.clean:
        out = clean(a.presets.split(","), seeds, a.max_new)
        print(json.dumps(out, indent=1))
        return out
    if a.preset not in ("tiny", "small"):
        ap.error(f"--preset={a.preset!r}: allowed: tiny or small (the sweep runs whole models on a CPU)")
    cfg = get_preset(a.preset)
    if a.coverage is not None:
        if a.coverage < 1:
            ap.error(f"--coverage={a.coverage}: allowed: an integer N >= 1")
        if a.single_seeds < 0:
            ap.error(f"--single-seeds={a.single_seeds}: allowed: an integer >= 0")
        out = sampled(a, cfg, seeds, ats)
        print(json.dumps(out, indent=1))
        return out
    t0, c0 = time.perf_counter(), time.process_time()
    kinds = {}
    for kind in a.kinds.split(","):
        cases = [run_case(kind, seed=s, at=at, layer=l, preset=a.preset, max_new=a.max_new, horizon=a.horizon)
                 for s in seeds for at in ats for l in sweep_layers(cfg, kind)]
        fired = [c for c in cases if c["fired_at"] is not None]
        print(f"{kind}: {len(fired)}/{len(cases)} fired, {sum(c['localized'] for c in fired)} localized",
              file=sys.stderr, flush=True)
        det = sum(c["detected"] for c in fired)
        loc = sum(c["localized"] for c in fired)
        kinds[kind] = {"injections": len(cases), "fired": len(fired),
                       "detected": round(det / len(fired), 4) if fired else None,
                       "localized": round(loc / len(fired), 4) if fired else None,
                       "false_alarms": sum(c["false_alarm"] for c in cases),
                       "ok": bool(fired) and det == len(fired) and loc >= 0.9 * len(fired)
                       and not any(c["false_alarm"] for c in cases),
                       "layers": list(sweep_layers(cfg, kind)),
                       "misses": [c for c in cases if c["fired_at"] is not None and not c["localized"]
                                  or c["false_alarm"]],
                       "not_fired": [[c["seed"], c["at"], c["layer"]] for c in cases if c["fired_at"] is None]}
    out = {"preset": a.preset, "seeds": seeds, "ats": ats, "max_new": a.max_new, "horizon": a.horizon,
           "wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1),
           "all_ok": all(k["ok"] for k in kinds.values()), "kinds": kinds}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
