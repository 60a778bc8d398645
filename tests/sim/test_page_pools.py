"""The compiled page pool (`twin/sim/_pages.c`) against the rules it implements, stated here plainly.

A `Model` keeps one pool as Python lists and a dict: reference counts, each page's hash, the free
queue in eviction order (freed at the tail, taken from the head, a hit pulled out from anywhere)
and the `hash -> page` index holding exactly the pages that cache a hash.  Random runs of every
pool operation (small pools and few distinct hashes, so duplicates, evictions, dry ring rewrites
and index probe collisions all happen) must leave both in the same state, operation by operation,
with the same answers.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twin.sim._pages import Pool, release_runs


class Model:
    def __init__(self, size: int):
        self.ref = [0] * size
        self.hash: list = [None] * size
        self.free = list(range(size))
        self.index: dict[int, int] = {}
        self.evictions = 0

    def _clear(self, b):
        h = self.hash[b]
        if h is not None:
            self.hash[b] = None
            if self.index.get(h) == b:
                del self.index[h]

    def _take1(self):
        b = self.free.pop(0)
        self.ref[b] = 1
        if self.hash[b] is not None:
            self._clear(b)
            self.evictions += 1
        return b

    def take(self, n):
        return tuple(self._take1() for _ in range(n))

    def release(self, pages):
        freed = []
        for b in pages:
            if b is None:
                continue
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)
                freed.append(b)
        return freed

    def hold(self, pages):
        pulled = []
        for b in pages:
            if b is None:
                continue
            if self.ref[b] == 0:
                self.free.remove(b)
                pulled.append(b)
            self.ref[b] += 1
        return pulled

    def rewrite(self, old, held):
        n = len(old)
        short = len(self.free) < n
        new = [] if short else [self._take1() for _ in range(n)]
        freed, detaches = [], 0
        for b, k in zip(old, held):
            r = self.ref[b]
            detaches += r > 1 or k > 0
            self.ref[b] = r + k - 1
            if self.ref[b] == 0:
                self.free.append(b)
                freed.append(b)
            if short:
                new.append(self._take1())
        return tuple(new), freed, detaches

    def runs_dry(self, old, held):
        avail = len(self.free)
        if avail >= len(old):
            return False
        for b, k in zip(old, held):
            avail += self.ref[b] + k - 1 == 0
            if avail == 0:
                return True
            avail -= 1
        return False

    def publish(self, table, a, n, ring, hashes, h0):
        for i in range(n):
            s = (a + i) % ring if ring else a + i
            b, h = table[s], int(hashes[h0 + i])
            if b is None:
                continue
            owner = self.index.get(h)
            if owner is None:
                self._clear(b)
                self.hash[b] = h
                self.index[h] = b
            elif owner != b:
                self._clear(b)

    def fresh(self, table, s0, m, ring, pinned):
        need = 0
        for i in range(m):
            s = (s0 + i) % ring
            if s >= len(table) or table[s] is None:
                continue
            b = table[s]
            need += self.ref[b] > 1 or any(s < len(pt) and pt[s] == b for pt in pinned)
        return need

    def hits(self, hashes, limit):
        i = 0
        while i < min(limit, len(hashes)) and int(hashes[i]) in self.index:
            i += 1
        return i


def same(pool: Pool, m: Model):
    assert list(pool) == m.free and len(pool) == pool.n == len(m.free)
    assert list(memoryview(pool)) == m.ref
    assert pool.hashes() == m.hash
    assert pool.index_size() == len(m.index)
    assert all(pool.owner(h) == b for h, b in m.index.items())
    assert pool.evictions == m.evictions
    assert all((b in pool) == (m.ref[b] == 0) for b in range(len(m.ref)))


@given(st.integers(1, 24), st.data())
@settings(max_examples=80, deadline=None)
def test_pool_moves_pages_as_the_rules_say(size, data):
    pool, m = Pool(size, "fam p0"), Model(size)
    # a few distinct 64-bit hashes, so pages share content and the index sees collisions
    universe = np.array(data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=12, unique=True)),
                        dtype=np.uint64)
    for _ in range(data.draw(st.integers(1, 40))):
        owned = [b for b in range(size) if m.ref[b] > 0]
        op = data.draw(st.sampled_from(["take", "release", "hold", "rewrite", "publish", "fresh", "query"]))
        if op == "take":
            n = data.draw(st.integers(0, len(m.free)))
            assert pool.take(n) == m.take(n)
        elif op == "release" and owned:
            pages = data.draw(st.lists(st.sampled_from(owned), unique=True, max_size=len(owned)))
            pages = pages + [None] if data.draw(st.booleans()) else pages
            want = data.draw(st.booleans())
            got = pool.release(tuple(pages), want)
            exp = m.release(pages)
            assert got == (exp if want else None)
        elif op == "hold":
            pages = data.draw(st.lists(st.integers(0, size - 1), unique=True, max_size=size))
            assert pool.hold(tuple(pages), True) == m.hold(pages)
        elif op == "rewrite" and owned:
            old = tuple(data.draw(st.lists(st.sampled_from(owned), unique=True, min_size=1, max_size=len(owned))))
            held = tuple(data.draw(st.lists(st.integers(0, 2), min_size=len(old), max_size=len(old))))
            if m.runs_dry(old, held):
                continue                    # the manager checks the fit first: a rewrite never runs dry
            none_held = data.draw(st.booleans()) and not any(held)
            new, freed, det = pool.rewrite(old, None if none_held else held, True)
            assert (new, freed, det) == m.rewrite(old, held)
        elif op == "publish" and owned:
            table = tuple(data.draw(st.lists(st.sampled_from(owned + [None]), min_size=1, max_size=len(owned) + 1)))
            table = tuple(b for i, b in enumerate(table) if b is None or b not in table[:i])   # a page once per table
            ring = data.draw(st.sampled_from([0, len(table)]))
            a = data.draw(st.integers(0, len(table) - 1))
            n = data.draw(st.integers(0, len(table) if ring else len(table) - a))
            hs = universe[data.draw(st.lists(st.integers(0, len(universe) - 1), min_size=n, max_size=n + 3))]
            h0 = data.draw(st.integers(0, len(hs) - n))
            pool.publish(table, a, n, ring, hs, h0)
            m.publish(table, a, n, ring, hs, h0)
        elif op == "fresh" and owned:
            slots = st.sampled_from(owned + [None])
            table = tuple(data.draw(st.lists(slots, min_size=1, max_size=8)))
            pinned = [tuple(data.draw(st.lists(slots, max_size=8))) for _ in range(data.draw(st.integers(0, 2)))]
            ring = data.draw(st.integers(len(table), len(table) + 2))
            s0, k = data.draw(st.integers(0, ring - 1)), data.draw(st.integers(0, ring))
            assert pool.fresh(table, s0, k, ring, pinned) == m.fresh(table, s0, k, ring, pinned)
        elif op == "query":
            hs = universe[data.draw(st.lists(st.integers(0, len(universe) - 1), max_size=6))]
            limit = data.draw(st.integers(0, 8))
            assert pool.hits(hs, limit) == m.hits(hs, limit)
            every = all(int(h) in m.index for h in hs)
            assert pool.cached(hs, 0, len(hs)) == every
            if every:
                assert pool.owners(hs, 0, len(hs)) == tuple(m.index[int(h)] for h in hs)
            else:
                with pytest.raises(KeyError, match="fam p0: no cached page"):
                    pool.owners(hs, 0, len(hs))
        same(pool, m)


def test_snapshot_runs_release_family_by_family_in_order():
    pools = [Pool(4, "a p0"), Pool(4, "b p0")]
    pools[0].take(3)
    pools[1].take(2)
    pools[0].hold((0, 2), False)                 # pages 0 and 2 of family 0 have two holders
    runs = [(0, 0, (0, 1)), (0, 2, (2,)), (1, 0, (1, 0))]
    assert release_runs(pools, runs, True) == [(0, [1]), (1, [1, 0])]
    assert list(pools[0]) == [3, 1] and list(pools[1]) == [2, 3, 1, 0]
    assert release_runs(pools, [(0, 0, (0, 2))], False) is None
    assert list(pools[0]) == [3, 1, 0, 2]
    with pytest.raises(AssertionError, match="a p0 block 0: negative ref count"):
        release_runs(pools, [(0, 0, (0,))], False)


def test_bad_arguments_are_named():
    pool = Pool(4, "ori p1")
    with pytest.raises(TypeError, match="uint64 array"):
        pool.hits([1, 2], 2)                     # prompt hashes come as uint64 arrays
    with pytest.raises(RuntimeError, match="ori p1: take 5 pages of 4 free"):
        pool.take(5)
    with pytest.raises(IndexError, match="ori p1: page 9 outside the pool of 4"):
        pool.release((9,), False)
    refs = memoryview(pool)                     # the reference counts, read-only
    assert refs.readonly and refs.format == "i" and refs.tolist() == [0, 0, 0, 0]
    with pytest.raises(TypeError):
        refs[0] = 1
    with pytest.raises(TypeError, match="size"):
        Pool.__new__(Pool)                      # no pool exists without its arrays


def test_a_refused_rewrite_leaves_the_pool_as_it_was():
    """A ring rewrite checks every slot and held count before it moves a page: a bad one is refused
    by name with the free queue and the reference counts unchanged."""
    pool = Pool(8, "csa_state p0")
    ring = pool.take(3)
    before = (list(pool), memoryview(pool).tolist())
    for old, held, match in [((ring[0], None, ring[2]), None, "empty slot"),
                             ((ring[0], 99, ring[2]), None, "page 99 outside"),
                             (ring, (0, -1, 0), "held count -1")]:
        with pytest.raises((ValueError, IndexError), match=match):
            pool.rewrite(old, held, True)
        assert (list(pool), memoryview(pool).tolist()) == before
    assert pool.rewrite(ring, None, True)[1] == list(ring)      # the same call with good slots moves


@pytest.mark.parametrize("seed", [0, 1])
def test_the_index_survives_churn(seed):
    """Thousands of publications and evictions over a full pool (every probe-run shape, including
    runs that wrap the index table's end) leave the index equal to the pages' hashes."""
    rng = np.random.default_rng(seed)
    size = 16
    pool, m = Pool(size, "fam p0"), Model(size)
    universe = rng.integers(0, 2**64, size=400, dtype=np.uint64)
    for _ in range(1500):
        k = int(rng.integers(1, size + 1))
        table = pool.take(k)
        assert table == m.take(k)
        hs = universe[rng.integers(0, len(universe), size=k)]
        pool.publish(table, 0, k, 0, hs, 0)
        m.publish(table, 0, k, 0, hs, 0)
        order = tuple(rng.permutation(table).tolist())
        assert pool.release(order, True) == m.release(order)
        assert pool.index_size() == len(m.index)
        assert all(pool.owner(h) == m.index.get(int(h)) for h in universe)
    same(pool, m)
