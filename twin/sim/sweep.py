"""A sweep over simulator settings: the grid file, its points, one tidy table and its plots.

The grid file (YAML or JSON) names `simulate` flags without their dashes:

    base:  {requests: 256, max-model-len: 2048}     # every point
    grid:  {request-rate: [8, 16, 32], num-speculative-tokens: [0, 7]}   # the cartesian product
    slo:   {ttft: 2000, tpot: 50}                    # goodput and SLO attainment (ms)

A point is base + one value of each grid setting; its id is a digest of its settings, so a
re-run finds the points already done (`point_dir/vllm_result.json`) and runs only the rest.
Running the points is the command's (`dspark-twin sweep`, on Ray); this module imports no engine.
"""
from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import pandas as pd

from twin.abi.errors import ConfigError
from twin.abi.inputs import read_json, read_text
from twin.abi.outputs import atomic_path

from .vllm_result import SLO_METRICS, SLO_RULE, slo_met, slo_ok

KEYS = ("base", "grid", "slo")
UNITS = {"request-rate": " (requests/s)", "rate": " (requests/s)", "max-concurrency": " (requests)"}
PERCENTILES = "50,90,99"
# the table's metric columns: vllm_result.json keys, then summary.json figures
VLLM_COLUMNS = ("completed", "failed", "request_throughput", "request_goodput", "output_throughput",
                "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
                *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p90", "p99")),
                "spec_decode_acceptance_length", "spec_decode_acceptance_rate")


def load_grid(path: str | Path) -> dict:
    path = Path(path)
    what = "a YAML or JSON grid: a mapping with 'grid' and optionally 'base', 'slo'"
    if path.suffix in (".yaml", ".yml"):
        text = read_text(path, "GRID", what)
        try:
            import yaml
        except ImportError:
            raise ConfigError("GRID", str(path), "PyYAML installed for a YAML grid (or a .json grid)") from None
        try:
            grid = yaml.safe_load(text)
        except yaml.YAMLError as e:
            line = getattr(getattr(e, "problem_mark", None), "line", None)
            raise ConfigError(f"{path}:{line + 1}" if line is not None else str(path), "",
                              "a YAML mapping with base / grid / slo") from None
    else:
        grid = read_json(path, "GRID", what)
    if not isinstance(grid, dict) or set(grid) - set(KEYS) or "grid" not in grid:
        raise ConfigError(str(path), sorted(grid) if isinstance(grid, dict) else type(grid).__name__,
                          f"a mapping with 'grid' and optionally 'base', 'slo' (keys {KEYS})")
    g = grid["grid"]
    if not isinstance(g, dict) or not g or not all(isinstance(v, list) and v for v in g.values()):
        raise ConfigError(f"{path}: grid", g, "a mapping of setting -> non-empty list of values")
    base = grid.get("base") or {}
    if not isinstance(base, dict):
        raise ConfigError(f"{path}: base", base, "a mapping of setting -> value")
    if set(base) & set(g):
        raise ConfigError(f"{path}: base", sorted(set(base) & set(g)), "settings not also in grid")
    slo = grid.get("slo") or {}
    if not isinstance(slo, dict) or set(slo) - set(SLO_METRICS) or not all(slo_ok(v) for v in slo.values()):
        raise ConfigError(f"{path}: slo", slo, f"a mapping of {' / '.join(SLO_METRICS)} -> {SLO_RULE}")
    for k in (*base, *g):
        if not isinstance(k, str) or k.startswith("-") or k in ("out", "json", "no-plots", "goodput"):
            raise ConfigError(f"{path}: setting", k, "a simulate flag without dashes (not out / json / "
                                                     "no-plots / goodput: the sweep sets those)")
    return {"base": base, "grid": g, "slo": slo}


def points(grid: dict) -> list[dict]:
    keys = list(grid["grid"])
    return [{**grid["base"], **dict(zip(keys, vals))} for vals in itertools.product(*grid["grid"].values())]


def point_id(settings: dict, slo: dict) -> str:
    blob = json.dumps({"settings": settings, "slo": slo}, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def argv(settings: dict, slo: dict, out: Path) -> list[str]:
    """simulate's command line for a point (a list value: a flag that takes several values)."""
    a = []
    for k, v in settings.items():
        if v is True:
            a.append(f"--{k}")
        elif v is False or v is None:
            continue
        else:
            a += [f"--{k}", *(str(x) for x in (v if isinstance(v, list) else [v]))]
    if slo:
        a += ["--goodput", *(f"{k}:{v}" for k, v in slo.items())]
    return [*a, "--metric-percentiles", PERCENTILES, "--out", str(out), "--json", "--no-plots"]


def done(point_dir: Path) -> bool:
    return (point_dir / "vllm_result.json").is_file() and (point_dir / "summary.json").is_file()


def row(pid: str, settings: dict, slo: dict, point_dir: Path) -> dict:
    v = json.loads((point_dir / "vllm_result.json").read_text())
    s = json.loads((point_dir / "summary.json").read_text())
    r = {"point": pid, **settings, **{c: v.get(c) for c in VLLM_COLUMNS}}
    if slo:
        ok = [e == "" for e in v["errors"]]
        met = int(slo_met(ok, v["ttfts"], v["latencies"], v["output_lens"], slo).sum())
        r["slo_attainment"] = met / len(ok) if ok else None      # failed requests miss every SLO
    r.update({"prefix_token_hit_rate": s["prefix_cache"]["token_hit_rate"], "preemptions": s["preemptions"],
              "slots_per_partition": s["slots_per_partition"]})
    return r


def plots(out: Path, table: pd.DataFrame, grid: dict) -> list[str]:
    """Throughput against latency, and SLO attainment, one series per combination of the other
    grid settings (markers distinguish them)."""
    from matplotlib.figure import Figure     # the object API: no pyplot, no global backend state

    keys = list(grid["grid"])
    x_key = next((k for k in keys if k in ("request-rate", "rate", "max-concurrency")), keys[0])
    others = [k for k in keys if k != x_key]
    groups = list(table.groupby(others, sort=True)) if others else [((), table)]
    markers = "osD^v<>pP*Xh"
    files = []
    fig = Figure(figsize=(12, 4.2))
    ax = fig.subplots(1, 2)
    for i, (vals, df) in enumerate(groups):
        vals = vals if isinstance(vals, tuple) else (vals,)
        label = ", ".join(f"{k}={v}" for k, v in zip(others, vals)) or "all points"
        df = df.sort_values("output_throughput")
        for a, lat in zip(ax, ("p99_tpot_ms", "p99_ttft_ms")):
            a.plot(df["output_throughput"], df[lat], marker=markers[i % len(markers)], label=label)
    for a, lat in zip(ax, ("p99 TPOT (ms)", "p99 TTFT (ms)")):
        a.set_xlabel("output throughput (tokens/s)")
        a.set_ylabel(lat)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    for a, k in zip(ax, ("tpot", "ttft")):
        if grid["slo"].get(k) is not None:
            a.axhline(grid["slo"][k], color="red", ls="--", lw=1)
            a.annotate(f"SLO {grid['slo'][k]:g} ms", (0.02, grid["slo"][k]), xycoords=("axes fraction", "data"),
                       color="red", fontsize=8, va="bottom")
    fig.suptitle(f"throughput vs latency over {x_key} ({len(table)} points)")
    fig.tight_layout()
    with atomic_path(out / "throughput_latency.png") as tmp:
        fig.savefig(tmp, dpi=110)
    files.append("throughput_latency.png")
    if "slo_attainment" in table:
        fig = Figure(figsize=(6.5, 4.2))
        a = fig.subplots()
        for i, (vals, df) in enumerate(groups):
            vals = vals if isinstance(vals, tuple) else (vals,)
            label = ", ".join(f"{k}={v}" for k, v in zip(others, vals)) or "all points"
            df = df.sort_values(x_key)
            a.plot(df[x_key], 100 * df["slo_attainment"], marker=markers[i % len(markers)], label=label)
        a.set_xlabel(x_key + UNITS.get(x_key, ""))
        a.set_ylabel("requests meeting every SLO (%)")
        a.set_ylim(-3, 103)
        a.set_title("SLO attainment: " + ", ".join(f"{k} <= {v:g} ms" for k, v in grid["slo"].items()))
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
        fig.tight_layout()
        with atomic_path(out / "slo_attainment.png") as tmp:
            fig.savefig(tmp, dpi=110)
        files.append("slo_attainment.png")
    return files
