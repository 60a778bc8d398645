"""Run the serving simulator: FLASH on 16 NPUs, K=7, the bundled workload; summary and report files.

With no arguments it runs the embedded default; every knob is a flag (docs/simulation.md).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ._common import add_deployment_args, deployment_from_args, print_json

# the simulator's defaults: a saturating FLASH serving setup (dest -> (default, help))
_DEFAULTS = {
    "max_model_len": (8192, "context ceiling"),
    "chunk": (512, "per-request prefill chunk (--long-prefill-token-threshold)"),
    "max_num_seqs": (None, "max running requests (at most 64 per TP group; default: 64 per group, 256 at EP16)"),
    "max_num_batched_tokens": (8192, "global token budget per step (a K=7 decode request costs 8)"),
}
DEPLOYMENT = {dest: (d, h if d is None else f"{h} (default {d} for simulate)") for dest, (d, h) in _DEFAULTS.items()}


def add_arguments(p) -> None:
    add_deployment_args(p, overrides=DEPLOYMENT)
    w = p.add_argument_group("workload (default: the bundled twin/sim/data/default_workload.json)")
    w.add_argument("--workload", help="a workload spec JSON file (keys: docs/simulation.md)")
    w.add_argument("--trace", help="replay a JSONL request trace instead of a generated workload")
    w.add_argument("--requests", type=int, help="number of requests (overrides the spec)")
    w.add_argument("--rate", type=float, help="arrival rate, requests/s ('inf': all at t=0)")
    w.add_argument("--arrival", choices=("poisson", "gamma", "burst"), help="arrival process")
    w.add_argument("--seed", type=int, default=0, help="workload, routing and acceptance seed (default 0)")
    m = p.add_argument_group("models")
    m.add_argument("--acceptance", default="default",
                   help="default | forced:<1..8> | rates:<a1,...,a7> (per-position conditional)")
    m.add_argument("--acceptance-from", help="acceptance.json of a golden run: use its per-position rates")
    m.add_argument("--executor", default="cost", choices=("cost", "golden"),
                   help="cost: the cost model's synthetic tokens; golden: real tokens from golden on a small "
                        "preset, plus tokens.jsonl and acceptance.json (docs/functional.md)")
    m.add_argument("--recompute", default="prompt", choices=("prompt", "replay"),
                   help="preemption re-prefill: 'prompt' as upstream (generated tokens leave the context, "
                        "serving-contract §10.2) or 'replay' (prompt + generated tokens)")
    m.add_argument("--routing", default="random", choices=("balanced", "random", "skewed", "trace"),
                   help="MoE routing policy (default random)")
    m.add_argument("--routing-skew", type=float, default=1.0, help="Zipf exponent for --routing skewed")
    m.add_argument("--routing-trace", help="JSON per-layer expert histograms for --routing trace")
    m.add_argument("--device", default="ascend-a3-die", help="device limits row (twin/sim/data/devices.json)")
    m.add_argument("--profile", help="measured profile JSON to calibrate the cost model")
    m.add_argument("--fidelity", default="exact", choices=("exact", "fleet"),
                   help="exact (page ids, the default) or fleet (page counts, ~10x+ faster, for sweeps; "
                        "docs/simulation.md#fidelity)")
    m.add_argument("--slots", type=int, help="override slots per partition (default: startup admission)")
    m.add_argument("--sync", action="store_true", help="synchronous scheduling (batch queue depth 1)")
    m.add_argument("--max-preemptions", type=int,
                   help="end a request at its n-th preemption (default: no cap, as upstream)")
    m.add_argument("--stop-check", default="end", choices=("end", "token"),
                   help="stop strings: 'end' as upstream (may miss one inside a multi-token step) or 'token'")
    m.add_argument("--prefill-hang-prob", type=float, default=0.0,
                   help="pypto-lib#1213 fault model: probability that an EP16 prefill dispatch hangs (default 0)")
    m.add_argument("--step-timeout", type=float, default=1200.0,
                   help="worker step timeout in seconds, what a hang costs (default 1200)")
    o = p.add_argument_group("outputs")
    o.add_argument("--slo-ttft", type=float, help="goodput SLO on TTFT (ms)")
    o.add_argument("--slo-tpot", type=float, help="goodput SLO on TPOT (ms)")
    o.add_argument("--slo-e2el", type=float, help="goodput SLO on E2EL (ms)")
    o.add_argument("--out", default="sim-out", help="report directory (default ./sim-out)")
    o.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    o.add_argument("--json", action="store_true", help="print the summary as JSON (no progress display)")
    o.add_argument("--decision-log", action="store_true",
                   help="write every scheduling decision to decisions.jsonl (exact fidelity; docs/simulation.md)")


def _requests(args, dep):
    from twin.sim.workload import WorkloadSpec, default_spec, generate, load_jsonl

    if args.trace:
        return load_jsonl(args.trace, vocab=dep.model.vocab_size, seed=args.seed), {"trace": args.trace}
    spec = WorkloadSpec.from_dict(json.loads(Path(args.workload).read_text())) if args.workload else default_spec()
    kw = {"seed": args.seed, "vocab": dep.model.vocab_size}
    if args.requests is not None:
        kw["num_requests"] = args.requests
    if args.rate is not None:
        kw["rate"] = args.rate
    if args.arrival is not None:
        kw["arrival"] = args.arrival
    spec = spec.replace(**kw)
    return generate(spec), spec.to_dict()


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn
    from rich.table import Table

    from twin.sim.acceptance import parse_acceptance
    from twin.sim.costmodel import Calibration, CostModel, DeviceLimits, Routing
    from twin.sim.run import SimConfig, simulate, startup_slots

    if args.max_num_seqs is None:             # saturate the topology: 64 requests per TP group
        args.max_num_seqs = 64 * max(1, args.ep // args.tp)
    dep = deployment_from_args(args)
    if args.executor == "golden" and not (args.workload or args.trace):
        from twin.functional.cli import default_workload
        args.workload = default_workload()
    device = DeviceLimits.load(args.device)
    routing = Routing.from_trace_file(args.routing_trace) if args.routing == "trace" and args.routing_trace \
        else Routing(args.routing, skew=args.routing_skew)
    reqs, workload = _requests(args, dep)
    slo = {k: v for k, v in (("ttft", args.slo_ttft), ("tpot", args.slo_tpot), ("e2el", args.slo_e2el)) if v}
    if args.acceptance_from:
        from twin.functional.acceptance import load_acceptance
        acceptance = load_acceptance(args.acceptance_from)
    else:
        acceptance = parse_acceptance(args.acceptance)
    cfg = SimConfig(dep, reqs, device=device, routing=routing, acceptance=acceptance,
                    slots=args.slots, async_depth=1 if args.sync else 2, stop_check=args.stop_check,
                    slo_ms=slo or None, seed=args.seed, prefill_hang_probability=args.prefill_hang_prob,
                    step_timeout=args.step_timeout, fidelity=args.fidelity, decision_log=args.decision_log,
                    max_preemptions=args.max_preemptions)
    if args.recompute == "replay":
        from twin.functional.replay import ReplayScheduler
        cfg.scheduler = ReplayScheduler
    golden = None
    if args.executor == "golden":
        from twin.functional import cli as functional
        golden = functional.attach(cfg)
    if args.profile:
        cfg.calibration = Calibration.from_profile(args.profile, CostModel(dep, startup_slots(cfg, device), device, routing))
    con = Console(stderr=True)
    if args.json:
        res = simulate(cfg)
    else:
        with Progress(TextColumn("[bold]simulating[/bold]"), BarColumn(), TextColumn("{task.completed}/{task.total} requests"),
                      TextColumn("t={task.fields[t]:.1f}s simulated"), console=con, transient=True) as prog:
            task = prog.add_task("sim", total=len(reqs), t=0.0)
            res = simulate(cfg, lambda t, done, total: prog.update(task, completed=done, t=t))
    out = Path(args.out)
    files = res.write(out, plots=not args.no_plots)
    if golden is not None:
        files += functional.write(out, cfg, golden, res.scheduler)
    s = res.summary
    s["workload"] = workload
    s["deployment"] = {"preset": dep.model.name, "ep": dep.topology.ep, "k": dep.k,
                       "max_model_len": dep.limits.max_model_len, "chunk": dep.limits.max_prefill_tokens_per_request,
                       "max_num_seqs": dep.limits.max_num_seqs,
                       "max_num_batched_tokens": dep.limits.max_num_batched_tokens, "device": device.name,
                       "executor": args.executor, "recompute": args.recompute}
    (out / "summary.json").write_text(json.dumps(s, indent=2, default=str))
    if args.json:
        print_json(s)
        return 0
    _print_summary(Console(), Table, res, out, files)
    return 0


def _print_summary(con, Table, res, out, files) -> None:
    s = res.summary
    t = Table(title=f"simulation: {s['completed']} completed, {s['failed']} failed, "
                    f"{s['duration_s']:.2f} s simulated in {s['wall_s']:.2f} s wall")
    t.add_column("metric")
    for c in ("mean", "median", "p90", "p99"):
        t.add_column(c + " (ms)", justify="right")
    for key in ("ttft", "tpot", "itl", "e2el"):
        st = s[key]
        t.add_row(key.upper(), *("-" if st[f"{c}_ms"] is None else f"{st[f'{c}_ms']:.1f}"
                                 for c in ("mean", "median", "p90", "p99")))
    con.print(t)
    acc = s["acceptance"]
    con.print(f"throughput: {s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.0f} output tok/s, "
              f"{s['total_token_throughput']:.0f} total tok/s"
              + (f"; goodput {s['request_goodput']:.2f} req/s" if s["request_goodput"] is not None else ""))
    if acc.get("mean_accepted_length"):
        con.print(f"acceptance: mean length {acc['mean_accepted_length']:.2f} over {acc['verifies']} verifies; "
                  f"per position {', '.join(f'{x:.2f}' for x in acc['acceptance_per_position'])}")
    pc = s["prefix_cache"]
    con.print(f"prefix cache: {pc['hits']}/{pc['queries']} requests hit, token hit rate {pc['token_hit_rate']:.1%}; "
              f"preemptions {s['preemptions']}; slots/partition {s['slots_per_partition']}")
    r = Table(title="risk report (serving-contract §10; docs/risks.md)")
    for c in ("risk", "count", "first t (s)"):
        r.add_column(c)
    for row in res.risk_summary.itertuples(index=False):
        r.add_row(row.risk, str(row.count), "-" if row.first_t is None or row.first_t != row.first_t else f"{row.first_t:.3f}",
                  style="yellow" if row.count else None)
    con.print(r)
    con.print(f"report: {out}/ ({', '.join(files)})")
    sys.stdout.flush()
