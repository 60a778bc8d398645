"""Arguments shared by several subcommands."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys

from twin.abi import PRESETS


# value types of the numeric flags: the syntax only (and never NaN, which no range check can
# refuse); each flag's range is checked where its rule lives (the deployment, the workload, ...)
def number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: a number") from None
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: a number (not NaN)")
    return value


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: an integer") from None


def seed(text: str) -> int:
    value = integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: an integer >= 0 (a random seed)")
    return value


def out_dir(path: str, flag: str):
    """Create a report directory before any work starts (a bad --out costs nothing)."""
    from twin.abi.outputs import output_dir

    return output_dir(path, flag)


def add_deployment_args(p: argparse.ArgumentParser, *,
                        overrides: dict[str, tuple[object, str]] | None = None) -> None:
    """The deployment flags.  overrides: dest -> (default, help) for a command whose defaults differ
    from the others' (simulate's saturating FLASH setup)."""
    overrides, dests = dict(overrides or {}), []

    def arg(*flags, dest: str, default, help: str, **kw) -> None:
        dests.append(dest)
        default, help = overrides.pop(dest, (default, help))
        p.add_argument(*flags, dest=dest, default=default, help=help, **kw)

    arg("--preset", dest="preset", default="flash", choices=sorted(PRESETS), help="model preset (default flash)")
    arg("--ep", dest="ep", type=integer, default=16, help="expert-parallel world size = ranks (8 or 16; default 16)")
    arg("--tp", dest="tp", type=integer, default=4, help="ranks per TP group (4; 1 only for small presets)")
    arg("--max-model-len", dest="max_model_len", type=integer, default=1024, help="context ceiling (default 1024)")
    arg("--chunk", "--long-prefill-token-threshold", dest="chunk", type=integer, default=2048,
        help="per-request prefill chunk (--long-prefill-token-threshold; default 2048)")
    arg("--max-num-batched-tokens", dest="max_num_batched_tokens", type=integer, default=8192,
        help="global token budget per step (default 8192, the documented DSpark command)")
    arg("--max-num-seqs", dest="max_num_seqs", type=integer, default=16, help="max running requests (default 16)")
    arg("-k", "--num-speculative-tokens", dest="k", type=integer, default=7, help="0 or 7 (default 7)")
    arg("--utilization", "--npu-memory-utilization", dest="utilization", type=number, default=0.90,
        help="NPU memory utilization for KV sizing (default 0.90)")
    arg("--temperature", dest="temperature", type=number, default=0.0, help="must be 0: DSpark serving is greedy")
    if overrides:
        raise ValueError(f"overrides: {sorted(overrides)} are not deployment arguments (allowed: {dests})")


def deployment_defaults(overrides: dict[str, tuple[object, str]] | None = None) -> dict:
    """The deployment flags' defaults (dest -> value) of a command with these overrides."""
    p = argparse.ArgumentParser(add_help=False)
    add_deployment_args(p, overrides=overrides)
    return {a.dest: a.default for a in p._actions if a.dest != "help"}


def slot_defaults_note(here: str, there: str, mine: dict, theirs: dict) -> str | None:
    """Why two commands' default slot counts differ: the sizing settings they default to (None
    when they agree).  mine / theirs: deployment defaults of `here` and `there`."""
    keys = [("max_model_len", "max-model-len"), ("chunk", "chunk")]
    diff = [(flag, mine[k], theirs[k]) for k, flag in keys if mine[k] != theirs[k]]
    if not diff:
        return None
    a = ", ".join(f"{f} {m}" for f, m, _ in diff)
    b = ", ".join(f"{f} {t}" for f, _, t in diff)
    return (f"{here}'s defaults size the pools for {a}; `dspark-twin {there}` defaults to {b}, so its slot "
            f"count differs: pass the same flags to both to compare")


def deployment_from_args(args):
    from twin.abi import deployment

    return deployment(args.preset, ep=args.ep, tp=args.tp, max_model_len=args.max_model_len,
                      long_prefill_token_threshold=args.chunk, max_num_batched_tokens=args.max_num_batched_tokens,
                      max_num_seqs=args.max_num_seqs, num_speculative_tokens=args.k,
                      npu_memory_utilization=args.utilization, temperature=args.temperature)


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


# the KV budget's sources: flag -> the name the ABI layer gives it
BUDGET_FLAGS = {"--total-kv-pages": "total_kv_pages", "--measured-free-bytes": "measured_free_bytes",
                "--measured-used-bytes": "measured_used_bytes", "--measured-slots": "measured_slots"}


def add_budget_args(p: argparse.ArgumentParser) -> None:
    """Where the KV budget comes from (docs/capacity.md#calibration); at most one of these."""
    g = p.add_argument_group("KV budget (default: the HBM account with the measured boot's unexplained line)")
    g.add_argument("--total-kv-pages", metavar="N", type=integer,
                   help="upstream's knob: slots = N // ori blocks per request (capped at 64), no budget")
    g.add_argument("--measured-free-bytes", metavar="BYTES", type=integer,
                   help="per-rank free HBM in bytes when init_kv_cache read it (the boot log's minimum over ranks)")
    g.add_argument("--measured-used-bytes", metavar="BYTES", type=integer,
                   help="per-rank used HBM (total - free) in bytes at that moment (the maximum over ranks)")
    g.add_argument("--measured-slots", metavar="N", type=integer,
                   help="slots per partition a boot at these settings admitted (its init_kv_cache log line)")


def budget_given(args) -> bool:
    """Whether a KV budget flag was given (the slot count then follows the budget, not the defaults)."""
    return any(getattr(args, d, None) is not None for d in BUDGET_FLAGS.values())


def budget_from_args(args):
    """(measurement or None, total_kv_pages or None) from the budget flags (integers by their
    type), validated: at most one source, a positive page count; a measurement's range is the ABI's."""
    from twin.abi import ConfigError, Measurement

    given = [(f, getattr(args, d)) for f, d in BUDGET_FLAGS.items() if getattr(args, d, None) is not None]
    if len(given) > 1:
        (f0, _), (f1, v1) = given[:2]
        raise ConfigError(f1, v1, f"not together with {f0}: the budget has one source")
    if not given:
        return None, None
    flag, value = given[0]
    if flag == "--total-kv-pages":
        if value < 1:
            raise ConfigError(flag, value, "a positive page count")
        return None, value
    return Measurement(BUDGET_FLAGS[flag], value), None


@contextlib.contextmanager
def flag_names():
    """Re-raise an ABI error about a budget value under the flag the user typed."""
    from twin.abi import AbiError

    try:
        yield
    except AbiError as e:
        flag = {d: f for f, d in BUDGET_FLAGS.items()}.get(e.name)
        if flag is None:
            raise
        raise type(e)(flag, e.value, e.allowed, e.where) from None
