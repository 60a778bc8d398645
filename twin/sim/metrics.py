"""Metrics with `vllm bench serve` definitions, as pandas frames and PNG plots (the trace: `trace`).

- TTFT: first token time - arrival; E2EL: finish time - arrival;
- TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token;
- ITL: gaps between successive streamed chunks (a K=7 step streams 1..8 tokens as one chunk);
- throughput over the benchmark duration (first arrival to last finish); goodput counts the
  completed requests that meet every given SLO (TTFT, TPOT, E2EL, in milliseconds).
Plus per-position acceptance (vLLM's accepted-per-position counters), prefix hit rate,
occupancy per group and preemptions.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from twin.abi.batches import Finish
from twin.abi.outputs import atomic_path, write_text

from .vllm_result import latency_stats, slo_met, spec_decode

COMPLETED = {Finish.EOS, Finish.LENGTH, Finish.STOP}
PERCENTILES = (50, 90, 95, 99)


def requests_frame(requests, rec) -> pd.DataFrame:
    rows = []
    for r in requests:
        d = rec.req.get(r.request_id, {})
        first, end = d.get("first"), d.get("end")
        n = len(r.outputs)
        ttft = None if first is None else first - r.arrival
        e2el = None if end is None else end - r.arrival
        tpot = (e2el - ttft) / (n - 1) if (ttft is not None and e2el is not None and n > 1) else None
        rows.append({"request_id": r.request_id, "tag": r.tag, "arrival": r.arrival, "admitted": d.get("admitted"),
                     "first_token": first, "end": end, "prompt_len": r.prompt_len, "output_len": n,
                     "max_new_tokens": r.max_new_tokens, "requested_max_new_tokens": r.sampling.max_new_tokens,
                     "capped": r.capped, "finish": r.finish.value if r.finish else None,
                     "finish_detail": r.finish_detail, "cached_tokens": d.get("cached", 0),
                     "preemptions": r.num_preemptions, "dropped_tokens": r.dropped_tokens,
                     "discarded_tokens": r.discarded_tokens, "chunks": d.get("chunks", 0),
                     "ttft": ttft, "tpot": tpot, "e2el": e2el,
                     "completed": r.finish in COMPLETED})
    return pd.DataFrame(rows)


def steps_frame(rec) -> pd.DataFrame:
    cols = ["step", "t", "n_prefill", "n_decode", "tokens", "waiting", "running"]
    df = pd.DataFrame([s[:7] for s in rec.steps], columns=cols)
    live = np.array([s[7] for s in rec.steps]).reshape(len(rec.steps), rec.partitions)
    for p in range(rec.partitions):
        df[f"live_p{p}"] = live[:, p] if len(rec.steps) else []
    return df


def dispatches_frame(rec) -> pd.DataFrame:
    rows = []
    for step, kind, start, secs, meta, parts in rec.dispatches:
        row = {"step": step, "kind": kind, "start": start, "seconds": secs,
               "requests_per_group": meta.get("requests_per_group"), "tokens_per_group": meta.get("tokens_per_group")}
        row.update({f"t_{k}": v for k, v in parts.items()})
        rows.append(row)
    return pd.DataFrame(rows)


def occupancy_frame(rec) -> pd.DataFrame:
    return pd.DataFrame(rec.pages, columns=["t", "partition", "family", "used_pages"])


def acceptance(rec) -> dict:
    h = rec.accept_hist
    if not rec.k:
        return {"verifies": 0, "fallback_steps": rec.fallbacks}
    sd = spec_decode(h, rec.k)                     # vLLM's figures of the same histogram ({}: no verify)
    return {"verifies": int(h.sum()), "fallback_steps": rec.fallbacks,
            "mean_accepted_length": sd.get("spec_decode_acceptance_length"),
            "acceptance_per_position": sd.get("spec_decode_per_position_acceptance_rates", [None] * rec.k),
            "histogram": {int(c): int(h[c]) for c in range(1, len(h))}}


def _stats(x) -> dict:
    """The summary's latency block: vLLM's statistics (`vllm_result.latency_stats`), None when empty."""
    # None and NaN both mean "no value": one vectorised mask instead of a Python test per element
    x = np.asarray(x)
    x = np.asarray(pd.to_numeric(pd.Series(x), errors="coerce"), dtype=float) if x.dtype == object else x.astype(float)
    x = x[~np.isnan(x)]
    if not len(x):
        return {"mean_ms": None, "median_ms": None, "std_ms": None, **{f"p{p}_ms": None for p in PERCENTILES}}
    return {k.replace("_x_", "_"): v for k, v in latency_stats("x", x, PERCENTILES).items()}


def completed_itl(req_df: pd.DataFrame, rec) -> np.ndarray:
    """Inter-token gaps (s) of the completed requests' streams, as vLLM counts them."""
    gaps = [np.diff([c[0] for c in rec.req.get(rid, {}).get("stream", ())])
            for rid in req_df.loc[req_df["completed"], "request_id"]]
    return np.concatenate(gaps) if gaps else np.zeros(0)


def summary(req_df: pd.DataFrame, rec, slo: dict | None = None) -> dict:
    done = req_df[req_df["completed"]]
    start = float(req_df["arrival"].min()) if len(req_df) else 0.0
    end = float(req_df["end"].max()) if len(req_df) and req_df["end"].notna().any() else start
    dur = max(end - start, 1e-12)
    out_tok = int(done["output_len"].sum())
    in_tok = int(done["prompt_len"].sum())
    good = int(slo_met(req_df["completed"], req_df["ttft"], req_df["e2el"], req_df["output_len"], slo).sum()) \
        if slo else 0
    p = rec.prefix
    live = np.array([st[7] for st in rec.steps], dtype=float).reshape(len(rec.steps), rec.partitions)
    occ = {"mean_live_per_group": live.mean(axis=0).tolist() if len(live) else [],
           "max_live_per_group": live.max(axis=0).astype(int).tolist() if len(live) else []}
    return {
        "completed": int(len(done)), "failed": int(len(req_df) - len(done)),
        "finish_reasons": req_df["finish"].value_counts().to_dict(),
        "duration_s": dur, "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": len(done) / dur, "output_token_throughput": out_tok / dur,
        "total_token_throughput": (in_tok + out_tok) / dur,
        "request_goodput": good / dur if slo else None, "slo_ms": slo or {},
        "ttft": _stats(done["ttft"]), "tpot": _stats(done["tpot"]), "itl": _stats(completed_itl(req_df, rec)),
        "e2el": _stats(done["e2el"]),
        "acceptance": acceptance(rec),
        "prefix_cache": {**p, "hit_rate": (p["hits"] / p["queries"]) if p["queries"] else 0.0,
                         "token_hit_rate": (p["hit_tokens"] / p["query_tokens"]) if p["query_tokens"] else 0.0},
        "occupancy": occ,
        "preemptions": int(sum(1 for e in rec.events if e[1] == "preempt")),
        "dropped_tokens": int(req_df["dropped_tokens"].sum()) if len(req_df) else 0,
        "capped_requests": int(req_df["capped"].sum()) if len(req_df) else 0,
    }


# ---- plots ------------------------------------------------------------------------------------
def plots(out: Path, req_df, steps, occ, acc: dict, *, capacity: dict[str, int] | None = None,
          slots: int | None = None, slo: dict | None = None, itl=None) -> list[str]:
    """latency_cdf.png (TTFT, TPOT, ITL, E2EL with p50/p90/p99 and SLO markers), occupancy.png
    (live requests per group against the slots, used pages per family against its capacity),
    acceptance.png.  capacity: pages per family over all partitions; itl: gaps in seconds."""
    from matplotlib.figure import Figure     # the object API: no pyplot, no global backend state

    files = []
    slo = slo or {}
    done = req_df[req_df["completed"]]
    series = {"ttft": done["ttft"].dropna().to_numpy(), "tpot": done["tpot"].dropna().to_numpy(),
              "itl": np.asarray(itl if itl is not None else [], dtype=float), "e2el": done["e2el"].dropna().to_numpy()}
    fig = Figure(figsize=(16, 3.9))
    ax = fig.subplots(1, 4)
    for a, (key, x) in zip(ax, series.items()):
        x = np.sort(x * 1e3)
        if len(x):
            a.plot(x, np.arange(1, len(x) + 1) / len(x), lw=1.4)
            for p, m in zip((50, 90, 99), ("o", "s", "^")):
                v = float(np.percentile(x, p))
                a.plot([v], [p / 100], m, color="black", ms=5)
                a.annotate(f"p{p} {v:.0f}", (v, p / 100), textcoords="offset points", xytext=(5, -10), fontsize=7)
        if slo.get(key) is not None:
            a.axvline(slo[key], color="red", ls="--", lw=1)
            met = float((x <= slo[key]).mean()) if len(x) else 0.0
            a.annotate(f"SLO {slo[key]:g} ms\n{met:.0%} within", (slo[key], 0.05), color="red", fontsize=7,
                       textcoords="offset points", xytext=(4, 0))
        a.set_title(f"{key.upper()} ({len(x)} {'gaps' if key == 'itl' else 'requests'})", fontsize=10)
        a.set_xlabel(f"{key.upper()} (ms)")
        a.set_ylabel("fraction at or below")
        a.set_ylim(0, 1.02)
        a.grid(alpha=0.3)
    fig.suptitle(f"latency CDFs: {len(done)} completed of {len(req_df)} requests", fontsize=11)
    fig.subplots_adjust(left=0.04, right=0.97, bottom=0.14, top=0.84, wspace=0.3)
    _savefig(fig, out / "latency_cdf.png")
    files.append("latency_cdf.png")

    fams = list(capacity) if capacity else sorted(occ["family"].unique()) if len(occ) else []
    ncol = 4
    nrow = 1 + (len(fams) + ncol - 1) // ncol if fams else 1
    fig = Figure(figsize=(16, 2.9 * nrow))
    gs = fig.add_gridspec(nrow, ncol)
    a = fig.add_subplot(gs[0, :])
    live = [c for c in steps.columns if c.startswith("live_p")]
    for c in live:
        a.step(steps["t"], steps[c], where="post", label=f"TP group {c[6:]}", lw=1)
    if slots is not None:
        a.axhline(slots, color="red", lw=1, ls="--")
        a.annotate(f"capacity slots per group: {slots}", (0.005, slots), xycoords=("axes fraction", "data"),
                   color="red", fontsize=8, va="bottom")
        a.set_ylim(0, slots * 1.15)
    a.set_ylabel("live requests")
    a.set_xlabel("simulated time (s)")
    a.set_title("live requests per TP group", fontsize=10)
    a.legend(fontsize=8, ncol=len(live), loc="upper right")
    a.grid(alpha=0.3)
    tot = occ.groupby(["t", "family"])["used_pages"].sum().unstack() if len(occ) else pd.DataFrame()
    for i, fam in enumerate(fams):
        a = fig.add_subplot(gs[1 + i // ncol, i % ncol])
        if fam in tot:
            a.plot(tot.index, tot[fam], lw=1.2)
            peak = int(tot[fam].max())
        else:
            peak = 0
        cap = capacity.get(fam) if capacity else None
        if cap is not None:
            a.axhline(cap, color="red", ls="--", lw=1)
            a.set_ylim(0, cap * 1.12)
            a.annotate(f"capacity {cap:,}", (0.02, cap), xycoords=("axes fraction", "data"), color="red",
                       fontsize=8, va="bottom")
        a.set_title(f"{fam}: peak {peak:,}" + (f" ({peak / cap:.0%})" if cap else "") + " pages", fontsize=9)
        a.set_ylabel("used pages (all groups)", fontsize=8)
        a.set_xlabel("simulated time (s)", fontsize=8)
        a.tick_params(labelsize=7)
        a.grid(alpha=0.3)
    fig.suptitle("occupancy: live requests and KV pages per cache family against their limits", fontsize=11)
    # fixed margins (the layout engines draw the figure once more to measure it)
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.5 / (2.9 * nrow), top=1 - 0.75 / (2.9 * nrow),
                        wspace=0.28, hspace=0.5)
    _savefig(fig, out / "occupancy.png")
    files.append("occupancy.png")

    if acc.get("acceptance_per_position"):
        fig = Figure(figsize=(6.5, 3.8))
        ax = fig.subplots()
        pp = acc["acceptance_per_position"]
        ax.bar(range(1, len(pp) + 1), pp)
        for i, v in enumerate(pp, 1):
            ax.annotate(f"{v:.2f}", (i, v), ha="center", va="bottom", fontsize=8)
        ax.set_xlabel("draft position")
        ax.set_ylabel("fraction of verifies accepting it")
        ax.set_ylim(0, 1.08)
        ax.set_title(f"acceptance per position: mean accepted length {acc['mean_accepted_length']:.2f} "
                     f"over {acc['verifies']} verifies", fontsize=10)
        fig.subplots_adjust(left=0.11, right=0.98, bottom=0.13, top=0.9)
        _savefig(fig, out / "acceptance.png")
        files.append("acceptance.png")
    return files


def _savefig(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)


def write_json(path: Path, obj, *, indent: int | None = 2) -> None:
    """indent None: one line, by json's C encoder (an indented dump runs in Python: for large files)."""
    write_text(path, json.dumps(obj, indent=indent, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
