"""Drafter kernels (K22-K26) against independent formulations, and the lease-ring addressing."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from exactness import assert_exact_close
from twin.abi import TINY, constants as C
from twin.abi.caches import filler_block, lease_block
from twin.abi.errors import AbiError
from golden.checkpoint import SyntheticCheckpoint
from golden.compose import Taps, target_hidden
from golden.dspark import drafter as D
from golden.dspark.markov import dspark_markov
from golden.dspark.ring import block_table, new_pools, ring_slots, window_positions
from golden.dspark.weights import DrafterCheckpoint
from golden.kernels.rmsnorm import rms_norm
from golden.numerics import numerics

CFG = TINY
EXACT = numerics("exact")
CK, DK = SyntheticCheckpoint(CFG, 3), DrafterCheckpoint(CFG, 3)


@settings(max_examples=100)
@given(st.integers(0, 63), st.integers(0, (1 << 20) - 1), st.integers(0, 2))
def test_ring_slots_follow_the_lease_formula(lease, pos, layer):
    s = int(ring_slots(lease, [pos], layer)[0])
    assert s == lease_block(lease, pos // 32, layer) * 32 + pos % 32
    assert lease * 6 * 32 <= s < (lease + 1) * 6 * 32                  # never leaves the lease's 6 blocks
    f = int(ring_slots(None, [pos], layer)[0])
    assert f == filler_block(pos // 32, layer) * 32 + pos % 32 and f >= C.DRAFTER_FILLER_BLOCK_BASE * 32
    assert block_table(lease, layer)[pos // 32] == lease_block(lease, pos // 32, layer)
    assert ring_slots(None, [-1, pos], layer)[0] == ring_slots(lease, [-1, pos], layer)[0] == -1


@settings(max_examples=100)
@given(st.integers(0, (1 << 20) - 200), st.integers(0, 63))
def test_the_read_window_never_aliases_in_the_ring(anchor, lease):
    """192-wide window: a-127..a and the 7 block rows, distinct physical rows for every layer."""
    win = window_positions(anchor)
    live = win[win >= 0]
    assert live[0] == max(0, anchor - 127) and live[-1] == anchor + 7 and len(win) == 192
    for layer in range(3):
        slots = ring_slots(lease, live, layer)
        assert len(set(slots.tolist())) == live.size


def _kv_at(positions, rng):
    return {int(p): rng.standard_normal(CFG.head_dim) for p in positions}


def test_block_attention_matches_a_per_row_loop_and_has_no_causal_mask():
    rng = np.random.default_rng(0)
    B, H, HD = 2, CFG.num_attention_heads, CFG.head_dim
    anchors = [40, 3]
    wins = [window_positions(a) for a in anchors]
    K = np.zeros((B, 192, HD))
    kv = [_kv_at(w[w >= 0], rng) for w in wins]
    for b in range(B):
        for j, p in enumerate(wins[b]):
            if p >= 0:
                K[b, j] = kv[b][int(p)]
    valid = np.stack([w >= 0 for w in wins])
    q = rng.standard_normal((B, 7, H, HD))
    sink = rng.standard_normal(H)
    got = D.dspark_attend(q, K, valid, sink, cfg=CFG, nm=EXACT)
    for b in range(B):
        ps = [int(p) for p in wins[b] if p >= 0]
        for i in range(7):
            for h in range(H):
                s = np.array([q[b, i, h] @ kv[b][p] for p in ps]) * CFG.head_dim ** -0.5
                m = s.max()
                e = np.exp(s - m)
                want = (e[:, None] * np.stack([kv[b][p] for p in ps])).sum(0) / (e.sum() + np.exp(sink[h] - m))
                np.testing.assert_allclose(got[b, i, h], want, rtol=1e-12, atol=1e-13)
    # no causal mask: block row 0 sees the last block row (position a+7)
    K2 = K.copy()
    K2[0, np.nonzero(wins[0] == anchors[0] + 7)[0][0]] += 1.0
    assert not np.allclose(D.dspark_attend(q, K2, valid, sink, cfg=CFG, nm=EXACT)[0, 0], got[0, 0])


def _drafter(rows, mh, nm, pool=None):
    pool = new_pools(CFG, 1, nm)[0] if pool is None else pool
    return D.drafter_forward(pool, mh, rows, DK, CK.model(), cfg=CFG, nm=nm)


def _hidden(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, 3 * CFG.hidden_size))


@pytest.mark.parametrize("mode", ["exact", "device"])
def test_context_and_block_rows_land_in_the_lease_ring(mode):
    nm = numerics(mode)
    ctx = tuple(range(10, 41))
    rows = [D.DraftRow(63, 40, 5, ctx)]
    mh = nm.bf16(_hidden(len(ctx)))
    head, pool = _drafter(rows, mh, nm)
    assert head.shape == (1, 7, CFG.hidden_size)
    main_x = D.dspark_proj(mh, DK.model()["main_proj_weight"], DK.model()["main_norm_weight"], cfg=CFG, nm=nm)
    for l in range(3):
        lw = DK.layer(l)
        want = D.context_kv(main_x, lw["wkv"], lw["gamma_ckv"], np.array(ctx), cfg=CFG, nm=nm)
        got = np.asarray(pool[l]).reshape(-1, CFG.head_dim)[ring_slots(63, ctx, l)]
        if mode == "device":        # device-mode sums are exact in any order (golden.numerics)
            np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))
        else:
            assert_exact_close(got, want)
        written = np.nonzero(np.abs(np.asarray(pool[l], np.float64)).reshape(-1, CFG.head_dim).sum(1))[0]
        expect = set(ring_slots(63, list(ctx) + list(range(41, 48)), l).tolist())
        assert set(written.tolist()) == expect                         # context + the 7 block rows, nothing else


def test_padding_rows_read_the_filler_and_publish_nothing():
    nm = EXACT
    ctx = tuple(range(0, 21))
    mh = _hidden(len(ctx))
    real = D.DraftRow(7, 20, 5, ctx)
    pad = D.DraftRow(None, 20, 0, ())
    head1, pool1 = _drafter([real], mh, nm)
    head2, pool2 = _drafter([real, pad], mh, nm)
    written = lambda p: set(np.nonzero(np.abs(np.asarray(p)).reshape(-1, CFG.head_dim).sum(1))[0].tolist())  # noqa
    assert written(pool1) == written(pool2)                            # the padding row wrote nothing
    np.testing.assert_allclose(pool2, pool1, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(head2[0], head1[0], rtol=1e-12, atol=1e-12)   # rows independent (MoE per token)
    assert not np.asarray(pool2[:, C.DRAFTER_FILLER_BLOCK_BASE:]).any()


def test_drafter_rejects_bad_rows():
    with pytest.raises(AbiError, match="context_positions"):
        _drafter([D.DraftRow(1, 5, 1, (6,))], _hidden(1), EXACT)
    with pytest.raises(AbiError, match="main_hidden"):
        _drafter([D.DraftRow(1, 5, 1, (4, 5))], _hidden(1), EXACT)
    with pytest.raises(AbiError, match="anchor"):
        _drafter([D.DraftRow(1, CFG.max_position_embeddings - 3, 1, ())], _hidden(0), EXACT)


@pytest.mark.parametrize("mode", ["exact", "device"])
def test_markov_chain_is_sequential_and_matches_a_loop(mode):
    nm = numerics(mode)
    rng = np.random.default_rng(1)
    B = 3
    head = nm.bf16(rng.standard_normal((B, 7, CFG.hidden_size)))
    dm, lm = DK.model(), CK.model()["lm_head_weight"]
    ns, last, nxt = np.array([1, 0, 1]), np.array([11, 12, 13]), np.array([21, 22, 23])
    drafts, conf = dspark_markov(head, dm["final_norm_weight"], lm, ns, last, nxt, dm["markov_w1"], dm["markov_w2"],
                                 dm["confidence_head_weight"], cfg=CFG, nm=nm)
    w1, w2 = nm.asf(dm["markov_w1"]), nm.asf(dm["markov_w2"])
    cw = nm.asf(dm["confidence_head_weight"])[0]
    for b in range(B):
        prev = last[b] if ns[b] > 0 else nxt[b]
        for i in range(7):
            hn = rms_norm(head[b, i:i + 1], dm["final_norm_weight"], cfg=CFG, nm=nm)[0]
            scores = np.asarray(hn @ nm.asf(lm).T) + w1[prev] @ w2.T
            c = nm.asf(head[b, i]) @ cw[:CFG.hidden_size] + w1[prev] @ cw[CFG.hidden_size:]
            assert drafts[b, i] == int(np.argmax(scores))
            np.testing.assert_allclose(conf[b, i], c, rtol=1e-5, atol=1e-5 * np.abs(cw).sum())
            prev = int(np.argmax(scores))
    # the previous draft feeds the next: changing draft 0's source token changes later drafts
    d2, _ = dspark_markov(head, dm["final_norm_weight"], lm, ns, last + 1, nxt, dm["markov_w1"], dm["markov_w2"],
                          dm["confidence_head_weight"], cfg=CFG, nm=nm)
    assert (d2[1] == drafts[1]).all() and not (d2[0] == drafts[0]).all()


def test_target_hidden_taps_differ_and_have_the_abi_shape():
    rng = np.random.default_rng(3)
    taps = Taps()
    T = 5
    for layer in CFG.dspark_target_layer_ids:
        taps.put(layer, "attn_in", rng.standard_normal((T, 4, CFG.hidden_size)))
        taps.put(layer, "x_hc", rng.standard_normal((T, 4, CFG.hidden_size)))
    model = CK.model()
    a = target_hidden(taps, model, cfg=CFG, nm=EXACT, tap="hc_head_of_outputs")
    b = target_hidden(taps, model, cfg=CFG, nm=EXACT, tap="mean_of_inputs")
    assert a.shape == b.shape == (T, 3 * CFG.hidden_size)
    np.testing.assert_allclose(b[:, :CFG.hidden_size], taps[(CFG.dspark_target_layer_ids[0], "attn_in")].mean(1))
    assert not np.allclose(a, b)
    with pytest.raises(AbiError, match="target_hidden_tap"):
        target_hidden(taps, model, cfg=CFG, nm=EXACT, tap="last_layer")


def test_flash_shaped_block_attention_near_the_position_ceiling():
    """One FLASH draft-attention sub-layer (64 heads x 512, o_proj 8 x 1024, the real [3, 512, 32, 1, 512]
    pool) at an anchor 16 positions below 1M: the block rows land in the lease ring, device numerics
    stay close to exact, and the 16-rank TP split is the single-rank result (bitwise in device
    mode, to float64 rounding in exact mode)."""
    from twin.abi import FLASH
    from golden.ranks import RankEmulation, layout_for
    lw = DrafterCheckpoint(FLASH, 0).layer(1)
    rows = [D.DraftRow(63, (1 << 20) - 16, 5, (), owner_rank=3), D.DraftRow(4, 5, 7, (), owner_rank=0)]
    outs = {}
    for mode in ("exact", "device"):
        nm = numerics(mode)
        x = nm.bf16(np.random.default_rng(0).standard_normal((14, FLASH.hidden_size)))
        pool = new_pools(FLASH, 1, nm)[0]
        assert pool.shape == (3, C.DRAFTER_POOL_BLOCKS, 32, 1, 512)
        out, new = D.dspark_attention(x, lw, pool, 1, rows, cfg=FLASH, nm=nm)
        flat = np.asarray(new[1], np.float64).reshape(-1, 512)
        for r in rows:
            assert np.abs(flat[ring_slots(r.lease, D.block_positions(r.anchor), 1)]).min(axis=1).max() > 0
        assert np.count_nonzero(np.abs(flat).sum(1)) == 14
        emu, _ = D.dspark_attention(x, lw, pool, 1, rows, cfg=FLASH, nm=nm, par=RankEmulation(layout_for(FLASH)))
        if mode == "device":
            # bitwise: the TP split packs a rank's rows at other GEMM positions, but device-mode
            # products (bf16 x bf16, W8A8) sum exactly in float64 (golden.numerics, Accumulation)
            np.testing.assert_array_equal(np.asarray(emu), np.asarray(out))
        else:
            assert_exact_close(emu, out)
        outs[mode] = np.asarray(out, np.float64)
    a, b = outs["exact"], outs["device"]
    cos = (a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b)
    assert cos > 0.999


def test_seeding_checks_the_captured_tail():
    from golden.dspark import step as S
    g = S.Golden(CFG, CK, DK, nm="exact", max_model_len=300)
    run = S.new_run(g, [S.Prompt("a", tuple(range(1, 151)), 4)], k=7)
    S.prefill_and_seed(g, run, k=7, chunk=64)                 # 150 tokens in chunks of 64: tail = 22..149
    s = run.seqs[0]
    assert sorted(s.tail) == list(range(22, 150)) and s.draft_anchor == 149
    run2 = S.new_run(g, [S.Prompt("a", tuple(range(1, 151)), 4)], k=7)
    S.prefill_and_seed(g, run2, k=7)                          # unchunked: the same seed
    np.testing.assert_array_equal(run.state.tokens, run2.state.tokens)
    s.tail.pop(100)
    with pytest.raises(AbiError, match="tail"):
        S.seed_wave(g, run, [s])
