"""The run as a Chrome / Perfetto JSON trace (`trace.json`; open it in ui.perfetto.dev).

Tracks, each named by metadata events:
- process "device": one thread per dispatch kind (prefill, seed, decode, error) and one per TP
  group (the slice of a dispatch on the groups that had requests in it, with their counts);
- process "engine (host)": the host lanes the engine models, schedule, prepare and reclaim;
- process "requests": one async slice per request (queued -> finish) holding its queued time,
  each prefill chunk (the prefill dispatches that carried it) and its decode;
- counters: used pages per cache family (all partitions, against the family's capacity) and
  live requests per partition;
- flow arrows from the prefill dispatch that produced a request's first token to the decode
  dispatch that produced its second.
Times are microseconds of simulated time.  A request's children are clipped to its own span
(the engine's times agree to a few ulps; the trace nests them exactly).
"""
from __future__ import annotations

import pandas as pd

DEVICE, HOST, REQUESTS, PAGES = 0, 1, 2, 3
KIND_TID = {"prefill": 0, "seed": 1, "decode": 2, "error": 3}
GROUP_TID0 = 10
LANES = ("schedule", "prepare", "reclaim")
US = 1e6


def _meta(pid: int, name: str, threads: dict[int, str], sort: int) -> list[dict]:
    ev = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}},
          {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": sort}}]
    for tid, tname in threads.items():
        ev.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": tname}})
        ev.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return ev


def perfetto_trace(rec, steps: pd.DataFrame, req_df: pd.DataFrame, capacity: dict[str, int]) -> dict:
    """capacity: pages per family over all partitions (the counters' ceiling)."""
    G = rec.partitions
    ev = _meta(DEVICE, "device (16 NPUs)", {**{t: k for k, t in KIND_TID.items()},
                                            **{GROUP_TID0 + g: f"TP group {g}" for g in range(G)}}, 0)
    ev += _meta(HOST, "engine (host)", {i: lane for i, lane in enumerate(LANES)}, 1)
    ev += _meta(REQUESTS, "requests", {0: "requests"}, 2)
    ev += _meta(PAGES, "KV pages", {}, 3)
    by_step: dict[tuple[int, str], tuple[float, float]] = {}
    carried: dict[str, list[tuple[float, float]]] = {}
    for step, kind, start, secs, meta, parts in rec.dispatches:
        ts, dur = start * US, secs * US
        if kind == "prefill" or (step, kind) not in by_step:
            by_step[(step, kind)] = (ts, dur)            # a step's last prefill, its one decode
        args = {"step": step, **{k: v for k, v in meta.items() if k != "requests"},
                **{f"t_{k}_ms": v * 1e3 for k, v in parts.items()}}
        ev.append({"name": kind, "cat": "dispatch", "ph": "X", "ts": ts, "dur": dur, "pid": DEVICE,
                   "tid": KIND_TID.get(kind, 4), "args": args})
        per = meta.get("requests_per_group") or []
        toks = meta.get("tokens_per_group") or [None] * len(per)
        for g, (n, tk) in enumerate(zip(per, toks)):
            if n:
                ev.append({"name": kind, "cat": "tp_group", "ph": "X", "ts": ts, "dur": dur, "pid": DEVICE,
                           "tid": GROUP_TID0 + g, "args": {"step": step, "requests": n,
                                                           **({"tokens": tk} if tk is not None else {})}})
        for rid in meta.get("requests", ()) if kind == "prefill" else ():
            carried.setdefault(rid, []).append((ts, ts + dur, step))
    for lane, step, start, end in rec.host_lanes:
        ev.append({"name": lane, "cat": "host", "ph": "X", "ts": start * US, "dur": (end - start) * US,
                   "pid": HOST, "tid": LANES.index(lane), "args": {"step": step}})
    ev += _requests(rec, req_df, carried, by_step)
    ev += _counters(rec, steps, capacity)
    return {"traceEvents": ev, "displayTimeUnit": "ms"}


def _span(name: str, rid: str, a: float, b: float, args: dict | None = None) -> list[dict]:
    base = {"name": name, "cat": "request", "id": rid, "pid": REQUESTS, "tid": 0}
    return [{**base, "ph": "b", "ts": a, **({"args": args} if args else {})}, {**base, "ph": "e", "ts": b}]


def _requests(rec, req_df, carried, by_step) -> list[dict]:
    ev = []
    flow = 0
    for r in req_df.itertuples(index=False):
        if pd.isna(r.end):
            continue                                     # never finished (a run cut short by `until`)
        lo, hi = r.arrival * US, r.end * US
        clip = lambda t: min(max(t, lo), hi)             # noqa: E731
        kids = []
        adm = r.admitted if pd.notna(r.admitted) else None
        first = r.first_token if pd.notna(r.first_token) else None
        if adm is not None and clip(adm * US) > lo:
            kids += _span("queued", r.request_id, lo, clip(adm * US))
        chunks = carried.get(r.request_id, ())
        last = clip(adm * US) if adm is not None else lo
        decode = (clip(first * US), hi) if first is not None else None
        for a, b, _ in chunks:
            a, b = max(clip(a), last), clip(b)
            if decode and a < decode[0] < b:           # a chunk crossing the first token: end it there
                b = decode[0]
            if b <= a or (decode and a >= decode[0]):
                continue                                 # a re-prefill after a preemption is inside decode
            kids += _span("prefill chunk", r.request_id, a, b)
            last = b
        if decode and decode[1] > decode[0]:
            kids += _span("decode", r.request_id, *decode, {"output_len": r.output_len})
        # parent begin, children, parent end: equal timestamps then nest in file order
        top = _span(f"request {r.request_id}", r.request_id, lo, hi,
                    {"prompt_len": r.prompt_len, "output_len": r.output_len, "finish": r.finish})
        ev += [top[0], *kids, top[1]]
        stream = rec.req.get(r.request_id, {}).get("stream", ())
        mine = carried.get(r.request_id, ())
        prefill_steps = {c[2] for c in mine}
        # its first decode chunk: the first streamed after the first token that no prefill of it made
        later = [c for c in stream[1:] if c[2] not in prefill_steps]
        if stream and later:
            done = [c for c in mine if c[2] == stream[0][2]]
            src = (done[-1][0], done[-1][1] - done[-1][0]) if done else by_step.get((stream[0][2], "prefill"))
            dst = by_step.get((later[0][2], "decode"))
            if src and dst:
                flow += 1
                ev.append({"name": "first decode", "cat": "flow", "ph": "s", "id": flow, "pid": DEVICE,
                           "tid": KIND_TID["prefill"], "ts": src[0] + src[1] / 2})
                ev.append({"name": "first decode", "cat": "flow", "ph": "f", "bp": "e", "id": flow, "pid": DEVICE,
                           "tid": KIND_TID["decode"], "ts": dst[0] + dst[1] / 2})
    return ev


def _counters(rec, steps: pd.DataFrame, capacity: dict[str, int]) -> list[dict]:
    ev = []
    if rec.pages:
        pages = pd.DataFrame(rec.pages, columns=["t", "partition", "family", "used"])
        tot = pages.groupby(["t", "family"], sort=True)["used"].sum().unstack()
        for fam in tot.columns:
            cap = capacity.get(fam)
            for t, used in tot[fam].items():
                ev.append({"name": f"pages {fam} (of {cap})", "ph": "C", "ts": t * US, "pid": PAGES,
                           "args": {"used": int(used)}})
    live = [c for c in steps.columns if c.startswith("live_p")]
    for row in steps[["t", *live]].itertuples(index=False):
        ev.append({"name": "live requests", "ph": "C", "ts": row[0] * US, "pid": HOST,
                   "args": {f"group {i}": int(v) for i, v in enumerate(row[1:])}})
    return ev


def family_capacity(kv) -> dict[str, int]:
    """Pages per family over all partitions, from the run's pools."""
    return {f.name: int(f.blocks_per_partition) * kv.partitions for f in kv.families}
