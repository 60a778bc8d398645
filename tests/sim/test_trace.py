"""trace.json reads in Perfetto: named tracks, well-bracketed async request slices, flows that bind
to existing slices, page counters within capacity, no overlapping slices on a track."""
import json
from collections import defaultdict

import pytest

from simtest import make_dep
from twin.sim.acceptance import ForcedAcceptance
from twin.sim.run import SimConfig, simulate
from twin.sim.trace import family_capacity
from twin.sim.workload import LengthDist, WorkloadSpec, generate

# ts and dur are seconds * 1e6; a slice's end (ts + dur) and the next one's start, equal in
# seconds, may differ by the rounding of that product: far below a nanosecond
EPS_US = 1e-3


def workload(n=40, **kw):
    return generate(WorkloadSpec(num_requests=n, rate=200.0, prompt=LengthDist("uniform", 500, 400, 16, 1000),
                                 output=LengthDist("uniform", 60, 50, 2, 120), seed=5, **kw))


CASES = {
    "exact": lambda: SimConfig(make_dep(max_model_len=2048), workload()),
    # one slot per partition and long outputs: preemptions and re-prefills inside a decode
    "pressure": lambda: SimConfig(make_dep(max_model_len=2048, max_num_seqs=64), workload(
        48, prefix_groups=2, prefix_len=300, prefix_fraction=0.5), slots=1, acceptance=ForcedAcceptance(8)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def traced(request, tmp_path_factory):
    res = simulate(CASES[request.param]())
    out = tmp_path_factory.mktemp(f"trace-{request.param}")
    res.write(out, plots=False)
    return request.param, res, json.loads((out / "trace.json").read_text())["traceEvents"]


def test_every_track_is_named(traced):
    _, _, ev = traced
    procs = {e["pid"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]) for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {e["pid"] for e in ev if e["ph"] != "M"} <= procs
    assert {(e["pid"], e["tid"]) for e in ev if e["ph"] in ("X", "b", "e", "s", "f")} <= threads
    names = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"prefill", "decode", "TP group 0", "TP group 3"} <= names


def test_async_slices_are_well_bracketed_per_request(traced):
    _, res, ev = traced
    stacks, tops = defaultdict(list), defaultdict(list)
    # the order a trace viewer reads them: by time, equal times in file order (a stable sort)
    for e in sorted((e for e in ev if e["ph"] in ("b", "e")), key=lambda e: e["ts"]):
        st = stacks[e["id"]]
        if e["ph"] == "b":
            if not st:
                tops[e["id"]].append(e["name"])
            st.append(e)
        else:
            assert st, f"an end without a begin on {e['id']}"
            b = st.pop()
            assert b["name"] == e["name"] and b["ts"] <= e["ts"], (b, e)
    assert all(not st for st in stacks.values()), "a begin without its end"
    finished = res.requests[res.requests["end"].notna()]
    # one top-level slice per finished request, holding its phases
    assert {rid: names for rid, names in tops.items()} == {rid: [f"request {rid}"] for rid in finished["request_id"]}
    children = defaultdict(list)
    for e in ev:
        if e["ph"] == "b" and not e["name"].startswith("request "):
            children[e["id"]].append(e["name"])
    done = finished[finished["completed"]]
    assert all("decode" in children[r] and "prefill chunk" in children[r] for r in done["request_id"])
    # the prefill dispatches name their requests: one slice per chunk
    assert max(children[r].count("prefill chunk") for r in done["request_id"]) > 1


def test_flows_bind_to_existing_slices(traced):
    _, res, ev = traced
    slices = defaultdict(list)
    for e in ev:
        if e["ph"] == "X":
            slices[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    ends = defaultdict(dict)
    for e in ev:
        if e["ph"] in ("s", "f"):
            assert e["ph"] not in ends[e["id"]], "one start and one finish per flow"
            ends[e["id"]][e["ph"]] = e
            hits = [s for s in slices[(e["pid"], e["tid"])] if s[0] <= e["ts"] <= s[1]]
            assert len(hits) == 1, e
            assert hits[0][2] == ("prefill" if e["ph"] == "s" else "decode")
    assert ends and all(set(d) == {"s", "f"} and d["s"]["ts"] < d["f"]["ts"] for d in ends.values())
    multi = res.requests[res.requests["completed"] & (res.requests["chunks"] >= 2)]
    assert len(ends) == len(multi)          # every request that decoded after its prefill


def test_page_counters_never_exceed_capacity(traced):
    _, res, ev = traced
    cap = family_capacity(res.scheduler.kv)
    seen = defaultdict(int)
    for e in ev:
        if e["ph"] == "C" and e["name"].startswith("pages "):
            fam = e["name"].split()[1]
            assert e["name"] == f"pages {fam} (of {cap[fam]})"
            assert 0 <= e["args"]["used"] <= cap[fam]
            seen[fam] = max(seen[fam], e["args"]["used"])
    assert set(seen) == set(cap) and max(seen.values()) > 0


def test_slices_on_one_track_never_overlap(traced):
    _, _, ev = traced
    tracks = defaultdict(list)
    for e in ev:
        if e["ph"] == "X":
            assert e["dur"] >= 0
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for key, iv in tracks.items():
        iv.sort()
        for (a0, a1), (b0, _) in zip(iv, iv[1:]):
            assert a1 <= b0 + EPS_US, (key, a0, a1, b0)
    lanes = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["pid"] == 1 and e["name"] == "thread_name"}
    assert lanes == {"schedule", "prepare", "reclaim"}
    assert {e["name"] for e in ev if e.get("cat") == "host"} == lanes
