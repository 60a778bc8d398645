"""Cache families and startup admission: the contract's formulas and their consequences."""
import math
import subprocess
import sys
import json

import pytest
from hypothesis import given, settings, strategies as st

from twin.abi import (FAMILY_NAMES, FLASH, CapacityError, ConfigError, admit_slots, allocate_with_retry,
                      bytes_per_slot, cache_families, deployment, family_sizing, hbm_account, page_alignment,
                      scratch_bytes, slots_from_budget)
from twin.abi import constants as C
from twin.abi.caches import DrafterPools, filler_block, lease_block, ring_pages


def flash(mml, chunk, **kw):
    return deployment("flash", ep=kw.pop("ep", 16), max_model_len=mml, long_prefill_token_threshold=chunk,
                      max_num_batched_tokens=8192, **kw)


def test_family_order_and_page_bytes_follow_the_formula():
    fams = cache_families(FLASH)
    assert tuple(f.name for f in fams) == FAMILY_NAMES
    for f in fams:
        assert f.page_bytes == len(f.layers) * f.rows_per_page * f.row_bytes
    pb = {f.name: f.page_bytes for f in fams}
    # per-row content: raw/compressed KV = head_dim BF16, idx = 128 INT8 + FP32 scale, states FP32
    assert pb["ori"] == 43 * 32 * 512 * 2 and pb["idx"] == 21 * 32 * (128 + 4)
    assert pb["csa_state"] == 21 * 2 * 2048 * 4 and pb["cmp_c128"] == 20 * 1 * 512 * 2
    assert page_alignment(fams) == 128


@pytest.mark.parametrize("mml,chunk,expect", [
    (1024, 128, (9, 8, 8, 8, 33, 69, 69)),
    (1024, 8192, (37, 8, 8, 8, 145, 517, 517)),
    (16384, 8192, (261, 128, 128, 128, 1041, 4101, 4101)),
    (1_048_576, 8192, (261, 8192, 8192, 8192, 1041, 4101, 4101)),
    (1_048_576, 128, (9, 8192, 8192, 8192, 33, 69, 69)),
])
def test_worked_table_of_blocks_per_request(mml, chunk, expect):
    s = family_sizing(flash(mml, chunk))
    assert tuple(s[n].max_blocks_per_seq for n in FAMILY_NAMES) == expect


def test_issue_numbers_are_computed_not_hardcoded():
    assert bytes_per_slot(flash(1024, 128)) == 70_362_112
    assert bytes_per_slot(flash(1_048_576, 8192)) == 9_345_323_008
    assert scratch_bytes(flash(1024, 128)) == 210_673_664
    # scratch is independent of the configuration
    assert scratch_bytes(flash(1_048_576, 8192)) == scratch_bytes(flash(16384, 512))


@settings(max_examples=200)
@given(st.integers(1, C.MAX_MODEL_LEN_CEILING), st.integers(1, 8192), st.integers(0, C.MAX_MODEL_LEN_CEILING))
def test_rolling_rings_hold_window_plus_in_flight_chunk(mml, chunk, start):
    """Consequence of the ring formula: the window history before a chunk plus the whole in-flight
    chunk land on distinct ring slots, wherever the chunk starts."""
    for f in cache_families(FLASH):
        n = f.max_blocks_per_seq(mml, chunk)
        if not f.rolling:
            assert n == math.ceil(mml / 128) and n <= C.CMP_MAX_BLOCKS
            continue
        in_flight = max(min(chunk, mml), 8)
        first, last = max(0, start - (f.window - 1)), start + in_flight - 1
        logical = range(first // f.page_tokens, last // f.page_tokens + 1)
        assert len({lp % n for lp in logical}) == len(logical)
        assert f.tail_pages <= n and f.window % f.page_tokens == 0


@settings(max_examples=200)
@given(st.integers(0, 1 << 42))
def test_slots_formula_invariants(budget):
    dep = flash(16384, 8192)
    per, scratch = bytes_per_slot(dep), scratch_bytes(dep)
    if budget < per + scratch:
        with pytest.raises(CapacityError, match="cannot fit one capacity slot"):
            slots_from_budget(dep, budget)
        return
    s = slots_from_budget(dep, budget)
    assert 1 <= s <= 64
    assert s * per + scratch <= budget
    assert s == 64 or (s + 1) * per + scratch > budget


def test_admission_uses_the_tightest_rank():
    dep = flash(16384, 8192)
    gib = 1 << 30
    ranks = [(64 * gib, 40 * gib)] * 15 + [(64 * gib, 30 * gib)]
    util = dep.limits.npu_memory_utilization
    tight = int(64 * gib * util) - (64 * gib - 30 * gib)
    assert admit_slots(dep, rank_memory=ranks) == slots_from_budget(dep, tight)
    assert admit_slots(dep, total_kv_pages=261 * 5 + 7) == 5
    with pytest.raises(CapacityError, match="total_kv_pages"):
        admit_slots(dep, total_kv_pages=100)
    with pytest.raises(ConfigError, match="rank_memory"):
        admit_slots(dep)


def test_allocate_with_retry_halves_down_to_one():
    tried = []
    assert allocate_with_retry(64, lambda s: tried.append(s) or s <= 5) == 4
    assert tried == [64, 32, 16, 8, 4]
    with pytest.raises(CapacityError):
        allocate_with_retry(3, lambda s: False)


def test_hbm_account_flash_ep16_and_ep8():
    a16 = hbm_account(flash(1024, 128))
    b = a16.breakdown
    # routed experts at EP16: 43 layers x 16 experts x 3 x 2048 x 4096 INT8 + scales, per rank
    routed = 43 * 16 * 3 * 2048 * 4096
    assert b["target_weights"] > routed
    assert a16.weights_by_buffer["routed_w1"] == 43 * 16 * 2048 * 4096
    assert b["drafter_state"] >= DrafterPools(FLASH).kv_cache_bytes
    assert b["kv_pools"] == a16.slots_per_partition * a16.bytes_per_slot and b["kv_scratch_pages"] == a16.scratch_bytes
    # the pools fill the budget: what is left of HBM x utilization is less than one more slot
    cap = int(64 * (1 << 30) * 0.9)
    assert 0 <= cap - a16.total_used < a16.bytes_per_slot
    # a 1M request (9.35 GB) is larger than the ~2.8 GB the measured boot leaves: it cannot boot
    long = hbm_account(flash(1_048_576, 8192))
    assert not long.fits and "cannot fit one capacity slot" in long.error
    assert long.kv_budget < long.bytes_per_slot + long.scratch_bytes
    # EP8 doubles routed experts per rank: one slot no longer fits either
    a8 = hbm_account(flash(1024, 128, ep=8))
    assert a8.weights_by_buffer["routed_w1"] == 2 * a16.weights_by_buffer["routed_w1"]
    assert not a8.fits and "cannot fit one capacity slot" in a8.error
    with pytest.raises(CapacityError):
        hbm_account(flash(1024, 128, ep=8), strict=True)


def test_drafter_ring_blocks_never_alias_and_filler_is_unreachable():
    for lease in range(C.DRAFTER_LEASES_PER_GROUP):
        for layer in range(3):
            blocks = {lease_block(lease, lb, layer) for lb in range(6)}
            assert blocks == set(range(lease * 6, lease * 6 + 6))
    assert {filler_block(lb, l) for lb in range(6) for l in range(3)} == set(range(384, 390))
    assert DrafterPools(FLASH).kv_cache_bytes == 48 * 2**20


def test_capacity_cli_json_reports_issue_numbers():
    out = subprocess.run([sys.executable, "-m", "twin.cli", "capacity", "--max-model-len", "1024", "--chunk", "128",
                          "--json"], capture_output=True, text=True, check=True).stdout
    d = json.loads(out)
    assert d["bytes_per_slot"] == 70_362_112 and d["scratch_bytes"] == 210_673_664
    r = subprocess.run([sys.executable, "-m", "twin.cli", "capacity", "--max-model-len", "1048576", "--chunk",
                        "8192", "--json"], capture_output=True, text=True)
    assert r.returncode == 3, r.stderr           # the report still comes: one 1M request does not fit
    d = json.loads(r.stdout)
    assert d["bytes_per_slot"] == 9_345_323_008
    assert set(d["per_rank_bytes"]) == {"driver_baseline", "target_weights", "drafter_weights", "decode_scratch",
                                        "drafter_state", "prefill_arena", "unexplained", "kv_pools",
                                        "kv_scratch_pages"}
    assert all(ln["source"] for ln in d["lines"]) and d["budget_source"] == "account"
