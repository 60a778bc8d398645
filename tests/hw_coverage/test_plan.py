"""The coverage plan's guarantee (hw.real.coverage): every site of a program is checked at least once
in every N consecutive dispatches of that program, a dispatch checks ceil(S/N) sites at most, and a
single-dispatch fault is caught with the probability the plan states."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hw.real.coverage import (DECODE, DRAFTER_SITE, FUSED, PREFILL, SEED, CoveragePlan, check_n, choose_n, layer_stages,
                              program_sites)
from twin.abi.errors import AbiError
from twin.abi.presets import get_preset
from twin.abi.topology import deployment


def _dep(preset, k=7):
    return deployment(get_preset(preset), ep=16 if preset == "flash" else 8, max_model_len=512,
                      num_speculative_tokens=k)


def test_sites_follow_the_deployment():
    cfg = get_preset("flash")
    dep = _dep("flash")
    plan = CoveragePlan.for_deployment(dep, 16)
    # 4 TP groups of FLASH's 16 ranks, 43 layers; CSA layers tap cmp_kv and idx_topk, HCA only cmp_kv
    per_layer = sum(len(layer_stages(cfg, layer)) for layer in range(cfg.num_hidden_layers))
    assert per_layer == 14 * 43 - len(cfg.swa_layers) * 2 - len(cfg.hca_layers)
    assert len(plan.sites[PREFILL]) == dep.partitions * per_layer == 4 * per_layer
    assert len(plan.sites[FUSED]) == 4 * per_layer + 1          # the drafter site covers every group
    assert plan.sites[SEED] == ((SEED, -1) + DRAFTER_SITE,)
    assert "idx_topk" in layer_stages(cfg, cfg.csa_layers[0]) and "idx_topk" not in layer_stages(cfg, cfg.hca_layers[0])
    assert "cmp_kv" not in layer_stages(cfg, cfg.swa_layers[0])
    # K=0: no drafter sites, no drafter programs
    plan0 = CoveragePlan.for_deployment(_dep("tiny", 0), 4)
    assert set(plan0.sites) == {PREFILL, DECODE}
    assert all(s[2] != "drafter" for p in plan0.sites.values() for s in p)
    # K=7 runs the fused program, not the K=0 decode
    assert set(plan.sites) == {PREFILL, FUSED, SEED}


@settings(max_examples=60)
@given(preset=st.sampled_from(["tiny", "small", "flash"]), n=st.integers(1, 400), seed=st.integers(0, 2 ** 31),
       start=st.integers(0, 10_000))
def test_every_site_within_n_dispatches_of_its_program(preset, n, seed, start):
    plan = CoveragePlan.for_deployment(_dep(preset), n, seed)
    for program, sites in plan.sites.items():
        window = [plan.plan(program, start + i) for i in range(n)]
        flat = [s for w in window for s in w]
        # each site exactly once in any n consecutive dispatches of the program: at least once, and
        # no dispatch spends a check twice
        assert sorted(flat) == sorted(sites)
        lo, hi = len(sites) // n, math.ceil(len(sites) / n)
        assert all(lo <= len(w) <= hi for w in window)
        assert all(s[0] == program for s in flat)


def test_the_plan_is_deterministic_and_the_seed_matters():
    dep = _dep("small")
    a, b = CoveragePlan.for_deployment(dep, 16, 3), CoveragePlan.for_deployment(dep, 16, 3)
    c = CoveragePlan.for_deployment(dep, 16, 4)
    assert [a.plan(FUSED, i) for i in range(16)] == [b.plan(FUSED, i) for i in range(16)]
    assert [a.plan(FUSED, i) for i in range(16)] != [c.plan(FUSED, i) for i in range(16)]
    site = a.sites[FUSED][5]
    j = a.phase(FUSED, site)
    assert [i for i in range(48) if site in a.plan(FUSED, i)] == [j, j + 16, j + 32]


def test_full_checking_is_n_1():
    plan = CoveragePlan.for_deployment(_dep("tiny"), 1)
    for program, sites in plan.sites.items():
        assert set(plan.plan(program, 0)) == set(sites) == set(plan.plan(program, 7))


@pytest.mark.parametrize("affected", [1, 3, 14])
def test_single_dispatch_hit_probability_matches_the_permutation(affected):
    """Over permutation seeds, the fraction of plans whose slot for one dispatch meets a fixed set of
    affected sites is within a 4-sigma binomial bound of `hit_probability`."""
    dep = _dep("tiny")
    sites = CoveragePlan.for_deployment(dep, 16).sites[FUSED]
    hit_set = set(sites[10:10 + affected])
    trials = 2000
    hits = sum(bool(hit_set & set(CoveragePlan({FUSED: sites}, 16, s).plan(FUSED, 9))) for s in range(trials))
    p = CoveragePlan({FUSED: sites}, 16, 0).hit_probability(FUSED, hit_set)
    assert abs(hits / trials - p) <= 4 * math.sqrt(p * (1 - p) / trials) + 1e-9
    if affected == 1:
        assert p == pytest.approx(1 / 16, abs=1e-12)       # 186 sites in 16 slots: mean slot size 186/16


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "4"])
def test_bad_n_is_refused(bad):
    with pytest.raises(AbiError, match="coverage"):
        check_n(bad)


@settings(max_examples=80)
@given(sites=st.integers(1, 5000), sites_per_s=st.floats(0.01, 1e4), dispatches_per_s=st.floats(0.01, 1e3))
def test_chosen_n_is_the_smallest_that_keeps_up(sites, sites_per_s, dispatches_per_s):
    r = choose_n(sites, sites_per_s, dispatches_per_s)
    n, budget = r["n"], sites_per_s / dispatches_per_s
    assert 1 <= n <= sites
    per = math.ceil(sites / n)
    if budget >= 1:
        assert r["keeps_up"] and per <= budget
        assert n == 1 or math.ceil(sites / (n - 1)) > math.floor(budget)
    else:
        assert not r["keeps_up"] and n == sites       # one site per dispatch, still behind: said so
    with pytest.raises(AbiError):
        choose_n(sites, 0.0, dispatches_per_s)
