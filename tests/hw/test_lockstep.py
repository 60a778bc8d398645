"""A clean CPU lockstep run: no false alarms over >= 100 dispatches of every kind; reports; replay."""
import json

import pytest

from hw.faults import Fault
from hw.lockstep import replay
from hw.model.spec import PROGRAMS
from hw.runs import build_run

STEPS = 104


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    d = tmp_path_factory.mktemp("clean")
    lr = build_run(d)
    return d, lr, lr.run(STEPS)


def test_clean_run_has_no_false_alarms_over_every_program(clean):
    d, _, s = clean
    assert s["verdict"] == "PASS" and s["failed_dispatches"] == 0 and s["first_divergence"] is None
    assert s["dispatches"] == STEPS
    assert set(s["programs"]) == set(PROGRAMS)           # prefill, K=0 decode, fused K=7, seeding
    assert all(c["dispatches"] >= 2 for c in s["programs"].values())


def test_every_resync_is_recorded_with_its_site(clean):
    d, _, s = clean
    entries = [json.loads(x) for x in (d / "report.jsonl").read_text().splitlines()]
    assert len(entries) == STEPS and [e["index"] for e in entries] == list(range(STEPS))
    rs = [r for e in entries for r in e["resyncs"]]
    assert rs and s["resyncs"] == {k: sum(r["kind"] == k for r in rs) for k in s["resyncs"]}
    for r in rs:
        assert r["kind"] in ("route", "sample", "draft", "accepted") and r["golden"] != r["device"]
        assert r["site"][1] in ("route", "sample", "verify")


def test_reports_jsonl_markdown_html(clean):
    d, _, s = clean
    md = (d / "summary.md").read_text()
    assert md.startswith("# Lockstep: PASS\n\n## First divergence")
    assert "| l3_decode_fwd_dspark |" in md
    html = (d / "summary.html").read_text()
    assert html.index("First divergence") < html.index("Dispatches")
    e = json.loads((d / "report.jsonl").read_text().splitlines()[0])
    assert {"index", "program", "verdict", "findings", "first_divergence", "resyncs"} <= set(e)
    kinds = {f["kind"] for f in e["findings"]}
    assert "kv_pool/bf16/none" in kinds and "logits/f32/none" in kinds


def test_records_replay_offline_against_golden(clean):
    d, lr, _ = clean
    entries = replay(d, lr.geo, lr.lock.golden, limit=40)
    assert len(entries) == 40 and {e["program"] for e in entries} == set(PROGRAMS)
    assert all(e["verdict"] == "pass" for e in entries)
    manifest = [json.loads(x) for x in (d / "records" / "manifest.jsonl").read_text().splitlines()]
    assert {"inputs", "outputs", "state_delta", "golden_state_delta", "weights"} <= set(manifest[0])


def test_strict_stops_continuous_goes_on_and_resyncs_state(tmp_path):
    strict = build_run(tmp_path / "s", mode="strict", fault=Fault("wrong_slot", at=4, layer=3), record=False)
    s = strict.run(12)
    assert s["dispatches"] == s["first_divergence"]["dispatch"] + 1 and s["failed_dispatches"] == 1
    cont = build_run(tmp_path / "c", mode="continuous", fault=Fault("wrong_slot", at=4, layer=3), record=False)
    c = cont.run(12)
    assert c["dispatches"] == 12 and c["failed_dispatches"] == 1            # reported once, no cascade
    assert c["resyncs"].get("state") == 1
    assert c["first_divergence"] == s["first_divergence"]
