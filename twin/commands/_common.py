"""Arguments shared by several subcommands."""
from __future__ import annotations

import argparse
import json
import sys

from twin.abi import PRESETS


def add_deployment_args(p: argparse.ArgumentParser, *, preset: str = "flash") -> None:
    p.add_argument("--preset", default=preset, choices=sorted(PRESETS), help=f"model preset (default {preset})")
    p.add_argument("--ep", type=int, default=16, help="expert-parallel world size = ranks (8 or 16; default 16)")
    p.add_argument("--tp", type=int, default=4, help="ranks per TP group (4; 1 only for small presets)")
    p.add_argument("--max-model-len", type=int, default=1024, help="context ceiling (default 1024)")
    p.add_argument("--chunk", "--long-prefill-token-threshold", dest="chunk", type=int, default=2048,
                   help="per-request prefill chunk (--long-prefill-token-threshold; default 2048)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="global token budget per step (default 8192, the documented DSpark command)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="max running requests (default 16)")
    p.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=7, help="0 or 7 (default 7)")
    p.add_argument("--utilization", "--npu-memory-utilization", dest="utilization", type=float, default=0.90,
                   help="NPU memory utilization for KV sizing (default 0.90)")
    p.add_argument("--temperature", type=float, default=0.0, help="must be 0: DSpark serving is greedy")


def deployment_from_args(args):
    from twin.abi import deployment

    return deployment(args.preset, ep=args.ep, tp=args.tp, max_model_len=args.max_model_len,
                      long_prefill_token_threshold=args.chunk, max_num_batched_tokens=args.max_num_batched_tokens,
                      max_num_seqs=args.max_num_seqs, num_speculative_tokens=args.k,
                      npu_memory_utilization=args.utilization, temperature=args.temperature)


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")
