"""Lowering then validating round-trips for random valid batches (hypothesis), on the small
presets over every topology they may run on, and on the FLASH binding (few, small dispatches:
a FLASH prefill table is [16, Q, 524288] int32)."""
import math
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))

from lowering_batches import Pools, decode_batch, drafter_batch, prefill_batch  # noqa: E402

from twin.abi import constants as C, deployment  # noqa: E402
from twin.abi.lowering import (LoweringContext, lower_bootstrap, lower_decode, lower_drafter, lower_fused,  # noqa: E402
                               lower_markov, lower_prefill, seeding_waves, validate)

SMALL_TOPOLOGIES = [("tiny", 1, 1), ("tiny", 4, 4), ("tiny", 4, 16), ("small", 4, 8), ("small", 4, 16)]
_CTX = {}


def ctx_of(preset, tp, ep, k, chunk):
    key = (preset, tp, ep, k, chunk)
    if key not in _CTX:
        dep = deployment(preset, tp=tp, ep=ep, max_model_len=2048, max_num_seqs=64 * (ep // tp),
                         long_prefill_token_threshold=chunk, max_num_batched_tokens=8192, num_speculative_tokens=k)
        _CTX[key] = LoweringContext(dep, slots=64)
    return _CTX[key]


contexts = st.tuples(st.sampled_from(SMALL_TOPOLOGIES), st.sampled_from([0, 7]), st.sampled_from([16, 128, 1024])
                     ).map(lambda t: ctx_of(*t[0], t[1], t[2]))


@st.composite
def prefill_specs(draw, ctx):
    n = draw(st.integers(1, 8))
    specs, load = [], {}
    for _ in range(n):
        g = draw(st.integers(0, ctx.partitions - 1))
        size = draw(st.integers(1, ctx.chunk_limit))
        if load.get(g, 0) + size > C.PREFILL_TOKENS_PER_GROUP:
            continue
        start = draw(st.integers(0, ctx.max_position - size))
        start = draw(st.sampled_from([start, start - start % 128]))    # prefix hits are 128-aligned
        load[g] = load.get(g, 0) + size
        specs.append((g, start, size))
    return specs or [(0, 0, 1)]


@st.composite
def decode_specs(draw, ctx, k):
    per_group_cap = min(C.DECODE_BATCH, 16 if ctx.tp == 1 and k else C.DECODE_BATCH)
    specs = []
    for g in range(ctx.partitions):
        n = draw(st.integers(0, min(per_group_cap, 6)))
        leases = draw(st.lists(st.integers(0, 63), min_size=n, max_size=n, unique=True))
        for lease in leases:
            anchor = draw(st.integers(0, ctx.max_position - 1))
            specs.append((g, anchor, draw(st.booleans()) and k > 0, lease if k else None))
    return specs or [(0, 5, k > 0, 0 if k else None)]


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(ctx=contexts, data=st.data())
def test_prefill_round_trips(ctx, data):
    b = prefill_batch(ctx, data.draw(prefill_specs(ctx)), seed=data.draw(st.integers(0, 9)))
    d = lower_prefill(b, ctx)
    validate(d, ctx)
    # and the facts the lowering promised: P from the largest group, every request's last row sampled
    loads = {}
    for it in b.items:
        loads[it.partition] = loads.get(it.partition, 0) + it.num_tokens
    assert d.meta["P"] == math.ceil(max(loads.values()) / ctx.tp) * ctx.tp
    for it in b.items:
        pl = d.meta["placement"][it.request_id]
        r, k = pl["sampled_slot"]
        assert d.args["logit_row_indices"][r, k] == pl["offset"] + pl["len"] - 1
        assert d.args["position_ids_full"][r, pl["offset"] + pl["len"] - 1] == it.end - 1


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(ctx=contexts, data=st.data())
def test_decode_round_trips_and_inactive_rows_never_publish(ctx, data):
    k = ctx.deployment.k
    b = decode_batch(ctx, data.draw(decode_specs(ctx, k)), k=k)
    d = lower_fused(b, ctx) if k else lower_decode(b, ctx)
    validate(d, ctx)
    if not k:
        a = d.args
        for rid, req in d.meta["requests"].items():
            pl = d.meta["placement"][rid]
            r0 = ctx.group_ranks(pl["group"]).start
            rows = slice(pl["stream_slot"] * 8, pl["stream_slot"] * 8 + 8)
            live = a["swa_slot_mapping"][r0, rows] >= 0
            assert live.sum() == req["commit"] and live[:req["commit"]].all()
        per = ctx.local_requests
        for g in range(ctx.partitions):
            r0 = ctx.group_ranks(g).start
            for s in range(64):
                if (s % per) >= a["num_tokens_per_owner"][r0 + s // per] // 8:
                    for n in ("swa_slot_mapping", "hca_state_slot_mapping", "csa_state_slot_mapping",
                              "csa_inner_state_slot_mapping", "hca_cmp_slot_mapping", "csa_cmp_slot_mapping",
                              "csa_idx_slot_mapping"):
                        assert (a[n][r0, s * 8:s * 8 + 8] == -1).all()


@settings(max_examples=30, suppress_health_check=[HealthCheck.too_slow])
@given(ctx=contexts.filter(lambda c: c.deployment.k == 7), data=st.data(), seed=st.booleans())
def test_drafter_programs_round_trip_and_padding_never_publishes(ctx, data, seed):
    specs = []
    for g in range(ctx.partitions):
        n = data.draw(st.integers(0, 16 if ctx.tp == 1 else 5))
        for lease in data.draw(st.lists(st.integers(0, 63), min_size=n, max_size=n, unique=True)):
            anchor = data.draw(st.integers(0, ctx.max_position - 8))
            specs.append((g, lease, anchor, data.draw(st.integers(1, min(8, anchor + 1)))))
    specs = specs or [(0, 0, 10, 1)]
    b = drafter_batch(ctx, specs, seed=seed)
    batches = [type(b)(tuple(w)) for w in seeding_waves(b.items)] if seed else [b]
    for wave in batches:
        progs = ("l3_dspark_draft_step_device_state",) if seed else ("l3_dspark_drafter", "l3_dspark_draft_step_device_state")
        for prog in progs:
            d = lower_drafter(wave, ctx, program=prog)
            validate(d, ctx)
            a = d.args
            pad = a["context_group_position_ids"] < 0
            assert (a["context_group_slot_mapping"].transpose(1, 0, 2)[:, pad] == -1).all()
            assert ((a["num_sampled"] == 0) | (a["num_sampled"] == int(not seed))).all()
        validate(lower_markov(wave, ctx), ctx)


# ---- FLASH ---------------------------------------------------------------------------------------
FLASH_CTX = LoweringContext(deployment("flash", ep=16, max_model_len=C.MAX_MODEL_LEN_CEILING, max_num_seqs=64,
                                       long_prefill_token_threshold=512, max_num_batched_tokens=8192), slots=1)


@settings(max_examples=4, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_flash_binding_round_trips(data):
    ctx = FLASH_CTX
    pools = Pools(ctx, data.draw(st.integers(0, 99)))
    g = data.draw(st.integers(0, 3))
    start = data.draw(st.sampled_from([0, 128 * 1000, C.MAX_MODEL_LEN_CEILING - 512]))
    pb = prefill_batch(ctx, [(g, start, data.draw(st.integers(1, 512)))], pools=pools)
    validate(lower_prefill(pb, ctx), ctx)
    anchor = data.draw(st.integers(0, C.MAX_MODEL_LEN_CEILING - 1))
    db = decode_batch(ctx, [(g, anchor, True, data.draw(st.integers(0, 63)))], pools=Pools(ctx, 1))
    validate(lower_fused(db, ctx), ctx)
    dr = drafter_batch(ctx, [(g, db.items[0].lease, min(anchor, C.MAX_MODEL_LEN_CEILING - 8), 1)])
    validate(lower_drafter(dr, ctx), ctx)


def test_flash_split_decode_and_bootstrap_round_trip():
    ctx = FLASH_CTX
    pools = Pools(ctx, 5)
    db = decode_batch(ctx, [(0, 1_048_000, True, 3), (2, 77, False, 9), (3, C.MAX_MODEL_LEN_CEILING - 3, True, 40)],
                      pools=pools)
    d = lower_decode(db, ctx)
    validate(d, ctx)
    assert d.args["hca_compress_state_block_table"].shape == (16, 64, 131072)
    assert d.meta["requests"]["d2"]["commit"] == 1          # the window would pass the 1M ceiling
    boot = lower_bootstrap(drafter_batch(ctx, [(1, 63, 5000, 0)], seed=True), ctx)
    validate(boot, ctx)
    assert boot.args["block_tables"].shape == (16, 3, 4, 32768)
