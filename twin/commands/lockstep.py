"""Run a workload through the scheduler with every dispatch checked in lockstep, and print the verdict.

The simulator's scheduler serves the workload (a spec, a trace, or seeded prompts) under the page
budget; every dispatch it issues (packed prefill, K=0 decode, fused K=7 verify+redraft, drafter
seeding) runs on the device backend, then on the golden re-synced from the device's decisions;
outputs, routing and touched pools are compared under the tolerance policy and the first divergence
is localized to (dispatch, layer, stage); the device's outputs are what the scheduler commits.  The
golden is golden's own compositions (`hw.real`); the device is the self-check backend (golden's
compositions with torch GEMMs) or, with --backend torch, the independent `hw.torchdev.TorchBackend`.  Records, report.jsonl and summary.{md,html} go to
--run-dir; running again on the same directory resumes where a killed run stopped.
"""
from __future__ import annotations

from twin.abi.errors import AbiError

from ._common import add_budget_args, budget_from_args, flag_names, integer, out_dir, seed


# the defaults of the flags that set up the run, which a replay has no use for (its records set the run)
DEVICE_SIDE = {"preset": "tiny", "backend": "selfcheck", "device": "cpu", "steps": 100, "mode": "strict",
               "fresh": False, "inject": None, "seed": 0, "no_records": False, "workload": None, "trace": None,
               "requests": None, "k": 7,
               "slots": None, "total_kv_pages": None, "measured_free_bytes": None, "measured_used_bytes": None,
               "measured_slots": None}

def add_arguments(p) -> None:
    d = DEVICE_SIDE
    p.add_argument("--preset", default=d["preset"], help="a small preset (tiny or small); FLASH does not run whole on a CPU")
    p.add_argument("--backend", default=d["backend"], choices=("selfcheck", "torch"),
                   help="the device: selfcheck (golden's compositions with torch GEMMs, default) or torch (the "
                        "independent hw.torchdev.TorchBackend)")
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
    w = p.add_argument_group("workload (as simulate's; default: seeded prompts, max(8, --steps) new tokens each, "
                             "at most 400)")
    w.add_argument("--workload", help="a workload spec JSON file (keys: docs/simulation.md)")
    w.add_argument("--trace", help="serve a JSONL request trace instead of a generated workload")
    w.add_argument("--requests", "--num-prompts", dest="requests", type=integer,
                   help="number of requests (a workload spec's default otherwise)")
    w.add_argument("-k", "--num-speculative-tokens", dest="k", type=integer, default=d["k"], help="0 or 7 (default 7)")
    w.add_argument("--slots", type=integer, help="slots per partition (default 2, or startup admission under a "
                                                  "KV budget flag)")
    add_budget_args(p)


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
    from hw.real.lockstep import parse_real_fault

    fault = parse_real_fault(args.inject) if args.inject else None
    lr = _parity(args, run_dir, resumed, fault, policy)
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
    sv = s["config"].get("serving")
    if sv:
        con.print("scheduler: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sv.items()))
    extra = ")" if args.no_records else ", records/)"
    con.print(f"report: {run_dir / 'summary.md'} (also .html, report.jsonl{extra}")
    return 0 if s["verdict"] == "PASS" else 1


def _parity(args, run_dir, resumed: bool, fault, policy):
    """The parity run the flags describe; a resumed run rebuilds the one its records describe (the
    same flags are required, and checked against them)."""
    import argparse

    from hw.real.records import read_config
    from twin.abi.presets import get_preset
    from twin.abi.topology import deployment
    from twin.functional.parity import build_lockstep, requests_from_rows, seeded_requests

    cfg = get_preset(args.preset)
    if not cfg.small:
        raise AbiError("--preset", args.preset, "a small preset (tiny or small): lockstep runs whole models on "
                       "both sides; FLASH-shaped layers are golden's per-layer tests", where="lockstep")
    measured, pages = budget_from_args(args)
    if measured is not None:
        raise AbiError(f"--{measured.kind.replace('_', '-')}", measured.value, "--total-kv-pages or --slots (the "
                       "parity run's page budget; a measured boot is FLASH's)", where="lockstep")
    if args.slots is not None and pages is not None:
        raise AbiError("--slots", args.slots, "not together with --total-kv-pages (one KV budget)", where="lockstep")
    if args.slots is not None and not 1 <= args.slots <= 64:
        raise AbiError("--slots", args.slots, "1..64", where="lockstep")
    if args.requests is not None and args.requests < 1:
        raise AbiError("--requests", args.requests, ">= 1", where="lockstep")
    if args.workload or args.trace:
        from ._datasets import OWN_DEFAULTS
        from .simulate import _requests

        dep = deployment(cfg, ep=8, max_model_len=512, num_speculative_tokens=args.k)
        ns = argparse.Namespace(trace=args.trace, workload=args.workload, seed=args.seed, requests=args.requests,
                                rate=None, arrival=None, burstiness=None, dataset_name=None, dataset_path=None,
                                tokenizer=None, sharegpt_output_len=None,
                                **{k: None for k in OWN_DEFAULTS})
        requests, _ = _requests(ns, dep)
    else:
        # about one decode dispatch per token: enough tokens for --steps (prompts + tokens fit 512 positions)
        requests = seeded_requests(args.preset, seed=args.seed, n_requests=args.requests or 4,
                                   max_new=min(400, max(8, args.steps)))
    if resumed:
        try:                       # a resumed run keeps the workload it began with
            requests = requests_from_rows(read_config(run_dir)["requests"])
        except (AbiError, KeyError):     # a run that kept no records starts afresh (refused below)
            pass
    try:
        with flag_names():              # a budget the deployment cannot admit fails under its flag's name
            return build_lockstep(preset=args.preset, backend=args.backend, device=args.device, mode=args.mode,
                                  seed=args.seed, k=args.k, requests=requests, slots=args.slots,
                                  total_kv_pages=pages, fault=fault, policy=policy, run_dir=run_dir,
                                  record=not args.no_records)
    except AbiError as e:
        if e.name != "fault":
            raise
        raise AbiError("--inject", args.inject, e.allowed, e.where) from None


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

    from twin.functional.parity import replay_records as replay
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
