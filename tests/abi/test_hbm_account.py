"""The per-rank HBM account: the measured boot, its named unexplained remainder, the itemized lines'
rules, and calibration from a measured figure in bytes or in slots."""
import pytest

from twin.abi import (MEASURED_BOOT, CapacityError, ConfigError, Measurement, budget_interval, bytes_per_slot,
                      deployment, hbm_account, itemized_lines, scratch_bytes, slots_from_budget)
from twin.abi.budget import FREE, SLOTS, USED, slots_or_zero
from twin.abi.hbm import AFTER, BEFORE, DRIVER_BASELINE_BYTES, moe_windows, used_before_kv

GIB = 1 << 30
HBM = 64 * GIB
BOOT = MEASURED_BOOT.deployment
BOOT_HEAP = MEASURED_BOOT.ring_heap


def cap(dep, hbm=HBM):
    return int(hbm * dep.limits.npu_memory_utilization)


def flash(mml, chunk, **kw):
    return deployment("flash", ep=kw.pop("ep", 16), max_model_len=mml, long_prefill_token_threshold=chunk,
                      max_num_batched_tokens=8192, **kw)


def test_the_measured_boot_is_the_accuracy_tests_server_command():
    lim, topo = BOOT.limits, BOOT.topology
    assert (topo.ep, topo.tp, BOOT.partitions, lim.k) == (16, 4, 4, 7)
    assert (lim.max_model_len, lim.max_prefill_tokens_per_request, lim.max_num_seqs) == (1024, 128, 8)
    assert lim.npu_memory_utilization == 0.9 and not lim.enable_prefix_caching
    assert BOOT_HEAP == "2147483648,2147483648,4294967296,8589934592"
    assert MEASURED_BOOT.measurement.kind == SLOTS and MEASURED_BOOT.measurement.value == 37


def test_itemized_lines_alone_overpredict_the_boot_and_the_gap_is_a_named_line():
    lines = itemized_lines(BOOT, None, BOOT_HEAP)
    itemized_budget = cap(BOOT) - used_before_kv(lines)
    # what the sources explain leaves room for far more than the 37 slots the device admitted
    assert slots_or_zero(BOOT, itemized_budget) > 38
    acct = hbm_account(BOOT, ring_heap=BOOT_HEAP)
    named = [ln for ln in acct.lines if ln.name == "unexplained"]
    assert len(named) == 1 and named[0].when == BEFORE and "not found" in named[0].source
    un = named[0].nbytes
    assert un == acct.remainder.point and acct.remainder.lo <= un <= acct.remainder.hi
    # with it the account reproduces the measured boot, and that alone is what closes the gap
    assert acct.slots_per_partition == 37
    assert acct.kv_budget == itemized_budget - un
    lo, hi = budget_interval(BOOT, 37)
    assert lo <= acct.kv_budget <= hi
    # the remainder is what it is: about 10.6 GiB per rank that no source accounts for
    assert 10 * GIB < un < 11 * GIB


def test_every_line_has_a_source_and_the_budget_is_their_complement():
    acct = hbm_account(flash(1024, 128))
    assert all(ln.source and ln.when in (BEFORE, AFTER) for ln in acct.lines)
    assert acct.used_before_kv == sum(ln.nbytes for ln in acct.lines if ln.when == BEFORE)
    assert acct.kv_budget == cap(acct.deployment) - acct.used_before_kv
    assert set(acct.after_kv_sizing) == {"prefill_scratch", "staged_inputs", "moe_windows", "arena_regrowth"}
    assert acct.breakdown["driver_baseline"] == DRIVER_BASELINE_BYTES == 3 * GIB


def test_only_the_prewarmed_prefill_arena_is_resident_at_kv_sizing():
    """The arena cache holds one sizing: the prefill profile's sum, not a per-depth max over the
    programs' profiles (which would be 4, 4, 4, 8 = 20 GiB at K=7)."""
    d = flash(1024, 128)
    lines = {ln.name: ln for ln in itemized_lines(d, None, "2147483648,2147483648,4294967296,8589934592")}
    assert lines["prefill_arena"].nbytes == 16 * GIB and lines["arena_regrowth"].nbytes == 0
    # the distinguishing case: a 4 GiB prefill arena lowers the line by 12 GiB, and the drafter
    # profile (4 GiB per depth) regrows the bank by as much after KV sizing
    small = {ln.name: ln for ln in itemized_lines(d, None, "1073741824")}
    assert small["prefill_arena"].nbytes == 4 * GIB
    assert small["arena_regrowth"].nbytes == 12 * GIB and small["arena_regrowth"].when == AFTER
    a = hbm_account(d, ring_heap="1073741824")
    assert a.kv_budget - hbm_account(d).kv_budget == 12 * GIB
    # K=0's split decode profile (1, 1, 1, 4 GiB) is smaller than a 16 GiB prefill arena: no regrowth,
    # but larger than a 4 GiB one
    k0 = {ln.name: ln.nbytes for ln in itemized_lines(flash(1024, 128, num_speculative_tokens=0), None, "1073741824")}
    assert k0["arena_regrowth"] == 3 * GIB and "drafter_weights" in k0 and k0["drafter_weights"] == 0


def test_prefill_scratch_is_allocated_after_kv_sizing_in_its_own_scope():
    acct = hbm_account(flash(1024, 128))
    from twin.abi.hbm import device_buffers

    bufs = device_buffers(flash(1024, 128))
    # prefill's attention staging [P, HC, D] FP32 per rank: 8192 x 4 x 4096 x 4 bytes
    assert bufs["prefill_scratch"]["attn_stage"] == 8192 * 4 * 4096 * 4
    assert "attn_stage" not in bufs["decode_scratch"]
    # one name in both dispatch classes is two buffers: decode's 128-row tap, prefill's 2048-row one
    assert bufs["decode_scratch"]["dspark_target_hidden"] == 128 * 3 * 4096 * 2
    assert bufs["prefill_scratch"]["dspark_target_hidden"] == 2048 * 3 * 4096 * 2
    assert acct.after_kv_sizing["prefill_scratch"] == sum(bufs["prefill_scratch"].values())
    assert acct.breakdown["decode_scratch"] == sum(bufs["decode_scratch"].values())


def test_moe_windows_follow_the_kernel_shapes():
    # recv_x [16 experts x 16*128 lanes, 4096] INT8 + aux and route [.., 8] x 4 bytes + routed_y
    # [128*6, 4096] BF16 + signals, once for the target and twice more for the drafter at K=7
    lanes = 16 * 16 * 128
    one = lanes * (4096 + 32 + 32) + 128 * 6 * 4096 * 2 + 4 * (16 * 16 + 3 * 16)
    assert moe_windows(flash(1024, 128, num_speculative_tokens=0)) == one
    assert moe_windows(flash(1024, 128)) == 3 * one
    # EP8: twice the experts per rank, half the senders: the same receive lanes
    e8 = moe_windows(flash(1024, 128, ep=8, num_speculative_tokens=0))
    assert e8 - one == 4 * ((32 * 8 + 3 * 8) - (16 * 16 + 3 * 16))


@pytest.mark.parametrize("kind", [FREE, USED])
def test_calibration_from_a_byte_figure(kind):
    d = flash(1024, 128)
    used = 52 * GIB + 123_456_789
    m = Measurement(kind, HBM - used if kind == FREE else used)
    acct = hbm_account(d, measured=m)
    # upstream's formula on the measured figure: total x utilization - (total - free)
    assert acct.kv_budget == cap(d) - used and acct.kv_budget_interval == (acct.kv_budget, acct.kv_budget)
    assert acct.slots_per_partition == slots_from_budget(d, cap(d) - used)
    assert acct.budget_source == kind and f"{m.value:,}" in acct.budget_detail
    # the remainder is exact, and it is what moves to every other setting: only the itemized lines
    # change with max-model-len and chunk (here the RoPE tables sized by max_model_len)
    long = d.replace(limits=d.limits.replace(max_model_len=1_048_576, long_prefill_token_threshold=8192))
    growth = used_before_kv(itemized_lines(long)) - used_before_kv(itemized_lines(d))
    assert growth == 6 * (1_048_576 - 1024) * 64 * 2
    pred = {(p["max_model_len"], p["chunk"]): p for p in acct.predictions()}
    assert pred[(1_048_576, 8192)]["kv_budget_bytes"] == acct.kv_budget - growth
    assert pred[(1_048_576, 8192)]["slots"] == slots_or_zero(long, acct.kv_budget - growth)
    assert (1024, 128) not in pred


def test_a_byte_figure_can_free_enough_for_a_1m_request():
    long = flash(1_048_576, 8192)
    need = scratch_bytes(long) + bytes_per_slot(long)
    used = cap(long) - need                          # exactly one slot's worth of budget
    assert hbm_account(long, measured=Measurement(USED, used)).slots_per_partition == 1
    acct = hbm_account(long, measured=Measurement(USED, used + 1))
    assert not acct.fits and "cannot fit one capacity slot" in acct.error


def test_a_slot_count_gives_the_budget_interval_and_predictions():
    d = flash(1024, 128)
    per, scratch = bytes_per_slot(d), scratch_bytes(d)
    acct = hbm_account(d, measured=Measurement(SLOTS, 20))
    lo, hi = acct.kv_budget_interval
    assert (lo, hi) == (scratch + 20 * per, scratch + 21 * per - 1)
    assert slots_from_budget(d, lo) == slots_from_budget(d, hi) == 20
    assert slots_from_budget(d, lo - 1) == 19 and slots_from_budget(d, hi + 1) == 21
    assert acct.slots_per_partition == 20 and acct.budget_source == SLOTS
    assert acct.remainder.hi - acct.remainder.lo == per - 1
    for p in acct.predictions():
        assert p["slots_min"] <= p["slots"] <= p["slots_max"]
    # the interval shifts by the change in the itemized lines, the slot bounds follow from its ends
    other = d.replace(limits=d.limits.replace(long_prefill_token_threshold=8192))
    shift = used_before_kv(itemized_lines(other)) - used_before_kv(itemized_lines(d))
    p = next(p for p in acct.predictions() if (p["max_model_len"], p["chunk"]) == (1024, 8192))
    assert p["slots_min"] == slots_or_zero(other, lo - shift) and p["slots_max"] == slots_or_zero(other, hi - shift)


def test_a_boot_at_the_cap_leaves_the_interval_open_above():
    d = flash(1024, 128)
    acct = hbm_account(d, measured=Measurement(SLOTS, 64))
    assert acct.kv_budget_interval == (scratch_bytes(d) + 64 * bytes_per_slot(d), None)
    assert acct.remainder.lo is None and acct.slots_per_partition == 64
    assert all(p["slots_max"] == 64 for p in acct.predictions())


def test_total_kv_pages_as_upstream():
    d = flash(1024, 128)                             # ori: 9 blocks per request
    a = hbm_account(d, total_kv_pages=9 * 5 + 8)
    assert a.slots_per_partition == 5 and a.budget_source == "total_kv_pages"
    assert hbm_account(d, total_kv_pages=9 * 100).slots_per_partition == 64      # capped as init_kv_cache does
    with pytest.raises(CapacityError, match="total_kv_pages=8.*>= ori blocks per request = 9"):
        hbm_account(d, total_kv_pages=8)
    with pytest.raises(ConfigError, match="total_kv_pages"):
        hbm_account(d, total_kv_pages=90, measured=Measurement(SLOTS, 3))


def test_allocation_is_tested_against_the_physically_free_hbm_and_halves():
    d = flash(1024, 8192)                            # 376 MB per slot, ori 37 blocks per request
    acct = hbm_account(d)
    free = HBM - acct.used_before_kv - acct.scratch_bytes
    n = free // acct.bytes_per_slot
    assert acct.allocates(n) and not acct.allocates(n + 1)
    assert acct.requested_slots == acct.slots_per_partition < n          # the 0.9 budget always allocates
    # upstream's page knob asks for 64 slots; the pools do not fit, so they halve to the largest that does
    pages = hbm_account(d, total_kv_pages=64 * 37)
    got = pages.slots_per_partition
    assert pages.requested_slots == 64 and got in (1, 2, 4, 8, 16, 32) and got <= n < 2 * got


@pytest.mark.parametrize("m,match", [
    (Measurement(SLOTS, 0), "measured_slots=0"),
    (Measurement(SLOTS, 65), "measured_slots=65"),
    (Measurement(FREE, -1), "measured_free_bytes=-1"),
    (Measurement(USED, HBM + 1), "measured_used_bytes="),
])
def test_impossible_measurements_are_rejected(m, match):
    with pytest.raises(ConfigError, match=match):
        hbm_account(flash(1024, 128), measured=m)


def test_unknown_measurement_kind():
    with pytest.raises(ConfigError, match="kind='free'"):
        Measurement("free", 1)
