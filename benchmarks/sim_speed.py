"""Simulator speed on a saturated FLASH burst, side by side with a baseline commit, printed as JSON
(docs/simulation.md, "Speed").

The load: FLASH, EP16, K=7, max_model_len 1,024, 128-token chunks, 256 running requests allowed,
every request arriving at t=0 (a burst), so the queue keeps the engine full until it drains.  Each
run is a fresh Python process (so its whole-process CPU time includes the interpreter's start and
every import) that generates the workload, runs `simulate` once and reports:

- `loop`: simulated seconds per CPU second of `simulate` (wiring, the run, the result frames), and
  CPU microseconds per request-step (a request-step: one running request in one scheduled step);
- `process`: simulated seconds per CPU second of the whole process;
- `saturated`: the same over the steps with requests still waiting, i.e. with the engine full
  (None if there were none);
- the run's outcome (steps, completed, failed, preemptions), so both sides are seen to run the
  same simulation.

Sizes 1,000 and 10,000 requests (`--quick`: 100 and 1,000), the working tree and the `twin` package
as committed at `--baseline` (default a18f1e3; `git archive` into a scratch directory, its compiled
part, if it has one, built there) in alternating rounds (`--repeat`, best of the rounds per side),
each round also running the working tree at the small size with the decision log on, for its cost
(best of the rounds against best of the rounds), and then the baseline's small run with its log:
`same_as_baseline` says whether the two decision logs (every decision, page ids included) are
byte-identical. `cpu_ratio` is the 1,000 -> 10,000 CPU growth (linear: 10).

    python benchmarks/sim_speed.py [--quick] [--baseline REF | --no-baseline] [--repeat N]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BASELINE = "a18f1e3"     # the commit this tree's simulator is measured against unless --baseline names another


def workload(n: int):
    """The benchmark's deployment and its `n`-request saturated burst (tests replay it too)."""
    from twin.abi import deployment
    from twin.sim.workload import LengthDist, WorkloadSpec, generate

    dep = deployment("flash", ep=16, max_model_len=1024, long_prefill_token_threshold=128, max_num_seqs=256,
                     max_num_batched_tokens=8192, num_speculative_tokens=7)
    # prompt + output under ~70% of max_model_len: the pools, not the context limit, bind
    reqs = generate(WorkloadSpec(num_requests=n, arrival="burst", prompt=LengthDist("uniform", 192, 128, 64, 320),
                                 output=LengthDist("uniform", 320, 160, 160, 400), eos_fraction=0.2, seed=0))
    return dep, reqs


def log_digest(records: list[dict]) -> str:
    """sha256 of the decision log as `decisions.jsonl` holds it (integers and strings only), a free
    queue's empty list of page ids left out: it moved no page (a `--baseline` ref's tree may log
    them), so two logs of the same decisions hash the same."""
    h = hashlib.sha256()
    for r in records:
        r = {k: ({q: ids for q, ids in v.items() if ids} if k in ("taken", "freed") else v) for k, v in r.items()}
        h.update((json.dumps(r) + "\n").encode())
    return h.hexdigest()


def worker(n: int, decision_log: bool) -> dict:
    """One run in this (fresh) process; every import happens here, inside the process's CPU time."""
    import numpy as np

    from twin.sim.run import SimConfig, simulate

    dep, reqs = workload(n)
    cfg = SimConfig(dep, reqs, **({"decision_log": True} if decision_log else {}))
    c0 = time.process_time()
    res = simulate(cfg)
    loop = time.process_time() - c0
    st = res.steps
    running = st.running.to_numpy()
    waiting = st.waiting.to_numpy()
    request_steps = int(running.sum())
    out = {"requests": n, "decision_log": decision_log, "simulated_s": res.sim_s, "steps": len(st),
           "completed": res.summary["completed"], "failed": res.summary["failed"],
           "preemptions": res.summary["preemptions"], "loop_cpu_s": loop,
           "loop_sim_s_per_cpu_s": res.sim_s / loop,
           "loop_cpu_us_per_request_step": 1e6 * loop / request_steps if request_steps else None,
           "saturated": None, "decision_log_sha256": log_digest(res.decisions) if decision_log else None}
    cpu = np.asarray(res.recorder.cpu)
    t = st.t.to_numpy()
    busy = np.flatnonzero(waiting[:-1] > 0)          # full steps with a successor to time them by
    if len(busy) and len(cpu) == len(st):
        sim_s = float((t[busy + 1] - t[busy]).sum())
        cpu_s = float((cpu[busy + 1] - cpu[busy]).sum())
        out["saturated"] = {"steps": len(busy), "mean_running": float(running[busy].mean()), "simulated_s": sim_s,
                            "cpu_s": cpu_s, "sim_s_per_cpu_s": sim_s / cpu_s if cpu_s else None,
                            "cpu_us_per_request_step": 1e6 * cpu_s / float(running[busy].sum())}
    import twin

    out["package"] = os.path.dirname(twin.__file__)
    out["process_cpu_s"] = time.process_time()            # CPU since the process started
    out["process_sim_s_per_cpu_s"] = res.sim_s / out["process_cpu_s"]
    return out


def in_subprocess(root: str, n: int, decision_log: bool = False) -> dict:
    """`worker(n)` in a fresh interpreter with the `twin` package found first under `root`."""
    env = {**os.environ, "PYTHONPATH": root}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(n)] + (["--decision-log"] if decision_log else [])
    got = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=root)
    if got.returncode:
        raise SystemExit(f"sim_speed: the run of {n} requests with twin from {root} failed:\n{got.stderr[-2000:]}")
    res = json.loads(got.stdout)
    if not res["package"].startswith(root):
        raise SystemExit(f"sim_speed: measured twin from {res['package']}, not from {root}")
    return res


def best(runs: list[dict]) -> dict:
    """The round with the least loop CPU (the least disturbed by the machine's other load)."""
    return min(runs, key=lambda r: r["loop_cpu_s"])


def side(runs: dict[int, list[dict]], small: int, big: int) -> dict:
    a, b = best(runs[small]), best(runs[big])
    return {"runs": {str(small): a, str(big): b}, "cpu_ratio": b["loop_cpu_s"] / a["loop_cpu_s"],
            "process_cpu_ratio": b["process_cpu_s"] / a["process_cpu_s"], "request_ratio": big / small}


def _extract(ref: str, into: str) -> None:
    arch = subprocess.run(["git", "-C", ROOT, "archive", ref, "twin"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=arch, check=True)
    setup = subprocess.run(["git", "-C", ROOT, "show", f"{ref}:setup.py"], capture_output=True)
    if setup.returncode == 0:               # the commit has a compiled part: build it in place there
        with open(os.path.join(into, "setup.py"), "wb") as f:
            f.write(setup.stdout)
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=into, check=True,
                       capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="100 and 1,000 requests (a smoke run, not the measurement)")
    ap.add_argument("--baseline", default=BASELINE, metavar="REF", help=f"git ref to compare with (default {BASELINE})")
    ap.add_argument("--no-baseline", action="store_true", help="measure the working tree only")
    ap.add_argument("--repeat", type=int, default=1, help="alternating rounds per side (best of them; default 1)")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--decision-log", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.decision_log)))
        return
    if args.repeat < 1:
        ap.error(f"--repeat {args.repeat}: a round count >= 1")
    small, big = (100, 1000) if args.quick else (1000, 10000)
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"current": ROOT}
        if not args.no_baseline:
            try:
                _extract(args.baseline, tmp)
            except subprocess.CalledProcessError as e:
                if e.cmd[0] == sys.executable:
                    ap.error(f"--baseline {args.baseline}: its compiled part does not build here "
                             f"({e.stderr.decode(errors='replace').strip().splitlines()[-1:]})")
                ap.error(f"--baseline {args.baseline}: not a commit of this repository")
            sides["baseline"] = tmp
        runs = {s: {small: [], big: []} for s in sides}
        logged = []
        for _ in range(args.repeat):
            for n in (small, big):
                for s, root in sides.items():       # alternating: both sides see the same load
                    runs[s][n].append(in_subprocess(root, n))
            # under the same load as the runs without the log that it is compared with
            logged.append(in_subprocess(ROOT, small, decision_log=True))
        log_on = best(logged)
        base_log = in_subprocess(sides["baseline"], small, decision_log=True) if "baseline" in sides else None
    out = {"benchmark": "sim_speed", "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
           "sizes": [small, big], "repeat": args.repeat, "targets": {"loop_sim_s_per_cpu_s": 200,
                                                                   "process_sim_s_per_cpu_s": 100}}
    out.update({s: side(r, small, big) for s, r in runs.items()})
    if "baseline" in runs:
        out["baseline"]["ref"] = args.baseline
        keys = ("simulated_s", "steps", "completed", "failed", "preemptions")
        out["speedup"] = {str(n): {
            "loop": out["baseline"]["runs"][str(n)]["loop_cpu_s"] / out["current"]["runs"][str(n)]["loop_cpu_s"],
            "process": out["baseline"]["runs"][str(n)]["process_cpu_s"] / out["current"]["runs"][str(n)]["process_cpu_s"],
            "same_run": all(out["baseline"]["runs"][str(n)][k] == out["current"]["runs"][str(n)][k] for k in keys)}
            for n in (small, big)}
    off = out["current"]["runs"][str(small)]
    out["decision_log"] = {"requests": small, "loop_cpu_s_off": off["loop_cpu_s"], "loop_cpu_s_on": log_on["loop_cpu_s"],
                           "cpu_ratio": log_on["loop_cpu_s"] / off["loop_cpu_s"],
                           "same_run": (log_on["steps"], log_on["simulated_s"]) == (off["steps"], off["simulated_s"]),
                           "sha256": log_on["decision_log_sha256"],
                           "same_as_baseline": None if base_log is None else
                           base_log["decision_log_sha256"] == log_on["decision_log_sha256"]}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
