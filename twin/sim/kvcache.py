"""The grouped prefix-cache block manager (upstream `KvCacheManager`, grouped mode).

One pool per cache family per partition: partition-local block ids, a reference count and an
optional hash per block, a free queue in eviction order (freed blocks append at the tail,
allocation pops the head) and a `hash -> block` index.  Requests own one table per family;
rolling families are rings of `max_blocks_per_seq` slots whose write slot is detached when
shared and rotated through the free queue when solely owned (serving-contract.md §3).

A pool's pages (ref counts, hashes, free queue, hash index) live in a compiled `Pool`
(`twin/sim/_pages.c`), which moves a whole run of pages per call; this module decides which pages
move and in which order, and keeps the per-request tables.

Async block-table pins (§3.5) are kept implicit: a pin of a page the request still owns costs
nothing; only when the owner drops a pinned page (a wrap onto it, a detach, the request's
release) does the pin become a stored reference, released with the snapshot in the snapshot's
slot order, family by family, as upstream's explicit pin references are.  So `ref` of a block
plus its implicit pins always equals its owners plus the in-flight snapshots that hold it
(`effective_refs`), while pinning a 4,000-page table costs O(1) instead of O(pages).  Tables are immutable tuples, replaced on every change, so a pin
is the tuple of the current tables (no copy) and a ring rewrite can tell at once that a pin
taken since the last change holds every slot.  No SimPy here.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter

import numpy as np

from twin.abi.caches import page_alignment

try:
    from ._pages import Pool, release_runs
except ImportError as e:            # the package was copied or installed without its build step
    raise ImportError(f"twin.sim._pages is not built ({e}): run `pip install -e .` or `python setup.py "
                      "build_ext --inplace` in the checkout (needs a C compiler and the Python headers)") from None


class KVCacheCapacityError(RuntimeError):
    """A partition lacks free pages for an atomic growth; `need` and `free` name the first family
    (in family order) that is short."""

    def __init__(self, partition: int, need: dict[str, int], free: dict[str, int]):
        super().__init__(partition, need, free)
        self.partition, self.need, self.free = partition, need, free

    def __str__(self) -> str:             # worded only when shown: the scheduler catches most
        short = ", ".join(f"{k} need {self.need[k]}/free {self.free[k]}" for k in self.need
                          if self.need[k] > self.free[k])
        return f"partition {self.partition}: not enough KV pages ({short})"


@dataclass(frozen=True)
class FamilySpec:
    """What the block manager needs of a cache family (from `twin.abi.caches`)."""

    name: str
    page_tokens: int
    window: int | None
    max_blocks_per_seq: int
    blocks_per_partition: int

    @property
    def rolling(self) -> bool:
        return self.window is not None

    @property
    def tail_pages(self) -> int:
        return self.window // self.page_tokens if self.rolling else 0


def family_specs(dep, slots: int) -> tuple[FamilySpec, ...]:
    """The seven families at a deployment with `slots` capacity slots per partition."""
    from twin.abi.capacity import family_sizing

    return tuple(FamilySpec(n, s.family.page_tokens, s.family.window, s.max_blocks_per_seq,
                            slots * s.max_blocks_per_seq) for n, s in family_sizing(dep).items())


# ---- chained page hashes --------------------------------------------------------------------
_HASH_RNG = np.random.default_rng(0x5EED)
_MIX = _HASH_RNG.integers(1, 2**63, size=8192, dtype=np.uint64) | np.uint64(1)
_CHAIN = np.uint64(0x9E3779B97F4A7C15)


def page_hashes(tokens: np.ndarray, page: int) -> np.ndarray:
    """One hash per full page (uint64); page i's hash depends on the fixed root and pages 0..i (a
    chain), computed as a position-weighted polynomial so it vectorises (uint64 arithmetic wraps)."""
    n = len(tokens) // page
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    t = tokens[: n * page].astype(np.uint64).reshape(n, page)
    content = (t * _MIX[:page]).sum(axis=1, dtype=np.uint64) + np.uint64(page)
    weights = np.cumprod(np.full(n, _CHAIN, dtype=np.uint64), dtype=np.uint64)
    return np.cumsum(content * weights, dtype=np.uint64)


def chained_hashes(tokens: np.ndarray, page: int) -> list[int]:
    """`page_hashes` as Python ints."""
    return page_hashes(tokens, page).tolist()


class _Owned:
    """Per request: tables (tuples of block ids, None for empty rolling slots; replaced, never
    mutated, so pins share them), logical block counts reached, published page counts, the
    partition and in-flight snapshots."""

    __slots__ = ("partition", "tables", "logical", "cached", "pins", "holes", "published")

    def __init__(self, nfam: int):
        self.partition: int | None = None
        self.tables: list[tuple] = [()] * nfam
        self.logical = [0] * nfam
        self.cached = [0] * nfam
        self.pins: list[Pin] = []
        self.holes = False              # rolling None slots after a prefix attach
        self.published = False          # every prompt page published: nothing left to hash


class Pin:
    """An in-flight step's exact block tables (§3.5); `stored` lists (family, first slot, blocks)
    runs of consecutive slots whose refs became explicit because the owner dropped the pages while
    this pin held them."""

    __slots__ = ("tables", "partition", "stored")

    def __init__(self, tables: tuple[tuple[int, ...], ...], partition: int, stored: list | None = None):
        self.tables, self.partition = tables, partition
        self.stored = [] if stored is None else stored

    def __repr__(self) -> str:
        return f"Pin(partition={self.partition}, stored={sum(len(bs) for _, _, bs in self.stored)})"


_RUN_KEY = itemgetter(0, 1)          # a stored run's (family, first slot)


class PageLog:
    """The page ids that left (`taken`) and joined (`freed`) each free queue since the last `cut`,
    in the order the manager moved them, keyed by (family index, partition); a canonical family's
    moves are also its mirrored families' (`twins`, see `KvCacheManager`)."""

    __slots__ = ("taken", "freed", "twins")

    def __init__(self, twins: dict[int, tuple[int, ...]] | None = None):
        self.taken: dict[tuple[int, int], list[int]] = {}
        self.freed: dict[tuple[int, int], list[int]] = {}
        self.twins = twins or {}

    def take(self, f: int, p: int, blocks) -> None:
        if blocks:                      # a queue nothing left holds no entry
            self.taken.setdefault((f, p), []).extend(blocks)

    def free(self, f: int, p: int, blocks) -> None:
        if blocks:
            self.freed.setdefault((f, p), []).extend(blocks)

    def cut(self, names) -> dict:
        """What moved since the last cut, as {"taken"|"freed": {"family/partition": [ids]}}."""
        out = {}
        for k, d in (("taken", self.taken), ("freed", self.freed)):
            moved = dict(d)
            for (f, p), v in d.items():
                for g in self.twins.get(f, ()):
                    moved[(g, p)] = list(v)
            out[k] = {f"{names[f]}/{p}": v for (f, p), v in sorted(moved.items())}
        self.taken, self.freed = {}, {}
        return out


class _Index:
    """A pool's `hash -> page` index seen as a mapping (for checks and tests; the manager asks the
    pool directly)."""

    __slots__ = ("pool",)

    def __init__(self, pool: Pool):
        self.pool = pool

    def get(self, h, default=None):
        b = self.pool.owner(h)
        return default if b is None else b

    def __getitem__(self, h) -> int:
        b = self.pool.owner(h)
        if b is None:
            raise KeyError(h)
        return b

    def __delitem__(self, h) -> None:
        self.pool.unindex(h)

    def __len__(self) -> int:
        return self.pool.index_size()


class KvCacheManager:
    """`share_identical`: families whose specs differ only in name (FLASH: `cmp_c128`, `cmp_c4`
    and `idx`; `csa_state` and `csa_inner_state`) see the same calls with the same arguments, so
    their pools stay equal page for page; the manager keeps one pool for each such set and shows
    it under every name (tables, ref counts, free queues, statistics and page moves as if kept
    apart).  False keeps one pool per family (the plain form, for the equality test)."""

    _pin_fast = True        # False: every ring rewrite by the general rule (for the equality test)

    def __init__(self, families: tuple[FamilySpec, ...], partitions: int, *, prefix_caching: bool = True,
                 share_identical: bool = True):
        self.families = families
        self.names = tuple(f.name for f in families)
        self.partitions = partitions
        self.prefix_caching = prefix_caching
        self.alignment = page_alignment(families)
        self.page_sizes = sorted({f.page_tokens for f in families})
        nf = len(families)
        # canonical families (the first of each set of equal specs) and the ones that mirror them
        first: dict[tuple, int] = {}
        of = []
        for i, f in enumerate(families):
            key = (f.page_tokens, f.window, f.max_blocks_per_seq, f.blocks_per_partition) if share_identical else i
            of.append(first.setdefault(key, i))
        self._canon = [i for i in range(nf) if of[i] == i]
        self.twins = {i: tuple(j for j in range(nf) if of[j] == i and j != i) for i in self._canon}
        self._mult = [1 + len(self.twins.get(i, ())) for i in range(nf)]
        # `free[f][p]` is the pool itself (its length, iteration and `in` are the free queue's);
        # `ref[f][p]` reads its reference counts, `index[f][p]` its hash index
        self.free: list[list[Pool]] = [[Pool(f.blocks_per_partition, f"{f.name} p{p}") if of[i] == i else None
                                        for p in range(partitions)] for i, f in enumerate(families)]
        for i in range(nf):                 # a mirrored family shows its canonical family's pool
            self.free[i] = self.free[of[i]]
        self.ref = [[memoryview(pool) for pool in pools] for pools in self.free]
        self._pools = [[self.free[f][p] for f in range(nf)] for p in range(partitions)]     # by partition
        self.index = [[_Index(pool) for pool in pools] for pools in self.free]
        self.reqs: dict[str, _Owned] = {}
        self.orphans: set[Pin] = set()      # pins of released requests, held until their step settles
        self.load = [0] * partitions
        self._next_partition = 0
        self._nf = nf
        self._full = [i for i in self._canon if not families[i].rolling]
        self._roll = [i for i in self._canon if families[i].rolling]
        self._full_pt = [(i, families[i].page_tokens) for i in self._full]
        self._canon_pt = [(i, families[i].page_tokens) for i in self._canon]
        self._page_tokens = [f.page_tokens for f in families]
        self._maxb = [f.max_blocks_per_seq for f in families]
        self._rolling = [f.rolling for f in families]
        self._detaches = self._rotations = 0
        self.log: PageLog | None = None     # page ids moved, for the decision log (off: no cost)

    @classmethod
    def from_deployment(cls, dep, slots: int) -> "KvCacheManager":
        return cls(family_specs(dep, slots), dep.partitions, prefix_caching=dep.limits.enable_prefix_caching)

    @property
    def stats(self) -> dict[str, int]:
        """Evictions (taken pages whose cached content went), detaches (ring slots rewritten off a
        shared or pinned page) and rotations (off a solely owned page), summed over every family."""
        ev = sum(pool.evictions * self._mult[f] for f in self._canon for pool in self.free[f])
        return {"evictions": ev, "detaches": self._detaches, "rotations": self._rotations}

    # ---- hashing ------------------------------------------------------------------------
    def prompt_hashes(self, prompt: np.ndarray) -> dict[int, np.ndarray]:
        """Per page size, the prompt's chained page hashes (uint64 arrays, as the pools read them)."""
        return {p: page_hashes(prompt, p) for p in self.page_sizes}

    # ---- queries ------------------------------------------------------------------------
    def num_free(self, f: int, p: int) -> int:
        return len(self.free[f][p])

    def table(self, rid: str, family: str) -> list:
        return self.reqs[rid].tables[self.names.index(family)]

    def partition_of(self, rid: str) -> int | None:
        o = self.reqs.get(rid)
        return o.partition if o else None

    # ---- page primitives ----------------------------------------------------------------
    def _take(self, f: int, p: int) -> int:
        return self._take_n(f, p, 1)[0]

    def _take_n(self, f: int, p: int, n: int) -> tuple[int, ...]:
        """Pop `n` pages from the free-queue head, in order: each gets one owner, and taking a page
        evicts its cached content (its hash and index entry go)."""
        out = self.free[f][p].take(n)
        if self.log is not None:
            self.log.take(f, p, out)
        return out

    def _decref_all(self, f: int, p: int, blocks) -> None:
        """One reference fewer on each block (None: no page); a page left unreferenced joins the
        free queue's tail with its hash kept."""
        log = self.log
        freed = self.free[f][p].release(blocks, log is not None)
        if freed:
            log.free(f, p, freed)

    # ---- growth (`ensure_group_blocks`) ------------------------------------------------------
    def _work(self, o: _Owned, tokens: int) -> list[int]:
        """Families whose tables must change to cover `tokens` (most decode steps touch few)."""
        if o.holes:
            return list(self._canon)
        lg = o.logical
        return [f for f, pt in self._canon_pt if -(-tokens // pt) > lg[f]]

    def _need(self, o: _Owned, f: int, tokens: int) -> int:
        fam = self.families[f]
        target = -(-tokens // fam.page_tokens)
        t = o.tables[f]
        if not fam.rolling:
            if target > fam.max_blocks_per_seq:
                raise ValueError(f"Full-history KV cache table capacity exceeded: {fam.name} needs {target} "
                                 f"> max_blocks_per_seq {fam.max_blocks_per_seq}")
            return max(0, target - len(t))
        maxb = fam.max_blocks_per_seq
        size = min(target, maxb)
        need = max(0, size - len(t))
        if o.holes:
            need += sum(1 for x in t[:size] if x is None)
        if target > maxb and target > o.logical[f] and o.partition is not None:
            # each ring slot rewritten once (a page taken in this call is solely owned: rotation,
            # no extra page); a shared or pinned page it overwrites needs a fresh one
            lo = max(o.logical[f], maxb)
            s0 = lo % maxb
            L = len(t)
            m = min(target - lo, maxb)
            pts = [pin.tables[f] for pin in o.pins]
            if any(pt is t for pt in pts):          # a pin shares the tuple: it holds every slot
                if None not in t:                   # the slots s0.. (mod maxb) that the table has
                    if s0 + m <= maxb:
                        return need + max(0, min(s0 + m, L) - s0)
                    return need + max(0, L - s0) + min(s0 + m - maxb, L)
                return need + sum(1 for i in range(m) if (s0 + i) % maxb < L and t[(s0 + i) % maxb] is not None)
            need += self.free[f][o.partition].fresh(t, s0, m, maxb, pts)
        return need

    def _fits(self, o: _Owned, p: int, tokens: int, work: list[int]) -> tuple[bool, dict, dict]:
        pt, maxb, rolling = self._page_tokens, self._maxb, self._rolling
        logical, tables, holes = o.logical, o.tables, o.holes
        free = self.free
        for f in work:
            # cheap upper bound first: each new logical page needs at most one free page
            target = -(-tokens // pt[f])
            bound = target - logical[f] + (len(tables[f]) if holes else 0)
            if free[f][p].n < bound:
                need = self._need(o, f, tokens)
                if need > free[f][p].n:
                    # the first short family is the answer (the scheduler only needs "no"; a full
                    # per-family account would cost as much as the check itself)
                    return False, {self.names[f]: need}, {self.names[f]: free[f][p].n}
            if not rolling[f] and target > maxb[f]:
                self._need(o, f, tokens)            # raises past the full-history table capacity
        return True, {}, {}

    def ensure(self, rid: str, tokens: int, partition: int | None = None) -> int:
        """Grow `rid`'s tables to cover `tokens` source tokens, atomically; a new request goes to
        the least-loaded partition that can hold it (ties round-robin).  Returns the partition."""
        o = self.reqs.get(rid)
        if o is not None and o.partition is not None and not o.holes:
            # the decode steady state: a placed request, most steps touching only the rolling rings;
            # the cheap bound (one free page per new logical page) settles the fit almost always
            p = o.partition
            lg, free, maxb, rolling = o.logical, self.free, self._maxb, self._rolling
            work = []
            slow = False
            for f, pt in self._canon_pt:
                target = -(-tokens // pt)
                if target > lg[f]:
                    work.append(f)
                    if free[f][p].n < target - lg[f] or (target > maxb[f] and not rolling[f]):
                        slow = True
            if not work:
                return p
            if slow:
                ok, need, nfree = self._fits(o, p, tokens, work)
                if not ok:
                    raise KVCacheCapacityError(p, need, nfree)
            tables = o.tables
            for f in work:
                t = tables[f]
                m = maxb[f]
                if rolling[f] and len(t) == m:        # a full ring: only the rewrite (no fill)
                    target = -(-tokens // self._page_tokens[f])
                    tables[f] = t = self._wrap(o, f, p, t, lg[f] if lg[f] > m else m, target, m)
                    for g in self.twins[f]:
                        tables[g] = t
                    lg[f] = target
                else:
                    self._grow(o, f, tokens)
            return p
        new = o is None
        if new:
            o = _Owned(self._nf)
        work = self._work(o, tokens)
        if o.partition is None and partition is None:
            p = self._choose_partition(o, tokens, work)
        else:
            p = o.partition if o.partition is not None else partition
            ok, need, free = self._fits(o, p, tokens, work)
            if not ok:
                raise KVCacheCapacityError(p, need, free)
        if new:
            self.reqs[rid] = o
        if o.partition is None:
            o.partition = p
            self.load[p] += 1
        for f in work:
            self._grow(o, f, tokens)
        o.holes = False
        return p

    def _choose_partition(self, o: _Owned, tokens: int, work: list[int]) -> int:
        """`_fits` in each partition, round-robin from the last choice, for a request that holds
        nothing yet: its need in a family (`_need`) is then the same in every partition, so it is
        computed once and only the free counts differ."""
        needs = []
        for f in work:
            if not self._rolling[f] and -(-tokens // self._page_tokens[f]) > self._maxb[f]:
                needs.append((f, None))     # past the table capacity: `_need` raises where reached
            else:
                needs.append((f, self._need(o, f, tokens)))
        free, load = self.free, self.load
        best, best_load, last = None, None, None
        for i in range(self.partitions):
            p = (self._next_partition + i) % self.partitions
            for f, need in needs:
                if need is None:
                    self._need(o, f, tokens)
                n = free[f][p].n
                if n < need:
                    last = last or (p, {self.names[f]: need}, {self.names[f]: n})
                    break
            else:
                if best is None or load[p] < best_load:
                    best, best_load = p, load[p]
        if best is None:
            raise KVCacheCapacityError(*last)
        self._next_partition = (best + 1) % self.partitions
        return best

    def _grow(self, o: _Owned, f: int, tokens: int) -> None:
        p = o.partition
        t = o.tables[f]
        target = -(-tokens // self._page_tokens[f])
        lg = o.logical
        if not self._rolling[f]:
            if len(t) < target:
                o.tables[f] = t = t + self._take_n(f, p, target - len(t))
                for g in self.twins[f]:
                    o.tables[g] = t
            if target > lg[f]:
                lg[f] = target
            return
        maxb = self._maxb[f]
        size = target if target < maxb else maxb
        if o.holes and None in t[:size]:
            t = list(t)
            for s in range(min(size, len(t))):
                if t[s] is None:
                    t[s] = self._take(f, p)
            t = tuple(t)
        if len(t) < size:
            t = t + self._take_n(f, p, size - len(t))
        if target > lg[f]:
            if target > maxb:
                t = self._wrap(o, f, p, t, max(lg[f], maxb), target, maxb)
            lg[f] = target
        o.tables[f] = t
        for g in self.twins[f]:
            o.tables[g] = t

    def _wrap(self, o: _Owned, f: int, p: int, t: tuple, start: int, target: int, maxb: int) -> tuple:
        """Rewrite ring slots for logical pages start..target-1 and return the new table: detach
        a shared or pinned page (no copy: the slot is overwritten), rotate a solely owned one
        through the free queue.  A slot is rewritten once per call (a page taken here is solely
        owned and unpinned)."""
        free = self.free[f][p]
        n = target - start
        if n > maxb:
            n = maxb
        s0 = start % maxb
        end = s0 + n
        pins = o.pins
        if len(pins) == 1 and free.n >= n and self._pin_fast:
            # the async steady state (the one in-flight step pins every rewritten slot): every
            # page moves from the owner to the pin, ref counts unchanged, all detaches
            pt = pins[0].tables[f]
            if end <= maxb:
                if pt is t or (end <= len(pt) and pt[s0:end] == t[s0:end]):
                    pins[0].stored.append((f, s0, t[s0:end]))
                    new = self._take_n(f, p, n)         # logs the taken pages
                    self._detaches += n * self._mult[f]
                    return t[:s0] + new + t[end:]
            else:
                e = end - maxb                          # the rewrite runs past the ring's end
                if pt is t or (len(pt) == maxb and pt[s0:] == t[s0:] and pt[:e] == t[:e]):
                    pins[0].stored += ((f, s0, t[s0:]), (f, 0, t[:e]))
                    new = self._take_n(f, p, n)
                    self._detaches += n * self._mult[f]
                    k = maxb - s0
                    return new[k:] + t[e:s0] + new[:k]
        slots = range(s0, end) if end <= maxb else [*range(s0, maxb), *range(end - maxb)]
        old = t[s0:end] if end <= maxb else t[s0:] + t[:end - maxb]
        # per page, how many in-flight pins hold it; a pin taken since the table last changed
        # shares the tuple itself and so holds every slot
        held = None
        for pin in pins:
            pt, stored = pin.tables[f], pin.stored
            if pt is not t:
                lp = len(pt)
                hit = [s < lp and pt[s] == b for s, b in zip(slots, old)]
            if pt is t or all(hit):
                # the pin holds every rewritten slot: one stored run per contiguous stretch
                hit = [True] * n
                if end <= maxb:
                    stored.append((f, s0, old))
                else:
                    stored.append((f, s0, t[s0:]))
                    stored.append((f, 0, t[:end - maxb]))
            else:
                stored.extend((f, s, (b,)) for s, b, h in zip(slots, old, hit) if h)
            held = hit if held is None else [x + y for x, y in zip(held, hit)]
        # a new page per slot from the queue head; each old page loses the owner's reference and
        # gains its pins' (`held`); the pool pops first unless the queue may run dry, when a page
        # freed by this rewrite is taken again, in order
        log = self.log
        new, freed, detaches = free.rewrite(old, held, log is not None)
        if log is not None:
            log.take(f, p, new)
            log.free(f, p, freed)
        m = self._mult[f]
        self._detaches += detaches * m
        self._rotations += (n - detaches) * m
        if end <= maxb:
            return t[:s0] + new + t[end:]
        k = maxb - s0
        return new[k:] + t[end - maxb:s0] + new[:k]

    # ---- prefix lookup and attach (`acquire_group_prefix_blocks`) -------------------------
    def lookup(self, hashes: dict[int, np.ndarray], max_hit_tokens: int) -> tuple[int, int | None]:
        """Longest aligned hit over all partitions (ties to the lowest index), as (tokens, partition):
        in each partition the full-history families' leading cached pages bound the hit, which then
        steps down by the alignment until every rolling family holds the tail before it."""
        if not self.prefix_caching or max_hit_tokens < self.alignment:
            return 0, None
        best, best_p = 0, None
        A = self.alignment
        free = self.free
        for p in range(self.partitions):
            cand = max_hit_tokens // A * A
            for f, pt in self._full_pt:
                hits = free[f][p].hits(hashes[pt], cand // pt)
                cand = min(cand, hits * pt) // A * A
            while cand > best:
                if self._rolling_valid(p, hashes, cand):
                    break
                cand -= A
            if cand > best:
                best, best_p = cand, p
        return best, best_p

    def _rolling_valid(self, p: int, hashes, end: int) -> bool:
        for f in self._roll:
            fam = self.families[f]
            eb = end // fam.page_tokens
            if not self.free[f][p].cached(hashes[fam.page_tokens], max(0, eb - fam.tail_pages), eb):
                return False
        return True

    def attach(self, rid: str, hashes, hit: int, partition: int) -> None:
        """Take references on the hit's pages in `partition` and pin the request there (a rolling
        family gets only the window's tail, in its ring slots)."""
        if rid in self.reqs:
            raise ValueError(f"request {rid!r} already owns blocks")
        o = self.reqs[rid] = _Owned(self._nf)
        o.partition = partition
        self.load[partition] += 1
        log = self.log
        for f in self._canon:
            fam = self.families[f]
            hs = hashes[fam.page_tokens]
            eb = hit // fam.page_tokens
            pool = self.free[f][partition]
            if fam.rolling:
                size = min(eb, fam.max_blocks_per_seq)
                lo = max(0, eb - fam.tail_pages)
                t: list = [None] * size
                for i, b in zip(range(lo, eb), pool.owners(hs, lo, eb)):
                    t[i % size] = b
                t = tuple(t)
            else:
                t = pool.owners(hs, 0, eb)
            pulled = pool.hold(t, log is not None)        # an unreferenced hit leaves the free queue
            if pulled:
                log.take(f, partition, pulled)
            o.tables[f] = t
            for g in self.twins[f]:
                o.tables[g] = t
            o.holes |= None in t
            o.logical[f] = eb
            o.cached[f] = eb

    # ---- pins and publication ---------------------------------------------------------------
    def pin(self, rid: str) -> Pin:
        """`retain_group_block_snapshot`: the exact tables a step was scheduled with."""
        o = self.reqs[rid]
        pin = Pin(tuple(o.tables), o.partition)
        o.pins.append(pin)
        return pin

    def unpin(self, rid: str, pin: Pin) -> None:
        """The step that took `pin` was applied or discarded: its references go."""
        o = self.reqs.get(rid)
        if o is not None and pin in o.pins:
            o.pins.remove(pin)
        else:
            self.orphans.discard(pin)
        self._release_stored(pin)

    def _release_stored(self, pin: Pin) -> None:
        """`release_group_block_snapshot`: family by family, in the snapshot's slot order (a page
        the owner still holds cannot reach zero here, so only the stored ones matter)."""
        st = pin.stored
        if not st:
            return
        if len(st) > 1:
            st.sort(key=_RUN_KEY)
        log = self.log
        freed = release_runs(self._pools[pin.partition], st, log is not None)
        if freed:
            for f, bs in freed:
                log.free(f, pin.partition, bs)
        st.clear()

    def _store_pin(self, pin: Pin, owner: list | None = None) -> set:
        """The owner drops every page: each page the pin still holds implicitly becomes a stored
        reference, so it stays in use until the in-flight step settles (upstream's snapshot ref).
        `owner`: the tables of an owner this pin is the only pin of; a family whose table the pin
        shares takes the owner's references over (no page can reach zero in that family: a +1 then
        a -1 on each), and the families taken over are returned for the owner to skip."""
        p = pin.partition
        moved = set()
        stored = pin.stored
        held: dict[int, list] = {}
        for f, s0, bs in stored:
            held.setdefault(f, []).append((s0, s0 + len(bs)))
        for f in self._canon:
            t = pin.tables[f]
            if not t:
                continue
            h = held.get(f)
            if owner is not None and owner[f] is t and h is None:
                stored.append((f, 0, t))
                moved.add(f)
                continue
            pool = self.free[f][p]
            if h is None:
                stored.append((f, 0, t))
                pool.hold(t, False)
                continue
            # the slots the pin does not store yet: the gaps between its stored runs, split at
            # empty slots (a run's pages release in slot order, as single slots would: runs are
            # disjoint and sorted by slot)
            a = 0
            for lo, hi in sorted(h) + [(len(t), len(t))]:
                while a < lo:
                    try:
                        e = t.index(None, a, lo)
                    except ValueError:
                        e = lo
                    if e > a:
                        run = t[a:e]
                        pool.hold(run, False)
                        stored.append((f, a, run))
                    a = e + 1
                a = max(a, hi)
        return moved

    def publish(self, rid: str, pin: Pin, confirmed: int, hashes) -> None:
        """`cache_group_blocks_from_snapshot`: after a confirmed step, hash the completed prompt
        pages through the pinned tables (never the live ones): a page caches a hash nobody holds,
        a page duplicating a cached one loses its hash (the index keeps the first)."""
        o = self.reqs.get(rid)
        if o is None or o.published or not self.prefix_caching or hashes is None:
            return
        p = pin.partition
        complete = True
        rolling = self._rolling
        free = self.free
        for f, pt in self._canon_pt:
            hs = hashes[pt]
            done = min(confirmed // pt, len(hs))
            t = pin.tables[f]
            start = o.cached[f]
            if rolling[f]:
                start = max(start, done - len(t))
            complete &= done >= len(hs)
            if done <= start:
                continue
            if rolling[f]:                      # logical pages start..done-1 at ring slots i % L
                L = len(t)
                free[f][p].publish(t, start % L, done - start, L, hs, start)
            elif len(t) > start:
                free[f][p].publish(t, start, min(done, len(t)) - start, 0, hs, start)
            o.cached[f] = max(o.cached[f], done)
        o.published = complete

    # ---- release -----------------------------------------------------------------------------
    def release(self, rid: str) -> None:
        """`release_all_group_requests`: the owner's pages in table order, family by family; pages
        an in-flight step still pins stay in use until that step is applied or discarded (`unpin`).
        Freed pages keep their hashes at the free-queue tail."""
        o = self.reqs.pop(rid, None)
        if o is None:
            return
        tables = o.tables
        moved = ()
        for pin in o.pins:
            moved = self._store_pin(pin, tables if len(o.pins) == 1 else None)
            self.orphans.add(pin)
        o.pins = []
        p = o.partition
        for f in self._canon:
            if tables[f] and f not in moved:
                self._decref_all(f, p, tables[f])
        if p is not None:
            self.load[p] -= 1

    # ---- checking ----------------------------------------------------------------------------
    def effective_refs(self) -> list[list[dict[int, int]]]:
        """Owners plus in-flight pins, recomputed from scratch (for invariant checks)."""
        out = [[dict() for _ in range(self.partitions)] for _ in self.families]
        for o in self.reqs.values():
            for f in self._canon:
                t = o.tables[f]
                d = out[f][o.partition]
                for b in t:
                    if b is not None:
                        d[b] = d.get(b, 0) + 1
                for pin in o.pins:
                    seen = set()
                    for b in pin.tables[f]:
                        if b is not None and b not in seen:
                            seen.add(b)
                            d[b] = d.get(b, 0) + 1
        for pin in self.orphans:
            for f, _, bs in pin.stored:
                d = out[f][pin.partition]
                for b in bs:
                    d[b] = d.get(b, 0) + 1
        return self._mirrored(out)

    def _mirrored(self, out: list) -> list:
        for f, twins in self.twins.items():
            for g in twins:
                out[g] = out[f]
        return out

    def implicit_pins(self) -> list[list[dict[int, int]]]:
        out = [[dict() for _ in range(self.partitions)] for _ in self.families]
        for o in self.reqs.values():
            for pin in o.pins:
                stored = {}
                for f, _, bs in pin.stored:
                    for b in bs:
                        stored[(f, b)] = stored.get((f, b), 0) + 1
                for f in self._canon:
                    d = out[f][o.partition]
                    for b in set(pin.tables[f]):
                        if b is None:
                            continue
                        if stored.get((f, b), 0):
                            stored[(f, b)] -= 1
                            continue
                        d[b] = d.get(b, 0) + 1
        return self._mirrored(out)

    def check(self) -> None:
        """Assert the pool invariants: no leaks, ref counts equal live references, no block twice
        in one request's row, free queue = zero-ref pages, every cached page is its hash's index entry."""
        eff = self.effective_refs()
        imp = self.implicit_pins()
        for f, fam in enumerate(self.families):
            for p in range(self.partitions):
                r = self.ref[f][p]
                for b in range(fam.blocks_per_partition):
                    want = eff[f][p].get(b, 0)
                    got = r[b] + imp[f][p].get(b, 0)
                    assert got == want, f"{fam.name} p{p} block {b}: ref {r[b]}+{imp[f][p].get(b, 0)} != live {want}"
                    assert (b in self.free[f][p]) == (r[b] == 0), f"{fam.name} p{p} block {b}: free queue vs ref {r[b]}"
                hashed = 0
                for b, h in enumerate(self.free[f][p].hashes()):
                    assert h is None or self.index[f][p].get(h) == b, f"{fam.name} p{p}: block {b}'s hash not indexed to it"
                    hashed += h is not None
                assert len(self.index[f][p]) == hashed, f"{fam.name} p{p}: an index entry without its page"
        for rid, o in self.reqs.items():
            for f, twins in self.twins.items():
                assert all(o.tables[g] == o.tables[f] for g in twins), f"{rid}: a mirrored table drifted"
            for f, t in enumerate(o.tables):
                ids = [b for b in t if b is not None]
                assert len(ids) == len(set(ids)), f"{rid}: block shared within its {self.names[f]} row"
                fam = self.families[f]
                assert len(t) <= fam.max_blocks_per_seq, f"{rid}: {fam.name} table over max_blocks_per_seq"
        assert sum(self.load) == len(self.reqs) and all(x >= 0 for x in self.load)

    def used_pages(self, p: int) -> dict[str, int]:
        return {n: f.blocks_per_partition - len(self.free[i][p]) for i, (n, f) in enumerate(zip(self.names, self.families))}

    def __repr__(self) -> str:
        return f"KvCacheManager({self.partitions} partitions, {dict(zip(self.names, (f.blocks_per_partition for f in self.families)))})"

