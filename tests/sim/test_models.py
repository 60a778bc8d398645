"""Cost model, acceptance models and workloads."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simtest import make_dep
from twin.abi.errors import ConfigError
from twin.sim.acceptance import ConditionalAcceptance, ForcedAcceptance, parse_acceptance
from twin.sim.costmodel import Calibration, CostModel, DeviceLimits, Routing
from twin.sim.workload import LengthDist, WorkloadSpec, documented_run, generate, load_jsonl, save_jsonl

DEP = make_dep(max_num_seqs=256)
OWN = lambda n: [i % 4 for i in range(n)]   # noqa: E731


def cm(**kw):
    return CostModel(DEP, 64, **kw)


# ---- cost model ---------------------------------------------------------------------------------
def test_device_limits_are_data_with_named_errors(tmp_path):
    d = DeviceLimits.load()
    assert d.hbm_bytes == 64 * 2**30 and d.int8_flops == 2 * d.bf16_flops and d.link_bw == 392e9
    assert DeviceLimits.load(hbm_bw=2e12).hbm_bw == 2e12
    with pytest.raises(ConfigError, match="device"):
        DeviceLimits.load("h100")
    with pytest.raises(ConfigError, match="hbm_bandwidth"):
        DeviceLimits.load(hbm_bandwidth=1)
    with pytest.raises(ConfigError, match="hbm_bw"):
        DeviceLimits.load(hbm_bw=-1)


def test_weights_come_from_the_abi_binding():
    m = cm()
    w = m.w["l3_decode_fwd_dspark"]
    # one routed expert of one layer: w1, w3 (inter x hidden) and w2 (hidden x inter) INT8 plus FP32 scales
    f = DEP.model
    assert w["expert_bytes"]["target"] == 3 * f.moe_intermediate_size * f.hidden_size + 4 * (2 * f.moe_intermediate_size + f.hidden_size)
    assert w["moe_layers"] == {"target": 43, "draft": 3}
    assert w["dense_bytes"] > m.w["l3_prefill_fwd"]["dense_bytes"]        # the fused program carries the drafter


def test_decode_under_the_fixed_tile_costs_the_same_for_any_count_except_attention():
    m = cm()
    t1, p1 = m.decode([[500], [], [], []], [[0], [], [], []])
    t2, p2 = m.decode([[500] * 64] * 4, [OWN(64)] * 4)
    assert p1["moe"] == p2["moe"] and p1["dense"] == p2["dense"]
    assert p2["attention"] > p1["attention"] and t2 > t1


def test_attention_grows_with_context_and_the_busiest_owner_rank_sets_the_time():
    m = cm()
    short = m.decode([[100] * 16] * 4, [OWN(16)] * 4)[1]["attention"]
    long = m.decode([[1000] * 16] * 4, [OWN(16)] * 4)[1]["attention"]
    skewed = m.decode([[1000] * 16] * 4, [[0] * 16] * 4)[1]["attention"]
    assert short < long < skewed


@given(st.lists(st.integers(1, 2048), min_size=1, max_size=8))
@settings(max_examples=25)
def test_prefill_time_grows_with_tokens(chunks):
    m = cm()
    a = m.prefill([[(n, 0) for n in chunks], [], [], []])[0]
    b = m.prefill([[(n + 64, 0) for n in chunks], [], [], []])[0]
    assert b >= a > 0


def test_moe_is_the_slowest_ep_rank():
    # many tokens: the hot rank's expert FLOPs set the layer time, so skew is slower than balance
    bal = cm(routing=Routing("balanced")).moe_time(8192, "target")
    skew = cm(routing=Routing("skewed", skew=1.5)).moe_time(8192, "target")
    assert skew > bal
    # few tokens: weight reads dominate and a skewed rank touches fewer distinct experts
    assert cm(routing=Routing("skewed", skew=1.5)).moe_time(256, "target") < cm(routing=Routing("balanced")).moe_time(256, "target")
    # with few tokens not every expert is touched: random routing reads fewer experts than all
    m = cm(routing=Routing("random"))
    E = DEP.model.n_routed_experts
    full = 43 * (E // 16) * m.w[m.decode_program]["expert_bytes"]["target"] / m.bw
    assert m.moe_time(64, "target") < full


def _moe_layer_by_layer(m: CostModel, tokens: int, key: str, program: str | None, rng) -> float:
    """The MoE rule read literally: layer after layer, one routing draw per drawn layer."""
    w = m.w[program or m.decode_program]
    n_layers, E = w["moe_layers"][key], DEP.model.n_routed_experts
    pairs = -(-tokens // m.moe_bucket) * m.moe_bucket * DEP.model.num_experts_per_tok
    total = 0.0
    for layer in range(n_layers):
        if m.routing.policy == "balanced" and layer >= DEP.model.num_hash_layers:
            per = np.full(E, pairs / E)
        else:
            per = rng.multinomial(pairs, m._probs(layer)).astype(float)
        by_rank = per.reshape(m.R, -1)
        t = np.maximum((by_rank > 0).sum(axis=1) * w["expert_bytes"][key] / m.bw,
                       by_rank.sum(axis=1) * m.expert_flops / m.f8)
        total += float(t.max())
    return total


@pytest.mark.parametrize("policy", ["random", "balanced", "skewed"])
def test_moe_draws_every_layer_at_once_as_layer_by_layer(policy):
    # one multinomial call over the layers is the per-layer stream: same bits, same draws left;
    # a repeated bucket draws nothing
    m = cm(routing=Routing(policy), seed=5)
    rng = np.random.default_rng(5)
    first: dict = {}
    for tokens, key, program in ((64, "target", None), (700, "target", "l3_prefill_fwd"), (3000, "draft", "seed"),
                                 (900, "draft", None), (40, "target", None), (5000, "target", None)):
        bucket = (key, -(-tokens // m.moe_bucket), program)
        if bucket not in first:
            first[bucket] = _moe_layer_by_layer(m, tokens, key, program, rng)
        assert m.moe_time(tokens, key, program) == first[bucket], (tokens, key, program)
    assert len(first) == 5 and m._rng.random() == rng.random()


def test_trace_routing_and_calibration_from_a_profile(tmp_path):
    E = DEP.model.n_routed_experts
    hot = [[1000.0 if e < 16 else 1.0 for e in range(E)]] * 43        # all load on rank 0's experts
    (tmp_path / "trace.json").write_text(json.dumps({"layers": hot}))
    tr = cm(routing=Routing.from_trace_file(tmp_path / "trace.json")).moe_time(2048, "target")
    assert tr > cm(routing=Routing("balanced")).moe_time(2048, "target")
    m = cm()
    pred = m.decode([[1024] * 64] * 4, [OWN(64)] * 4)[0]
    (tmp_path / "profile.json").write_text(json.dumps({"points": [
        {"kind": "decode", "seconds": 2 * pred, "requests_per_group": [64, 64, 64, 64], "context": 1024}]}))
    cal = Calibration.from_profile(tmp_path / "profile.json", m)
    assert cal.decode == pytest.approx(2.0) and cal.prefill == 1.0
    assert m.with_calibration(cal).decode([[1024] * 64] * 4, [OWN(64)] * 4)[0] == pytest.approx(2 * pred)
    with pytest.raises(ConfigError, match="routing"):
        Routing("zipf")


# ---- acceptance -----------------------------------------------------------------------------------
def test_conditional_acceptance_matches_its_expectation():
    a = ConditionalAcceptance()
    rng = np.random.default_rng(0)
    c = a.counts(200_000, np.ones(200_000, bool), rng)
    assert c.min() >= 1 and c.max() <= 8
    assert c.mean() == pytest.approx(a.expected_length(), rel=0.01)
    # per position: P(count >= i + 2 | count >= i + 1) is the i-th conditional rate
    for i, r in enumerate(a.rates):
        assert (c >= i + 2).sum() / (c >= i + 1).sum() == pytest.approx(r, abs=0.01)
    assert (a.counts(10, np.zeros(10, bool), rng) == 1).all()      # window does not fit: fallback


def test_forced_acceptance_and_parsing():
    assert (ForcedAcceptance(5).counts(4, np.array([1, 1, 0, 1], bool), None) == [5, 5, 1, 5]).all()
    assert parse_acceptance("forced:3") == ForcedAcceptance(3)
    assert parse_acceptance("rates:" + ",".join(["0.5"] * 7)).rates == (0.5,) * 7
    for bad in ("forced:9", "rates:0.5,0.5", "often"):
        with pytest.raises(ConfigError):
            parse_acceptance(bad)


# ---- workloads ------------------------------------------------------------------------------------
def test_poisson_and_gamma_arrivals_have_the_requested_rate_and_burstiness():
    for arrival, cv in (("poisson", 1.0), ("gamma", 3.0)):
        reqs = generate(WorkloadSpec(num_requests=4000, arrival=arrival, rate=50, gamma_cv=cv,
                                     prompt=LengthDist("fixed", 4), output=LengthDist("fixed", 2)))
        gaps = np.diff([r.arrival for r in reqs])
        assert gaps.mean() == pytest.approx(1 / 50, rel=0.1)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)


def test_lengths_prefixes_and_planted_tokens():
    spec = WorkloadSpec(num_requests=300, prompt=LengthDist("uniform", 300, 100, 200, 400),
                        output=LengthDist("lognormal", 50, 0.5, 5, 80), prefix_groups=2, prefix_len=256,
                        prefix_fraction=0.5, eos_fraction=0.5, stop_fraction=0.3)
    reqs = generate(spec)
    assert all(200 <= r.prompt_len <= 400 for r in reqs) and all(5 <= r.sampling.max_new_tokens <= 80 for r in reqs)
    grouped = [r for r in reqs if r.tag]
    assert 100 < len(grouped) < 200
    a, b = [r for r in grouped if r.tag == "prefix0"][:2]
    assert (a.prompt[:256] == b.prompt[:256]).all()
    assert any(1 in r.script.values() for r in reqs) and any(r.sampling.stop for r in reqs)
    assert generate(spec)[7].prompt.tolist() == reqs[7].prompt.tolist()      # deterministic


def test_jsonl_round_trip_and_errors(tmp_path):
    reqs = generate(WorkloadSpec(num_requests=5, stop_fraction=1.0, prompt=LengthDist("fixed", 10),
                                 output=LengthDist("fixed", 20)))
    save_jsonl(reqs, tmp_path / "t.jsonl")
    back = load_jsonl(tmp_path / "t.jsonl")
    assert [r.prompt.tolist() for r in back] == [r.prompt.tolist() for r in reqs]
    assert [r.script for r in back] == [r.script for r in reqs] and back[0].sampling.stop == reqs[0].sampling.stop
    (tmp_path / "bad.jsonl").write_text('{"id": "x", "max_new_tokens": 3}\n')
    with pytest.raises(ConfigError, match="prompt"):
        load_jsonl(tmp_path / "bad.jsonl")
    with pytest.raises(ConfigError, match="workload key"):
        WorkloadSpec.from_dict({"rps": 3})
    with pytest.raises(ConfigError, match="arrival"):
        WorkloadSpec(arrival="uniform")


def test_documented_run_workload():
    spec, lim = documented_run()
    reqs = generate(spec)
    assert len(reqs) == 32 and all(33 <= r.prompt_len <= 512 for r in reqs)
    assert lim["long_prefill_token_threshold"] == 128 and lim["num_speculative_tokens"] == 7


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), fixed=st.booleans())
def test_cost_model_list_forms_flatten_into_the_array_forms(seed, fixed):
    """decode / prefill flatten their per-group lists into decode_arrays / prefill_arrays; integer
    contexts read a per-context table that must equal the float formula; a few prefill rows are
    priced in Python, many by numpy, with the same bits (bincount adds its weights in input order,
    as the loop does)."""
    dep = make_dep(max_model_len=512, max_num_seqs=48, max_num_batched_tokens=1024)
    rng = np.random.default_rng(seed)
    a, b = CostModel(dep, 3, fixed_tile=fixed), CostModel(dep, 3, fixed_tile=fixed)
    n = int(rng.integers(1, 64))
    ctx, g, o = rng.integers(1, 512, n).astype(float), rng.integers(0, 4, n), rng.integers(0, 4, n)
    want = a.decode([list(ctx[g == k]) for k in range(4)], [list(o[g == k]) for k in range(4)])
    got = b.decode_arrays(ctx, g, o)
    # the flattening reorders the per-group rows: a reordered float sum, so a relative tolerance
    assert got[0] == pytest.approx(want[0], rel=1e-12) and got[1].keys() == want[1].keys()
    # the table holds the float formula's values at each integer context: same operations, same bits
    assert b.decode_arrays(ctx.astype(np.int64), g, o)[0] == got[0]
    tok, start = rng.integers(1, 129, n), rng.integers(0, 400, n)
    want = a.prefill([[(int(x), int(y)) for x, y, k in zip(tok, start, g) if k == q] for q in range(4)])
    got = b.prefill_arrays(tok, start.astype(float), g)
    assert got[0] == pytest.approx(want[0], rel=1e-12)
    per, attn = b._prefill_rows(tok.tolist(), start.astype(float).tolist(), g.tolist())
    assert attn == b._prefill_attention(tok, start.astype(float), g)
    assert per == np.bincount(g, weights=tok, minlength=4).tolist()
