"""SMALL's decode step past the length where its indexer keeps every candidate (4 * 64 + 3 tokens:
the admissible limit before the indexer's re-sync): natural near ties of the INT8 index scores
make JAX and NumPy keep other compressed rows on some rows; re-synced (golden.ties'
index_near_ties, with routing), every selection is NumPy's set and every logit row agrees."""
import numpy as np

from golden.checkpoint import SyntheticCheckpoint
from golden.compose import Taps, forward
from golden.jax_path import JaxGolden
from golden.jax_resync import RESYNC_STAGES, agreement, jax_admissible
from jax_decode import OPT0, session
from twin.abi.presets import SMALL


def test_small_decode_past_the_old_limit_agrees_with_both_rankings_resynced():
    """SMALL, 2 requests x 8 rows at 264-271: 66-68 candidates for index_topk 64."""
    cfg = SMALL
    ckpt = SyntheticCheckpoint(cfg, seed=0)
    s, meta = session(ckpt, cfg, 2, 264)
    L = int(meta.position_ids.max()) + 1
    assert L // 4 > cfg.index_topk and jax_admissible(cfg, "l3_decode_fwd", max_len=L)[0]
    ref = forward(ckpt, meta, s.caches, cfg=cfg, nm=s.nm, taps=Taps(RESYNC_STAGES))
    jg = JaxGolden(ckpt, cfg, "device", compiler_options=OPT0)
    out = jg.forward(meta, s.caches, resync_from=ref.taps, taps=("idx_topk",))
    res = agreement(out, ref, jg.resyncs)
    assert res["agrees"] and res["rows_within_tol"] == meta.T, res
    assert res["index_refused"] == 0 and res["route_refused"] == 0
    # the case exercises the rule: JAX's own ranking kept other rows somewhere (measured: 10 rows)
    assert res["index_resyncs"] > 0
    for l in (l for l, r in enumerate(cfg.compress_ratios[:cfg.num_hidden_layers]) if r == 4):
        got, want = np.asarray(out.taps[(l, "idx_topk")]), np.asarray(ref.taps[(l, "idx_topk")])
        assert ((want >= 0).sum(-1) == cfg.index_topk).all()        # ranked: a full top-k kept
        np.testing.assert_array_equal(np.sort(got, -1), np.sort(want, -1), err_msg=f"layer {l}")
