"""The emulated 16-rank forward equals the single-rank forward for prefill, decode and the drafter:
to float64 rounding in exact mode ("ordered" reduction; a rank's rows sit at other GEMM positions
than in the single-rank run, see exactness.py), within tolerance in device mode (the device's
partial-sum reduce-scatter), and a whole K=7 generation run as 16 ranks makes the single-rank
run's tokens exactly."""
import numpy as np
import pytest

from exactness import assert_exact_close
from twin.abi import TINY
from golden.checkpoint import SyntheticCheckpoint
from golden.compose import Taps, forward, target_hidden
from golden.dspark import drafter as D, step as S
from golden.dspark.markov import dspark_markov
from golden.dspark.ring import new_pools
from golden.dspark.weights import DrafterCheckpoint
from golden.numerics import numerics
from golden.paged import DECODE, PREFILL, Span, alloc_caches, assign_blocks, lower
from golden.ranks import RankEmulation, layout_for
from golden.ranks.target import cp_owners, forward_ranks

CFG = TINY
CK, DK = SyntheticCheckpoint(CFG, 0), DrafterCheckpoint(CFG, 0)
REDUCTION = {"exact": "ordered", "device": "partial_sums"}


def _same(a, b, mode, *, rel=2e-3):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if mode == "exact":
        assert_exact_close(a, b)
    else:
        assert np.linalg.norm(a - b) <= rel * max(np.linalg.norm(b), 1e-30)


def _compare(a, b, ta, tb, mode):
    _same(a.logits, b.logits, mode, rel=1e-3)
    np.testing.assert_array_equal(np.asarray(a.sampled), np.asarray(b.sampled))
    for la, lb in zip(a.caches, b.caches):
        for name in la:
            _same(la[name], lb[name], mode, rel=1e-2)
    nm = numerics(mode)
    _same(target_hidden(ta, CK.model(), cfg=CFG, nm=nm), target_hidden(tb, CK.model(), cfg=CFG, nm=nm), mode, rel=1e-2)


@pytest.mark.parametrize("mode", ["exact", "device"])
def test_prefill_then_decode_as_16_ranks(mode):
    nm = numerics(mode)
    rng = np.random.default_rng(0)
    lens = [37, 133, 9, 70]                                 # crosses the window and a ratio-128 boundary
    blocks, pages = assign_blocks(CFG, len(lens), 160)
    par = RankEmulation(layout_for(CFG), REDUCTION[mode])
    spans = [Span(i, 0, tuple(int(t) for t in rng.integers(0, CFG.vocab_size, L)), blocks[i])
             for i, L in enumerate(lens)]
    meta = lower(CFG, spans, form=PREFILL)
    c0 = alloc_caches(CFG, pages, nm)
    owners = cp_owners(meta, {0: 0, 1: 1, 2: 1, 3: 3}, 4)   # group 1 packs two requests, group 2 idles
    assert sorted(set(owners.tolist())) == [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]
    ta, tb = Taps({"x_hc", "attn_in"}), Taps({"x_hc", "attn_in"})
    a = forward(CK, meta, c0, cfg=CFG, nm=nm, taps=ta)
    b = forward_ranks(CK, meta, c0, owners, par, cfg=CFG, nm=nm, taps=tb)
    _compare(a, b, ta, tb, mode)
    # a K=7 verify window per request, owners = lease % 4 within each request's group
    spans = [Span(i, L, tuple(int(t) for t in rng.integers(0, CFG.vocab_size, 8)), blocks[i])
             for i, L in enumerate(lens)]
    meta = lower(CFG, spans, form=DECODE)
    owners = np.repeat([3, 4 + 2, 4 + 1, 12], 8)
    ta, tb = Taps({"x_hc", "attn_in"}), Taps({"x_hc", "attn_in"})
    a2 = forward(CK, meta, a.caches, cfg=CFG, nm=nm, taps=ta)
    b2 = forward_ranks(CK, meta, a.caches, owners, par, cfg=CFG, nm=nm, taps=tb)
    _compare(a2, b2, ta, tb, mode)
    ranks_used = {r for stage, r, _ in par.trace}
    assert ranks_used == set(range(16)) - {8, 9, 10, 11}


@pytest.mark.parametrize("mode", ["exact", "device"])
def test_drafter_and_markov_as_16_ranks(mode):
    nm = numerics(mode)
    rows = [D.DraftRow(63, 40, 5, tuple(range(0, 41)), owner_rank=3),
            D.DraftRow(62, 10, 7, tuple(range(0, 11)), owner_rank=2),
            D.DraftRow(8, 20, 9, tuple(range(15, 21)), owner_rank=0)]
    mh = nm.bf16(np.random.default_rng(0).standard_normal((58, 3 * CFG.hidden_size)))
    dm = DK.model()
    out = []
    for par in (None, RankEmulation(layout_for(CFG), REDUCTION[mode])):
        kw = {} if par is None else {"par": par}
        head, pool = D.drafter_forward(new_pools(CFG, 1, nm)[0], mh, rows, DK, CK.model(), cfg=CFG, nm=nm, **kw)
        drafts, conf = dspark_markov(head, dm["final_norm_weight"], CK.model()["lm_head_weight"], [1, 0, 1],
                                     [5, 0, 9], [0, 7, 0], dm["markov_w1"], dm["markov_w2"],
                                     dm["confidence_head_weight"], cfg=CFG, nm=nm, owners=[3, 2, 0], **kw)
        out.append((head, pool, drafts, conf))
    (h1, p1, d1, c1), (h2, p2, d2, c2) = out
    _same(h2, h1, mode, rel=1e-2)
    _same(p2, p1, mode, rel=1e-2)
    _same(c2, c1, mode, rel=1e-2)
    np.testing.assert_array_equal(d2, d1)


@pytest.mark.parametrize("topo,groups,spec", [
    ((4, 16), 4, [(9, 12), (30, 10), (5, 14), (17, 8), (12, 9)]),
    ((4, 4), 1, [(9, 6), (30, 5), (5, 7)]),                # reduced topologies of the small presets
    ((1, 1), 1, [(9, 6), (12, 5)]),
])
def test_a_k7_generation_as_ranks_equals_one_rank(topo, groups, spec):
    """Every dispatch of the run (prefill, seeding waves, fused steps) through the emulation."""
    rng = np.random.default_rng(5)
    reqs = [S.Prompt(f"r{i}", tuple(int(t) for t in rng.integers(0, CFG.vocab_size, L)), n)
            for i, (L, n) in enumerate(spec)]
    runs = []
    for par in (None, RankEmulation(layout_for(CFG, *topo), "ordered")):
        kw = {} if par is None else {"par": par}
        g = S.Golden(CFG, CK, DK, nm="exact", max_model_len=48, groups=groups, **kw)
        runs.append(S.generate(g, reqs, k=7))
    a, b = runs
    assert S.outputs(a) == S.outputs(b)
    assert a.counters.summary() == b.counters.summary()
    for la, lb in zip(a.caches, b.caches):
        for name in la:
            assert_exact_close(la[name], lb[name], what=name)
    for pa, pb in zip(a.pools, b.pools):
        assert_exact_close(pa, pb, what="drafter pool")
    np.testing.assert_array_equal(a.state.tokens, b.state.tokens)
    np.testing.assert_array_equal(a.state.meta, b.state.meta)
    ranks_used = {r for _, r, _ in par.trace}
    assert ranks_used <= set(range(topo[1])) and len(ranks_used) == min(topo[1], 4 * groups)


def test_the_emulated_topology_must_match_the_run():
    from twin.abi.errors import AbiError
    with pytest.raises(AbiError, match="groups"):
        S.Golden(CFG, CK, DK, nm="exact", max_model_len=48, groups=1, par=RankEmulation(layout_for(CFG)))
