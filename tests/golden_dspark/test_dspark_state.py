"""Device state and linear-chain acceptance (K27, serving-contract §7.5): properties over random
drafts, samples, anchors and position limits, plus the rules that must raise."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from twin.abi import constants as C
from twin.abi.errors import AbiError
from golden.dspark.state import (ANCHOR, COMMITTED, DRAFTS, LIMIT, VALID, SlotRef, accept, commit_drafts,
                                 new_state, prepare, release, seed)

NOISE = 99
V = 50


def seeded(prompt_len=10, limit=100, drafts=(1, 2, 3, 4, 5, 6, 7), first=9, lease=63, gen=1, group=0, groups=1):
    st_ = new_state(groups, NOISE)
    return seed(st_, SlotRef(group, lease, gen), first, drafts, prompt_len=prompt_len, position_limit=limit)


def test_shapes_are_the_abi_state():
    s = new_state(4, NOISE)
    assert s.tokens.shape == (4, C.DRAFTER_LEASES_PER_GROUP, 8) and s.tokens.dtype == np.int64
    assert s.meta.shape == (4, C.DRAFTER_LEASES_PER_GROUP, len(C.STATE_META_FIELDS)) and s.meta.dtype == np.int32
    assert (s.tokens == NOISE).all() and (s.meta == 0).all()


def test_seed_writes_the_initial_rows():
    s = seeded()
    assert s.tokens[0, 63].tolist() == [9, 1, 2, 3, 4, 5, 6, 7]
    assert s.meta[0, 63].tolist() == [1, 1, 10, 10, 7, 100]
    # the seed block a+1..a+7 (a = 9) does not fit under 16: nothing is seeded, noise tokens
    s = seeded(limit=16, drafts=[])
    assert s.meta[0, 63, DRAFTS] == 0 and (s.tokens[0, 63, 1:] == NOISE).all()
    with pytest.raises(AbiError, match="drafts"):
        seeded(limit=16)
    # it fits under 17 (9 + 7 < 17) but the first verify window (10 + 7) does not: seeded, then fallback
    s = seeded(limit=17)
    assert s.meta[0, 63, DRAFTS] == 7
    prep = prepare(s, [SlotRef(0, 63, 1)])
    assert prep.active_width[0] == 1 and prep.draft_count[0] == 0


@settings(max_examples=200)
@given(st.integers(0, 7), st.integers(1, 500), st.integers(0, 40), st.data())
def test_acceptance_is_the_longest_matching_prefix(mismatch_at, anchor, headroom, data):
    """matched = first j with draft_j != sampled[j] (7 if none); count = matched + 1; the tokens are
    sampled[0..matched]; the next token is sampled[matched]; eff = 0 when the window does not fit."""
    limit = anchor + 1 + headroom
    drafts = data.draw(st.lists(st.integers(0, V - 1), min_size=7, max_size=7))
    s = seeded(prompt_len=anchor, limit=limit, drafts=drafts) if anchor + 6 < limit else \
        seeded(prompt_len=anchor, limit=limit, drafts=[])
    prep = prepare(s, [SlotRef(0, 63, 1)])
    fits = anchor + 7 < limit
    assert prep.active_width[0] == (8 if fits else 1)
    assert prep.positions[0].tolist() == [min(anchor + o, limit - 1) for o in range(8)]
    sampled = np.array([drafts + [data.draw(st.integers(0, V - 1))]], np.int64)
    if mismatch_at < 7:
        sampled[0, mismatch_at] = (sampled[0, mismatch_at] + 1) % V
    acc, s2 = accept(s, prep, sampled)
    want_matched = (mismatch_at if mismatch_at < 7 else 7) if fits else 0
    assert acc.matched[0] == want_matched and acc.counts[0] == want_matched + 1
    assert 1 <= acc.counts[0] <= 8
    c = int(acc.counts[0])
    assert acc.token_ids[0, :c].tolist() == sampled[0, :c].tolist() and (acc.token_ids[0, c:] == -1).all()
    assert acc.next_token[0] == sampled[0, want_matched]
    assert acc.drafter_anchor[0] == anchor + c - 1
    assert acc.redraft[0] == (anchor + c + 7 < limit)
    assert acc.proposed[0] == (7 if fits else 0)
    m = s2.meta[0, 63]
    assert m[ANCHOR] == anchor + c and m[COMMITTED] == anchor + c and m[DRAFTS] == 0 and m[LIMIT] == limit
    assert s2.tokens[0, 63, 0] == acc.next_token[0] and (s2.tokens[0, 63, 1:] == NOISE).all()
    # commit only when the next window fits
    s3 = commit_drafts(s2, [SlotRef(0, 63, 1)], [[5] * 7])
    assert s3.meta[0, 63, DRAFTS] == (7 if anchor + c + 7 < limit else 0)


def test_inactive_rows_are_ignored_and_live_rows_must_be_sampled():
    s = seeded(prompt_len=95, limit=100, drafts=[])
    prep = prepare(s, [SlotRef(0, 63, 1)])
    assert prep.active_width[0] == 1 and prep.live[0].tolist() == [True] + [False] * 7
    acc, _ = accept(s, prep, np.array([[7, -1, -1, -1, -1, -1, -1, -1]]))
    assert acc.counts[0] == 1 and acc.next_token[0] == 7
    with pytest.raises(AbiError, match="sampled"):
        accept(s, prep, np.array([[-1] * 8]))
    with pytest.raises(AbiError, match="sampled"):
        accept(s, prep, np.array([[1] * 7]))


def test_a_stale_or_released_slot_is_never_verified():
    s = seeded()
    with pytest.raises(AbiError, match="generation"):
        prepare(s, [SlotRef(0, 63, 2)])
    with pytest.raises(AbiError, match="lease"):
        prepare(s, [SlotRef(0, 62, 1)])
    with pytest.raises(AbiError, match="lease"):
        prepare(s, [SlotRef(0, 63, 1), SlotRef(0, 63, 1)])
    r = release(s, SlotRef(0, 63, 1))
    assert r.meta[0, 63, VALID] == 0
    with pytest.raises(AbiError, match="lease"):
        prepare(r, [SlotRef(0, 63, 1)])
    with pytest.raises(AbiError, match="group"):
        prepare(s, [SlotRef(3, 63, 1)])


def test_bad_seeds_are_rejected():
    with pytest.raises(AbiError, match="prompt_len"):
        seeded(prompt_len=100, limit=100)
    with pytest.raises(AbiError, match="drafts"):
        seeded(drafts=(1, 2, 3))


def test_functions_are_pure():
    s = seeded()
    t0, m0 = s.tokens.copy(), s.meta.copy()
    prep = prepare(s, [SlotRef(0, 63, 1)])
    accept(s, prep, np.zeros((1, 8), np.int64))
    commit_drafts(s, [SlotRef(0, 63, 1)], [[1] * 7])
    assert (s.tokens == t0).all() and (s.meta == m0).all()


def test_slots_are_independent():
    s = seeded(lease=63, groups=2)
    s = seed(s, SlotRef(1, 63, 4), 3, [3] * 7, prompt_len=20, position_limit=100)
    prep = prepare(s, [SlotRef(1, 63, 4), SlotRef(0, 63, 1)])
    sampled = np.array([[3] * 8, [0] * 8])
    acc, s2 = accept(s, prep, sampled)
    assert acc.counts.tolist() == [8, 1]
    assert s2.meta[1, 63, ANCHOR] == 28 and s2.meta[0, 63, ANCHOR] == 11
