"""The JAX path re-syncs the indexer's top-k from NumPy at near ties (golden.ties.index_near_ties,
the lockstep's own rule), which makes it admissible past min(index_topk, TILE) candidates.

The distinguishing case is constructed: NumPy's indexer keeps, on chosen rows of one CSA layer,
the best row it dropped in place of the weakest it kept.  Where that swap is a near tie JAX takes
NumPy's rows (without re-sync its own selection differs there), and the step agrees on every
logit row; where the swapped-in row scores far below the boundary, JAX refuses it and the step
does not agree (SMALL at a real length: test_jax_index_resync_small.py)."""
import numpy as np
import pytest

from golden.checkpoint import SyntheticCheckpoint
from golden.compose import Taps, forward
from golden.jax_path import JaxGolden
from golden.jax_resync import RESYNC_STAGES, agreement, jax_admissible
from golden.kernels.indexer import lightning_indexer
from golden.numerics import FP32_NEG_INF
from golden.ties import INDEX_TIE_TOL
from jax_decode import OPT0, session
from twin.abi.presets import TINY


def _swapping_indexer(cfg, layer, pick):
    """lightning_indexer whose selection at `layer` swaps, on the rows pick(score, topk) names, the
    weakest kept row for the best dropped one; -> (the hook, {row: (kept, dropped, relative gap)})."""
    csa = [l for l, r in enumerate(cfg.compress_ratios[:cfg.num_hidden_layers]) if r == 4]
    calls, swaps = [0], {}

    def hook(*a, **kw):
        score, topk = lightning_indexer(*a, **kw)
        here = csa[calls[0]]
        calls[0] += 1
        if here != layer:
            return score, topk
        topk = np.array(topk)
        for r, far in pick(score, topk):
            k, vis = int((topk[r] >= 0).sum()), _visible(score[r])
            order = np.argsort(-score[r], kind="stable")
            kept, dropped = order[k - 1], order[vis - 1 if far else k]
            scale = max(1.0, np.abs(score[r, topk[r][:k]]).max())
            topk[r][topk[r] == kept] = dropped
            swaps[r] = (int(kept), int(dropped), float((score[r, kept] - score[r, dropped]) / scale))
        return score, topk
    return hook, swaps


def _boundary_rows(n, far=False, width=4):
    """The first n rows whose kept-dropped boundary gap is under INDEX_TIE_TOL / width (room for
    the two paths' drift), or with far=True the first n rows swapped for their weakest visible row."""
    def pick(score, topk):
        out = []
        for r in range(len(score)):
            k, vis = int((topk[r] >= 0).sum()), _visible(score[r])
            if k == 0 or vis <= k:
                continue
            s = np.sort(score[r])[::-1]
            scale = max(1.0, np.abs(s[:k]).max())
            gap = (s[k - 1] - (s[vis - 1] if far else s[k])) / scale
            if (far and gap > 3 * INDEX_TIE_TOL) or (not far and gap < INDEX_TIE_TOL / width):
                out.append((r, far))
            if len(out) == n:
                break
        return out
    return pick


def _visible(score_row) -> int:
    """Candidates a token sees (masked ones score FP32_NEG_INF, ranked last)."""
    return int((score_row > FP32_NEG_INF).sum())


@pytest.fixture(scope="module")
def tiny_case():
    """TINY, 2 requests at 104 tokens: 26 compressed candidates for index_topk 16 (JAX ranks them;
    before the indexer re-sync this length was inadmissible: TINY's limit was 67 tokens)."""
    ckpt = SyntheticCheckpoint(TINY, seed=0)
    s, meta = session(ckpt, TINY, 2, 96)
    jg = JaxGolden(ckpt, TINY, "device", compiler_options=OPT0)
    return ckpt, s, meta, jg


def test_near_tie_swap_is_adopted_and_the_step_agrees(tiny_case):
    ckpt, s, meta, jg = tiny_case
    cfg, layer = TINY, 4
    hook, swaps = _swapping_indexer(cfg, layer, _boundary_rows(3))
    ref = forward(ckpt, meta, s.caches, cfg=cfg, nm=s.nm, taps=Taps(RESYNC_STAGES), indexer=hook)
    assert len(swaps) == 3 and all(0 <= g < INDEX_TIE_TOL for *_, g in swaps.values())
    mine = np.asarray(ref.taps[(layer, "idx_topk")])
    # without re-sync: JAX does not hold the swapped-in row on any swapped row (it ranks below the
    # boundary on JAX's scores too); which row JAX keeps at the boundary instead may be another near
    # tie of its own (its float32 scores move by ulps with the CPU's SIMD kernels)
    own = jg.forward(meta, s.caches, taps=("idx_topk",))
    own_sel = np.asarray(own.taps[(layer, "idx_topk")])
    for r, (kept, dropped, _) in swaps.items():
        assert dropped not in own_sel[r] and dropped in mine[r], r
    # with re-sync: adopted exactly there (and perhaps at natural near ties), every selection of
    # every CSA layer then NumPy's set, every logit row within kernel-math §2
    out = jg.forward(meta, s.caches, resync_from=ref.taps, taps=("idx_topk",))
    assert set(swaps) <= set(jg.resyncs.index_adopted[layer])
    assert jg.resyncs.counts()["index_refused"] == 0
    for l in (2, 4, 6):
        got, want = np.asarray(out.taps[(l, "idx_topk")]), np.asarray(ref.taps[(l, "idx_topk")])
        np.testing.assert_array_equal(np.sort(got, -1), np.sort(want, -1), err_msg=f"layer {l}")
    res = agreement(out, ref, jg.resyncs)
    assert res["agrees"] and res["rows_within_tol"] == meta.T, res
    assert res["index_resyncs"] >= len(swaps)
    assert jax_admissible(cfg, "l3_decode_fwd", max_len=int(meta.position_ids.max()) + 1)[0]


def test_a_swap_beyond_the_margin_is_refused(tiny_case):
    ckpt, s, meta, jg = tiny_case
    cfg, layer = TINY, 2
    hook, swaps = _swapping_indexer(cfg, layer, _boundary_rows(2, far=True))
    ref = forward(ckpt, meta, s.caches, cfg=cfg, nm=s.nm, taps=Taps(RESYNC_STAGES), indexer=hook)
    assert len(swaps) == 2 and all(g > 3 * INDEX_TIE_TOL for *_, g in swaps.values())
    out = jg.forward(meta, s.caches, resync_from=ref.taps, taps=("idx_topk",))
    assert set(swaps) <= set(jg.resyncs.index_refused[layer])
    got = np.asarray(out.taps[(layer, "idx_topk")])
    for r, (kept, dropped, _) in swaps.items():
        assert kept in got[r] and dropped not in got[r], r      # JAX keeps its own rows there
    assert not agreement(out, ref, jg.resyncs)["agrees"]
