"""`dspark-twin`: the command line.  Each subcommand lives in `twin.commands.<name>` with
`add_arguments(parser)` and `run(args) -> int`; this file only wires them together.

The commands package is the composition root: it is the one place allowed to bring golden, the
simulator and hw together, and it imports them lazily inside `run`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from twin.abi.errors import AbiError

COMMANDS = {
    "abi": "print the programs and their positional arguments",
    "capacity": "startup admission and the per-rank HBM account",
    "simulate": "run the serving simulator (capacity and admission)",
    "lockstep": "run dispatches on a device backend and check them against golden",
    "sweep": "run a grid of simulations as Ray tasks: one table and its plots",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dspark-twin", description="Digital twin of DeepSeek-V4-Flash DSpark serving")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in COMMANDS.items():
        try:
            mod = importlib.import_module(f"twin.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"twin.commands.{name}":
                raise
            continue     # a subcommand whose module does not exist yet is simply not offered
        sp = sub.add_parser(name, help=help_, description=(mod.__doc__ or help_).strip().splitlines()[0])
        mod.add_arguments(sp)
        sp.set_defaults(_run=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except AbiError as e:
        print(f"dspark-twin {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
