"""Run dispatches on a device backend in lockstep with the golden model and print the verdict.

Every dispatch (packed prefill, K=0 decode, fused K=7 verify+redraft, drafter seeding) runs on the
device backend, then on the golden re-synced from the device's decisions; outputs, routing and
touched pools are compared under the tolerance policy and the first divergence is localized to
(dispatch, layer, stage).  The golden is golden's own compositions (`hw.real`).  Records,
report.jsonl and summary.{md,html} go to --run-dir; running again on the same directory resumes
where a killed run stopped.
"""
from __future__ import annotations

from twin.abi.errors import AbiError

from ._common import integer, out_dir, seed


# the defaults of the flags that set up the device side, which a replay has no use for
DEVICE_SIDE = {"preset": "tiny", "device": "cpu", "steps": 100, "mode": "strict", "fresh": False, "inject": None,
               "seed": 0, "no_records": False}


def add_arguments(p) -> None:
    d = DEVICE_SIDE
    p.add_argument("--preset", default=d["preset"], help="a small preset (tiny or small); FLASH does not run whole on a CPU")
    p.add_argument("--device", default=d["device"], help="torch device: cpu, cuda[:n] or npu[:n] (default cpu)")
    p.add_argument("--steps", type=integer, default=d["steps"], help="dispatches to run (default 100)")
    p.add_argument("--mode", default=d["mode"], choices=("strict", "continuous"),
                   help="strict stops at the first failing dispatch (default); continuous re-syncs and goes on")
    p.add_argument("--run-dir", default="lockstep-run", help="records and reports (default ./lockstep-run)")
    p.add_argument("--fresh", action="store_true", help="discard an existing run in --run-dir instead of resuming")
    p.add_argument("--inject", default=d["inject"], metavar="KIND[@AT[:LAYER]]",
                   help="inject one fault (see docs/lockstep.md for the kinds)")
    p.add_argument("--policy", default=None, help="JSON file of tolerance entries overriding the defaults")
    p.add_argument("--seed", type=seed, default=d["seed"], help="weights and workload seed (default 0)")
    p.add_argument("--no-records", action="store_true", help="do not write dispatch records (no resume, no replay)")
    p.add_argument("--replay", action="store_true",
                   help="no device: re-judge the records in --run-dir against the golden offline and "
                        "compare with its report")


def run(args) -> int:
    import shutil
    from pathlib import Path

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from golden.heap import retain_heap
    from hw.report import ReportWriter
    from hw.run_format import check_run_dir
    from hw.threads import limit_cpu_threads
    from hw.tolerance import Policy

    if args.device == "cpu":
        limit_cpu_threads(1)
        retain_heap()           # golden's temporaries reused, not re-faulted (golden.heap)

    con = Console()
    run_dir = Path(args.run_dir)
    policy = Policy.from_json(args.policy) if args.policy else None
    if args.replay:
        # the run directory's records/config.json sets the run a replay rebuilds: a flag for the device
        # side would be ignored
        for dest, default in DEVICE_SIDE.items():
            if getattr(args, dest) != default:
                raise AbiError("--" + dest.replace("_", "-"), getattr(args, dest), "no value with --replay (the run directory's records set "
                               "the run; --policy re-judges it)", where="lockstep")
        return _replay(args, run_dir, con, policy)
    out_dir(run_dir, "--run-dir")
    if args.fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    check_run_dir(run_dir)
    resumed = (run_dir / "report.jsonl").exists()
    from hw.real.lockstep import build_real, parse_real_fault
    from hw.real.records import read_config

    fault = parse_real_fault(args.inject) if args.inject else None
    # about one decode dispatch per token: enough tokens for --steps (prompts + tokens fit 512 positions);
    # a resumed run keeps the token budget it started with
    max_new = min(400, max(8, args.steps))
    if resumed:
        try:
            max_new = read_config(run_dir).get("max_new", max_new)
        except AbiError:            # a run that kept no records starts its budget afresh
            pass
    lr = build_real(preset=args.preset, device=args.device, mode=args.mode, seed=args.seed, fault=fault,
                    policy=policy, run_dir=run_dir, max_new=max_new, record=not args.no_records)
    done = len(ReportWriter(run_dir).entries())
    if resumed:
        con.print(f"resuming {run_dir}: {done} dispatches already checked")
    with Progress(TextColumn("[bold]lockstep"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=con, transient=True) as prog:
        task = prog.add_task("", total=args.steps, completed=min(done, args.steps))

        def tick(e):
            mark = "[green]ok[/green]" if e["verdict"] == "pass" else "[red]FAIL[/red]"
            prog.update(task, advance=1, description=f"#{e['index']} {e['program']} {mark}")
        s = lr.run(args.steps, tick)
    fd = s["first_divergence"]
    progs = ", ".join(f"{k} {v['dispatches']}" for k, v in sorted(s["programs"].items()))
    color = "green" if s["verdict"] == "PASS" else "red"
    con.print(f"[bold {color}]{s['verdict']}[/bold {color}]: {s['dispatches']} dispatches ({progs}), "
              f"{s['failed_dispatches']} failed")
    if fd:
        con.print(f"first divergence: dispatch {fd['dispatch']} ({fd['program']}), layer {fd['layer']}, "
                  f"stage {fd['stage']}, tensor {fd['tensor']}: {'; '.join(fd['reasons'])}")
    if fault is not None and fault.fired:
        con.print(f"injected: {fault.fired}")
    rs = ", ".join(f"{k} {v}" for k, v in s["resyncs"].items()) or "none"
    con.print(f"re-syncs: {rs}")
    extra = ")" if args.no_records else ", records/)"
    con.print(f"report: {run_dir / 'summary.md'} (also .html, report.jsonl{extra}")
    return 0 if s["verdict"] == "PASS" else 1


def interrupted(args) -> str:
    if args.replay:
        return "the replay wrote nothing; rerun it to replay again"
    if args.no_records:
        return (f"{args.run_dir}/report.jsonl keeps the dispatches checked so far, but a run without records "
                "cannot resume: rerun with --fresh")
    return f"{args.run_dir} keeps every dispatch checked so far: rerun the same command to resume"


def _replay(args, run_dir, con, policy) -> int:
    """Exit 0 when every recorded dispatch replays to its report line, 1 when any differs."""
    import json

    from hw.real.replay import replay
    from hw.report import ReportWriter
    from hw.run_format import check_run_dir

    check_run_dir(run_dir)
    entries = replay(run_dir, policy=policy)
    report = ReportWriter(run_dir).entries()
    differ = [e["index"] for e, r in zip(entries, report)
              if json.dumps(e, sort_keys=True) != json.dumps(r, sort_keys=True)]
    failed = sum(e["verdict"] == "fail" for e in entries)
    con.print(f"replayed {len(entries)} recorded dispatches offline: {failed} failed, "
              f"{len(entries) - len(differ)} identical to the report"
              + (f"; differ at {differ[:8]}" if differ else ""))
    return 1 if differ or len(entries) != len(report) else 0
