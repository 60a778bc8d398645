"""A fixed request set served as the real scheduler would: packed prefill chunks, seeding waves
(K=7), then decode (fused K=7 verify + redraft, or K=0 one row per request) until every request has
its tokens.  Each step becomes a scheduler batch that `twin.abi.lowering` lowers and validates;
golden then runs what the dispatch stages: prefill tokens and positions are read from the dispatch
stream, and golden's own slot mappings are checked against the dispatch's staged ones (after the
partition-local to golden page shift), so a run cannot pass while the dispatch is wrong.

Pages: the scheduler's ids are partition-local; golden keeps one pool per family holding every
partition, page `p * num_blocks + id` (`golden.staging.PageMap`, which the functional twin uses
too, as it does `golden.staging`'s dispatch/golden cross-checks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from golden.dspark import step as S
from golden.dspark.state import release
from golden.paged import PREFILL
from golden.staging import PageMap, check_decode, check_prefill, prefill_stream
from twin.abi import constants as C
from twin.abi.batches import DecodeBatch, DecodeItem, Dispatch, DrafterBatch, DrafterItem, PrefillBatch, PrefillItem
from twin.abi.errors import AbiError
from twin.abi.lowering import LoweringContext, lower, seeding_waves, validate

# the golden slot key (golden.staging.SLOTS) that writes each pool
POOL_SLOTS = {"kv_cache": "ori", "hca_compress_state": "hca_state", "csa_compress_state": "csa_state",
              "csa_inner_compress_state": "csa_inner_state", "hca_cmp_kv": "hca_cmp", "csa_cmp_kv": "csa_cmp",
              "idx_kv_cache": "csa_idx", "idx_kv_scale": "csa_idx"}


@dataclass
class RealDispatch:
    index: int
    kind: str                          # prefill | seed | decode
    dispatch: Dispatch
    rows: list                         # request indices, in the order the sides run them
    items: list = field(default_factory=list)


class Stream:
    def __init__(self, dep, slots: int, prompts, *, max_new: int = 24, chunk: int = 64):
        self.dep, self.k = dep, dep.k
        self.ctx = LoweringContext(dep, slots)
        G = dep.partitions
        if len(prompts) > G * slots:
            raise AbiError("prompts", len(prompts), f"at most partitions x slots = {G * slots}", where="hw.real stream")
        if chunk < 1:
            raise AbiError("chunk", chunk, ">= 1", where="hw.real stream")
        self.pages = PageMap(self.ctx)
        self.per = {f: n // slots for f, n in self.pages.num_blocks.items()}
        self.pool_pages = self.pages.pool_pages
        self.prompts = [tuple(int(t) for t in p) for p in prompts]
        self.max_new, self.chunk = max_new, chunk
        self.place = [(i % G, i // G) for i in range(len(prompts))]       # (partition, slot)
        self.computed = [0] * len(prompts)
        self.seeded = not self.k
        self.index = 0

    # ---- addressing ------------------------------------------------------------------------------
    def local_blocks(self, i: int) -> dict:
        _, slot = self.place[i]
        return {f: tuple(range(slot * n, (slot + 1) * n)) for f, n in self.per.items()}

    def golden_blocks(self, i: int) -> dict:
        return self.pages.to_golden(self.place[i][0], self.local_blocks(i))

    def setup(self, side) -> None:
        """The requests' bookkeeping on one side: block-table rows, drafter slots (lease = slot)."""
        for i, prompt in enumerate(self.prompts):
            p, slot = self.place[i]
            s = S.Seq(S.Request(f"r{i}", prompt, self.max_new), i, p)
            if self.k:
                s.lease, s.generation = slot, 1
            side.run.blocks.append(self.golden_blocks(i))
            side.run.seqs.append(s)

    # ---- the scheduler (driven by the device side's run) ------------------------------------------
    def next(self, dev) -> RealDispatch | None:
        seqs = dev.run.seqs
        todo = [i for i in range(len(seqs)) if self.computed[i] < len(self.prompts[i])]
        if todo:
            items, budget = [], self.dep.limits.max_num_batched_tokens
            for i in todo:
                a = self.computed[i]
                b = min(len(self.prompts[i]), a + self.chunk, a + budget)
                if b <= a:
                    break
                budget -= b - a
                s = seqs[i]
                items.append(PrefillItem(s.req.request_id, self.prompts[i][a:b], a, len(self.prompts[i]),
                                         self.local_blocks(i), s.group, s.lease, s.generation))
            return self._emit("prefill", PrefillBatch(tuple(items)), [int(it.request_id[1:]) for it in items], items)
        if not self.seeded:
            waves = seeding_waves([s for s in seqs if not getattr(s, "_seeded", False)])
            if waves:
                wave = waves[0]
                for s in wave:
                    s._seeded = True
                rows = [DrafterItem(s.req.request_id, s.group, s.lease, s.generation, len(s.req.prompt) - 1,
                                    tuple(range(max(0, len(s.req.prompt) - C.SLIDING_WINDOW), len(s.req.prompt))),
                                    0, next_prefill_token=s.current) for s in wave]
                return self._emit("seed", DrafterBatch(tuple(rows)), [s.index for s in wave], rows)
            self.seeded = True
        live = [s for s in seqs if not s.done]
        if not live:
            return None
        items = []
        for s in live:
            drafts = tuple(int(t) for t in dev.run.state.tokens[s.group, s.lease, 1:]) if self.k else ()
            items.append(DecodeItem(s.req.request_id, s.current, s.anchor, self.local_blocks(s.index), s.group,
                                    drafts, s.lease, s.generation))
        return self._emit("decode", DecodeBatch(tuple(items), k=self.k), [s.index for s in live], items)

    def _emit(self, kind, batch, rows, items) -> RealDispatch:
        d = lower(batch, self.ctx)
        validate(d, self.ctx)
        d = Dispatch(d.program, d.args, {**d.meta, "index": self.index})
        rd = RealDispatch(self.index, kind, d, rows, list(items))
        self.index += 1
        return rd

    def advance(self, rd: RealDispatch) -> None:
        if rd.kind == "prefill":
            for it in rd.items:
                self.computed[int(it.request_id[1:])] = it.end

    # ---- one side runs a dispatch ----------------------------------------------------------------
    def execute(self, side, rd: RealDispatch) -> dict:
        side.par.reset()
        run, g = side.run, side.g
        seqs = [run.seqs[i] for i in rd.rows]
        if rd.kind == "prefill":
            spans = self.spans_from_dispatch(rd, run)
            sampled, mh = S.forward_spans(g, run, spans, PREFILL)
            check_prefill(rd.dispatch, side.par.calls[-1][0], rd.items, self.pages)
            row = 0
            for i, (s, it) in enumerate(zip(seqs, rd.items)):
                a, b = it.num_computed, it.end
                for p, h in zip(range(a, b), mh[row:row + b - a]):
                    s.tail[p] = h
                s.tail = {p: h for p, h in s.tail.items() if p > b - 1 - C.SLIDING_WINDOW}
                row += b - a
                if it.terminal:
                    s.anchor, s.current = b, int(sampled[i])
                    s.generated.append(s.current)
            return {"sampled_ids": np.asarray(sampled, np.int64), "main_hidden": np.asarray(mh, np.float32)}
        if rd.kind == "seed":
            S.seed_wave(g, run, seqs)
            return {"drafts": np.stack([run.state.tokens[s.group, s.lease] for s in seqs]),
                    "state_meta": np.stack([run.state.meta[s.group, s.lease] for s in seqs])}
        check_decode(rd.dispatch, rd.items, seqs, self.k)
        if not self.k:
            S.plain_step(g, run, seqs)
            return {"sampled_ids": np.array([s.current for s in seqs], np.int64)}
        acc = S.fused_step(g, run, seqs)
        for s in seqs:
            if s.done and not s.released:
                run.state = release(run.state, s.ref)
                s.released = True
        return {"accepted_ids": np.asarray(acc.token_ids, np.int64), "accepted_counts": np.asarray(acc.counts),
                "drafts": np.stack([run.state.tokens[s.group, s.lease] for s in seqs]),
                "state_meta": np.stack([run.state.meta[s.group, s.lease] for s in seqs])}

    def spans_from_dispatch(self, rd, run) -> list:
        """Golden's spans from the staged dispatch: each request's tokens and first position read
        from its placement in the packed stream."""
        spans = []
        for it in rd.items:
            toks, pos, _, _ = prefill_stream(rd.dispatch, it.request_id)
            i = int(it.request_id[1:])
            spans.append(S.Span(i, int(pos[0]), tuple(int(t) for t in toks), run.blocks[i]))
        return spans


def mapped_rows(calls) -> dict:
    """pool -> flat rows the dispatch's target forwards write (every slot >= 0 of its family)."""
    out = {}
    for pool, key in POOL_SLOTS.items():
        rows = [m.slots[key][m.slots[key] >= 0] for m, *_ in calls]
        out[pool] = np.unique(np.concatenate(rows)) if rows else np.zeros(0, np.int64)
    return out
