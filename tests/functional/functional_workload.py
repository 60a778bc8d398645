"""The must-show workload, run once per session and shared by the functional tests.

TINY on EP8 (two TP groups), three capacity slots per partition, 64-token chunks, K=7: six requests
with ragged prompts, three of them behind a 256-token shared prefix, arriving in three waves.  The
first shared-prefix request publishes its pages before the later ones arrive (a 128-aligned hit
that leaves the last 128 prompt tokens to replay), long prompts take several chunks packed with
other requests, and the slots are too few for every request at once, so requests are preempted
after they have generated tokens.

Drafts: golden's synthetic Markov drafter never guesses right, so the drafter's proposals are
replaced (after it ran and wrote its caches) by the oracle's continuation with one wrong token at
an index that cycles through 0..7; acceptance lengths 1..8 all occur.  Drafts only change how many
tokens a step commits, never which: the target verifies every one of them.
"""

import numpy as np

from golden.dspark.oracle_drafts import continuation_drafts

from twin.abi import deployment
from twin.abi.batches import Request, Sampling

SPEC = [("p", 30, 20, 0.0), (None, 170, 20, 0.0), ("p", 90, 20, 0.005), (None, 60, 20, 0.005),
        (None, 220, 16, 0.01), ("p", 10, 20, 0.01)]
PREFIX = 256
SLOTS = 3
WRONG_AT = [7, 3, 0, 5, 1, 6, 2, 4]          # index of the wrong draft per verify (7: all right)


def make_dep():
    return deployment("tiny", ep=8, max_model_len=512, long_prefill_token_threshold=64, max_num_seqs=6,
                      max_num_batched_tokens=256)


def make_requests(seed: int = 3):
    rng = np.random.default_rng(seed)
    V = make_dep().model.vocab_size
    shared = rng.integers(2, V, PREFIX)
    reqs = []
    for i, (grp, L, n, t) in enumerate(SPEC):
        body = rng.integers(2, V, L)
        prompt = np.concatenate([shared, body]) if grp else body
        reqs.append(Request(f"r{i}", prompt, Sampling(n), arrival=t, tag=grp or ""))
    return reqs


def oracle_drafts(reference: dict, requests, vocab: int):
    full = {r.request_id: [int(t) for t in r.prompt] + reference[r.request_id] for r in requests}
    calls: dict = {}

    def policy(seq, drafts):
        rid = seq.req.request_id
        f, a = full[rid], seq.anchor
        i = calls.get(rid, 0)
        calls[rid] = i + 1
        return continuation_drafts(f, a, WRONG_AT[i % len(WRONG_AT)], vocab, pad=2)

    return policy
