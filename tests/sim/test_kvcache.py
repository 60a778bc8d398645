"""The grouped prefix-cache block manager against serving-contract.md §3."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simtest import make_dep
from twin.abi.caches import FAMILY_NAMES
from twin.sim.kvcache import KVCacheCapacityError, KvCacheManager, chained_hashes

DEP = make_dep()
ORI = FAMILY_NAMES.index("ori")


def kv(slots=2, dep=DEP):
    return KvCacheManager.from_deployment(dep, slots)


def prefill_and_publish(m, rid, prompt, chunk=128, partition=None):
    """Prefill `prompt` chunk by chunk, publishing each confirmed chunk through its pin."""
    hashes = m.prompt_hashes(prompt)
    done = 0
    while done < len(prompt):
        n = min(chunk, len(prompt) - done)
        m.ensure(rid, done + n, partition)
        pin = m.pin(rid)
        done += n
        m.publish(rid, pin, done, hashes)
        m.unpin(rid, pin)
    return hashes


@given(st.lists(st.integers(0, 1000), min_size=0, max_size=300), st.integers(0, 299), st.sampled_from([2, 8, 32, 128]))
@settings(max_examples=60)
def test_chained_hashes_depend_on_the_whole_prefix(tokens, k, page):
    a = np.array(tokens, dtype=np.int32)
    h = chained_hashes(a, page)
    assert len(h) == len(a) // page
    if k < len(a):
        b = a.copy()
        b[k] += 1
        hb = chained_hashes(b, page)
        first_changed = k // page
        assert h[:first_changed] == hb[:first_changed]          # pages before the edit are shared
        assert all(x != y for x, y in zip(h[first_changed:], hb[first_changed:]))


def test_page_alignment_is_128():
    assert kv().alignment == 128


def test_new_requests_go_to_the_least_loaded_partition_round_robin():
    m = kv(slots=4)
    parts = [m.ensure(f"r{i}", 100) for i in range(6)]
    assert parts[:4] == [0, 1, 2, 3]           # all equal: round-robin from the pointer
    assert sorted(parts[4:]) == [0, 1]
    assert parts[4:] == [0, 1]
    m.release("r0")
    m.release("r4")                            # partition 0 now has the fewest live requests
    assert m.ensure("x", 100) == 0
    assert m.ensure("y", 100) == 2             # ties (2 and 3 hold one each) go round-robin


def test_growth_is_atomic_and_names_the_short_family():
    m = kv(slots=1)
    m.ensure("a", 1000, partition=0)
    before = [m.num_free(f, 0) for f in range(7)]
    with pytest.raises(KVCacheCapacityError) as e:
        m.ensure("b", 1000, partition=0)
    assert e.value.partition == 0 and any(e.value.need[k] > e.value.free[k] for k in e.value.need)
    assert "need" in str(e.value)
    assert [m.num_free(f, 0) for f in range(7)] == before and "b" not in m.reqs
    m.check()


def test_full_history_table_capacity_is_enforced():
    m = kv()
    with pytest.raises(ValueError, match="table capacity exceeded"):
        m.ensure("a", 1025 + 128)


def test_longest_hit_is_aligned_and_capped_at_prompt_minus_128():
    m = kv(slots=4)
    prompt = np.arange(2, 514, dtype=np.int32)            # 512 tokens
    prefill_and_publish(m, "a", prompt)
    p = m.partition_of("a")
    m.release("a")                                         # pages keep their hashes in the free queue
    h = m.prompt_hashes(prompt)
    assert m.lookup(h, len(prompt) - 128) == (384, p)     # K=7 cap: 512 - 128
    assert m.lookup(h, len(prompt) - 1) == (384, p)       # K=0: 511 aligns down to 384
    assert m.lookup(h, 255) == (128, p)
    assert m.lookup(h, 127) == (0, None)                   # below one 128-token alignment
    other = m.prompt_hashes(prompt + 1)
    assert m.lookup(other, 384) == (0, None)


def test_ring_rotation_evicts_old_rolling_checkpoints_when_spares_run_out():
    # with 2 slots, rotating the csa rings through the free queue pops the oldest hashed pages, so
    # the 128-token boundary's csa tail is gone while the 384 one survives
    m = kv(slots=2)
    prompt = np.arange(2, 514, dtype=np.int32)
    prefill_and_publish(m, "a", prompt)
    p = m.partition_of("a")
    m.release("a")
    h = m.prompt_hashes(prompt)
    assert m.lookup(h, 384) == (384, p)
    assert m.lookup(h, 255) == (0, None)
    assert m.stats["evictions"] > 0


def test_nothing_is_published_before_confirmation():
    m = kv()
    prompt = np.arange(2, 514, dtype=np.int32)
    h = m.prompt_hashes(prompt)
    m.ensure("a", 512)
    m.pin("a")                                             # dispatched, never confirmed
    m.release("a")
    assert m.lookup(h, 384) == (0, None)


def test_rolling_tail_must_be_present():
    m = kv()
    prompt = np.arange(2, 514, dtype=np.int32)
    prefill_and_publish(m, "a", prompt)
    p = m.partition_of("a")
    m.release("a")
    h = m.prompt_hashes(prompt)
    # drop the ori page just before the 384 boundary: the 384 hit's 4-page tail is incomplete
    del m.index[ORI][p][h[32][384 // 32 - 1]]
    hit, part = m.lookup(h, 384)
    assert hit == 256 and part == p


def test_hit_attaches_pages_and_pins_the_partition():
    m = kv()
    prompt = np.arange(2, 514, dtype=np.int32)
    prefill_and_publish(m, "a", prompt)
    p = m.partition_of("a")
    h = m.prompt_hashes(prompt)
    hit, part = m.lookup(h, 384)
    m.attach("b", h, hit, part)
    assert m.partition_of("b") == p
    cmp = FAMILY_NAMES.index("cmp_c4")
    assert m.reqs["b"].tables[cmp] == m.reqs["a"].tables[cmp][:3]
    assert all(m.ref[cmp][p][b] == 2 for b in m.reqs["b"].tables[cmp])
    ori_b = m.reqs["b"].tables[ORI]
    assert len(ori_b) == 9 and sum(x is not None for x in ori_b) == 4     # only the 4-page immutable tail
    m.ensure("b", 512)                                     # the suffix chunk fills the empty ring slots
    assert None not in m.reqs["b"].tables[ORI]
    m.check()


def test_shared_rolling_page_is_detached_on_write():
    m = kv()
    prompt = np.arange(2, 514, dtype=np.int32)
    prefill_and_publish(m, "a", prompt)
    h = m.prompt_hashes(prompt)
    hit, part = m.lookup(h, 384)
    m.attach("b", h, hit, part)
    m.ensure("b", 512)
    shared_slot = (384 // 32 - 1) % 9                       # logical ori page 11 sits in slot 2
    page = m.reqs["b"].tables[ORI][shared_slot]
    assert m.ref[ORI][part][page] == 2
    before = m.stats["detaches"]
    m.ensure("b", 32 * 21)                                  # logical pages 16..20: slot 2 is rewritten
    assert m.reqs["b"].tables[ORI][shared_slot] != page and m.ref[ORI][part][page] == 1
    assert m.stats["detaches"] > before
    m.check()


def test_saturated_rotation_falls_back_to_the_same_page():
    m = kv(slots=1)
    m.ensure("a", 288)                                      # one slot: the ori ring is the whole pool
    s0 = m.reqs["a"].tables[ORI][0]
    m.ensure("a", 320)
    assert m.reqs["a"].tables[ORI][0] == s0 and m.num_free(ORI, 0) == 0
    m.check()


def test_sole_owner_rotates_and_pins_force_a_detach():
    m = kv(slots=2)
    m.ensure("a", 288)                                      # ori ring of 9 pages, full
    free = m.num_free(ORI, 0)
    r0 = m.stats["rotations"]
    s0 = m.reqs["a"].tables[ORI][0]
    m.ensure("a", 320)                                      # logical 9 -> slot 0, sole owner: rotate
    assert m.stats["rotations"] > r0 and m.num_free(ORI, 0) == free
    assert m.reqs["a"].tables[ORI][0] != s0 and list(m.free[ORI][0])[-1] == s0     # released to the tail
    pin = m.pin("a")                                        # a step in flight holds the table
    old = m.reqs["a"].tables[ORI][1]
    d0 = m.stats["detaches"]
    m.ensure("a", 352)                                      # logical 10 -> slot 1, pinned: detach
    assert m.stats["detaches"] > d0
    assert m.ref[ORI][0][old] == 1 and old not in m.free[ORI][0]     # the pin keeps the old page
    m.check()
    m.unpin("a", pin)
    assert m.ref[ORI][0][old] == 0 and old in m.free[ORI][0]
    m.check()


def test_publication_reads_the_pinned_tables_not_the_live_ones():
    m = kv(slots=2)
    prompt = np.arange(2, 514, dtype=np.int32)
    h = m.prompt_hashes(prompt)
    m.ensure("a", 128)
    pin = m.pin("a")
    pinned = pin.tables[ORI][:4]
    m.ensure("a", 512)                                      # the live ring moves on before the result
    m.publish("a", pin, 128, h)
    assert [m.index[ORI][0][h[32][i]] for i in range(4)] == list(pinned)
    m.unpin("a", pin)
    m.check()


def test_release_returns_every_page():
    m = kv(slots=2)
    for i in range(4):
        m.ensure(f"r{i}", 700)
    for i in range(4):
        m.release(f"r{i}")
    for f, fam in enumerate(m.families):
        for p in range(m.partitions):
            assert m.num_free(f, p) == fam.blocks_per_partition
    assert m.load == [0, 0, 0, 0]
