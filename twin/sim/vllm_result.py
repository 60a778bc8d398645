"""The `vllm bench serve` result file: its flat keys, units and formulas, from a simulated run.

Keys and meanings follow vLLM's `vllm/benchmarks/serve.py` (`benchmark()` and `main_async()`):

- per-request arrays over every request, in seconds: `input_lens`, `output_lens` (0 for a failed
  request), `ttfts`, `itls` (one list per request: the gaps between its streamed chunks),
  `latencies` (E2EL), `start_times` (when the client sent it), `queue_times` (client-side wait
  under `--max-concurrency`), `errors` ("" for a success);
- summary figures over the successful requests, in milliseconds: `mean_/median_/std_/p<NN>_`
  `{ttft,tpot,itl,e2el}_ms` (std is the population deviation, NumPy's default; TPOT only for
  requests with more than one output token; an empty set gives 0, as `np.mean([] or 0)` does);
- throughput over `duration` (s): `request_throughput`, `output_throughput`,
  `total_token_throughput`; `request_goodput` only when SLOs are given (a request is good when
  every SLO is met; a one-token request's TPOT counts as 0);
- `max_output_tokens_per_s`: the most output tokens in one 1-second bucket counted from the
  first start time; each token of a chunk lands at the chunk's time (vLLM's client counts one
  per streamed chunk, which is the same when every chunk carries one token);
- `max_concurrent_requests`: the peak of successful requests in flight, over half-open
  [start, start + latency) intervals;
- speculative decoding (with K > 0): `spec_decode_num_drafts` (verifies that had drafts),
  `spec_decode_draft_tokens` (K each), `spec_decode_accepted_tokens`, `spec_decode_acceptance_rate`
  (percent), `spec_decode_acceptance_length` (1 + accepted / drafts) and
  `spec_decode_per_position_acceptance_rates` (fraction of drafts accepted at each position).
"""
from __future__ import annotations

import datetime as _dt
import math

import numpy as np
import pandas as pd

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")
SLO_RULE = "a finite number of milliseconds > 0"


def slo_ok(ms) -> bool:
    """The one rule for an SLO value, wherever it comes from (--slo-*, --goodput, a sweep grid)."""
    return isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms > 0 and not math.isinf(ms)


def tpot_s(ttft, e2el, output_lens) -> np.ndarray:
    """Per request, (E2EL - TTFT) / (output tokens - 1) in seconds; 0 for a one-token request."""
    n = np.asarray(output_lens, dtype=float)
    return np.divide(np.asarray(e2el, dtype=float) - np.asarray(ttft, dtype=float), n - 1,
                     out=np.zeros(len(n)), where=n > 1)


def slo_met(ok, ttft, e2el, output_lens, slo: dict) -> np.ndarray:
    """Per request (seconds; `ok`: it completed): whether it completed within every SLO of `slo`
    (ms), a one-token request's TPOT counted as 0, as vLLM's goodput does.  The one goodput rule:
    the summary, vllm_result.json and a sweep's SLO attainment all count with it."""
    ttft, e2el = np.asarray(ttft, dtype=float), np.asarray(e2el, dtype=float)
    vals = {"ttft": ttft, "tpot": tpot_s(ttft, e2el, output_lens), "e2el": e2el}
    met = np.asarray(ok, dtype=bool).copy()
    for key, ms in slo.items():
        met &= vals[key] <= ms / 1000
    return met


DEFAULT_PERCENTILES = (99.0,)          # vLLM's --metric-percentiles default "99"


def percentile_key(metric: str, p: float) -> str:
    """vLLM's percentile key: p99_ttft_ms, p99.9_itl_ms."""
    word = str(int(p)) if int(p) == p else str(p)
    return f"p{word}_{metric}_ms"


def latency_stats(metric: str, seconds, percentiles) -> dict:
    """mean / median / std / percentiles of `seconds`, in ms, under vLLM's key names."""
    x = np.asarray(seconds, dtype=float)
    x = x if len(x) else np.zeros(1)                 # vLLM: np.mean(values or 0)
    out = {f"mean_{metric}_ms": float(np.mean(x) * 1000), f"median_{metric}_ms": float(np.median(x) * 1000),
           f"std_{metric}_ms": float(np.std(x) * 1000)}
    for p in percentiles:
        out[percentile_key(metric, p)] = float(np.percentile(x, p) * 1000)
    return out


def per_request(req_df: pd.DataFrame, rec) -> dict:
    """The per-request arrays (seconds), in the requests frame's order."""
    streams = [rec.req.get(rid, {}).get("stream", []) for rid in req_df["request_id"]]
    ok = req_df["completed"].to_numpy(bool)
    itls = [np.diff([c[0] for c in s]).tolist() if o else [] for s, o in zip(streams, ok)]
    start = req_df["arrival"].to_numpy(float)
    ttft = np.where(ok, req_df["ttft"].to_numpy(float, na_value=np.nan), 0.0)
    e2el = np.where(ok, req_df["e2el"].to_numpy(float, na_value=np.nan), 0.0)
    errors = ["" if o else f"{f}: {d}" if d else str(f)
              for o, f, d in zip(ok, req_df["finish"], req_df["finish_detail"])]
    queue = [rec.client_queue.get(rid, 0.0) for rid in req_df["request_id"]]
    return {"input_lens": req_df["prompt_len"].astype(int).tolist(),
            "output_lens": np.where(ok, req_df["output_len"], 0).astype(int).tolist(),
            "ttfts": ttft.tolist(), "itls": itls, "latencies": e2el.tolist(), "start_times": start.tolist(),
            "queue_times": queue, "errors": errors,
            "_tokens": [[c[1] for c in s] if o else [] for s, o in zip(streams, ok)],
            "_times": [[c[0] for c in s] if o else [] for s, o in zip(streams, ok)]}


def peaks(start, latency, times, tokens) -> tuple[float, int]:
    """(max output tokens in a 1 s bucket, peak concurrent requests) over the successful requests."""
    if not len(start):
        return 0.0, 0
    t0 = min(start)
    span = int(math.ceil(max(s + lat for s, lat in zip(start, latency)) - t0)) + 1
    buckets = np.zeros(span)
    for ts, ns in zip(times, tokens):
        if ts:
            b = (np.asarray(ts) - t0).astype(int)
            np.add.at(buckets, b[(b >= 0) & (b < span)], np.asarray(ns)[(b >= 0) & (b < span)])
    # half-open intervals: at equal times a departure (-1) comes before an arrival (+1)
    ev = sorted([(s, 1) for s in start] + [(s + lat, -1) for s, lat in zip(start, latency)])
    level = peak = 0
    for _, d in ev:
        level += d
        peak = max(peak, level)
    return float(buckets.max()), int(peak)


def spec_decode(accept_hist, k: int) -> dict:
    """vLLM's spec_decode_* keys from the accepted-count histogram (index c: verifies that
    emitted c tokens, c - 1 accepted drafts plus the bonus)."""
    h = np.asarray(accept_hist, dtype=np.int64)
    drafts = int(h.sum())
    if not k or not drafts:
        return {}
    c = np.arange(len(h))
    accepted = int(((c - 1).clip(0) * h).sum())
    at_least = np.cumsum(h[::-1])[::-1]
    return {"spec_decode_acceptance_rate": accepted / (drafts * k) * 100,
            "spec_decode_acceptance_length": 1 + accepted / drafts,
            "spec_decode_num_drafts": drafts, "spec_decode_draft_tokens": drafts * k,
            "spec_decode_accepted_tokens": accepted,
            "spec_decode_per_position_acceptance_rates": [float(at_least[i + 2] / drafts) for i in range(k)]}


def result(req_df: pd.DataFrame, rec, *, duration: float, num_prompts: int, request_rate, burstiness,
           max_concurrency, percentiles=DEFAULT_PERCENTILES, goodput: dict | None = None,
           model_id: str = "", label: str | None = None) -> dict:
    arr = per_request(req_df, rec)
    ok = req_df["completed"].to_numpy(bool)
    out_lens = np.asarray(arr["output_lens"])
    ttft = np.asarray(arr["ttfts"])[ok]
    e2el = np.asarray(arr["latencies"])[ok]
    n_ok = out_lens[ok]
    multi = n_ok > 1
    tpot_all = tpot_s(ttft, e2el, n_ok)
    itl = [g for o, gaps in zip(ok, arr["itls"]) if o for g in gaps]
    good = None
    if goodput:
        good = int(slo_met(ok, arr["ttfts"], arr["latencies"], out_lens, goodput).sum()) / duration
    start = np.asarray(arr["start_times"])[ok]
    max_tok, max_conc = peaks(start.tolist(), e2el.tolist(),
                              [t for o, t in zip(ok, arr.pop("_times")) if o],
                              [n for o, n in zip(ok, arr.pop("_tokens")) if o])
    total_in = int(np.asarray(arr["input_lens"])[ok].sum())
    total_out = int(out_lens.sum())
    res = {"date": _dt.datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": "dspark-twin",
           "backend": "dspark-twin", "label": label, "model_id": model_id, "tokenizer_id": None,
           "num_prompts": num_prompts,
           "request_rate": "inf" if request_rate is None or math.isinf(request_rate) else request_rate,
           "burstiness": burstiness, "max_concurrency": max_concurrency,
           "duration": duration, "completed": int(ok.sum()), "failed": int((~ok).sum()),
           "total_input_tokens": total_in, "total_output_tokens": total_out,
           "request_throughput": int(ok.sum()) / duration, "request_goodput": good,
           "output_throughput": total_out / duration, "total_token_throughput": (total_in + total_out) / duration,
           **arr, "max_output_tokens_per_s": max_tok, "max_concurrent_requests": max_conc, "rtfx": 0.0}
    res.update(spec_decode(rec.accept_hist, rec.k))
    for metric, values in (("ttft", ttft), ("tpot", tpot_all[multi]), ("itl", itl), ("e2el", e2el)):
        res.update(latency_stats(metric, values, percentiles))
    return res


def parse_goodput(pairs) -> dict[str, float]:
    """`--goodput ttft:500 tpot:50` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    from twin.abi.errors import ConfigError

    out: dict[str, float] = {}
    for pair in pairs or ():
        name, sep, val = pair.partition(":")
        try:
            ms = float(val) if sep else None
        except ValueError:
            ms = None
        if name not in SLO_METRICS or not slo_ok(ms):
            raise ConfigError("--goodput", pair, f"KEY:MS pairs, KEY one of {SLO_METRICS}, MS {SLO_RULE}")
        if name in out:
            raise ConfigError("--goodput", pair, f"each of {SLO_METRICS} at most once")
        out[name] = ms
    return out


def parse_percentiles(text: str) -> tuple[float, ...]:
    """`--metric-percentiles 50,90,99` -> (50.0, 90.0, 99.0)."""
    from twin.abi.errors import ConfigError

    try:
        ps = tuple(float(x) for x in text.split(","))
    except ValueError:
        ps = ()
    if not ps or any(not 0 <= p <= 100 for p in ps) or len(set(ps)) != len(ps):
        raise ConfigError("--metric-percentiles", text, "comma-separated distinct numbers in [0, 100]")
    return ps
