"""A sampled run's records keep the taps its planned sites and its head check read, not every tap:
the device side hashes about a plan's share of them.  What that costs is stated, not hidden: a
sampled recording replays its plan (another site of a recorded dispatch is refused by name), and a
failure found asynchronously is localized among the sites whose taps its record keeps
(`localized_over` of `localized_of`), the same in the live report and in its replay."""
import json

import pytest

pytest.importorskip("torch")

from hw.real.coverage import drafter_reads, layer_stages, recorded_taps, site_reads  # noqa: E402
from hw.real.faults import RealFault  # noqa: E402
from hw.real.step import DECISION_STAGES  # noqa: E402
from hw.records import RecordStore  # noqa: E402
from twin.abi.errors import AbiError  # noqa: E402
from twin.functional.parity import build_lockstep, check, check_dispatches  # noqa: E402

N = 4
STEPS = 10


def _taps(rec) -> set:
    out = set()
    for name in rec.outputs:
        kind, _, rest = name.partition(":")
        if kind == "tap":
            layer, _, stage = rest.partition("#")[0].rpartition("/")
            out.add((int(layer) if layer.isdigit() else layer, stage))
    return out


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    d = tmp_path_factory.mktemp("sampled")
    lr = build_lockstep(preset="tiny", k=7, max_new=16, coverage=N, run_dir=d)
    s = lr.run_async(STEPS, workers=1, backlog=4)
    return lr, s, d


def test_each_record_keeps_the_decisions_and_what_its_plan_and_head_read(sampled):
    lr, s, d = sampled
    assert s["verdict"] == "PASS"
    g = lr.checker.dev.g
    cfg, tap = g.cfg, g.drafter.target_hidden_tap
    every = {(layer, st) for layer in range(cfg.num_hidden_layers) for st in ("attn_in",) + layer_stages(cfg, layer)}
    recs = RecordStore(d / "records").records()
    assert len(recs) == len(lr.entries) == STEPS
    fewer = 0
    for rec, e in zip(recs, lr.entries):
        kept = _taps(rec)
        if not kept:                # a seeding wave: no target forward, no taps
            continue
        want = recorded_taps(cfg, [tuple(x[:3]) for x in e["sites"]], tap)
        assert {t for t in kept if t[1] not in DECISION_STAGES} == {t for t in want if t[1] not in DECISION_STAGES}
        assert {t for t in every if t[1] in DECISION_STAGES} <= kept
        for x in e["sites"]:
            if x[1] != "drafter":
                assert set(site_reads(cfg, x[1], x[2])) <= kept
        fewer += bool(every - kept)
    assert fewer, "no record kept fewer taps than a forward has"


def test_a_sampled_recording_replays_its_plan_and_refuses_other_sites(sampled):
    lr, _, d = sampled
    lines = (d / "report.jsonl").read_text().splitlines()
    i, e = next((i, e) for i, e in enumerate(lr.entries) if e["program"] == "l3_decode_fwd_dspark")
    assert json.dumps(check_dispatches(d, [i])[0], sort_keys=True) == lines[i]
    kept = _taps(RecordStore(d / "records").records()[i])
    cfg = lr.checker.dev.g.cfg
    other = next((layer, st) for layer in range(cfg.num_hidden_layers) for st in layer_stages(cfg, layer)
                 if not set(site_reads(cfg, layer, st)) <= kept)
    with pytest.raises(AbiError, match="replay its plan"):
        check(d, i, [(e["program"], 0, *other)])
    # the drafter site too: a dispatch whose plan had no drafter site keeps no target hidden for it
    g = lr.checker.dev.g
    j, ej = next((j, x) for j, x in enumerate(lr.entries) if x["program"] == "l3_decode_fwd_dspark"
                 and not any(y[1] == "drafter" for y in x["sites"])
                 and not set(drafter_reads(cfg, g.drafter.target_hidden_tap))
                 <= _taps(RecordStore(d / "records").records()[j]))
    with pytest.raises(AbiError, match="replay its plan"):
        check(d, j, [(ej["program"], -1, "drafter", "ctx_kv")])


def test_an_asynchronous_failure_is_localized_among_its_records_sites(tmp_path):
    """A persistent o_proj fault in layer 1: the first failing dispatch's planned sites catch it at
    layer 1; its record keeps only its plan's sub-layers, so the first divergence is the first among
    those, said in the line (fewer sites localized over than its program has), and it is the fault's."""
    f = RealFault("weight", at=0, layer=1, persistent=True)
    lr = build_lockstep(preset="tiny", k=7, max_new=16, coverage=N, fault=f, run_dir=tmp_path, mode="continuous")
    s = lr.run_async(8, workers=1, backlog=4)
    bad = [e for e in lr.entries if e["verdict"] == "fail"]
    assert bad, "the fault went undetected in 8 dispatches"
    e = bad[0]
    assert 0 < e["localized_over"] < e["localized_of"]
    assert (e["first_divergence"]["layer"], e["first_divergence"]["stage"]) == ("1", "attn_out")
    # the summary and its markdown say it too
    fd = s["first_divergence"]
    assert (fd["dispatch"], fd["localized_over"], fd["localized_of"]) == (e["index"], e["localized_over"],
                                                                         e["localized_of"])
    assert f"localized among the {e['localized_over']} of {e['localized_of']} sites" in \
        (tmp_path / "summary.md").read_text()
    lines = (tmp_path / "report.jsonl").read_text().splitlines()
    k = [x["index"] for x in lr.entries].index(e["index"])
    assert json.dumps(check_dispatches(tmp_path, [e["index"]])[0], sort_keys=True) == lines[k]
