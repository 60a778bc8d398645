"""Startup admission: blocks per request, bytes per slot, the per-rank HBM account, slots per partition."""
from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from twin.abi import hbm_account
from twin.abi.constants import GIB

from ._common import (add_budget_args, add_deployment_args, budget_from_args, deployment_from_args, flag_names,
                      number, print_json)


def add_arguments(p) -> None:
    add_deployment_args(p)
    p.add_argument("--hbm-gib", type=number, default=64.0, help="HBM per rank in GiB (default 64: Ascend 910B / A3 die)")
    p.add_argument("--ring-heap", default=None,
                   help="prefill ring heap: one byte count or four comma-separated (default 2,2,4,8 GiB)")
    add_budget_args(p)
    p.add_argument("--json", action="store_true", help="print JSON (keys documented in docs/cli.md)")


def _gib(v: int | None) -> str:
    return "open" if v is None else f"{v / GIB:.3f}"


def _defaults_note(con, args) -> None:
    """On capacity's own sizing defaults: say that simulate's differ, and what they admit."""
    import os

    from . import simulate
    from ._common import budget_given, deployment_defaults, slot_defaults_note

    mine, theirs = deployment_defaults(), deployment_defaults(simulate.DEPLOYMENT)
    if (args.max_model_len, args.chunk) != (mine["max_model_len"], mine["chunk"]) or budget_given(args):
        return
    note = slot_defaults_note("capacity", "simulate", mine, theirs)
    if note:
        sim = hbm_account(deployment_from_args(argparse.Namespace(**{**vars(args), "max_model_len": theirs["max_model_len"],
                                                                      "chunk": theirs["chunk"]})),
                          hbm_bytes=int(args.hbm_gib * GIB), env=os.environ, ring_heap=args.ring_heap)
        con.print(f"note: {note} (at simulate's max-model-len {theirs['max_model_len']} and chunk {theirs['chunk']}, "
                  f"with this command's HBM settings: {sim.slots_per_partition} slots per partition)")


def run(args) -> int:
    import os

    from twin.abi.inputs import number as check_number

    dep = deployment_from_args(args)
    check_number(args.hbm_gib, "--hbm-gib", lo=0.0, lo_open=True, unit="(GiB of HBM per rank)")
    measured, pages = budget_from_args(args)
    with flag_names():
        acct = hbm_account(dep, hbm_bytes=int(args.hbm_gib * GIB), env=os.environ, ring_heap=args.ring_heap,
                           measured=measured, total_kv_pages=pages)
    d = acct.to_dict()
    if args.json:
        print_json(d)
        return 0 if acct.fits else 3
    con = Console()
    t = Table(title=f"cache families ({dep.model.name}, max_model_len={dep.limits.max_model_len}, "
                    f"chunk={dep.limits.max_prefill_tokens_per_request})")
    for col in ("family", "blocks/request", "page bytes", "bytes/slot", "scratch bytes"):
        t.add_column(col, justify="right")
    for name, blocks in acct.blocks_per_request.items():
        pb = acct.page_bytes[name]
        t.add_row(name, f"{blocks:,}", f"{pb:,}", f"{blocks * pb:,}", f"{64 * pb:,}")
    t.add_row("total", "", "", f"{acct.bytes_per_slot:,}", f"{acct.scratch_bytes:,}", style="bold")
    con.print(t)
    h = Table(title=f"per-rank HBM ({args.hbm_gib:g} GiB, utilization {dep.limits.npu_memory_utilization}); "
                    "sources: docs/capacity.md, --json 'lines'")
    h.add_column("item")
    h.add_column("GiB", justify="right")
    h.add_column("when")
    for k, v in acct.breakdown.items():
        h.add_row(k, f"{v / GIB:.3f}", "at KV sizing" if k not in ("kv_pools", "kv_scratch_pages") else "KV pools")
    h.add_row("total", f"{acct.total_used / GIB:.3f}", "", style="bold")
    for k, v in acct.after_kv_sizing.items():
        h.add_row(k, f"{v / GIB:.3f}", "after KV sizing", style="dim")
    con.print(h)
    lo, hi = acct.kv_budget_interval
    con.print(f"budget source: [bold]{acct.budget_source}[/bold]: {acct.budget_detail}")
    con.print(f"KV budget: {_gib(acct.kv_budget)} GiB per rank (interval {_gib(lo)} .. {_gib(hi)} GiB); "
              f"unexplained {_gib(acct.remainder.point)} GiB")
    p = Table(title="the same budget source at other settings (slots per partition)")
    for col in ("max_model_len", "chunk", "slots", "min", "max", "KV budget GiB"):
        p.add_column(col, justify="right")
    for r in d["predictions"]:
        p.add_row(f"{r['max_model_len']:,}", str(r["chunk"]), str(r["slots"]), str(r["slots_min"]),
                  str(r["slots_max"]), _gib(r["kv_budget_bytes"]))
    con.print(p)
    if acct.fits and not acct.after_fits:
        con.print(f"[yellow]warning[/yellow]: what is allocated after KV sizing "
                  f"({sum(acct.after_kv_sizing.values()) / GIB:.3f} GiB) exceeds the {acct.headroom / GIB:.3f} GiB "
                  "left: a later dispatch would run out of HBM")
    if acct.fits and acct.requested_slots != acct.slots_per_partition:
        con.print(f"requested {acct.requested_slots} slots: the pools do not fit the HBM left free, halved to "
                  f"{acct.slots_per_partition}")
    if acct.fits:
        con.print(f"slots per partition: [bold]{acct.slots_per_partition}[/bold] "
                  f"(x {dep.partitions} partitions = {acct.slots_per_partition * dep.partitions} max-length requests)")
        _defaults_note(con, args)
        return 0
    con.print(f"[red]does not fit[/red]: {acct.error}")
    return 3
