"""Property tests of the lowering primitives against the contract's invariants (§2.2, §6, §7.1)."""
import functools
import math
import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))

from lowering_batches import Pools, prefill_batch  # noqa: E402

from twin.abi import FLASH, cache_families, constants as C, deployment  # noqa: E402
from twin.abi.batches import DecodeBatch, DecodeItem  # noqa: E402
from twin.abi.caches import filler_block, lease_block, ring_pages  # noqa: E402
from twin.abi.lowering import (LoweringContext, filler_ring_table, filler_slot, lease_ring_table,  # noqa: E402
                               lease_slot, lower_fused, lower_prefill)
from twin.abi.lowering.primitives import (absolute_table, compressed_slot, paged_slot, ring_slot,  # noqa: E402
                                          ring_table, swa_window, trailing_ring_table)

ROLLING = [f for f in cache_families(FLASH) if f.rolling]
CEIL = C.MAX_MODEL_LEN_CEILING


def distinct_ids(n, seed):
    return np.random.default_rng(seed).permutation(10 * n + 7)[:n]


@settings(max_examples=300)
@given(fam=st.sampled_from(ROLLING), limit=st.integers(8, 8192), data=st.data())
def test_rolling_ring_never_aliases_window_history_plus_in_flight_chunk(fam, limit, data):
    chunk = data.draw(st.integers(1, limit))
    start = data.draw(st.integers(0, CEIL - chunk))
    n = fam.max_blocks_per_seq(CEIL, limit)
    assert n == ring_pages(fam.window, fam.page_tokens, limit)
    ids = distinct_ids(n, start)
    pos = np.arange(max(0, start - fam.window + 1), start + chunk)
    slots = ring_slot(pos, ids, fam.page_tokens)
    assert np.unique(slots).size == pos.size
    # the frozen-depth ring table the prefill stages gives the same slots
    depth = fam.frozen_depth(CEIL)
    lo = pos[0] // fam.page_tokens
    tbl = ring_table(ids, depth)
    assert np.array_equal(paged_slot(pos, tbl, fam.page_tokens), slots)
    assert lo >= 0


@settings(max_examples=300)
@given(lease=st.integers(0, 63), anchor=st.integers(0, CEIL - 8), layer=st.integers(0, 2))
def test_lease_ring_never_aliases_a_128_window_plus_7_query_rows(lease, anchor, layer):
    pos = np.arange(max(0, anchor - 127), anchor + 8)
    slots = lease_slot(pos, lease, layer)
    assert np.unique(slots).size == pos.size
    blocks = slots // C.BLOCK_SIZE
    assert ((blocks >= lease * 6) & (blocks < lease * 6 + 6)).all()       # never another lease or the filler
    tbl = lease_ring_table(lease, layer, C.ORI_MAX_BLOCKS)
    assert np.array_equal(paged_slot(pos, tbl, C.BLOCK_SIZE), slots)
    lb = int(pos[-1]) // 32
    assert tbl[lb] == lease_block(lease, lb, layer)
    assert filler_ring_table(layer, 12)[lb % 12] == filler_block(lb % 12, layer) >= C.DRAFTER_FILLER_BLOCK_BASE
    # a padding row at the same positions: the filler ring's own slots, through the filler's block table
    filler = filler_slot(pos, layer)
    assert np.array_equal(paged_slot(pos, filler_ring_table(layer, C.ORI_MAX_BLOCKS), C.BLOCK_SIZE), filler)
    assert (filler // C.BLOCK_SIZE >= C.DRAFTER_FILLER_BLOCK_BASE).all() and np.unique(filler).size == pos.size


@settings(max_examples=300)
@given(ratio=st.sampled_from([4, 128]), start=st.integers(0, CEIL - 64), n=st.integers(1, 64), data=st.data())
def test_compressed_slots_only_at_boundaries_and_within_the_commit(ratio, start, n, data):
    pos = np.arange(start, start + n)
    commit = data.draw(st.integers(0, n))
    mask = np.arange(n) < commit
    pages = math.ceil((start + n) / 128)
    tbl = absolute_table(distinct_ids(pages, start), C.CMP_MAX_BLOCKS)
    s = compressed_slot(pos, tbl, ratio, mask)
    live = s >= 0
    assert (((pos + 1) % ratio == 0) & mask)[live].all()
    assert (live == (((pos + 1) % ratio == 0) & mask)).all()            # every committed boundary is written
    rpp = 128 // ratio
    row = pos // ratio
    assert np.array_equal(s[live], (tbl[row // rpp] * rpp + row % rpp)[live])
    assert np.unique(s[live]).size == live.sum()


@settings(max_examples=300)
@given(fam=st.sampled_from(ROLLING), limit=st.sampled_from([8, 128, 512, 2048, 8192]),
       pos=st.integers(0, CEIL - 1), extra=st.integers(0, 8192), hit=st.integers(0, 64), seed=st.integers(0, 99))
def test_fused_ring_descriptors_match_the_prefill_ring_mapping_through_1m(fam, limit, pos, extra, hit, seed):
    """The fused state descriptor (depth = ring period, device index (p // page) mod period) and the
    prefill table (frozen depth) give the same slot: unwrapped, after the wrap, at the last position
    below the ceiling, and after a prefix hit (the scheduler's table is then sized from the hit end)."""
    page, period = fam.page_tokens, fam.max_blocks_per_seq(CEIL, limit)
    end = min(CEIL, max(pos + 1, hit * 128) + extra)
    n = min(math.ceil(end / page), period)
    ids = distinct_ids(n, seed)
    prefill = paged_slot(np.array([pos, CEIL - 1]), ring_table(ids, fam.frozen_depth(CEIL)), page)
    fused_tbl = ring_table(ids, period)
    for p, want in zip((pos, CEIL - 1), prefill):
        if p // page < n or n == period:
            assert fused_tbl[(p // page) % period] * page + p % page == want


@settings(max_examples=200)
@given(pos=st.integers(0, CEIL - 1), n=st.integers(8, 4101), seed=st.integers(0, 99))
def test_trailing_transaction_ring_holds_the_last_8_pages_at_position_mod_16(pos, n, seed):
    """Built at the window end, the ring covers every row of an 8-row verify window ending there."""
    ids = distinct_ids(n, seed)
    t = trailing_ring_table(ids, pos, 2, 8)
    for p in range(max(0, (pos // 2 - 7) * 2), pos + 1):       # the last 8 pages (16 rows)
        assert t[(p // 2) % 8] * 2 + p % 2 == ring_slot(p, ids, 2)
    assert (t >= 0).sum() == min(8, pos // 2 + 1)
    assert (pos // 2 - 7) * 2 <= pos - 7 or pos < 16


@settings(max_examples=100)
@given(p=st.integers(0, CEIL - 1), n=st.integers(5, 261), seed=st.integers(0, 9))
def test_swa_window_is_the_last_128_positions_oldest_first(p, n, seed):
    ids = distinct_ids(n, seed)
    idx, lens = swa_window(np.array([p]), ids)
    start = max(0, p - 127)
    assert lens[0] == p - start + 1
    assert np.array_equal(idx[0, :lens[0]], ring_slot(np.arange(start, p + 1), ids, 32))
    assert (idx[0, lens[0]:] == -1).all()


# ---- the same property on real dispatches at the FLASH binding ---------------------------------
@functools.lru_cache(maxsize=1)
def _flash_ctx():
    dep = deployment("flash", ep=16, max_model_len=CEIL, max_num_seqs=64, long_prefill_token_threshold=512,
                     max_num_batched_tokens=8192)
    return LoweringContext(dep, slots=1)


@settings(max_examples=5)
@given(start=st.sampled_from([0, 640, 128 * 4099, CEIL - 512]), n=st.integers(8, 512), g=st.integers(0, 3),
       lease=st.integers(0, 63), seed=st.integers(0, 99))
def test_fused_dispatch_descriptors_match_the_prefill_dispatch_slots(start, n, g, lease, seed):
    """Prefill a chunk, then stage a fused step for the same request and block rows: the slots the
    device derives from the fused descriptors (index (p // page) mod depth) equal the prefill's, for
    an unwrapped ring, after the wrap, after a 128-aligned prefix hit and up to position 1,048,575."""
    ctx = _flash_ctx()
    n = min(n, CEIL - start)
    pb = prefill_batch(ctx, [(g, start, n)], pools=Pools(ctx, seed))
    pre = lower_prefill(pb, ctx)
    it = pb.items[0]
    anchor = it.end - 8
    fb = DecodeBatch((DecodeItem("x", 1, anchor, it.block_ids, g, tuple(range(7)), lease, 1),))
    fused = lower_fused(fb, ctx)
    r0 = 4 * g
    s = fused.meta["placement"]["x"]["stream_slot"]
    pos = np.arange(start, it.end)
    for fam_table, pre_slots, page in (("group_ori_block_tables", "ori_slot_mapping_full", 32),
                                       ("group_hca_state_block_tables", "hca_state_slot_mapping_full", 8),
                                       ("group_csa_state_block_tables", "csa_state_slot_mapping_full", 2),
                                       ("group_csa_inner_state_block_tables", "csa_inner_state_slot_mapping_full", 2)):
        t = fused.args[fam_table][r0, s].astype(np.int64)
        device = t[(pos // page) % t.size] * page + pos % page
        assert np.array_equal(device, pre.args[pre_slots][r0, :n]), fam_table
    for fam_table, pre_table in (("group_csa_cmp_block_tables", "csa_cmp_block_table"),
                                 ("group_idx_block_tables", "idx_block_table")):
        assert np.array_equal(fused.args[fam_table][r0, s], pre.args[pre_table][r0, 0])

