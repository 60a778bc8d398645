"""Lockstep reports: one JSON line per dispatch (`report.jsonl`), and a summary in markdown and HTML
that leads with the first divergence.

Report lines hold no wall-clock times or paths, so a run that was killed and resumed writes the
same bytes as one that was not; timings go to `run.json`.
"""
from __future__ import annotations

import html
import json
from collections import Counter
from pathlib import Path

from twin.abi.errors import AbiError
from twin.abi.outputs import atomic_path, write_text

from .run_format import check_run_dir


class ReportWriter:
    def __init__(self, run_dir):
        self.path = Path(run_dir) / "report.jsonl"

    def append(self, entry: dict) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(entry, sort_keys=True) + "\n")
            fh.flush()      # a killed process loses nothing flushed (fsync would only guard a machine crash)

    def entries(self) -> list[dict]:
        """The complete lines (those whose newline was written) in order; a torn tail (a killed
        writer) is cut from the file.  A bad complete line is corruption, refused naming the line:
        dropping it would silently drop every later dispatch too.  A run directory of another format
        is refused (`hw.run_format`)."""
        check_run_dir(self.path.parent)
        if not self.path.exists():
            return []
        raw = self.path.read_bytes()
        *lines, tail = raw.split(b"\n")
        out = []
        for ln, line in enumerate(lines, 1):
            try:
                entry = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                entry = None
            if not isinstance(entry, dict) or not {"index", "program", "verdict"} <= set(entry):
                raise AbiError("line", line[:60].decode(errors="replace"), "a report entry written by lockstep, "
                               "one JSON object per line (start afresh with --fresh)",
                               where=f"--run-dir {self.path}:{ln}")
            out.append(entry)
        if tail:
            with open(self.path, "r+b") as fh:
                fh.truncate(len(raw) - len(tail))
        return out


def summarize(entries: list[dict], config: dict) -> dict:
    first = next((e for e in entries if e["verdict"] == "fail"), None)
    by_prog: dict = {}
    for e in entries:
        c = by_prog.setdefault(e["program"], {"dispatches": 0, "failed": 0})
        c["dispatches"] += 1
        c["failed"] += e["verdict"] == "fail"
    resyncs = Counter(r["kind"] for e in entries for r in e["resyncs"])
    worst: dict = {}
    for e in entries:
        for f in e["findings"]:
            m = f["metrics"]
            w = worst.setdefault(f["kind"], {"max_rel_l2": 0.0, "min_cosine": 1.0, "max_abs": 0.0, "max_kl": 0.0,
                                             "max_row_rel_l2": 0.0})
            for k, key, fn in (("rel_l2", "max_rel_l2", max), ("cosine", "min_cosine", min),
                               ("max_abs", "max_abs", max), ("kl", "max_kl", max),
                               ("max_row_rel_l2", "max_row_rel_l2", max)):
                if isinstance(m.get(k), (int, float)):
                    w[key] = fn(w[key], m[k])
    failed = sum(e["verdict"] == "fail" for e in entries)
    return {
        "verdict": "PASS" if not failed and entries else ("FAIL" if failed else "EMPTY"),
        "dispatches": len(entries), "failed_dispatches": failed,
        "first_divergence": None if first is None else {"dispatch": first["index"], "program": first["program"],
                                                        **first["first_divergence"],
                                                        **{k: first[k] for k in LOCALIZED if k in first}},
        "programs": by_prog, "resyncs": dict(sorted(resyncs.items())), "worst_metrics": dict(sorted(worst.items())),
        "config": config, **({"coverage": coverage_ledger(entries, config["coverage"])} if "coverage" in config else {}),
    }


def coverage_ledger(entries: list[dict], plan: dict) -> dict:
    """A sampled run's sites: per program how many were checked, and per site the last dispatch that
    checked it with its result (`last_checked` rows: program, group, layer, stage, dispatch, verdict)."""
    last: dict = {}
    for e in entries:
        for group, layer, stage, verdict in e.get("sites", ()):
            last[(e["program"], group, str(layer), stage)] = (e["index"], verdict)
    programs = {}
    for p, n in sorted(plan["sites"].items()):
        mine = {k: v for k, v in last.items() if k[0] == p}
        checked = len(mine)
        programs[p] = {"sites": n, "checked": checked, "never_checked": n - checked,
                       "last_failed": sum(v[1] == "fail" for v in mine.values()),
                       "oldest_last_check": min((v[0] for v in mine.values()), default=None)}
    return {"n": plan["n"], "seed": plan["seed"], "programs": programs,
            "last_checked": [[*k, *v] for k, v in sorted(last.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                                       kv[0][2], kv[0][3]))]}


# a sampled dispatch's localization: over how many of its program's target sites (hw.real.site_check)
LOCALIZED = ("localized_over", "localized_of")


def localized_note(fd: dict) -> str:
    """What a first divergence found among fewer sites than its program has says of that ("" else)."""
    if fd.get("localized_over", 0) >= fd.get("localized_of", 0):
        return ""
    return (f" (localized among the {fd['localized_over']} of {fd['localized_of']} sites whose taps the "
            "dispatch's record keeps)")


def _fd_lines(s: dict) -> list[str]:
    fd = s["first_divergence"]
    if fd is None:
        return [f"No divergence in {s['dispatches']} dispatches."]
    return [f"Dispatch **{fd['dispatch']}** (`{fd['program']}`), layer **{fd['layer']}**, stage **{fd['stage']}**, "
            f"tensor `{fd['tensor']}`: {'; '.join(fd['reasons'])}{localized_note(fd)}"]


def write_summary(run_dir, entries: list[dict], config: dict) -> dict:
    s = summarize(entries, config)
    run_dir = Path(run_dir)
    write_text(run_dir / "summary.json", json.dumps(s, indent=2, sort_keys=True) + "\n")
    md = [f"# Lockstep: {s['verdict']}", "", "## First divergence", "", *_fd_lines(s), ""]
    if s["first_divergence"]:
        md += ["| metric | value |", "|---|---|"]
        # sorted: a resumed run reads its entries back from report.jsonl (sorted keys) and must match
        md += [f"| {k} | {v} |" for k, v in sorted(s["first_divergence"]["metrics"].items())]
        md.append("")
    md += ["## Dispatches", "", "| program | dispatches | failed |", "|---|---:|---:|"]
    md += [f"| {p} | {c['dispatches']} | {c['failed']} |" for p, c in sorted(s["programs"].items())]
    if "coverage" in s:
        cv = s["coverage"]
        md += ["", f"## Coverage (sampled: every site at least once every {cv['n']} dispatches of its program)", "",
               "| program | sites | checked | never checked | failing at last check | oldest last check |",
               "|---|---:|---:|---:|---:|---:|"]
        md += [f"| {p} | {c['sites']} | {c['checked']} | {c['never_checked']} | {c['last_failed']} | "
               f"{'-' if c['oldest_last_check'] is None else c['oldest_last_check']} |"
               for p, c in cv["programs"].items()]
        bad = [r for r in cv["last_checked"] if r[5] == "fail"]
        if bad:
            md += ["", "Sites failing at their last check (program, group, layer, stage, dispatch):", ""]
            md += [f"- {r[0]} group {r[1]} layer {r[2]} {r[3]}: dispatch {r[4]}" for r in bad[:32]]
        md.append("")
        md.append("Per site, the last dispatch that checked it and its result: `summary.json` `coverage.last_checked`.")
    md += ["", "## Re-syncs (golden adopted the device's decision)", ""]
    md += [f"- {k}: {v}" for k, v in s["resyncs"].items()] or ["- none"]
    md += ["", "## Worst metrics by tensor kind", "",
           "| kind | max rel-L2 | max row rel-L2 | min cosine | max abs | max KL |", "|---|---:|---:|---:|---:|---:|"]
    md += [f"| {k} | {w['max_rel_l2']:.3g} | {w['max_row_rel_l2']:.3g} | {w['min_cosine']:.6f} | {w['max_abs']:.3g} "
           f"| {w['max_kl']:.3g} |"
           for k, w in s["worst_metrics"].items()]
    md += ["", "## Run", "", "```json", json.dumps(s["config"], indent=2, sort_keys=True), "```", ""]
    write_text(run_dir / "summary.md", "\n".join(md))
    write_text(run_dir / "summary.html", _html(s))
    write_tensor_csv(run_dir / "tensors.csv", entries)
    return s


TENSOR_COLUMNS = ("dispatch", "program", "layer", "stage", "tensor", "shape", "dtype", "quant", "op",
                  "golden_max", "golden_min", "golden_mean", "golden_l2", "device_max", "device_min", "device_mean",
                  "device_l2", "cosine", "max_abs_err", "max_rel_err", "rel_l2", "max_ulp", "bad_points", "points",
                  "pass")


def write_tensor_csv(path, entries: list[dict]) -> None:
    """One row per compared tensor of every dispatch, in the msprobe compare layout: its site,
    shape and dtype, golden and device statistics, and the error metrics with the verdict."""
    import csv

    with atomic_path(path) as tmp, open(tmp, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(TENSOR_COLUMNS)
        for e in entries:
            for f in e["findings"]:
                op, dtype, quant = (f["kind"].split("/") + ["", "", ""])[:3]
                site = f.get("site") or ["", ""]
                g, d, m = f.get("stats", {}).get("golden", {}), f.get("stats", {}).get("device", {}), f["metrics"]
                w.writerow([e["index"], e["program"], site[0], site[1], f["name"],
                            "x".join(map(str, f["shape"])) if f.get("shape") is not None else "", dtype, quant, op,
                            *(g.get(k) for k in ("max", "min", "mean", "l2")),
                            *(d.get(k) for k in ("max", "min", "mean", "l2")),
                            m.get("cosine"), m.get("max_abs"), m.get("max_rel"), m.get("rel_l2"), m.get("max_ulp"),
                            f["bad_points"], f["points"], f["passed"]])


def _html(s: dict) -> str:
    e = html.escape
    fd = s["first_divergence"]
    color = "#1a7f37" if s["verdict"] == "PASS" else "#cf222e"
    rows = "".join(f"<tr><td>{e(p)}</td><td>{c['dispatches']}</td><td>{c['failed']}</td></tr>"
                   for p, c in sorted(s["programs"].items()))
    if fd:
        met = "".join(f"<tr><td>{e(str(k))}</td><td>{e(str(v))}</td></tr>" for k, v in sorted(fd["metrics"].items()))
        lead = (f"<p>Dispatch <b>{fd['dispatch']}</b> (<code>{e(fd['program'])}</code>), "
                f"layer <b>{e(fd['layer'])}</b>, stage <b>{e(fd['stage'])}</b>, "
                f"tensor <code>{e(fd['tensor'])}</code>: {e('; '.join(fd['reasons']))}</p>"
                f"<table><tr><th>metric</th><th>value</th></tr>{met}</table>")
    else:
        lead = f"<p>No divergence in {s['dispatches']} dispatches.</p>"
    rs = "".join(f"<li>{e(k)}: {v}</li>" for k, v in s["resyncs"].items()) or "<li>none</li>"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>Lockstep {s['verdict']}</title>"
            "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}td,th{border:1px solid #ccc;"
            "padding:2px 8px}table{border-collapse:collapse}</style></head><body>"
            f"<h1 style='color:{color}'>Lockstep: {s['verdict']}</h1><h2>First divergence</h2>{lead}"
            f"<h2>Dispatches</h2><table><tr><th>program</th><th>dispatches</th><th>failed</th></tr>{rows}</table>"
            f"<h2>Re-syncs</h2><ul>{rs}</ul>"
            f"<h2>Run</h2><pre>{e(json.dumps(s['config'], indent=2, sort_keys=True))}</pre></body></html>\n")
