"""Arguments shared by several subcommands."""
from __future__ import annotations

import argparse
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


def deployment_from_args(args):
    from twin.abi import deployment

    return deployment(args.preset, ep=args.ep, tp=args.tp, max_model_len=args.max_model_len,
                      long_prefill_token_threshold=args.chunk, max_num_batched_tokens=args.max_num_batched_tokens,
                      max_num_seqs=args.max_num_seqs, num_speculative_tokens=args.k,
                      npu_memory_utilization=args.utilization, temperature=args.temperature)


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")
