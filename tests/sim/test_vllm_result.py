"""The `vllm bench serve` result file: vLLM's keys, units and formulas, recomputed here from the
file's own per-request arrays; the vLLM-named flags and their bad inputs."""
import json
import math

import numpy as np
import pytest

from simtest import make_dep
from twin.cli import main
from twin.sim.acceptance import ForcedAcceptance
from twin.sim.run import SimConfig, simulate
from twin.sim.vllm_result import parse_percentiles, peaks, percentile_key, slo_met
from twin.sim.workload import LengthDist, WorkloadSpec, default_spec, generate

# the keys `vllm bench serve --save-result --save-detailed` writes for a generation run, read
# from vllm/benchmarks/serve.py (main_async's setup and traffic keys, benchmark()'s result, the
# spec_decode_* block, and process_one_metric's statistics for ttft, tpot, itl and e2el)
VLLM_KEYS = {"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
             "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
             "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
             "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls",
             "latencies", "start_times", "queue_times", "errors", "max_output_tokens_per_s",
             "max_concurrent_requests", "rtfx"}
SPEC_KEYS = {"spec_decode_acceptance_rate", "spec_decode_acceptance_length", "spec_decode_num_drafts",
             "spec_decode_draft_tokens", "spec_decode_accepted_tokens", "spec_decode_per_position_acceptance_rates"}
PCTS = (50.0, 90.0, 99.0)


def stat_keys(pcts):
    return {f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std")} | \
        {percentile_key(m, p) for m in ("ttft", "tpot", "itl", "e2el") for p in pcts}


def spec(**kw):
    base = dict(num_requests=48, rate=40.0, prompt=LengthDist("uniform", 300, 200, 33, 700),
                output=LengthDist("uniform", 40, 30, 1, 80), eos_fraction=0.2, seed=3)
    base.update(kw)
    return WorkloadSpec(**base)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run where some requests are rejected (prompt over the context), some stop at EOS and
    some emit a single token, with SLOs given: every branch of the formulas is taken."""
    out = tmp_path_factory.mktemp("vllm")
    reqs = generate(spec())
    reqs[0].prompt = np.arange(2, 2 + 1100, dtype=np.int32)        # over max_model_len: fails
    reqs[0].prompt_len = 1100
    reqs[1].sampling = type(reqs[1].sampling)(1, 1, False, ())       # a one-token request
    reqs[1].max_new_tokens = 1
    res = simulate(SimConfig(make_dep(), reqs, slo_ms={"ttft": 300.0, "tpot": 12.0}))
    res.write(out, plots=False, trace=False, traffic={"request_rate": 40.0, "burstiness": 1.0}, percentiles=PCTS)
    return res, json.loads((out / "vllm_result.json").read_text()), json.loads((out / "summary.json").read_text())


def test_the_file_has_exactly_vllms_keys(run):
    _, v, _ = run
    assert set(v) == VLLM_KEYS | SPEC_KEYS | stat_keys(PCTS)
    assert v["num_prompts"] == 48 and v["request_rate"] == 40.0 and v["burstiness"] == 1.0
    assert v["max_concurrency"] is None and v["failed"] >= 1


def test_summary_figures_recompute_from_the_per_request_arrays(run):
    _, v, _ = run
    ok = np.array([e == "" for e in v["errors"]])
    n = len(v["errors"])
    assert all(len(v[k]) == n for k in ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times"))
    assert v["completed"] == ok.sum() and v["failed"] == n - ok.sum()
    out = np.array(v["output_lens"])
    assert (out[~ok] == 0).all() and 1 in out[ok]
    ttft, lat = np.array(v["ttfts"])[ok], np.array(v["latencies"])[ok]
    dur = v["duration"]
    assert v["total_output_tokens"] == out.sum()
    assert v["total_input_tokens"] == np.array(v["input_lens"])[ok].sum()
    assert v["request_throughput"] == pytest.approx(ok.sum() / dur, rel=1e-12)
    assert v["output_throughput"] == pytest.approx(out.sum() / dur, rel=1e-12)
    assert v["total_token_throughput"] == pytest.approx((out.sum() + v["total_input_tokens"]) / dur, rel=1e-12)
    multi = out[ok] > 1
    tpot = (lat[multi] - ttft[multi]) / (out[ok][multi] - 1)
    itl = np.array([g for o, gaps in zip(ok, v["itls"]) if o for g in gaps])
    # the arrays are seconds, the statistics milliseconds; the same NumPy reductions on the same
    # values, only the order of the * 1000 may differ: a few ulps
    for name, x in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", lat)):
        assert v[f"mean_{name}_ms"] == pytest.approx(x.mean() * 1e3, rel=1e-12)
        assert v[f"median_{name}_ms"] == pytest.approx(np.median(x) * 1e3, rel=1e-12)
        assert v[f"std_{name}_ms"] == pytest.approx(x.std() * 1e3, rel=1e-9)
        for p in PCTS:
            assert v[percentile_key(name, p)] == pytest.approx(np.percentile(x, p) * 1e3, rel=1e-12)
    # goodput: a one-token request's TPOT counts as 0 (vLLM); SLOs in ms against seconds
    all_tpot = np.zeros(ok.sum())
    all_tpot[multi] = tpot
    good = ((ttft <= 0.300) & (all_tpot <= 0.012)).sum()
    assert 0 < good < ok.sum()
    assert v["request_goodput"] == pytest.approx(good / dur, rel=1e-12)
    # an ITL list has one gap fewer than the request's streamed chunks; E2EL = TTFT + its gaps
    for o, t, gaps, l in zip(ok, v["ttfts"], v["itls"], v["latencies"]):
        if o:
            assert l == pytest.approx(t + sum(gaps), abs=1e-9)


def test_peaks_recompute_independently(run):
    _, v, _ = run
    ok = [e == "" for e in v["errors"]]
    iv = [(s, s + l) for s, l, o in zip(v["start_times"], v["latencies"], ok) if o]
    # peak concurrency by brute force at every start (half-open intervals)
    brute = max(sum(1 for a, b in iv if a <= s < b) for s, _ in iv)
    assert v["max_concurrent_requests"] == brute
    span = max(b for _, b in iv) - min(a for a, _ in iv)
    # the busiest second holds at least the mean of the seconds and at most every token
    assert v["total_output_tokens"] / (math.ceil(span) + 1) <= v["max_output_tokens_per_s"] <= v["total_output_tokens"]


def test_slo_met_on_a_small_case():
    """Inclusive limits in ms against seconds; a one-token request's TPOT is 0, so it meets any
    TPOT SLO; a request that did not complete meets none, whatever its times."""
    ok = [True, True, True, False]
    ttft = [0.300, 0.100, 0.301, 0.0]
    e2el = [0.300 + 9 * 0.015, 0.100, 0.301, 0.0]        # the first: TPOT 15 ms
    n = [10, 1, 1, 5]
    assert slo_met(ok, ttft, e2el, n, {"ttft": 300, "tpot": 20}).tolist() == [True, True, False, False]
    assert slo_met(ok, ttft, e2el, n, {"tpot": 10}).tolist() == [False, True, True, False]
    assert slo_met(ok, ttft, e2el, n, {}).tolist() == ok


def test_peaks_on_a_small_case():
    # two back-to-back requests never overlap on half-open intervals; the third overlaps both
    assert peaks([0.0, 1.0], [1.0, 1.0], [[0.5, 0.9], [1.2]], [[3, 4], [8]])[1] == 1
    tok, conc = peaks([0.0, 1.0, 0.5], [1.0, 1.0, 1.0], [[0.5, 0.9], [1.2], [1.3]], [[3, 4], [8], [2]])
    assert conc == 2 and tok == 10.0        # second 1 holds 8 + 2 tokens, second 0 holds 7


def test_the_file_agrees_with_summary_json(run):
    _, v, s = run
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            key = f"{stat}_{name}_ms" if stat in ("mean", "median") else f"{stat}_{name}_ms"
            assert v[key] == pytest.approx(s[name][f"{stat}_ms"], rel=1e-12), key
    assert v["completed"] == s["completed"] and v["duration"] == s["duration_s"]
    # one goodput rule (vllm_result.slo_met) counts both: the same count over the same duration
    assert v["request_goodput"] == s["request_goodput"]
    acc = s["acceptance"]
    # the summary's acceptance is vllm_result.spec_decode of the same histogram: the same figures
    assert v["spec_decode_acceptance_length"] == acc["mean_accepted_length"]
    assert v["spec_decode_per_position_acceptance_rates"] == acc["acceptance_per_position"]
    assert v["spec_decode_num_drafts"] == acc["verifies"] and v["spec_decode_draft_tokens"] == 7 * acc["verifies"]


def test_streams_account_for_every_output_token(run):
    res, v, _ = run
    for rid, n, done in zip(res.requests["request_id"], res.requests["output_len"], res.requests["completed"]):
        if done:
            assert sum(c[1] for c in res.recorder.req[rid]["stream"]) == n


def test_forced_acceptance_gives_the_spec_decode_block_exactly():
    # every verify accepts 2 drafts + the bonus: rate 2/7, length 3, positions 1, 1, then 0
    res = simulate(SimConfig(make_dep(), generate(spec(num_requests=12, eos_fraction=0.0)),
                             acceptance=ForcedAcceptance(3)))
    v = res.bench_result()
    assert v["spec_decode_acceptance_length"] == 3.0
    assert v["spec_decode_acceptance_rate"] == pytest.approx(200 / 7, rel=1e-12)
    assert v["spec_decode_accepted_tokens"] == 2 * v["spec_decode_num_drafts"]
    assert v["spec_decode_per_position_acceptance_rates"] == [1.0, 1.0, 0, 0, 0, 0, 0]
    assert v["request_rate"] == "inf" and v["request_goodput"] is None


def test_max_concurrency_is_a_closed_loop():
    reqs = generate(spec(num_requests=24, rate=float("inf"), arrival="burst", eos_fraction=0.0))
    res = simulate(SimConfig(make_dep(), reqs, max_concurrency=3))
    v = res.bench_result()
    assert v["max_concurrency"] == 3 and v["completed"] == 24
    assert v["max_concurrent_requests"] == 3
    iv = sorted((s, s + l) for s, l in zip(v["start_times"], v["latencies"]))
    assert max(sum(1 for a, b in iv if a <= s < b) for s, _ in iv) <= 3
    # sent when one finishes: later requests waited on the client, their clock starts when sent
    assert sum(q > 0 for q in v["queue_times"]) >= 20
    for s, q in zip(v["start_times"], v["queue_times"]):
        assert s == pytest.approx(q, abs=1e-12)          # all intended at t = 0


def test_percentile_keys_follow_vllm():
    assert percentile_key("ttft", 99.0) == "p99_ttft_ms" and percentile_key("itl", 99.9) == "p99.9_itl_ms"
    assert parse_percentiles("50,90,99") == (50.0, 90.0, 99.0)


# ---- the flags ------------------------------------------------------------------------------
def cli(tmp_path, *args):
    return main(["simulate", "--requests", "16", "--max-model-len", "2048", "--out", str(tmp_path),
                 "--no-plots", "--json", *args])


def test_vllm_named_flags(tmp_path, capsys):
    assert cli(tmp_path / "a", "--request-rate", "25", "--goodput", "ttft:400", "tpot:40",
               "--metric-percentiles", "50,99.9", "--burstiness", "1") == 0
    a = json.loads((tmp_path / "a" / "vllm_result.json").read_text())
    (tmp_path / "cv1.json").write_text(json.dumps({**default_spec().to_dict(), "arrival": "gamma", "gamma_cv": 1.0}))
    assert cli(tmp_path / "b", "--workload", str(tmp_path / "cv1.json"), "--rate", "25", "--slo-ttft", "400",
               "--slo-tpot", "40") == 0
    b = json.loads((tmp_path / "b" / "vllm_result.json").read_text())
    capsys.readouterr()
    # --request-rate is --rate, --goodput is --slo-*, burstiness 1 is gamma with CV 1: the same run
    # (the same arrivals from the same seed, so the same scheduling and the same float operations)
    assert a["start_times"] == b["start_times"] and a["ttfts"] == b["ttfts"]
    assert a["request_goodput"] == b["request_goodput"] is not None
    assert a["request_rate"] == 25.0 and a["burstiness"] == 1.0
    assert "p99.9_itl_ms" in a and "p50_ttft_ms" in a and "p99_ttft_ms" not in a
    assert cli(tmp_path / "c", "--request-rate", "25", "--burstiness", "4") == 0
    c = json.loads((tmp_path / "c" / "vllm_result.json").read_text())
    assert c["burstiness"] == pytest.approx(4.0) and c["start_times"] != a["start_times"]
    assert cli(tmp_path / "d", "--max-concurrency", "4") == 0
    assert json.loads((tmp_path / "d" / "vllm_result.json").read_text())["max_concurrent_requests"] <= 4


@pytest.mark.parametrize("args, names", [
    (("--goodput", "ttft"), "--goodput"),
    (("--goodput", "ttfb:100"), "--goodput"),
    (("--goodput", "ttft:-1"), "--goodput"),
    (("--goodput", "ttft:1", "ttft:2"), "--goodput"),
    (("--goodput", "ttft:500", "--slo-ttft", "400"), "--goodput"),
    (("--metric-percentiles", "99,101"), "--metric-percentiles"),
    (("--metric-percentiles", "p99"), "--metric-percentiles"),
    (("--burstiness", "0"), "--burstiness"),
    (("--burstiness", "2", "--arrival", "poisson"), "--burstiness"),
    (("--max-concurrency", "0"), "max_concurrency"),
])
def test_bad_vllm_flags_exit_2_with_one_line(tmp_path, capsys, args, names):
    assert cli(tmp_path, *args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and names in err and "allowed" in err and "Traceback" not in err
