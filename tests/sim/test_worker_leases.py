"""Packed-prefill splitting, seeding waves, decode tile placement and drafter leases."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twin.abi.batches import DecodeItem, PrefillItem
from twin.abi.lowering.decode import owner_member
from twin.sim.leases import LeaseManager, LeasesExhausted
from twin.sim.worker import decode_groups, seeding_waves, split_prefill


def item(rid, n, part, start=0, plen=None):
    return PrefillItem(rid, (5,) * n, start, plen if plen is not None else start + n, {}, part)


@given(st.lists(st.tuples(st.integers(1, 8192), st.integers(0, 3)), min_size=1, max_size=200),
       st.integers(1, 64), st.integers(1, 256))
@settings(max_examples=80)
def test_split_prefill_respects_every_cap_and_keeps_order(chunks, per_part, max_batch):
    items = [item(f"r{i}", n, p) for i, (n, p) in enumerate(chunks)]
    out = split_prefill(items, max_batch, per_part)
    seen = [it.request_id for b in out for it in b.items]
    assert sorted(seen) == sorted(it.request_id for it in items)
    for b in out:
        assert 1 <= len(b.items) <= max_batch
        for p, its in b.by_partition().items():
            assert len(its) <= per_part and sum(i.num_tokens for i in its) <= 8192
    # greedy first-fit: each dispatch starts with the first request not yet dispatched
    pos = {it.request_id: i for i, it in enumerate(items)}
    done = set()
    for b in out:
        first = min(pos[i] for i in (x.request_id for x in b.items))
        assert first == min(pos[r] for r in pos if r not in done)
        done.update(x.request_id for x in b.items)


def test_a_chunk_over_8192_tokens_raises():
    with pytest.raises(ValueError, match="8192"):
        split_prefill([item("a", 8193, 0)], 64, 64)


def test_seeding_waves_take_the_wth_completed_request_of_every_group():
    its = [item("a", 5, 0), item("b", 5, 0), item("c", 5, 1), item("d", 5, 0), item("e", 5, 2)]
    waves = seeding_waves(its)
    assert [[i.request_id for i in w] for w in waves] == [["a", "c", "e"], ["b"], ["d"]]


def decode_item(rid, part, lease):
    return DecodeItem(rid, 1, 10, {}, part, (0,) * 7, lease, 1)


def test_decode_tile_overflow_is_a_worker_error():
    items = [decode_item(f"r{i}", 0, i % 64) for i in range(65)]
    groups, err = decode_groups(items, 4, 7)
    assert len(groups[0]) == 65 and "exceeds local capacity 64" in err
    groups, err = decode_groups(items[:64], 4, 7)
    assert err is None


def test_owner_rank_is_lease_mod_4():
    items = [decode_item(f"r{i}", 1, 4 * i) for i in range(17)]     # every lease on owner rank 0
    _, err = decode_groups(items, 4, 7)
    assert "owner rank" in err


def test_leases_follow_the_upstream_free_list():
    m = LeaseManager(4)
    assert m.reserve("a", 0) == (63, 1)
    assert m.reserve("b", 0) == (62, 1)
    assert m.reserve("a", 0) == (63, 1)                  # stable for the request's lifetime
    m.release("a")
    m.release("a")                                       # idempotent
    assert m.reserve("c", 0) == (63, 2)                  # appended back, popped first; new generation
    assert owner_member(7, 63, 0) == 3 and owner_member(0, 63, 6) == 2   # K=7 by lease, K=0 by ordinal
    m.check()


def test_lease_exhaustion_names_the_group():
    m = LeaseManager(2)
    for i in range(64):
        m.reserve(f"r{i}", 1)
    with pytest.raises(LeasesExhausted, match="TP group 1"):
        m.reserve("x", 1)
    assert m.reserve("y", 0) == (63, 1)
