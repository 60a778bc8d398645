"""Speculation in the golden, side by side in one run; prints JSON.

A mixed workload on a small preset (prompts across the 128-token window and a ratio-128 boundary,
requests that reach the position ceiling and fall back) runs at K=0 and at K=7, with drafts that
are right up to a fixed length j (a drafter of known quality: accepted length j + 1 per step) and
with the Markov drafter's own drafts.  For each: target steps, wall time, the ratio to K=0, the
speculation summary, and whether every request's tokens equal K=0's (they must).

    python benchmarks/dspark_speculation.py [--preset tiny] [--mode device] [--lengths 0 3 7]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from golden.checkpoint import SyntheticCheckpoint
from golden.dspark import step as S
from golden.dspark.oracle_drafts import continuation_drafts
from golden.dspark.weights import DrafterCheckpoint
from twin.abi import get_preset

MIXED = [(5, 40), (30, 60), (120, 40), (150, 26), (170, 6)]
LIMIT = 176


def fixed_length_policy(reference, j, vocab):
    def policy(seq, drafts):
        return continuation_drafts(reference[seq.req.request_id], seq.anchor, j, vocab)
    return policy


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--mode", default="device", choices=["device", "exact"])
    ap.add_argument("--lengths", type=int, nargs="*", default=[0, 3, 7])
    args = ap.parse_args(argv)
    cfg = get_preset(args.preset)
    rng = np.random.default_rng(1)
    reqs = [S.Prompt(f"r{i}", tuple(int(t) for t in rng.integers(0, cfg.vocab_size, L)), n)
            for i, (L, n) in enumerate(MIXED)]
    g = S.Golden(cfg, SyntheticCheckpoint(cfg, 0), DrafterCheckpoint(cfg, 0), nm=args.mode, max_model_len=LIMIT,
                 groups=2)
    t = time.perf_counter()
    base = S.generate(g, reqs, k=0)
    t0 = time.perf_counter() - t
    out0 = S.outputs(base)
    reference = {r.request_id: list(r.prompt) + out0[r.request_id] for r in reqs}
    runs = {}
    for name, policy in [(f"drafts_right_to_{j}", fixed_length_policy(reference, j, cfg.vocab_size))
                         for j in args.lengths] + [("markov_drafter", None)]:
        t = time.perf_counter()
        run = S.generate(g, reqs, k=7, draft_policy=policy)
        dt = time.perf_counter() - t
        runs[name] = {"target_steps": run.steps, "seconds": round(dt, 3), "time_vs_k0": round(dt / t0, 3),
                      "steps_vs_k0": round(run.steps / base.steps, 3),
                      "tokens_equal_k0": S.outputs(run) == out0, "summary": run.counters.summary()}
    print(json.dumps({"preset": cfg.name, "mode": args.mode, "max_model_len": LIMIT,
                      "requests": [{"prompt": L, "max_new_tokens": n} for L, n in MIXED],
                      "k0": {"target_steps": base.steps, "seconds": round(t0, 3)}, "k7": runs}, indent=1))


if __name__ == "__main__":
    main()
