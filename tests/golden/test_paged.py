"""Paged addressing (serving-contract.md §6.1) and pool allocation."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from golden.paged import (Span, absolute_table, alloc_caches, assign_blocks, compressed_slot, lower, paged_slot,
                          ring_table, window_indices)
from twin.abi.errors import AbiError
from twin.abi.presets import TINY


def test_primitives():
    assert ring_table([7, 3, 5], 7).tolist() == [7, 3, 5, 7, 3, 5, 7]
    assert absolute_table([4, 2], 4).tolist() == [4, 2, -1, -1]
    with pytest.raises(AbiError, match="at most 1 pages"):
        absolute_table([1, 2], 1)
    with pytest.raises(AbiError, match="non-negative"):
        ring_table([1, -1], 4)
    t = ring_table([7, 3, 5], 3)
    assert paged_slot(np.array([0, 33, 96, 97]), t, 32).tolist() == [224, 3 * 32 + 1, 7 * 32, 7 * 32 + 1]
    cmp = absolute_table([9, 4], 8)
    # ratio 4: a write only at boundaries; row p // 4 of 32 rows per page
    assert compressed_slot(np.array([2, 3, 127, 131, 259]), cmp, 4, 32).tolist() == [-1, 9 * 32, 9 * 32 + 31, 4 * 32, -1]
    # ratio 128: one row per page; commit masks uncommitted columns
    assert compressed_slot(np.array([127, 255]), cmp, 128, 1, column=np.array([0, 5]), commit=3).tolist() == [9, -1]


@settings(max_examples=40)
@given(st.integers(0, 5000), st.lists(st.integers(0, 500), min_size=1, max_size=40, unique=True))
def test_window_indices_cover_the_last_128_positions(p, ids):
    t = ring_table(ids, len(ids))
    idx, lens = window_indices(np.array([p]), t, 32, 128)
    assert lens[0] == min(p + 1, 128)
    want = [paged_slot(np.array([q]), t, 32)[0] for q in range(max(0, p - 127), p + 1)]
    assert idx[0, : lens[0]].tolist() == want and np.all(idx[0, lens[0]:] == -1)


def test_lower_packs_spans_and_names_bad_input():
    blocks, pages = assign_blocks(TINY, 2, 300, rng=np.random.default_rng(0))
    meta = lower(TINY, [Span(0, 0, (1, 2, 3), blocks[0]), Span(1, 128, (4,) * 5, blocks[1])])
    assert meta.position_ids.tolist() == [0, 1, 2] + list(range(128, 133))
    assert meta.req.tolist() == [0] * 3 + [1] * 5 and meta.first_pos.tolist() == [0, 128]
    assert meta.logit_row_indices.tolist() == [2, 7] and meta.kv_seq_lens.tolist() == [3, 133]
    assert meta.slots["hca_cmp"].tolist() == [-1] * 8 and (meta.slots["csa_cmp"] >= 0).sum() == 1
    dec = lower(TINY, [Span(0, 10, (1,) * 8, blocks[0])], form="decode")
    assert dec.logit_row_indices.tolist() == list(range(8))
    with pytest.raises(AbiError, match="all 7 cache families"):
        lower(TINY, [Span(0, 0, (1,), {"ori": [0]})])
    with pytest.raises(AbiError, match="form='verify'"):
        lower(TINY, [Span(0, 0, (1,), blocks[0])], form="verify")
    bad = dict(blocks[0], ori=[1, 1])
    with pytest.raises(AbiError, match="repeated"):
        lower(TINY, [Span(0, 0, (1,), bad)])
    with pytest.raises(AbiError, match="start"):
        lower(TINY, [Span(0, TINY.max_position_embeddings, (1,), blocks[0])])


def test_alloc_caches_layout(nm):
    _, pages = assign_blocks(TINY, 1, 256)
    caches = alloc_caches(TINY, pages, nm)
    assert set(caches[0]) == {"kv_cache"} and "hca_cmp_kv" in caches[3] and "idx_kv_scale" in caches[2]
    assert caches[2]["csa_compress_state"].shape[1:] == (2, 4 * TINY.head_dim)
    assert caches[3]["hca_cmp_kv"].shape[1:] == (1, 1, TINY.head_dim)
    assert caches[0]["kv_cache"].dtype == nm.store_dtype
    assert caches[2]["idx_kv_cache"].dtype == (np.float64 if nm.exact else np.int8)
