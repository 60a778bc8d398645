"""Builders of valid scheduler batches for the lowering tests (block ids drawn like the grouped
prefix cache allocates them: per partition, per family, never repeated within a request)."""
from __future__ import annotations

import math

import numpy as np

from twin.abi import constants as C
from twin.abi.batches import DecodeBatch, DecodeItem, DrafterBatch, DrafterItem, PrefillBatch, PrefillItem


class Pools:
    """Hands out distinct block ids per (partition, family) from a shuffled free list."""

    def __init__(self, ctx, seed=0):
        self.ctx = ctx
        self.rng = np.random.default_rng(seed)
        self.free = {}

    def take(self, part, fam, n):
        key = (part, fam)
        if key not in self.free:
            self.free[key] = list(self.rng.permutation(self.ctx.num_blocks[fam]))
        fl = self.free[key]
        if len(fl) < n:
            raise RuntimeError("pool exhausted: raise slots in the test")
        out, self.free[key] = fl[:n], fl[n:]
        return tuple(int(x) for x in out)

    def rows(self, part, end):
        ids = {}
        for name, fam in self.ctx.families.items():
            if fam.rolling:
                n = min(math.ceil(end / fam.page_tokens), self.ctx.ring_period(name))
            else:
                n = math.ceil(end / C.COMPRESSED_BLOCK_TOKENS)
            ids[name] = self.take(part, name, max(n, 1))
        return ids


def prefill_batch(ctx, specs, seed=0, pools=None):
    """specs: [(partition, start, length)] -> PrefillBatch with random tokens."""
    pools = pools or Pools(ctx, seed)
    rng = np.random.default_rng(seed + 1)
    items = []
    for i, (part, start, n) in enumerate(specs):
        toks = tuple(int(t) for t in rng.integers(0, ctx.model.vocab_size, n))
        items.append(PrefillItem(f"p{i}", toks, start, start + n, pools.rows(part, start + n), part))
    return PrefillBatch(tuple(items))


def decode_batch(ctx, specs, k=7, seed=0, pools=None):
    """specs: [(partition, anchor, speculative, lease or None)] -> DecodeBatch."""
    pools = pools or Pools(ctx, seed)
    rng = np.random.default_rng(seed + 2)
    items = []
    for i, (part, anchor, spec, lease) in enumerate(specs):
        drafts = tuple(int(t) for t in rng.integers(0, ctx.model.vocab_size, 7)) if spec else ()
        end = min(anchor + C.DECODE_SEQ, ctx.max_position)
        items.append(DecodeItem(f"d{i}", int(rng.integers(0, ctx.model.vocab_size)), anchor,
                                pools.rows(part, end), part, drafts, lease, None if lease is None else 1 + i % 3))
    return DecodeBatch(tuple(items), k)


def drafter_batch(ctx, specs, seed=False):
    """specs: [(partition, lease, anchor, n_context)]; seed=True builds seed rows with full tails."""
    items = []
    for i, (part, lease, anchor, n) in enumerate(specs):
        if seed:
            cp = tuple(range(max(0, anchor + 1 - C.SLIDING_WINDOW), anchor + 1))
        else:
            cp = tuple(range(anchor - n + 1, anchor + 1))
        items.append(DrafterItem(f"r{i}", part, lease, 1 + i % 5, anchor, cp, 0 if seed else 1,
                                 last_sampled=7 + i, next_prefill_token=11 + i))
    return DrafterBatch(tuple(items))
