"""Every injected fault kind is detected, and localized to the right (dispatch, layer, stage)."""
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hw.faults import KINDS, Fault
from hw.runs import build_run

ISSUE_KINDS = {"bitflip", "stale_draft_kv", "wrong_slot", "dropped_boundary", "off_by_one_position",
               "flipped_route", "uncommitted_publish", "ring_alias"}
CASES = [(k, at, layer) for k in KINDS for at, layer in ((2, 0), (6, 1))]


def test_the_issue_kinds_are_all_injectable():
    assert ISSUE_KINDS <= set(KINDS) and len(KINDS) >= 8
    with pytest.raises(Exception, match="fault='melted'"):
        Fault("melted")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = {}
    for kind, at, layer in CASES:
        f = Fault(kind, at=at, layer=layer, seed=at)
        s = build_run(tmp_path_factory.mktemp(kind), fault=f, record=False).run(24)
        out[(kind, at, layer)] = (f.fired, s)
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{k}@{a}:{l}" for k, a, l in CASES])
def test_fault_fires_and_is_detected_at_its_dispatch(outcomes, case):
    fired, s = outcomes[case]
    assert fired is not None, "the fault found no dispatch to break"
    assert s["verdict"] == "FAIL"
    assert s["first_divergence"]["dispatch"] == fired["dispatch"]       # strict: the first failure is the fault


def test_localization_to_layer_and_stage_is_at_least_90_percent(outcomes):
    hits = [(f["layer"], f["stage"]) == (s["first_divergence"]["layer"], s["first_divergence"]["stage"])
            for f, s in outcomes.values()]
    assert sum(hits) / len(hits) >= 0.9, [(c, o[1]["first_divergence"]) for c, o in outcomes.items()]


@settings(max_examples=6)
@given(kind=st.sampled_from(KINDS), at=st.integers(0, 8), layer=st.integers(0, 6), seed=st.integers(0, 10_000))
def test_any_fault_anywhere_is_detected_at_the_dispatch_it_breaks(tmp_path_factory, kind, at, layer, seed):
    f = Fault(kind, at=at, layer=layer, seed=seed)
    s = build_run(tmp_path_factory.mktemp("prop"), fault=f, record=False).run(at + 14)
    assume(f.fired is not None)              # no applicable dispatch in the window: nothing was broken
    assert s["verdict"] == "FAIL" and s["first_divergence"]["dispatch"] == f.fired["dispatch"]
