"""Run the serving simulator: FLASH on 16 NPUs, K=7, the bundled workload; summary and report files.

With no arguments it runs the embedded default; every knob is a flag (docs/simulation.md).
"""
from __future__ import annotations

import sys

from twin.abi.errors import ConfigError

from ._common import (add_budget_args, add_deployment_args, budget_from_args, deployment_from_args, flag_names, integer,
                      number, out_dir, print_json, seed)
from ._datasets import add_dataset_args, dataset_requests

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
    w.add_argument("--requests", "--num-prompts", dest="requests", type=integer,
                   help="number of requests (overrides the spec; --num-prompts is vLLM's name)")
    w.add_argument("--rate", "--request-rate", dest="rate", type=number,
                   help="arrival rate, requests/s ('inf': all at t=0); --request-rate is vLLM's name")
    w.add_argument("--burstiness", type=number,
                   help="vLLM's gamma-arrival shape: 1 is Poisson, < 1 burstier, > 1 more uniform "
                        "(sets --arrival gamma with CV 1/sqrt(burstiness))")
    w.add_argument("--max-concurrency", type=integer,
                   help="closed loop, as vllm bench serve: at most this many requests unfinished; "
                        "a request is sent when one finishes")
    w.add_argument("--arrival", choices=("poisson", "gamma", "burst"), help="arrival process")
    w.add_argument("--seed", type=seed, default=None,
                   help="workload, routing and acceptance seed (default: the workload spec's seed, 0 with --trace)")
    add_dataset_args(p)
    m = p.add_argument_group("models")
    m.add_argument("--acceptance", default="default",
                   help="default | forced:<1..8> | rates:<a1,...,a7> (per-position conditional)")
    m.add_argument("--acceptance-from", help="acceptance.json of a golden run: use its per-position rates")
    m.add_argument("--executor", default="cost", choices=("cost", "golden"),
                   help="cost: the cost model's synthetic tokens; golden: real tokens from golden on a small "
                        "preset, plus tokens.jsonl and acceptance.json (docs/functional.md)")
    m.add_argument("--drafter", default="device", choices=("device", "v4.1"),
                   help="golden executor's drafter: the device kernels' (default) or the V4.1 release's "
                        "(docs/drafter.md)")
    m.add_argument("--recompute", default="prompt", choices=("prompt", "replay"),
                   help="preemption re-prefill: 'prompt' as upstream (generated tokens leave the context, "
                        "serving-contract §10.2) or 'replay' (prompt + generated tokens)")
    m.add_argument("--routing", default="random", choices=("balanced", "random", "skewed", "trace"),
                   help="MoE routing policy (default random)")
    m.add_argument("--routing-skew", type=number, default=None,
                   help="Zipf exponent >= 0 for --routing skewed (default 1)")
    m.add_argument("--routing-trace", help="JSON per-layer expert histograms for --routing trace")
    m.add_argument("--device", default="ascend-a3-die", help="device limits row (twin/sim/data/devices.json)")
    m.add_argument("--profile", help="measured profile JSON to calibrate the cost model")
    m.add_argument("--slots", type=integer, help="override slots per partition (default: startup admission)")
    add_budget_args(p)
    m.add_argument("--sync", action="store_true", help="synchronous scheduling (batch queue depth 1)")
    m.add_argument("--max-preemptions", type=integer,
                   help="end a request at its n-th preemption (default: no cap, as upstream)")
    m.add_argument("--stop-check", default="end", choices=("end", "token"),
                   help="stop strings: 'end' as upstream (may miss one inside a multi-token step) or 'token'")
    m.add_argument("--prefill-hang-prob", type=number, default=0.0,
                   help="pypto-lib#1213 fault model: probability that an EP16 prefill dispatch hangs (default 0)")
    m.add_argument("--step-timeout", type=number, default=1200.0,
                   help="worker step timeout in seconds, what a hang costs (default 1200)")
    o = p.add_argument_group("outputs")
    o.add_argument("--slo-ttft", type=number, help="goodput SLO on TTFT (ms, > 0)")
    o.add_argument("--slo-tpot", type=number, help="goodput SLO on TPOT (ms, > 0)")
    o.add_argument("--slo-e2el", type=number, help="goodput SLO on E2EL (ms, > 0)")
    o.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                   help="goodput SLOs by vLLM's flag: ttft:500 tpot:50 e2el:2000 (ms; same as --slo-*)")
    o.add_argument("--metric-percentiles", default="99",
                   help="percentiles in vllm_result.json, comma-separated (default 99, as vLLM)")
    o.add_argument("--out", default="sim-out", help="report directory (default ./sim-out)")
    o.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    o.add_argument("--json", action="store_true", help="print the summary as JSON (no progress display)")
    o.add_argument("--decision-log", action="store_true",
                   help="write every scheduling decision to decisions.jsonl (docs/simulation.md#decision-log)")


def _traffic(workload: dict) -> dict:
    """vLLM's request_rate and burstiness for the result file (a trace: no rate, written "inf" as vLLM's default)."""
    if "trace" in workload:                     # a --trace file, or a timed dataset
        return {"request_rate": None, "burstiness": 1.0}
    burst = workload["arrival"] == "burst"
    return {"request_rate": None if burst else workload["rate"],
            "burstiness": 1.0 / workload["gamma_cv"] ** 2 if workload["arrival"] == "gamma" else 1.0}


def _slo(args) -> dict:
    """--slo-* and vLLM's --goodput, merged; the same SLO given twice must agree."""
    from twin.sim.vllm_result import parse_goodput

    slo = {k: v for k, v in (("ttft", args.slo_ttft), ("tpot", args.slo_tpot), ("e2el", args.slo_e2el))
           if v is not None}
    for k, v in parse_goodput(args.goodput).items():
        if k in slo and slo[k] != v:
            raise ConfigError("--goodput", f"{k}:{v:g}", f"agreeing with --slo-{k} {slo[k]:g}")
        slo[k] = v
    return slo


def _check_flags(args) -> None:
    """Flags that would otherwise be ignored without a word: each needs the mode that reads it."""

    timed = args.dataset_name in ("mooncake", "azure")
    if args.trace or timed:
        source = "--trace" if args.trace else f"--dataset-name {args.dataset_name}"
        given = [f for f, v in (("--workload", args.workload), ("--requests", args.requests), ("--rate", args.rate),
                                ("--arrival", args.arrival), ("--burstiness", args.burstiness))
                 if v is not None and not (timed and f == "--requests")]
        if given:
            raise ConfigError(given[0], getattr(args, given[0][2:]), f"no value with {source} (its file sets the "
                              "requests, their lengths and arrivals)")
    if args.drafter != "device" and args.executor != "golden":
        raise ConfigError("--drafter", args.drafter, "'device' unless --executor golden (the cost model draws "
                          "acceptance, it runs no drafter)")
    if args.routing_skew is not None and args.routing != "skewed":
        raise ConfigError("--routing-skew", args.routing_skew, f"only with --routing skewed (--routing is "
                          f"{args.routing!r})")
    if args.routing_trace and args.routing != "trace":
        raise ConfigError("--routing-trace", args.routing_trace, f"only with --routing trace (--routing is "
                          f"{args.routing!r})")
    if args.routing == "trace" and not args.routing_trace:
        raise ConfigError("--routing-trace", None, "a JSON file of per-layer expert histograms with --routing trace")
    if args.executor == "golden" and (args.acceptance != "default" or args.acceptance_from):
        flag, value = ("--acceptance-from", args.acceptance_from) if args.acceptance_from else \
            ("--acceptance", args.acceptance)
        raise ConfigError(flag, value, "no acceptance model with --executor golden (golden's real tokens decide "
                          "what is accepted)")
    if args.acceptance_from and args.acceptance != "default":
        raise ConfigError("--acceptance", args.acceptance, "'default' with --acceptance-from (the file sets the "
                          "acceptance rates)")


def _requests(args, dep):
    from twin.abi.inputs import located, read_json
    from twin.sim.workload import WorkloadSpec, default_spec, generate, load_jsonl

    vocab = dep.model.vocab_size
    if args.trace and (args.dataset_name or args.dataset_path):
        raise ConfigError("--trace", args.trace, "not with --dataset-name / --dataset-path (one source of requests)")
    if args.trace:
        return load_jsonl(args.trace, vocab=vocab, seed=args.seed or 0), {"trace": args.trace}
    if args.workload:
        raw = read_json(args.workload, "--workload", "a workload spec: a JSON object of workload keys "
                                                     "(docs/simulation.md#workloads)")
        with located(f"--workload {args.workload}"):
            if "vocab" in raw and raw["vocab"] != vocab:
                raise ConfigError("vocab", raw["vocab"], f"{vocab}, the vocabulary of {dep.model.name} "
                                  "(or leave the key out)")
            spec = WorkloadSpec.from_dict(raw)
    else:
        spec = default_spec()
    kw = {"vocab": vocab}               # prompts are drawn from the model's vocabulary
    for key, value in (("seed", args.seed), ("num_requests", args.requests), ("rate", args.rate),
                       ("arrival", args.arrival)):
        if value is not None:
            kw[key] = value
    if args.burstiness is not None:
        if args.arrival not in (None, "gamma"):
            raise ConfigError("--burstiness", args.burstiness, "only with --arrival gamma (or no --arrival)")
        kw["arrival"], kw["gamma_cv"] = "gamma", 1.0 / args.burstiness ** 0.5
    spec = spec.replace(**kw)
    reqs, record = dataset_requests(args, dep, spec)
    if reqs is not None:
        return reqs, record
    return generate(spec), spec.to_dict()


def interrupted(args) -> str:
    from pathlib import Path

    out = Path(args.out)
    kept = f"no report was written to {out}/" if not (out.is_dir() and any(out.iterdir())) else \
        f"{out}/ holds whole files only, but not a complete report of this run"
    return f"{kept}; a simulation does not resume: rerunning the command starts it from the beginning"


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn
    from rich.table import Table

    from twin.sim.acceptance import parse_acceptance
    from twin.sim.costmodel import Calibration, CostModel, DeviceLimits, Routing
    from twin.sim.run import SimConfig, simulate, startup_slots
    from twin.sim.vllm_result import parse_percentiles

    _check_flags(args)
    if args.max_num_seqs is None:             # saturate the topology: 64 requests per TP group
        args.max_num_seqs = 64 * max(1, args.ep // args.tp)
    dep = deployment_from_args(args)
    if args.executor == "golden" and not (args.workload or args.trace):
        from twin.functional.cli import default_workload
        args.workload = default_workload()
    device = DeviceLimits.load(args.device)
    routing = Routing.from_trace_file(args.routing_trace) if args.routing == "trace" \
        else Routing(args.routing, skew=1.0 if args.routing_skew is None else args.routing_skew)
    slo = _slo(args)
    percentiles = parse_percentiles(args.metric_percentiles)
    if args.burstiness is not None and not (args.burstiness > 0 and args.burstiness != float("inf")):
        raise ConfigError("--burstiness", args.burstiness, "a finite number > 0")
    reqs, workload = _requests(args, dep)
    if args.acceptance_from:
        from twin.functional.acceptance import load_acceptance
        acceptance = load_acceptance(args.acceptance_from)
    else:
        acceptance = parse_acceptance(args.acceptance)
    measured, pages = budget_from_args(args)
    if args.slots is not None and (measured or pages):
        raise ConfigError("--slots", args.slots, "not together with a KV budget flag (--total-kv-pages, --measured-*)")
    seed_ = args.seed if args.seed is not None else workload.get("seed", 0)
    cfg = SimConfig(dep, reqs, device=device, routing=routing, acceptance=acceptance,
                    slots=args.slots, measured=measured, total_kv_pages=pages, async_depth=1 if args.sync else 2,
                    stop_check=args.stop_check, slo_ms=slo or None, seed=seed_,
                    prefill_hang_probability=args.prefill_hang_prob,
                    step_timeout=args.step_timeout, max_concurrency=args.max_concurrency,
                    decision_log=args.decision_log, max_preemptions=args.max_preemptions)
    if args.recompute == "replay":
        from twin.functional.replay import ReplayScheduler
        cfg.scheduler = ReplayScheduler
    golden = None
    if args.executor == "golden":
        from twin.functional import cli as functional
        golden = functional.attach(cfg, drafter=args.drafter)
    with flag_names():
        slots = startup_slots(cfg, device)     # bad budget values fail before the run, under their flags
    if args.profile:
        cfg.calibration = Calibration.from_profile(args.profile, CostModel(dep, slots, device, routing))
    out = out_dir(args.out, "--out")
    con = Console(stderr=True)
    if args.json or not con.is_terminal:      # a progress bar is for a person watching a terminal
        res = simulate(cfg, slots=slots)
    else:
        with Progress(TextColumn("[bold]simulating[/bold]"), BarColumn(), TextColumn("{task.completed}/{task.total} requests"),
                      TextColumn("t={task.fields[t]:.1f}s simulated"), console=con, transient=True) as prog:
            task = prog.add_task("sim", total=len(reqs), t=0.0)
            res = simulate(cfg, lambda t, done, total: prog.update(task, completed=done, t=t), slots=slots)
    s = res.summary                            # what the run was given, in the summary `write` puts out
    s["workload"] = workload
    s["deployment"] = {"preset": dep.model.name, "ep": dep.topology.ep, "k": dep.k,
                       "max_model_len": dep.limits.max_model_len, "chunk": dep.limits.max_prefill_tokens_per_request,
                       "max_num_seqs": dep.limits.max_num_seqs,
                       "max_num_batched_tokens": dep.limits.max_num_batched_tokens, "device": device.name,
                       "executor": args.executor, "recompute": args.recompute,
                       "drafter": args.drafter if args.executor == "golden" else None}
    files = res.write(out, plots=not args.no_plots, percentiles=percentiles, traffic=_traffic(workload))
    if golden is not None:
        from twin.functional.run import write_outputs
        files += write_outputs(out, cfg.requests, res.scheduler, golden["executor"])
    capped = capped_line(s, dep)
    if args.json:
        print_json(s)
        if capped:
            print(capped, file=sys.stderr)
        return 0
    _print_summary(Console(), Table, res, out, files, capped)
    return 0


def capped_line(s: dict, dep) -> str:
    n = s["capped_requests"]
    if not n:
        return ""
    return (f"capped: {n} request{'s' if n > 1 else ''} asked for more new tokens than the context leaves under "
            f"max_model_len={dep.limits.max_model_len}; admission lowered max_new_tokens (requests.csv: capped, "
            f"requested_max_new_tokens)")


def _print_summary(con, Table, res, out, files, capped: str) -> None:
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
              f"preemptions {s['preemptions']}; slots/partition {s['slots_per_partition']} "
              f"(budget: {s['kv_budget_source']})")
    from twin.abi.account import ACCOUNT

    from ._common import deployment_defaults, slot_defaults_note

    mine, theirs = deployment_defaults(DEPLOYMENT), deployment_defaults()
    dep = s["deployment"]
    if (dep["max_model_len"], dep["chunk"]) == (mine["max_model_len"], mine["chunk"]) and \
            s.get("kv_budget_source") == ACCOUNT:
        note = slot_defaults_note("simulate", "capacity", mine, theirs)
        if note:
            con.print(f"note: {note}")
    r = Table(title="risk report (serving-contract §10; docs/risks.md)")
    for c in ("risk", "count", "first t (s)"):
        r.add_column(c)
    for row in res.risk_summary.itertuples(index=False):
        r.add_row(row.risk, str(row.count), "-" if row.first_t is None or row.first_t != row.first_t else f"{row.first_t:.3f}",
                  style="yellow" if row.count else None)
    con.print(r)
    if capped:
        con.print(capped, style="yellow")
    con.print(f"report: {out}/ ({', '.join(files)})")
    sys.stdout.flush()
