"""The fleet fidelity's KV pools: page COUNTS per (partition, family), no page identities.

A request's pages are derived from its positions (docs/simulation.md, "Fidelity"):

- an append-only family holds ceil(tokens / page_tokens) pages;
- a rolling ring holds min(ceil(tokens / page_tokens), max_blocks_per_seq) slots; each logical page
  past the ring rewrites one slot, which is a rotation (a page freed, a page taken) or, while a step
  of the request is in flight (async), a detach: the old page stays with the in-flight step's
  block-table snapshot until that step is applied, the new one comes from the free pool;
- the prefix cache is kept at prompt-block granularity (the 128-token alignment): one entry per
  (partition, chained block hash) holding the append-only families' pages of that block, with a
  reference count; an unreferenced entry stays hit-able until its pages would be taken from the
  free queue, i.e. until as many pages have been taken in that pool as were free ahead of it
  (the FIFO position of a freed page, tracked with one counter per pool).

What it drops (page ids, LRU order of individual pages, rolling tails of a prefix hit being
shared rather than copied, pages re-taken out of the middle of the queue by a hit) is listed in
docs/simulation.md.  No SimPy, no per-page Python work: the step's growth is a compiled loop
(`fleet_kernels`).
"""
from __future__ import annotations

import bisect

import numpy as np

from twin.abi.caches import page_alignment

from . import fleet_kernels as fk


class Entry:
    """A published prompt block in one partition: its append-only pages, shared by `refs` live
    requests (once unreferenced, alive while the pool has taken fewer than `evict_at` pages), and
    the rolling families' tail at its end boundary, held by `tail_refs` requests whose rings still
    cover it (once dropped, alive while fewer than `tail_evict` pages were taken; 0: never)."""

    __slots__ = ("refs", "evict_at", "tail_refs", "tail_evict")

    def __init__(self, F: int):
        self.refs = 1
        self.evict_at: list[int] | None = None
        self.tail_refs = [0] * F              # plain lists: a few families, touched one at a time
        self.tail_evict = [0] * F


class PagePools:
    def __init__(self, families, partitions: int, *, prefix_caching: bool = True):
        self.families = families
        self.names = tuple(f.name for f in families)
        self.partitions = G = partitions
        self.prefix_caching = prefix_caching
        self.pt = np.array([f.page_tokens for f in families], dtype=np.int64)
        self.maxb = np.array([f.max_blocks_per_seq for f in families], dtype=np.int64)
        self.rolling = np.array([f.rolling for f in families], dtype=bool)
        self.tail = np.array([f.tail_pages for f in families], dtype=np.int64)
        self.cap = np.array([f.blocks_per_partition for f in families], dtype=np.int64)
        self.F = len(families)
        self.free = np.tile(self.cap, (G, 1))
        self.takes = np.zeros((G, self.F), dtype=np.int64)      # pages ever taken from each free queue
        self.align = page_alignment(families)
        self.block_pages = np.where(self.rolling, 0, self.align // self.pt)
        self.index: list[dict[int, Entry]] = [{} for _ in range(G)]
        self.load = np.zeros(G, dtype=np.int64)
        self.next_partition = np.zeros(1, dtype=np.int64)     # the round-robin start (`fleet_kernels.place`)
        self.stats = {"evictions": 0, "detaches": 0, "rotations": 0}
        self._first: dict[int, tuple] = {}
        self.fam = fk.family_table(self.pt, self.maxb, self.rolling)      # the growth kernels' per-family rows
        # tokens past a boundary after which a ring no longer holds that boundary's tail pages
        self.tail_span = np.where(self.rolling, (self.maxb - self.tail) * self.pt, 0)
        self._span = self.tail_span.tolist()
        self._max_span = max(self._span)
        self._full_idx = np.flatnonzero(~self.rolling).tolist()
        self._roll_idx = np.flatnonzero(self.rolling).tolist()
        # the rolling families by ascending span: one boundary's tails then arrive in drop order
        # (appended, not inserted; equal spans keep family order, as an insertion after equals would)
        self._roll_by_span = sorted(self._roll_idx, key=lambda f: (self._span[f], f))

    @classmethod
    def from_deployment(cls, dep, slots: int) -> "PagePools":
        from .kvcache import family_specs

        return cls(family_specs(dep, slots), dep.partitions, prefix_caching=dep.limits.enable_prefix_caching)

    def first_rows(self, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """A request placed from nothing with `tokens`: the pages it needs, and its row of
        (logical pages, ring slots, own pages, pinned pages) per family."""
        got = self._first.get(tokens)
        if got is None:
            zero = np.zeros((1, self.F), dtype=np.int64)
            g = fk.grow_rows(np.array([tokens], dtype=np.int64), zero, zero, np.zeros(1, dtype=bool), self.fam)[:, 0]
            got = self._first[tokens] = (g[0], np.stack([g[4], g[5], g[1], zero[0]]))     # the growth from nothing
        return got

    # ---- prefix cache --------------------------------------------------------------------------
    def _alive(self, e: Entry, p: int) -> bool:
        if e.refs > 0:
            return True
        tk = self.takes[p]
        return all(tk[f] < e.evict_at[f] for f in self._full_idx)

    def _tail_valid(self, e: Entry, p: int) -> bool:
        tk = self.takes[p]
        return all(e.tail_refs[f] > 0 or tk[f] < e.tail_evict[f] for f in self._roll_idx)

    def lookup(self, hashes: list[int], max_hit_tokens: int) -> tuple[int, int | None]:
        """Longest aligned run of live blocks whose end boundary still has its rolling tails, over
        partitions (ties to the lowest index)."""
        A = self.align
        if not self.prefix_caching or max_hit_tokens < A:
            return 0, None
        limit = min(max_hit_tokens // A, len(hashes))
        best, best_p = 0, None
        for p in range(self.partitions):
            idx = self.index[p]
            run = []
            while len(run) < limit:
                h = hashes[len(run)]
                e = idx.get(h)
                if e is None:
                    break
                if not self._alive(e, p):
                    del idx[h]
                    self.stats["evictions"] += int(self.block_pages.sum())
                    break
                run.append(e)
            n = len(run)
            while n * A > best and not self._tail_valid(run[n - 1], p):
                n -= 1
            if n * A > best:
                best, best_p = n * A, p
        return best, best_p

    def attach(self, hashes: list[int], hit: int, p: int, entries: list, drops: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Reference the hit's blocks in `p` and hold its boundary's rolling tail; returns the
        request's (L, S, own) rows.  The tail pages are counted as the request's own (a copy, not
        a share: at most one window per family)."""
        idx, free = self.index[p], self.free[p]
        e = None
        for j in range(hit // self.align):
            e = idx[hashes[j]]
            if e.refs == 0:
                free -= self.block_pages
                e.evict_at = None
            e.refs += 1
            entries.append(e)
        if e is not None:
            self._hold_tail(e, hit, self._roll_by_span, drops)
        L = hit // self.pt
        tail = np.where(self.rolling, np.minimum(self.tail, np.minimum(L, self.maxb)), 0)
        free -= tail
        self.takes[p] += tail
        S = np.where(self.rolling, tail, L)
        return L, S, tail

    def _hold_tail(self, e: Entry, boundary: int, fams, drops: list) -> None:
        for f in fams:
            e.tail_refs[f] += 1
            d = (boundary + self._span[f], id(e), e, f)
            if drops and drops[-1][0] > d[0]:
                bisect.insort(drops, d, key=lambda x: x[:2])
            else:
                drops.append(d)                 # boundaries come in order: the usual case

    def publish(self, hashes: list[int], start: int, end: int, confirmed: int, p: int, entries: list,
                drops: list) -> int:
        """Index prompt blocks start..end-1 of a request in `p` after a step confirmed `confirmed`
        tokens; returns how many became entries (their pages leave the request's own count).  A
        block whose content is already indexed stays the request's own (upstream keeps the first
        copy).  A boundary's rolling tail is published when the ring still covered it, and
        refreshes an entry whose tail was evicted."""
        idx = self.index[p]
        moved = 0
        A = self.align
        tk = self.takes[p]
        for j in range(start, end):
            h = hashes[j]
            e = idx.get(h)
            b = (j + 1) * A
            covered = ([f for f in self._roll_by_span if confirmed <= b + self._span[f]]
                       if b >= confirmed - self._max_span else ())
            if e is not None and self._alive(e, p):
                stale = [f for f in covered if e.tail_refs[f] == 0 and tk[f] >= e.tail_evict[f]]
                if stale:
                    self._hold_tail(e, b, stale, drops)
                continue
            e = idx[h] = Entry(self.F)
            entries.append(e)
            moved += 1
            if covered:
                self._hold_tail(e, b, covered, drops)
        return moved

    def drop_tails(self, drops: list, tokens: int, p: int, ends: list | None = None) -> list | None:
        """The request's ring moved past these tails (or it left): a tail whose last holder leaves
        gets its FIFO position, the queue's end as the pools stand now.  ends: that table
        ((takes + free) as lists), read once per step by a caller that drops for several requests;
        returned (read here if it was needed and not given) for the next call."""
        while drops and drops[0][0] < tokens:
            _, _, e, f = drops.pop(0)
            e.tail_refs[f] -= 1
            if not e.tail_refs[f]:
                if ends is None:
                    ends = (self.takes + self.free).tolist()
                e.tail_evict[f] = ends[p][f]
        return ends

    def release_entries(self, entries: list, p: int) -> None:
        free = self.free[p]
        for e in entries:
            e.refs -= 1
            if e.refs == 0:
                free += self.block_pages
                e.evict_at = (self.takes[p] + free).tolist()     # its FIFO position in each queue
        entries.clear()

    def live_entry_pages(self) -> np.ndarray:
        """Pages held by referenced entries, per partition and family (for invariant checks)."""
        out = np.zeros_like(self.free)
        for p, idx in enumerate(self.index):
            refs = sum(1 for e in idx.values() if e.refs > 0)   # a referenced entry is never replaced
            out[p] = refs * self.block_pages
        return out
