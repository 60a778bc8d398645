"""Startup admission: blocks per request, bytes per slot, slots per partition, per-rank HBM."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from twin.abi import hbm_account
from twin.abi.constants import GIB

from ._common import add_deployment_args, deployment_from_args, number, print_json


def add_arguments(p) -> None:
    add_deployment_args(p)
    p.add_argument("--hbm-gib", type=number, default=64.0, help="HBM per rank in GiB (default 64: Ascend 910B / A3 die)")
    p.add_argument("--ring-heap", default=None,
                   help="prefill ring heap: one byte count or four comma-separated (default 2,2,4,8 GiB)")
    p.add_argument("--json", action="store_true", help="print JSON (keys documented in docs/cli.md)")


def run(args) -> int:
    import os

    dep = deployment_from_args(args)
    from twin.abi.inputs import number

    number(args.hbm_gib, "--hbm-gib", lo=0.0, lo_open=True, unit="(GiB of HBM per rank)")
    acct = hbm_account(dep, hbm_bytes=int(args.hbm_gib * GIB), env=os.environ, ring_heap=args.ring_heap)
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
    h = Table(title=f"per-rank HBM ({args.hbm_gib:g} GiB, utilization {dep.limits.npu_memory_utilization})")
    h.add_column("item")
    h.add_column("GiB", justify="right")
    for k, v in acct.breakdown.items():
        h.add_row(k, f"{v / GIB:.3f}")
    h.add_row("total", f"{acct.total_used / GIB:.3f}", style="bold")
    con.print(h)
    if acct.fits:
        con.print(f"slots per partition: [bold]{acct.slots_per_partition}[/bold] "
                  f"(x {dep.partitions} partitions = {acct.slots_per_partition * dep.partitions} max-length requests)")
        return 0
    con.print(f"[red]does not fit[/red]: {acct.error}")
    return 3
