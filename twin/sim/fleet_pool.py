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
docs/simulation.md.  No SimPy, no per-page Python work: the step's growth is array arithmetic.
"""
from __future__ import annotations

import numpy as np

from twin.abi.caches import page_alignment


class Entry:
    """A published prompt block in one partition: its append-only pages, shared by `refs` live
    requests; once unreferenced, alive while the pool has taken fewer than `evict_at` pages."""

    __slots__ = ("refs", "evict_at")

    def __init__(self):
        self.refs = 1
        self.evict_at: np.ndarray | None = None


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
        self._full = ~self.rolling
        self.index: list[dict[int, Entry]] = [{} for _ in range(G)]
        self.load = np.zeros(G, dtype=np.int64)
        self.next_partition = 0
        self.stats = {"evictions": 0, "detaches": 0, "rotations": 0}
        self._first: dict[int, tuple] = {}

    @classmethod
    def from_deployment(cls, dep, slots: int) -> "PagePools":
        from .kvcache import family_specs

        return cls(family_specs(dep, slots), dep.partitions, prefix_caching=dep.limits.enable_prefix_caching)

    # ---- growth, vectorised over requests ------------------------------------------------------
    def growth(self, tokens: np.ndarray, L: np.ndarray, S: np.ndarray, pinned: np.ndarray):
        """Rows of requests growing to `tokens`: logical pages `L` and filled ring slots `S`
        (n x F), `pinned` whether a step is in flight.  Returns (need, own, taken, L', S'):
        free pages needed, pages added to the request's own count, pages taken from the queue."""
        tgt = -(-tokens[:, None] // self.pt)
        rolling, maxb = self.rolling, self.maxb
        grow_full = np.where(rolling, 0, np.maximum(tgt - L, 0))
        size = np.minimum(tgt, maxb)
        fill = np.where(rolling, np.maximum(size - S, 0), 0)
        wrap = np.where(rolling & (tgt > maxb), np.clip(tgt - np.maximum(L, maxb), 0, maxb), 0)
        detach = wrap * pinned[:, None]
        own = grow_full + fill
        return own + detach, own, own + wrap, np.maximum(L, tgt), np.where(rolling, np.maximum(S, size), np.maximum(L, tgt))

    def first_rows(self, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A request placed from nothing with `tokens`: (pages needed, logical pages, ring slots)."""
        got = self._first.get(tokens)
        if got is None:
            tgt = -(-tokens // self.pt)
            need = np.where(self.rolling, np.minimum(tgt, self.maxb), tgt)
            got = self._first[tokens] = (need, tgt, need)
        return got

    def choose_partition(self, need: np.ndarray) -> int | None:
        """The least-loaded partition whose pools hold `need` (ties round-robin)."""
        ok = (need <= self.free).all(axis=1).tolist()
        load = self.load.tolist()
        best, best_load = None, None
        for i in range(self.partitions):
            p = (self.next_partition + i) % self.partitions
            if ok[p] and (best is None or load[p] < best_load):
                best, best_load = p, load[p]
        if best is not None:
            self.next_partition = (best + 1) % self.partitions
        return best

    # ---- prefix cache --------------------------------------------------------------------------
    def _alive(self, e: Entry, p: int) -> bool:
        return e.refs > 0 or bool((self.takes[p][self._full] < e.evict_at[self._full]).all())

    def lookup(self, hashes: list[int], max_hit_tokens: int) -> tuple[int, int | None]:
        """Longest aligned run of live blocks over partitions (ties to the lowest index)."""
        A = self.align
        if not self.prefix_caching or max_hit_tokens < A:
            return 0, None
        limit = min(max_hit_tokens // A, len(hashes))
        best, best_p = 0, None
        for p in range(self.partitions):
            idx = self.index[p]
            n = 0
            while n < limit:
                e = idx.get(hashes[n])
                if e is None:
                    break
                if not self._alive(e, p):
                    del idx[hashes[n]]
                    self.stats["evictions"] += int(self.block_pages.sum())
                    break
                n += 1
            if n * A > best:
                best, best_p = n * A, p
        return best, best_p

    def attach(self, hashes: list[int], hit: int, p: int, entries: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Reference the hit's blocks in `p`; returns the request's (L, S, own) rows.  The rolling
        tails the hit needs are counted as the request's own pages (taken from the pool)."""
        idx, free = self.index[p], self.free[p]
        for j in range(hit // self.align):
            e = idx[hashes[j]]
            if e.refs == 0:
                free -= self.block_pages
                e.evict_at = None
            e.refs += 1
            entries.append(e)
        L = hit // self.pt
        tail = np.where(self.rolling, np.minimum(self.tail, np.minimum(L, self.maxb)), 0)
        free -= tail
        self.takes[p] += tail
        S = np.where(self.rolling, tail, L)
        return L, S, tail

    def publish(self, hashes: list[int], start: int, end: int, p: int, entries: list) -> int:
        """Index prompt blocks start..end-1 of a request in `p` (after the step is confirmed);
        returns how many became entries (their pages leave the request's own count).  A block whose
        content is already indexed stays the request's own (upstream keeps the first copy)."""
        idx = self.index[p]
        moved = 0
        for j in range(start, end):
            h = hashes[j]
            e = idx.get(h)
            if e is not None and self._alive(e, p):
                continue
            e = idx[h] = Entry()
            entries.append(e)
            moved += 1
        return moved

    def release_entries(self, entries: list, p: int) -> None:
        free = self.free[p]
        for e in entries:
            e.refs -= 1
            if e.refs == 0:
                free += self.block_pages
                e.evict_at = self.takes[p] + free     # its FIFO position in each queue
        entries.clear()

    def used(self) -> np.ndarray:
        return self.cap[None, :] - self.free

    def live_entry_pages(self) -> np.ndarray:
        """Pages held by referenced entries, per partition and family (for invariant checks)."""
        out = np.zeros_like(self.free)
        for p, idx in enumerate(self.index):
            refs = sum(1 for e in idx.values() if e.refs > 0)   # a referenced entry is never replaced
            out[p] = refs * self.block_pages
        return out
