"""Print the six programs with their argument counts, or one program's positional arguments."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from twin.abi import PROGRAMS, bind, get_program

from ._common import add_deployment_args, deployment_from_args, integer, print_json


def add_arguments(p) -> None:
    p.add_argument("program", nargs="?", help=f"one of {', '.join(PROGRAMS)}")
    add_deployment_args(p)
    p.add_argument("--slots", type=integer, default=1, help="capacity slots per partition that size the pools (default 1)")
    p.add_argument("--json", action="store_true", help="print JSON (keys documented in docs/cli.md)")


def program_summary(dep) -> list[dict]:
    return [{"program": p.name, "compiled_as": p.compiled_as, "args": len(p), "ring_heap": p.ring_heap,
             "compiled_for_k": list(p.modes)} for p in PROGRAMS.values()]


def program_args(name: str, dep, slots: int) -> list[dict]:
    prog = get_program(name)
    return [{"index": i + 1, "name": b.name, "shape": list(b.shape), "symbolic_shape": b.arg.shape,
             "dtype": b.dtype, "role": b.arg.role, "dynamic_axis": b.arg.dyn, "pool": b.arg.pool,
             "buffer": b.arg.buffer_id, "bytes_per_rank": b.nbytes_per_rank}
            for i, b in enumerate(bind(prog, dep, slots))]


def run(args) -> int:
    dep = deployment_from_args(args)
    if args.program is None:
        rows = program_summary(dep)
        if args.json:
            print_json(rows)
            return 0
        t = Table(title=f"programs ({dep.model.name}, ep={dep.topology.ep})")
        for col in ("program", "compiled as", "args", "ring heap", "compiled for K"):
            t.add_column(col)
        for r in rows:
            t.add_row(r["program"], r["compiled_as"], str(r["args"]), r["ring_heap"],
                      ",".join(map(str, r["compiled_for_k"])) or "legacy (pinned by tests)")
        Console().print(t)
        return 0
    rows = program_args(args.program, dep, args.slots)
    if args.json:
        print_json({"program": args.program, "preset": dep.model.name, "ep": dep.topology.ep, "args": rows})
        return 0
    t = Table(title=f"{args.program}: {len(rows)} args ({dep.model.name}, ep={dep.topology.ep})")
    for col in ("#", "name", "shape", "symbolic", "dtype", "role"):
        t.add_column(col)
    for r in rows:
        t.add_row(str(r["index"]), r["name"], "[" + ", ".join(map(str, r["shape"])) + "]", r["symbolic_shape"],
                  r["dtype"], r["role"])
    Console(width=200).print(t)
    return 0
