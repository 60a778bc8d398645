"""The oracle: an independent sequential greedy generation of one prompt.

No scheduler, no batching, no chunking, no paging shared with anyone, no prefix cache, no
speculation: golden alone on one request.  Two forms:

- "incremental": golden's K=0 driver on the single request with its own fresh caches (one
  prefill of the whole prompt, then one row per token);
- "recompute": every token is a fresh forward over the whole sequence so far (nothing cached
  between tokens at all), the most independent and the slowest; the tests check that both agree.
"""
from __future__ import annotations

import numpy as np

from golden.compose import Session
from golden.dspark import step as S
from golden.paged import PREFILL
from twin.abi.errors import AbiError

MODES = ("incremental", "recompute")


def sequential_greedy(golden: S.Golden, prompt, n: int, *, mode: str = "incremental") -> list[int]:
    prompt = tuple(int(t) for t in prompt)
    if mode not in MODES:
        raise AbiError("mode", mode, f"one of {MODES}", where="sequential_greedy")
    if n < 1 or not prompt:
        raise AbiError("n" if n < 1 else "prompt", n if n < 1 else 0, ">= 1", where="sequential_greedy")
    if mode == "incremental":
        g = S.Golden(golden.cfg, golden.ckpt, None, golden.nm, max_model_len=len(prompt) + n, groups=1)
        return S.outputs(S.generate(g, [S.Prompt("oracle", prompt, n)], k=0))["oracle"]
    seq = list(prompt)
    for _ in range(n):
        sess = Session(golden.ckpt, golden.cfg, golden.nm, 1, len(seq))
        out = sess.run({0: seq}, PREFILL)
        seq.append(int(np.asarray(out.sampled)[-1]))
    return seq[len(prompt):]


def reference_outputs(golden: S.Golden, requests, *, lengths: dict | None = None, mode: str = "incremental") -> dict:
    """Request id -> the oracle's first `lengths[id]` tokens (default: the request's max_new_tokens)."""
    out = {}
    for r in requests:
        n = (lengths or {}).get(r.request_id, r.max_new_tokens)
        out[r.request_id] = sequential_greedy(golden, r.prompt, n, mode=mode) if n else []
    return out


def first_difference(outputs: dict, reference: dict):
    """The first (request, position, got, want) where outputs differ from the reference, in the
    reference's request order; a missing or short output differs at its end.  None if all equal."""
    for rid, want in reference.items():
        got = list(outputs.get(rid, []))
        for i, w in enumerate(want):
            if i >= len(got) or got[i] != w:
                return rid, i, (got[i] if i < len(got) else None), w
        if len(got) > len(want):
            return rid, len(want), got[len(want)], None
    return None
