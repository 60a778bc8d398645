"""The SMALL preset on the real-golden path (hw.real): a clean run passes with no false alarm under
the default policy, whose route and sample tie margins grow with layer depth as measured
(hw.tolerance depth fields), and injected faults are still caught and localized on SMALL.  The
>= 100-dispatch clean runs are benchmarks/real_fault_sweep.py --clean (docs: measured)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from twin.functional.parity import run_case  # noqa: E402
from twin.functional.parity import build_lockstep  # noqa: E402
from hw.tolerance import DEFAULT_TABLE, Policy, Tolerance  # noqa: E402
from twin.abi.errors import AbiError  # noqa: E402


@pytest.fixture(scope="module")
def clean_small():
    lr = build_lockstep(preset="small", k=7, max_new=14)
    return lr, lr.run(200)


def test_small_clean_run_has_no_false_alarm(clean_small):
    lr, s = clean_small
    assert s["verdict"] == "PASS", s["first_divergence"]
    assert set(s["programs"]) == {"l3_prefill_fwd", "l3_dspark_draft_step_device_state", "l3_decode_fwd_dspark"}
    assert s["dispatches"] >= 14 and all(e["verdict"] == "pass" for e in lr.entries)
    # the deep layers' near-tie flips were adopted under the depth-scaled margin (recorded), not hidden
    assert s["resyncs"].get("route", 0) > 0
    deep = [l for l, g in lr.gold.par.route_gaps if l >= 7]
    assert deep, "SMALL's layers 7-10 flip near-tie routes"
    for sd, sg in zip(lr.dev.run.seqs, lr.gold.run.seqs):
        assert sd.generated == sg.generated and len(sd.generated) >= 14


def test_small_k0_decode_run():
    s = build_lockstep(preset="small", k=0, max_new=4).run(10)
    assert s["verdict"] == "PASS", s["first_divergence"]
    assert s["programs"]["l3_decode_fwd"]["dispatches"] >= 3


@pytest.mark.parametrize("kind,at,layer", [("flipped_route", 0, 10), ("wrong_slot", 5, 9),
                                           ("dropped_boundary", 0, 10), ("uncommitted_publish", 0, 0)])
def test_faults_still_caught_on_small(kind, at, layer):
    c = run_case(kind, preset="small", seed=0, at=at, layer=layer, max_new=6, horizon=at + 6)
    assert c["detected"] and c["localized"] and not c["false_alarm"], c


# ---- the depth fields of the policy ---------------------------------------------------------------------
def test_depth_scaling_is_linear_beyond_ref_and_keeps_the_caps():
    t = Tolerance(atol=0.1, rtol=0.05, max_row_rel_l2=0.12, min_cosine=0.99, tie_tol=0.02, hard_atol=0.7,
                  max_ulp=8, bad_budget=0.05, depth_ref=4, depth_growth=0.25)
    assert t.at_depth(0) is t and t.at_depth(4) is t
    d8 = t.at_depth(8)                                   # 1 + 0.25 * 4 = 2x
    assert d8.tie_tol == pytest.approx(0.04) and d8.max_row_rel_l2 == pytest.approx(0.24)
    assert d8.atol == pytest.approx(0.2) and d8.min_cosine == pytest.approx(0.98)
    assert (d8.hard_atol, d8.max_ulp, d8.bad_budget) == (0.7, 8, 0.05)
    assert Tolerance(tie_tol=0.02).at_depth(50).tie_tol == 0.02          # flat entries stay flat


@settings(max_examples=25, deadline=None)
@given(d=st.integers(0, 60), e=st.integers(0, 60))
def test_depth_margins_never_shrink_with_depth(d, e):
    p = Policy()
    for op in ("route", "sample"):
        lo, hi = sorted((d, e))
        assert p.lookup(op, "i32", depth=lo).tie_tol <= p.lookup(op, "i32", depth=hi).tie_tol
        assert p.lookup(op, "i32", depth=lo).tie_tol >= p.lookup(op, "i32").tie_tol


def test_depth_fields_are_data(tmp_path):
    path = tmp_path / "policy.json"
    Policy().to_json(path)
    d = json.loads(path.read_text())
    assert {"depth_ref", "depth_growth"} <= set(d["route/i32/none"])
    back = Policy.from_json(path)
    assert back.lookup("route", "i32", depth=9) == Policy().lookup("route", "i32", depth=9)
    assert DEFAULT_TABLE[("route", "i32", "none")].depth_growth > 0
    with pytest.raises(AbiError, match="depth_growth"):
        Tolerance(depth_growth=-1.0)
    with pytest.raises(AbiError, match="depth_ref"):
        Tolerance(depth_ref=-2)
    with pytest.raises(AbiError, match="depth"):
        Policy().lookup("route", "i32", depth=-1)
