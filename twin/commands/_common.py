"""Arguments shared by several subcommands."""
from __future__ import annotations

import argparse
import json
import sys

from twin.abi import PRESETS


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
    arg("--ep", dest="ep", type=int, default=16, help="expert-parallel world size = ranks (8 or 16; default 16)")
    arg("--tp", dest="tp", type=int, default=4, help="ranks per TP group (4; 1 only for small presets)")
    arg("--max-model-len", dest="max_model_len", type=int, default=1024, help="context ceiling (default 1024)")
    arg("--chunk", "--long-prefill-token-threshold", dest="chunk", type=int, default=2048,
        help="per-request prefill chunk (--long-prefill-token-threshold; default 2048)")
    arg("--max-num-batched-tokens", dest="max_num_batched_tokens", type=int, default=8192,
        help="global token budget per step (default 8192, the documented DSpark command)")
    arg("--max-num-seqs", dest="max_num_seqs", type=int, default=16, help="max running requests (default 16)")
    arg("-k", "--num-speculative-tokens", dest="k", type=int, default=7, help="0 or 7 (default 7)")
    arg("--utilization", "--npu-memory-utilization", dest="utilization", type=float, default=0.90,
        help="NPU memory utilization for KV sizing (default 0.90)")
    arg("--temperature", dest="temperature", type=float, default=0.0, help="must be 0: DSpark serving is greedy")
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
