"""The risk report: each run is scanned for the situations upstream reported failing or unsafe
(serving-contract.md §10).  A flag is evidence that the real system would have been exposed, not a
prediction that it failed; docs/risks.md explains each one.
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd


@dataclass(frozen=True)
class RiskKind:
    id: str
    title: str
    source: str


KINDS = {k.id: k for k in (
    RiskKind("idle_tp_groups", "decode step with idle TP groups while others are active",
             "pypto-lib#1208 / simpler#2260 (closed): non-uniform DP occupancy stalls the EP16 MoE barrier"),
    RiskKind("active_group_drop", "number of active decode groups dropped between consecutive steps",
             "DSpark dev guide: inactive-group TENSOR_WAIT_TIMEOUT when the active batch shrinks 4 -> 3"),
    RiskKind("packed_prefill_q_gt1", "packed prefill with more than one request per TP group at EP16",
             "pypto-lib#1213 (open): l3_prefill_fwd TENSOR_WAIT_TIMEOUT at EP16"),
    RiskKind("ep16_prefill", "any prefill dispatch at EP16 (newer docs: #1213 also hangs unpacked)",
             "pypto-lib#1213, serving-contract §0.2 item 6"),
    RiskKind("partition_over_64", "a partition with more than 64 live requests",
             "serving-contract §10.2 item 1: decode tile / lease overflow aborts every in-flight request"),
    RiskKind("preempt_with_outputs", "preemption of a request that already has outputs",
             "serving-contract §10.2 item 2: the re-prefill drops generated tokens from the KV context"),
    RiskKind("preemption_thrash", "a request preempted 10 or more times (partitions preempting each other)",
             "serving-contract §4.7 + §10.2 item 5: victims come from any partition; pinned rings need spare pages"),
    RiskKind("stop_in_chunk", "a stop string completed inside a multi-token acceptance",
             "serving-contract §10.2 item 3: endswith() after all accepted tokens misses it"),
    RiskKind("worker_error", "a worker error aborted the failed and in-flight batches",
             "serving-contract §4.11"),
    RiskKind("livelock", "no progress over the livelock window: the run stopped (requests preempting each other)",
             "twin: upstream has no preemption cap and would never end (serving-contract §4.13 rule 10)"),
    RiskKind("stall", "a request could never be scheduled (no pages, nothing to preempt)",
             "twin: upstream would wait forever"),
)}


def scan(rec, ep: int) -> pd.DataFrame:
    """One row per flagged occurrence: risk, t, step, request, detail."""
    rows = []
    G = rec.partitions
    prev_active = None
    for step, kind, start, secs, meta, _ in rec.dispatches:
        per = meta.get("requests_per_group")
        if kind == "decode" and per:
            active = sum(1 for n in per if n)
            if 0 < active < G:
                rows.append(("idle_tp_groups", start, step, None, {"requests_per_group": per}))
            if prev_active is not None and active < prev_active:
                rows.append(("active_group_drop", start, step, None, {"from": prev_active, "to": active}))
            prev_active = active
        elif kind == "prefill" and per and ep == 16:
            rows.append(("ep16_prefill", start, step, None, {"requests_per_group": per}))
            if max(per) > 1:
                rows.append(("packed_prefill_q_gt1", start, step, None, {"requests_per_group": per}))
    for step, t, _, _, _, _, _, live in rec.steps:
        over = [p for p, n in enumerate(live) if n > 64]
        if over:
            rows.append(("partition_over_64", t, step, None, {"partitions": over, "live": list(live)}))
    counts: dict[str, int] = {}
    for t, kind, rid, detail in rec.events:
        if kind == "preempt":
            if detail["outputs"] > 0:
                rows.append(("preempt_with_outputs", t, None, rid, detail))
            counts[rid] = counts.get(rid, 0) + 1
            if counts[rid] == 10:
                rows.append(("preemption_thrash", t, None, rid, {"preemptions": 10}))
        elif kind in KINDS:
            rows.append((kind, t, detail.get("step"), rid, detail))
    return pd.DataFrame(rows, columns=["risk", "t", "step", "request", "detail"])


def summarize(flags: pd.DataFrame) -> pd.DataFrame:
    """Per risk kind: count, first time and an example, including kinds that never fired."""
    out = []
    for k in KINDS.values():
        sub = flags[flags["risk"] == k.id] if len(flags) else flags
        first = sub.iloc[0] if len(sub) else None
        out.append({"risk": k.id, "title": k.title, "count": int(len(sub)),
                    "first_t": None if first is None else float(first["t"]),
                    "example": None if first is None else str(first["detail"]), "source": k.source})
    return pd.DataFrame(out)
