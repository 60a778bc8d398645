"""The sampled lockstep (hw.real.coverage + hw.real.site_check) on TINY: a clean run passes with every
site checked within N dispatches of its program, the site check judges a layer from the device's
recorded state alone, every fault kind injected persistently is detected within N dispatches of its
program and localized, and a single-dispatch fault is caught as often as the plan says."""
import json
import math

import pytest

from hw.real.faults import REAL_KINDS, RealFault
from hw.real.site_check import check_recorded
from twin.functional.parity import build_lockstep, run_case, single_dispatch_case

N = 4


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    d = tmp_path_factory.mktemp("clean")
    lr = build_lockstep(preset="tiny", k=7, max_new=16, coverage=N, run_dir=d)
    return lr, lr.run(steps=24), d


def test_clean_sampled_run_passes_and_covers_every_site(clean):
    lr, s, d = clean
    assert s["verdict"] == "PASS" and s["dispatches"] == 24
    plan = lr.checker.plan
    cov = json.loads((d / "summary.json").read_text())["coverage"]
    assert cov["n"] == N
    by_prog = {}
    for e in lr.entries:
        by_prog.setdefault(e["program"], []).append(e)
        # the plan's sites for this dispatch, exactly, each with its result
        want = plan.plan(e["program"], e["coverage"]["nth"])
        assert [tuple([e["program"], *x[:3]]) for x in e["sites"]] == [tuple(w) for w in want]
        assert {x[3] for x in e["sites"]} <= {"pass"}
    for program, es in by_prog.items():
        c = cov["programs"][program]
        # N dispatches of a program check each of its sites once: all checked, none failing
        if len(es) >= N:
            assert c["checked"] == c["sites"] == len(plan.sites[program]) and c["never_checked"] == 0
        assert c["last_failed"] == 0
    # the ledger's last check of a site is the last dispatch of its program whose plan holds it
    prog, group, layer, stage, index, verdict = cov["last_checked"][0]
    site = (prog, group, int(layer) if layer.lstrip("-").isdigit() else layer, stage)
    last = max(e["index"] for e in lr.entries if e["program"] == prog and site in plan.plan(prog, e["coverage"]["nth"]))
    assert (index, verdict) == (last, "pass")
    assert "## Coverage" in (d / "summary.md").read_text()


def test_recorded_site_check_reproduces_the_live_verdicts(clean):
    lr, _, d = clean
    e = next(e for e in lr.entries if e["program"] == "l3_decode_fwd_dspark" and e["sites"])
    sites = [[e["program"], *x[:3]] for x in e["sites"]]
    r = check_recorded(str(d), e["index"], sites)
    assert [x["site"] for x in r["sites"]] == sites
    assert all(x["verdict"] == "pass" for x in r["sites"])
    assert not [f for f in r["head"] if not f["passed"]]
    # and as plain data: what a worker process hands back
    json.dumps(r)


def test_a_dispatch_replayed_alone_checks_the_sites_the_plan_gave_it(clean):
    from twin.functional.parity import check_dispatches

    _, _, d = clean
    lines = (d / "report.jsonl").read_text().splitlines()
    # a later dispatch replayed on its own (as a Ray chunk starts): the dispatches replayed past still
    # count in its program's plan, so its line is the live one
    for k in (9, 19):
        e = check_dispatches(d, [k])[0]
        assert e["coverage"]["nth"] > 0 and json.dumps(e, sort_keys=True) == lines[k]


def test_a_site_check_needs_no_layer_before_it(tmp_path):
    """A persistent o_proj fault in layer 1: from the records alone, every site of the dispatch is
    checked; only layer 1's attention stages from attn_out on fail.  A golden that ran from the
    embeddings would fail every later layer too; re-synced from the device's input residual of each
    layer, layers 2.. agree with the (faulty) device."""
    f = RealFault("weight", at=0, layer=1, persistent=True)
    lr = build_lockstep(preset="tiny", k=7, max_new=8, coverage=1, fault=f, run_dir=tmp_path, mode="continuous")
    lr.run(steps=1)
    plan = lr.checker.plan
    prog = lr.entries[0]["program"]
    r = check_recorded(str(tmp_path), 0, plan.sites[prog])
    bad = {(x["site"][2], x["site"][3]) for x in r["sites"] if x["verdict"] == "fail"}
    assert bad and {layer for layer, _ in bad} == {1}
    assert {stage for _, stage in bad} <= {"attn_out", "attn_x_hc"} and (1, "attn_out") in bad
    fd = next(x for x in r["sites"] if x["verdict"] == "fail")["first_divergence"]
    assert (fd["layer"], fd["stage"]) == ("1", "attn_out")
    # the logits are the device's last layer through golden's head: layer 1's fault is not theirs
    assert all(f["passed"] for f in r["head"])
    assert lr.entries[0]["first_divergence"]["stage"] == "attn_out"


# the layer each kind is injected at on TINY (dropped_boundary: a CSA layer, where every fused dispatch
# crosses a ratio-4 boundary; ring_alias: the SWA ring); at dispatch 5, the first fused dispatch
LAYER = {"weight": 3, "route": 3, "kv_row": 3, "stray": 3, "wrong_slot": 3, "dropped_boundary": 2,
         "flipped_route": 3, "ring_alias": 0}


@pytest.mark.parametrize("kind", REAL_KINDS)
def test_persistent_fault_is_detected_within_n_dispatches_of_its_program(kind):
    r = run_case(kind, seed=0, at=5, layer=LAYER.get(kind, 0), persistent=True, coverage=N, horizon=5 + 3 * N,
                 max_new=16)
    assert r["fired_at"] is not None, r
    assert not r["false_alarm"] and r["detected"], r
    assert r["program_latency"] <= N, r
    assert r["localized"], r


@pytest.mark.parametrize("kind", ["kv_row", "weight", "stale_draft_kv"])
def test_single_dispatch_fault_is_caught_with_the_plans_probability(kind, tmp_path):
    """One firing at a fused dispatch (kv_row: one pool row; weight: layer 3's attention output;
    stale_draft_kv: one stale drafter context row, the drafter site alone): at N = 1 the dispatch's failing sites are the set A; for
    each of 40 plan seeds at N = 4 the recorded dispatch's planned sites are checked from the records.
    Each seed's outcome is the plan's (caught exactly when its slot meets A), and the frequency is
    within a 4-sigma binomial bound of `hit_probability`."""
    r = single_dispatch_case(kind, at=6, layer=3, n=N, plan_seeds=range(40), run_dir=tmp_path)
    assert r["fired_at"] == 6 and r["affected_sites"] and not r["head"]
    if kind == "stale_draft_kv":
        # the drafter's stage re-run from the records fails, and nothing upstream of it
        assert r["affected_sites"] == [["l3_decode_fwd_dspark", -1, "drafter", "ctx_kv"]], r
    assert r["disagree_with_plan"] == [], r
    p = r["plan_probability"]
    assert 0 < p < 1
    assert abs(r["frequency"] - p) <= 4 * math.sqrt(p * (1 - p) / r["trials"]), r
