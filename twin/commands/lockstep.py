"""Run a workload through the scheduler with every dispatch checked in lockstep, and print the verdict.

The simulator's scheduler serves the workload (a spec, a trace, or seeded prompts) under the page
budget; every dispatch it issues (packed prefill, K=0 decode, fused K=7 verify+redraft, drafter
seeding) runs on the device backend, then on the golden re-synced from the device's decisions;
outputs, routing and touched pools are compared under the tolerance policy and the first divergence
is localized to (dispatch, layer, stage); the device's outputs are what the scheduler commits.  The
golden is golden's own compositions (`hw.real`); the device is the self-check backend (golden's
compositions with torch GEMMs) or, with --backend torch, the independent `hw.torchdev.TorchBackend`.  Records, report.jsonl and summary.{md,html} go to
--run-dir; running again on the same directory resumes where a killed run stopped.

The torch device can split its ranks over gloo processes: `--nproc N` spawns them on this machine,
and under `torchrun --nproc-per-node N -m twin.cli lockstep --backend torch ...` rank 0 runs the
lockstep and the other ranks serve their rank slices (docs/lockstep.md, "Several processes").
"""
from __future__ import annotations

import argparse

from twin.abi.errors import AbiError

from ._common import add_budget_args, budget_from_args, flag_names, integer, out_dir, seed

POLICIES = ("throttle", "skip-oldest")        # hw.real.pool.POLICIES (not imported: the CLI loads lazily)
CHECKER_GOLDENS = ("numpy", "jax", "auto")    # hw.real.jax_check.GOLDENS


# the defaults of the flags that set up the run, which a replay has no use for (its records set the run)
DEVICE_SIDE = {"preset": "tiny", "backend": "selfcheck", "device": "cpu", "steps": 100, "mode": "strict",
               "fresh": False, "inject": None, "seed": 0, "no_records": False, "workload": None, "trace": None,
               "requests": None, "k": 7,
               "slots": None, "total_kv_pages": None, "measured_free_bytes": None, "measured_used_bytes": None,
               "measured_slots": None, "coverage": None}

LOCKSTEP_RANKS = 8          # the parity deployment: TP4 x EP8 (twin.functional.parity.build_lockstep)
CALIBRATION = 4             # hw.real.coverage.CALIBRATION (not imported: the CLI loads lazily)


def coverage(text: str):
    """--coverage: an integer N (checked >= 1 where the run is built) or auto."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: an integer N >= 1 or auto") from None

def add_arguments(p) -> None:
    d = DEVICE_SIDE
    p.add_argument("--preset", default=d["preset"], help="a small preset (tiny or small); FLASH does not run whole on a CPU")
    p.add_argument("--backend", default=d["backend"], choices=("selfcheck", "torch"),
                   help="the device: selfcheck (golden's compositions with torch GEMMs, default) or torch (the "
                        "independent hw.torchdev.TorchBackend)")
    p.add_argument("--device", default=d["device"], help="torch device: cpu, cuda[:n] or npu[:n] (default cpu)")
    p.add_argument("--nproc", type=integer, default=1,
                   help=f"--backend torch: split the device's {LOCKSTEP_RANKS} ranks over this many local gloo "
                        "processes (1, 2, 4 or 8; default 1); under torchrun the world size sets it")
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
    p.add_argument("--coverage", type=coverage, default=d["coverage"], metavar="N|auto",
                   help="sampled checking: every site (program, group, layer, stage) checked at least once every N "
                        "dispatches of its program, each from the device's state; the head every dispatch; auto: "
                        f"the first {CALIBRATION} dispatches check every site and measure the checker's and the "
                        "device's rates, then N is the smallest at which the checker keeps up, fixed for the run "
                        "(default: every dispatch checked in full)")
    p.add_argument("--checker-golden", choices=CHECKER_GOLDENS, default="numpy",
                   help="with --coverage: the golden of the site checks: numpy (default), jax (the JAX path, on "
                        "an accelerator where JAX has one; refused for a run holding a program it is not "
                        "admissible for) or auto (JAX where admissible, NumPy elsewhere, the reason reported); "
                        "a sub-layer JAX finds failing is judged again on NumPy")
    p.add_argument("--replay", nargs="?", const=True, default=False, metavar="RUN_DIR",
                   help="no device: re-judge the records in RUN_DIR (default --run-dir) against the golden "
                        "offline and compare with its report")
    a = p.add_argument_group("asynchronous checking (docs/lockstep.md#asynchronous-checking)")
    a.add_argument("--async", dest="async_", action="store_true",
                   help="the device never waits on the golden: each dispatch is recorded and checked on a pool "
                        "of checker workers (default: synchronous, every dispatch checked in turn)")
    a.add_argument("--check-workers", type=integer, default=None,
                   help="checker worker processes (implies --async; default 1)")
    a.add_argument("--backlog", type=integer, default=None,
                   help="checks pending at most before the policy acts (implies --async; default 32)")
    a.add_argument("--backlog-policy", choices=POLICIES, default=None,
                   help="when the backlog is full: throttle (the device waits for a check, default) or "
                        "skip-oldest (the oldest check not yet handed to a worker is skipped and counted)")
    a.add_argument("--ray", default=None, metavar="auto|ADDRESS",
                   help="checks as Ray tasks: auto (this machine's cluster, or a local one started for the "
                        "run) or a running cluster's address; with --replay the recorded dispatches fan out")
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
    from golden.heap import retain_heap
    from hw.threads import limit_cpu_threads

    nproc = _nproc(args)
    if args.device == "cpu":
        limit_cpu_threads(1)
    from hw.launch import serve_torchrun_rank, torchrun_rank

    if nproc > 1 and torchrun_rank()[0] > 0:
        serve_torchrun_rank(args.device)     # a torchrun rank > 0 serves its rank slice; rank 0 reports
        return 0
    if args.device == "cpu":
        retain_heap()           # golden's temporaries reused, not re-faulted (golden.heap)
    if nproc > 1:
        from hw.launch import torch_device_ranks
        with torch_device_ranks(nproc, args.device):
            return _run(args, nproc)
    return _run(args, nproc)


def _nproc(args) -> int:
    """The processes the torch device's ranks split over: --nproc, or torchrun's world size."""
    from hw.launch import torchrun_rank

    world = torchrun_rank()[1]
    if world > 1 and args.nproc != 1:
        raise AbiError("--nproc", args.nproc, "1 under torchrun (its world size, "
                       f"{world}, sets the processes)", where="lockstep")
    n = world if world > 1 else args.nproc
    flag = "WORLD_SIZE" if world > 1 else "--nproc"
    if n == 1:
        return 1
    if n < 1 or LOCKSTEP_RANKS % n:
        raise AbiError(flag, n, f"a count dividing the lockstep deployment's {LOCKSTEP_RANKS} ranks (1, 2, 4 or 8)",
                       where="lockstep")
    if args.replay:
        raise AbiError(flag, n, "1 with --replay (no device runs)", where="lockstep")
    if args.backend != "torch":
        raise AbiError(flag, n, "1 with --backend selfcheck (only --backend torch splits its ranks over "
                       "processes)", where="lockstep")
    if args.device != "cpu":
        raise AbiError(flag, n, f"1 with --device {args.device} (the split device's collectives are gloo on cpu)",
                       where="lockstep")
    if args.k:
        raise AbiError(flag, n, f"1 with -k {args.k} (the fused K=7 step runs the device's ranks in one process; "
                       "-k 0 splits them)", where="lockstep")
    from hw.launch import gloo_problem

    problem = gloo_problem()
    if problem:
        raise AbiError(flag, n, f"1: {problem}", where="lockstep")
    return n


def _run(args, nproc: int) -> int:
    import shutil
    from pathlib import Path

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from hw.report import ReportWriter, localized_note
    from hw.run_format import check_run_dir
    from hw.tolerance import Policy

    con = Console()
    run_dir = Path(args.run_dir)
    policy = Policy.from_json(args.policy) if args.policy else None
    asynchronous = _async_args(args)
    if args.replay:
        # the run directory's records/config.json sets the run a replay rebuilds: a flag for the device
        # side would be ignored
        for dest, default in {**DEVICE_SIDE, **ASYNC_SIDE}.items():
            if getattr(args, dest) != default:
                raise AbiError("--" + dest.replace("_", "-").rstrip("-"), getattr(args, dest), "no value with --replay "
                               "(the run directory's records set the run; --policy re-judges it, --ray fans it out)",
                               where="lockstep")
        if args.replay is not True:
            if args.run_dir != "lockstep-run" and Path(args.run_dir) != Path(args.replay):
                raise AbiError("--run-dir", args.run_dir, f"unset with --replay RUN_DIR, or RUN_DIR {args.replay!r}",
                               where="lockstep")
            run_dir = Path(args.replay)
        return _replay(args, run_dir, con, policy)
    out_dir(run_dir, "--run-dir")
    if args.fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    check_run_dir(run_dir)
    resumed = (run_dir / "report.jsonl").exists()
    from hw.real.lockstep import parse_real_fault

    fault = parse_real_fault(args.inject) if args.inject else None
    lr = _parity(args, run_dir, resumed, fault, policy, nproc)
    done = len(ReportWriter(run_dir).entries())
    if nproc > 1:
        held = lr.checker.backend.torch.ranks
        con.print(f"torch device: {held.R} ranks over {nproc} gloo processes, "
                  + ", ".join(f"{s.start}-{s.stop - 1}" for s in map(held.slice_of, range(nproc))))
    if resumed:
        con.print(f"resuming {run_dir}: {done} dispatches already checked")
    with Progress(TextColumn("[bold]lockstep"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=con, transient=True) as prog:
        task = prog.add_task("", total=args.steps, completed=min(done, args.steps))

        def tick(e):
            # an asynchronous run ticks when the device is done: its check is queued, skipped or not sampled
            mark = {"pass": "[green]ok[/green]", "fail": "[red]FAIL[/red]"}.get(e["verdict"], f"[dim]{e['verdict']}[/dim]")
            prog.update(task, advance=1, description=f"#{e['index']} {e['program']} {mark}")
        if asynchronous:
            s = _run_async(args, lr, tick, resumed)
        else:
            s = lr.run(args.steps, tick)
    fd = s["first_divergence"]
    progs = ", ".join(f"{k} {v['dispatches']}" for k, v in sorted(s["programs"].items()))
    color = "green" if s["verdict"] == "PASS" else "red"
    con.print(f"[bold {color}]{s['verdict']}[/bold {color}]: {s['dispatches']} dispatches ({progs}), "
              f"{s['failed_dispatches']} failed")
    if fd:
        con.print(f"first divergence: dispatch {fd['dispatch']} ({fd['program']}), layer {fd['layer']}, "
                  f"stage {fd['stage']}, tensor {fd['tensor']}: {'; '.join(fd['reasons'])}{localized_note(fd)}")
    if fault is not None and fault.fired:
        con.print(f"injected: {fault.fired}")
    ck = s["config"].get("checking")
    if ck:
        con.print(f"checked {ck['checked']} of {len(ck['per_dispatch'])} dispatches on {ck['workers']['n']} "
                  f"{ck['workers']['kind']} worker(s): backlog high-water {ck['backlog_high_water']} of "
                  f"{ck['backlog']} ({ck['policy']}), {len(ck['skipped'])} skipped")
    auto = _coverage_auto(run_dir, lr.checker)
    if auto:
        con.print(auto)
    if "coverage" in s:
        cv = s["coverage"]
        seen = sum(c["checked"] for c in cv["programs"].values())
        total = sum(c["sites"] for c in cv["programs"].values())
        con.print(f"coverage: every site at least once every {cv['n']} dispatches of its program; {seen} of {total} "
                  f"sites checked so far (per site: summary.json coverage.last_checked)")
    cg = s["config"].get("checker_golden")
    if cg:
        from rich.markup import escape

        con.print(escape(_checker_line(cg)))
    rs = ", ".join(f"{k} {v}" for k, v in s["resyncs"].items()) or "none"
    con.print(f"re-syncs: {rs}")
    sv = s["config"].get("serving")
    if sv:
        con.print("scheduler: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sv.items()))
    extra = ")" if args.no_records else ", records/)"
    con.print(f"report: {run_dir / 'summary.md'} (also .html, report.jsonl{extra}", soft_wrap=True)   # a path stays whole
    return 0 if s["verdict"] == "PASS" else 1


def _checker_line(cg: dict) -> str:
    """The --checker-golden line: the golden of each target program (why where NumPy), what JAX
    handed to NumPy and the backend it ran on."""
    progs = "; ".join(f"{p} {c['golden']}" + ("" if c["golden"] == "jax" else f" ({c['why']})")
                      for p, c in sorted(cg["programs"].items())) or "no site checks (no --coverage)"
    t = cg["tally"]
    line = (f"checker golden {cg['chosen']}: {progs}; {t['jax_dispatches']} dispatches' sites on JAX "
            f"({t['sites_to_numpy']} sites judged again on NumPy), {t['numpy_dispatches']} on NumPy")
    return line + (f"; JAX on {', '.join(t['backends'])}" if t["backends"] else "")


def _coverage_auto(run_dir, checker) -> str | None:
    """The --coverage auto line: the chosen N, the rates behind it, and whether the checker kept up."""
    if checker.auto is None:
        return None
    a = checker.auto_report()
    if a["n"] is None:
        return f"coverage auto: {a['why']} (no N chosen; run past {a['calibration_dispatches']} dispatches)"
    c = a["calibration"]
    line = (f"coverage auto: N = {a['n']}, chosen at dispatch {a['chosen_at']} from the checker's "
            f"{c['sites_per_s_per_worker']:.3g} site checks/s on each of {c['workers']} worker(s) against the device's "
            f"{c['dispatches_per_s']:.3g} dispatches/s ({c['sites']} sites: {c['site_checks_per_dispatch']:.3g} site "
            f"checks per dispatch); guarantee: {a['guarantee']}")
    if "run" in a:
        r = a["run"]
        line += (f"; over the run {r['sites_per_s']:.3g} site checks/s against {r['dispatches_per_s']:.3g} "
                 f"dispatches/s: {'kept up' if a['kept_up'] else 'did not keep up'} (those rates give N = {r['n']})")
    if not a["guarantee_holds"]:
        line += f"; {a['skipped']} check(s) skipped: the guarantee does not hold for their sites"
    return line + f" ({run_dir / 'run.json'} coverage_auto)"


# the asynchronous-checking flags' defaults (a replay takes none but --ray)
ASYNC_SIDE = {"async_": False, "check_workers": None, "backlog": None, "backlog_policy": None}


def _async_args(args) -> bool:
    """Whether the run checks asynchronously; bad values refused under their flags."""
    for flag, v in (("--check-workers", args.check_workers), ("--backlog", args.backlog)):
        if v is not None and v < 1:
            raise AbiError(flag, v, ">= 1", where="lockstep")
    if args.ray is not None and not args.ray.strip():
        raise AbiError("--ray", args.ray, "auto, or a Ray cluster address (host:port or ray://host:port)",
                       where="lockstep")
    return bool(args.async_ or args.check_workers is not None or args.backlog is not None
                or args.backlog_policy is not None or (args.ray is not None and not args.replay))


def _run_async(args, lr, tick, resumed: bool) -> dict:
    if resumed:
        raise AbiError("--run-dir", args.run_dir, "a fresh run directory with --async (an asynchronous run does "
                       "not resume: --fresh)", where="lockstep")
    if args.no_records:
        raise AbiError("--no-records", True, "unset with --async (the checks read the records)", where="lockstep")
    workers, started = args.check_workers or 1, None
    if args.ray is not None:
        from hw.real.pool import RayWorkers

        from ._ray import connect
        ray, started = connect("--ray", args.ray)
        workers = RayWorkers(args.check_workers)
    try:
        return lr.run_async(args.steps, workers=workers, backlog=args.backlog,
                            policy=args.backlog_policy or "throttle", progress=tick)
    finally:
        if started:
            ray.shutdown()


def _parity(args, run_dir, resumed: bool, fault, policy, nproc: int = 1):
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
    if args.coverage == "auto" and args.steps <= CALIBRATION:
        raise AbiError("--steps", args.steps, f"> {CALIBRATION} with --coverage auto (its first {CALIBRATION} "
                       "dispatches check every site to measure the rates N is chosen from)", where="lockstep")
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
                                  record=not args.no_records, nproc=nproc,
                                  coverage=args.coverage, checker_golden=args.checker_golden)
    except AbiError as e:
        if e.name == "coverage":
            raise AbiError("--coverage", args.coverage, e.allowed, e.where) from None
        if e.name == "checker_golden":
            raise AbiError("--checker-golden", args.checker_golden, e.allowed, e.where) from None
        if e.name != "fault":
            raise
        raise AbiError("--inject", args.inject, e.allowed, e.where) from None


def interrupted(args) -> str:
    if args.replay:
        return "the replay wrote nothing; rerun it to replay again"
    if args.async_ or args.check_workers is not None or args.backlog is not None or args.backlog_policy is not None \
            or args.ray is not None:
        return (f"{args.run_dir}/report.jsonl keeps the checks finished so far in dispatch order; an asynchronous "
                "run does not resume: rerun with --fresh")
    if args.no_records:
        return (f"{args.run_dir}/report.jsonl keeps the dispatches checked so far, but a run without records "
                "cannot resume: rerun with --fresh")
    return f"{args.run_dir} keeps every dispatch checked so far: rerun the same command to resume"


def _replay(args, run_dir, con, policy) -> int:
    """Exit 0 when every report line is what its recorded dispatch replays to (and, for a synchronous
    run, every record has its line), 1 otherwise."""
    import json

    from twin.functional.parity import replay_records as replay
    from hw.report import ReportWriter
    from hw.run_format import check_run_dir

    check_run_dir(run_dir)
    replay = _flag_named(replay, "checker_golden", "--checker-golden", args.checker_golden)
    if args.ray is None:
        entries = replay(run_dir, policy=policy, checker_golden=args.checker_golden)
    else:
        from hw.real.pool import RayWorkers

        from ._ray import connect
        from hw.real.records import read_config

        read_config(run_dir)                 # a run directory that is not one is refused before Ray starts
        ray, started = connect("--ray", args.ray)
        try:
            entries = replay(run_dir, policy=policy, workers=RayWorkers(), checker_golden=args.checker_golden)
        finally:
            if started:
                ray.shutdown()
    report = ReportWriter(run_dir).entries()
    # an asynchronous run's report holds the dispatches it checked; each is held to its replay
    replayed = {e["index"]: json.dumps(e, sort_keys=True) for e in entries}
    differ = [r["index"] for r in report if replayed.get(r["index"]) != json.dumps(r, sort_keys=True)]
    failed = sum(e["verdict"] == "fail" for e in entries)
    # a synchronous run's report has a line for every record; an asynchronous one's, for those checked
    complete = [r["index"] for r in report] == list(range(len(report)))
    where = "" if args.ray is None else " on Ray"
    con.print(f"replayed {len(entries)} recorded dispatches offline{where}: {failed} failed, "
              f"{len(report) - len(differ)} identical to the report" + ("" if complete else
                                                                         f" (of its {len(report)} lines)")
              + (f"; differ at {differ[:8]}" if differ else ""))
    return 1 if differ or not report or (complete and len(entries) != len(report)) else 0


def _flag_named(fn, name: str, flag: str, value):
    """fn, its AbiError under argument `name` reported under the CLI's `flag`."""
    def call(*a, **kw):
        try:
            return fn(*a, **kw)
        except AbiError as e:
            if e.name != name:
                raise
            raise AbiError(flag, value, e.allowed, e.where) from None
    return call
