"""`dspark-twin`: the command line.  Each subcommand lives in `twin.commands.<name>` with
`add_arguments(parser)` and `run(args) -> int` (and optionally `interrupted(args) -> str`, what a
Ctrl-C leaves behind); this file only wires them together.

Exit statuses: 0 success (lockstep: PASS), 1 lockstep FAIL, 2 bad input (one line naming the
argument or file, the value and what is allowed), 3 capacity does not fit, 70 an internal error (a
bug: one line saying where, `--debug` for the traceback), 130 interrupted (Ctrl-C).

The commands package is the composition root: it is the one place allowed to bring golden, the
simulator and hw together, and it imports them lazily inside `run`.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 2, 70, 130

COMMANDS = {
    "abi": "print the programs and their positional arguments",
    "capacity": "startup admission and the per-rank HBM account",
    "simulate": "run the serving simulator (capacity and admission)",
    "lockstep": "run dispatches on a device backend and check them against golden",
    "sweep": "run a grid of simulations as Ray tasks: one table and its plots",
}


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage text is what --help is for)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or with `command` only that one's flags (the others are
    listed, their modules not imported: each imports what its own run needs)."""
    p = Parser(prog="dspark-twin", description="Digital twin of DeepSeek-V4-Flash DSpark serving")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in COMMANDS.items():
        if command is not None and name != command:
            sub.add_parser(name, help=help_)
            continue
        try:
            mod = importlib.import_module(f"twin.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"twin.commands.{name}":
                raise
            continue     # a subcommand whose module does not exist yet is simply not offered
        sp = sub.add_parser(name, help=help_, description=(mod.__doc__ or help_).strip().splitlines()[0])
        mod.add_arguments(sp)
        sp.add_argument("--debug", action="store_true",
                        help="print the traceback of an error (for reporting an internal error)")
        sp.set_defaults(_run=mod.run, _interrupted=getattr(mod, "interrupted", None))
    return p


def chosen(argv: list[str]) -> str | None:
    """The subcommand `argv` names (its first word, the parser's only positional), if it is one."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser(chosen(argv)).parse_args(argv)
    except KeyboardInterrupt:
        print("dspark-twin: interrupted (Ctrl-C) before the command started", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:          # building the parser failed: a bug
        return internal("dspark-twin", e, "--debug" in argv)
    return run(args)


def run(args) -> int:
    from twin.abi.errors import AbiError
    from twin.abi.lowering import DispatchError

    prog = f"dspark-twin {args.command}"
    try:
        return int(args._run(args) or 0)
    except AbiError as e:
        if isinstance(e, DispatchError):    # no command takes a dispatch as input: the twin lowered a bad one
            return internal(prog, e, args.debug)
        if args.debug:
            traceback.print_exc()
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        left = args._interrupted(args) if args._interrupted else "nothing was written"
        print(f"{prog}: interrupted (Ctrl-C): {left}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader of stdout went away (`| head`): nothing more to say, and nowhere to say it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:          # a bug, never dressed as bad input: its own status and where to look
        return internal(prog, e, args.debug)


def internal(prog: str, e: BaseException, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    print(f"{prog}: internal error: {internal_error(e)}; "
          + ("the traceback is above" if debug else "rerun with --debug for the traceback"), file=sys.stderr)
    return EXIT_INTERNAL


def internal_error(e: BaseException) -> str:
    """'Type: message at file:line': the innermost frame in this project's code (else the innermost)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    text = f"{type(e).__name__}: {' '.join(str(e).split()) or '(no message)'}"
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if os.path.abspath(f.filename).startswith(root)] or frames
    where = ""
    if ours:
        path = os.path.abspath(ours[-1].filename)
        where = f" at {path[len(root):] if path.startswith(root) else path}:{ours[-1].lineno}"
    return f"{text}{where}"


if __name__ == "__main__":
    sys.exit(main())
