"""Fault detection and localization on the real-golden lockstep (hw.real), printed as JSON.

Every kind of `hw.real.faults` is injected over seeds x dispatch indices x layers
(`hw.real.faults.sweep_layers`), each injection a strict lockstep run (`hw.real.faults.run_case`)
that stops at its first failure.  Per kind: injections, how many fired (a kind fires at the first
dispatch >= AT that can host it; the five weight/store kinds only at AT exactly), detection rate
(failed at the dispatch it fired at, never before) and localization rate (the first divergence
names the expected layer and stage), with every miss listed.  Issue 8 asks 100 % detection and
>= 90 % localization; `ok` says whether each kind meets it.

    python benchmarks/real_fault_sweep.py                       # TINY: 3 seeds x 3 dispatch indices
    python benchmarks/real_fault_sweep.py --preset small --seeds 0 --ats 0,6
"""
from __future__ import annotations

import os

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402


def main(argv=None) -> dict:
    from hw.real.faults import REAL_KINDS, run_case, sweep_layers
    from twin.abi.presets import get_preset

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--ats", default="0,5,12", help="dispatch indices to arm the fault at")
    ap.add_argument("--kinds", default=",".join(REAL_KINDS))
    ap.add_argument("--max-new", type=int, default=40, help="tokens per request (40 reach a ratio-128 boundary)")
    ap.add_argument("--horizon", type=int, default=60, help="dispatches a run may take to fire")
    a = ap.parse_args(argv)
    cfg = get_preset(a.preset)
    seeds, ats = [int(x) for x in a.seeds.split(",")], [int(x) for x in a.ats.split(",")]
    t0, c0 = time.perf_counter(), time.process_time()
    kinds = {}
    for kind in a.kinds.split(","):
        cases = [run_case(kind, seed=s, at=at, layer=l, preset=a.preset, max_new=a.max_new, horizon=a.horizon)
                 for s in seeds for at in ats for l in sweep_layers(cfg, kind)]
        fired = [c for c in cases if c["fired_at"] is not None]
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
