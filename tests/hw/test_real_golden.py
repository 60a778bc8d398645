"""Lockstep against golden's real compositions (hw.real) on parity runs driven by the one scheduler
(twin.functional.parity): golden.compose / golden.dspark run from dispatches that twin.abi.lowering
lowers and validates; the self-check device runs the same compositions with every GEMM on torch
(FP32 accumulation).  A clean run has no false alarm; injected faults are detected at the dispatch
they break and localized to the stage they corrupt."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from hw.real.faults import EXPECTED_STAGES, REAL_KINDS, RealFault  # noqa: E402
from twin.functional.parity import build_lockstep  # noqa: E402
from twin.abi.errors import AbiError  # noqa: E402


@pytest.fixture(scope="module")
def clean_k7():
    lr = build_lockstep(k=7, max_new=30)
    return lr, lr.run(200)


def test_clean_k7_run_has_no_false_alarm(clean_k7):
    lr, s = clean_k7
    assert s["verdict"] == "PASS", s["first_divergence"]
    assert s["dispatches"] >= 30
    assert set(s["programs"]) == {"l3_prefill_fwd", "l3_dspark_draft_step_device_state", "l3_decode_fwd_dspark"}
    assert all(e["verdict"] == "pass" for e in lr.entries)
    # the sides really differ (torch FP32 accumulation vs golden's float64 sums) and the near-ties
    # that difference flips were adopted from the device, not hidden
    assert s["worst_metrics"]["activation/bf16/w8a8"]["max_abs"] > 0
    assert s["resyncs"].get("route", 0) > 0
    # every request ran to its budget on both sides, with the same tokens
    for sd, sg in zip(lr.dev.run.seqs, lr.gold.run.seqs):
        assert len(sd.generated) >= 30 and sd.generated == sg.generated


def test_clean_k7_golden_used_dispatch_addressing(clean_k7):
    """Each side's target pools hold exactly the rows the dispatches mapped: nothing outside them moved."""
    lr, _ = clean_k7
    for layer, pools in enumerate(lr.gold.run.caches):
        kv = np.asarray(pools["kv_cache"], np.float32).reshape(-1, pools["kv_cache"].shape[-1])
        written = np.flatnonzero(np.abs(kv).sum(-1) > 0)
        assert written.size > 0
        dev = np.asarray(lr.dev.run.caches[layer]["kv_cache"], np.float32).reshape(kv.shape)
        assert set(np.flatnonzero(np.abs(dev).sum(-1) > 0)) == set(written)


def test_clean_k0_run():
    s = build_lockstep(k=0, max_new=8).run(12)
    assert s["verdict"] == "PASS", s["first_divergence"]
    assert s["programs"]["l3_decode_fwd"]["dispatches"] >= 7


def test_exact_mode_sides_agree_closely():
    lr = build_lockstep(k=7, max_new=4, golden_mode="exact")
    s = lr.run(6)
    assert s["verdict"] == "PASS", s["first_divergence"]
    assert s["resyncs"].get("route", 0) == 0 and s["resyncs"].get("sample", 0) == 0
    h = s["worst_metrics"]["activation/bf16/w8a8"]
    assert h["max_rel_l2"] < 1e-9


@pytest.mark.parametrize("kind,at,layer", [("weight", 5, 2), ("route", 0, 5), ("kv_row", 5, 3), ("stray", 6, 4),
                                           ("token", 6, 0), ("weight", 0, 6)])
def test_fault_detected_and_localized(kind, at, layer):
    f = RealFault(kind, at=at, layer=layer)
    lr = build_lockstep(k=7, max_new=8, fault=f)
    s = lr.run(at + 4)
    assert f.fired
    assert s["verdict"] == "FAIL"
    assert [e["index"] for e in lr.entries if e["verdict"] == "fail"] == [at]      # strict: stops there
    fd = s["first_divergence"]
    assert fd["dispatch"] == at
    assert fd["stage"] in EXPECTED_STAGES[kind]
    assert fd["layer"] == ("head" if kind == "token" else str(layer))
    if kind == "stray":
        assert any("unmapped rows modified" in r for r in fd["reasons"])


@settings(max_examples=6, deadline=None)
@given(kind=st.sampled_from(["weight", "kv_row", "stray"]), at=st.integers(0, 7), layer=st.integers(0, 6))
def test_any_fault_fires_and_is_caught_where_it_fires(kind, at, layer):
    """A fault that fires is reported at its dispatch and layer; one that finds nothing to break
    (a seed dispatch runs no target layer) leaves the run clean."""
    f = RealFault(kind, at=at, layer=layer)
    lr = build_lockstep(k=7, max_new=6, fault=f)
    s = lr.run(at + 2)
    if f.fired:
        fd = s["first_divergence"]
        assert (fd["dispatch"], fd["layer"], fd["stage"] in EXPECTED_STAGES[kind]) == (at, str(layer), True)
    else:
        assert lr.entries[at]["kind"] == "seed" and s["verdict"] == "PASS"


def test_continuous_mode_resyncs_after_a_fault():
    f = RealFault("kv_row", at=5, layer=3)
    lr = build_lockstep(k=7, max_new=10, fault=f, mode="continuous")
    s = lr.run(12)
    assert [e["index"] for e in lr.entries if e["verdict"] == "fail"] == [5]   # reported once, then in sync
    assert s["dispatches"] == 12 and s["resyncs"]["state"] == 1


def _corrupt_first_prefill(monkeypatch, arg, edit):
    """Every prefill dispatch the executor lowers gets `edit` applied to its argument `arg`."""
    import twin.functional.executor as ex

    real = ex.lower

    def bad(batch, ctx, **kw):
        d = real(batch, ctx, **kw)
        if d.program == "l3_prefill_fwd":
            a = np.array(d.args[arg])
            edit(a)
            d = type(d)(d.program, {**d.args, arg: a}, d.meta)
        return d

    monkeypatch.setattr(ex, "lower", bad)
    monkeypatch.setattr(ex, "validate", lambda d, ctx: None)


def test_golden_checks_the_staged_slots(monkeypatch):
    """Golden runs what the dispatch stages: a dispatch whose slot mapping disagrees with the pages
    the scheduler gave the request is refused, naming the slot mapping."""
    def shift(a):
        a[0, 3] += 1
    _corrupt_first_prefill(monkeypatch, "ori_slot_mapping_full", shift)
    with pytest.raises(AbiError, match="ori_slot_mapping_full"):
        build_lockstep(k=7, max_new=4).run(1)


def test_bad_inputs_name_the_argument():
    with pytest.raises(AbiError, match="kind"):
        RealFault("bitrot")
    with pytest.raises(AbiError, match="layer"):
        build_lockstep(fault=RealFault("weight", layer=99))
    with pytest.raises(AbiError, match="preset"):
        build_lockstep(preset="flash")
    with pytest.raises(AbiError, match="mode"):
        build_lockstep(mode="lenient")
    assert set(EXPECTED_STAGES) == set(REAL_KINDS)


def test_cli_golden_real(tmp_path, capsys):
    """The real golden is the CLI's default: records on, a run directory resumes, --no-records opts out."""
    from twin.cli import main

    assert main(["lockstep", "--steps", "6", "--run-dir", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    assert "PASS: 6 dispatches" in out and "re-syncs:" in out and "records/" in out
    assert (tmp_path / "a" / "summary.md").exists() and (tmp_path / "a" / "report.jsonl").exists()
    config = json.loads((tmp_path / "a" / "summary.json").read_text())["config"]
    assert config["golden"] == "real" and config["compressor_contract"] == "eager-publish"   # the one checked
    assert (tmp_path / "a" / "records" / "manifest.jsonl").read_text().count("\n") == 6
    rc = main(["lockstep", "--steps", "8", "--run-dir", str(tmp_path / "b"), "--inject", "kv_row@5:3"])
    out = capsys.readouterr().out.replace("\n", " ")
    assert rc == 1 and "dispatch 5" in out and "layer 3" in out and "stage kv" in out
    # the same directory again resumes: 6 done, 2 more
    assert main(["lockstep", "--steps", "8", "--run-dir", str(tmp_path / "a")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "6 dispatches already checked" in out and "PASS: 8 dispatches" in out
    # without records a run directory cannot resume
    assert main(["lockstep", "--steps", "2", "--no-records", "--run-dir", str(tmp_path / "c")]) == 0
    assert not (tmp_path / "c" / "records").exists() and "records/" not in capsys.readouterr().out
    assert main(["lockstep", "--steps", "3", "--no-records", "--run-dir", str(tmp_path / "c")]) == 2
    assert "run_dir=" in capsys.readouterr().err
    assert main(["lockstep", "--inject", "melt@1", "--run-dir", str(tmp_path / "d")]) == 2
    assert "kind='melt'" in capsys.readouterr().err


def test_golden_checks_every_staged_position(monkeypatch):
    """The shared cross-check (golden.staging) also holds the dispatch's positions to golden's: a
    position staged out of order inside a chunk is refused, naming position_ids_full."""
    def bump(a):
        a[0, 5] += 1
    _corrupt_first_prefill(monkeypatch, "position_ids_full", bump)
    with pytest.raises(AbiError, match="position_ids_full"):
        build_lockstep(k=7, max_new=4).run(1)
