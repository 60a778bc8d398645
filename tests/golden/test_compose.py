"""Compositions on small presets: full prefill, chunked prefill and prefill + step-by-step decode give
the same logits at every position; physical block ids do not matter; packing does not matter."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from golden.compose import Session, Taps, forward, target_hidden
from golden.paged import DECODE, Span, lower
from golden_testlib import DEVICE, EXACT, rel
from twin.abi.errors import AbiError
from twin.abi.presets import SMALL, TINY

N = 262          # crosses the window (128), two ratio-128 boundaries and 65 ratio-4 boundaries


def _tokens(cfg, n, seed=1):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, n)


def _all_logits(ckpt, cfg, nm, ids, cuts, decode_rows=0, seed=None):
    """Prefill in chunks ending at `cuts`, then decode the rest `decode_rows` tokens per call."""
    s = Session(ckpt, cfg, nm, 1, len(ids) + 8, seed=seed)
    out, start = [], 0
    for end in list(cuts) + [len(ids)] if not decode_rows else list(cuts):
        meta = lower(cfg, [Span(0, start, tuple(ids[start:end]), s.blocks[0])], logits="all")
        r = forward(ckpt, meta, s.caches, cfg=cfg, nm=s.nm)
        s.caches, start = r.caches, end
        out.append(r.logits)
    s.lengths[0] = start
    while decode_rows and start < len(ids):
        end = min(start + decode_rows, len(ids))
        r = s.run({0: ids[start:end]}, form=DECODE)
        start = end
        out.append(r.logits)
    return np.concatenate(out)


@pytest.fixture(scope="module")
def tiny_full(tiny_ckpt):
    ids = _tokens(TINY, N)
    return ids, {m: _all_logits(tiny_ckpt, TINY, m, ids, []) for m in ("exact", "device")}


def test_device_against_exact_is_quantization_noise_except_where_routing_flips(tiny_ckpt, tiny_full):
    """W8A8 + bf16 noise moves logits by < 1 %; a top-k routing flip (a near-tie of expert scores,
    a discontinuity of the model itself) moves one token's path entirely.  Every token whose
    routing agrees in every layer must be within upstream's full-forward bar (cosine >= 0.99)."""
    ids, full = tiny_full
    taps = {}
    for mode in ("exact", "device"):
        taps[mode] = Taps(stages=["moe_indices"])
        s = Session(tiny_ckpt, TINY, mode, 1, N)
        forward(tiny_ckpt, lower(TINY, [Span(0, 0, tuple(ids), s.blocks[0])], logits="all"), s.caches, cfg=TINY,
                nm=s.nm, taps=taps[mode])
    flipped = np.zeros(N, bool)
    for layer in range(TINY.num_hidden_layers):
        a, b = (np.sort(taps[m][(layer, "moe_indices")], -1) for m in ("exact", "device"))
        flipped |= (a != b).any(-1)
        if layer < TINY.num_hash_layers:
            assert not (a != b).any()                     # hash routing cannot flip
    ex, dv = full["exact"], full["device"]
    cos = np.sum(dv * ex, -1) / np.linalg.norm(dv, axis=-1) / np.linalg.norm(ex, axis=-1)
    assert cos[~flipped].min() >= 0.99 and np.median(cos) >= 0.999
    assert (dv.argmax(-1) == ex.argmax(-1))[~flipped].mean() >= 0.9
    assert flipped.mean() < 0.3


@settings(max_examples=4)
@given(st.lists(st.integers(1, N - 1), min_size=1, max_size=4, unique=True))
def test_chunked_prefill_any_chunks_exact(tiny_ckpt, tiny_full, cuts):
    ids, full = tiny_full
    got = _all_logits(tiny_ckpt, TINY, "exact", ids, sorted(cuts), seed=len(cuts))
    assert rel(got, full["exact"]) <= 1e-9


@pytest.mark.parametrize("rows", [1, 8])
def test_prefill_then_decode_exact_and_device(tiny_ckpt, tiny_full, rows):
    ids, full = tiny_full
    cut = N - 4 * rows - 3           # decode also crosses a ratio-4 boundary mid-step
    ex = _all_logits(tiny_ckpt, TINY, "exact", ids, [100, cut], decode_rows=rows, seed=5)
    assert rel(ex, full["exact"]) <= 1e-9
    dv = _all_logits(tiny_ckpt, TINY, "device", ids, [100, cut], decode_rows=rows, seed=6)
    assert np.array_equal(dv.argmax(-1), full["device"].argmax(-1))
    assert rel(dv, full["device"]) <= 1e-3


def test_small_preset_chunked_and_decode_device(small_ckpt):
    ids = _tokens(SMALL, 140, seed=2)
    full = _all_logits(small_ckpt, SMALL, "device", ids, [])
    got = _all_logits(small_ckpt, SMALL, "device", ids, [3, 64, 131], decode_rows=2, seed=9)
    assert np.array_equal(got.argmax(-1), full.argmax(-1)) and rel(got, full) <= 1e-3


@pytest.mark.parametrize("mode", ["exact", "device"])
def test_block_permutation_invariance(tiny_ckpt, tiny_full, mode):
    ids, full = tiny_full
    for seed in (11, 12):
        got = _all_logits(tiny_ckpt, TINY, mode, ids, [], seed=seed)
        assert rel(got, full[mode]) <= (1e-12 if mode == "exact" else 0.0)


def test_packed_prefill_equals_separate_requests(tiny_ckpt):
    a, b = _tokens(TINY, 150, 3), _tokens(TINY, 40, 4)
    s = Session(tiny_ckpt, TINY, "device", 3, 200, seed=1)
    s.run({0: a[:100], 2: b[:10]})
    packed = s.run({0: a[100:], 1: b, 2: b[10:]})
    alone = []
    for r, ids, pre in ((0, a, 100), (1, b, 0), (2, b, 10)):
        t = Session(tiny_ckpt, TINY, "device", 1, 200, seed=r)
        if pre:
            t.run({0: ids[:pre]})
        alone.append(t.run({0: ids[pre:]}).logits)
    # bitwise: device mode, whose sums do not depend on a row's GEMM position (golden.numerics)
    assert np.array_equal(packed.logits, np.concatenate(alone))
    assert packed.sampled.tolist() == [int(x.argmax()) for x in np.concatenate(alone)]


def test_taps_and_target_hidden(tiny_ckpt):
    cfg = TINY
    s = Session(tiny_ckpt, cfg, "device", 1, 40)
    taps = Taps()
    r = s.run({0: _tokens(cfg, 20)}, taps=taps)
    stages = {k[1] for k in taps if k[0] == 2}
    assert {"attn_in", "q", "kv", "cmp_kv", "idx_topk", "attn_out", "moe_indices", "ffn_out", "x_hc"} <= stages
    assert "cmp_kv" in {k[1] for k in taps if k[0] == 3} and np.array_equal(taps[("head", "logits")], r.logits)
    for tap in ("hc_head_of_outputs", "mean_of_inputs"):
        th = target_hidden(taps, tiny_ckpt.model(), cfg=cfg, nm=DEVICE, tap=tap)
        assert th.shape == (20, 3 * cfg.hidden_size) and np.array_equal(th, DEVICE.bf16(th))
    with pytest.raises(AbiError, match="target_hidden_tap"):
        target_hidden(taps, tiny_ckpt.model(), cfg=cfg, nm=DEVICE, tap="last")
    only = Taps(stages=["x_hc"])
    Session(tiny_ckpt, cfg, "device", 1, 40).run({0: _tokens(cfg, 5)}, taps=only)
    assert {k[1] for k in only} == {"x_hc"}


def test_session_rejects_overflow_and_non_contiguous(tiny_ckpt):
    s = Session(tiny_ckpt, TINY, "exact", 1, 10)
    with pytest.raises(AbiError, match="max_len=10"):
        s.run({0: [1] * 11})
    meta = lower(TINY, [Span(0, 0, (1, 2, 3), s.blocks[0])])
    meta.position_ids = np.array([0, 2, 3], np.int32)
    with pytest.raises(AbiError, match="consecutive"):
        forward(tiny_ckpt, meta, s.caches, cfg=TINY, nm=EXACT)


@pytest.mark.parametrize("mode", ["exact", "device"])
def test_rejected_drafts_are_rewritten_by_the_next_verify_step(tiny_ckpt, mode):
    """A verify step writes all 8 rows (KV, compressor state) but commits compressed rows only for
    columns < commit; the next step restarts at the new anchor and rewrites the rejected positions.
    The result equals a history that never saw the rejected drafts."""
    cfg = TINY
    ids = _tokens(cfg, 140, seed=7)
    start = 125                                   # the step crosses the ratio-128 boundary at 127
    wrong = (ids[start + 3:start + 8] + 1) % cfg.vocab_size

    def history(spans_fn):
        s = Session(tiny_ckpt, cfg, mode, 1, 140, seed=3)
        s.run({0: ids[:start]})
        for span in spans_fn(s.blocks[0]):
            r = forward(tiny_ckpt, lower(cfg, [span], form=DECODE), s.caches, cfg=cfg, nm=s.nm)
            s.caches = r.caches
        return r.logits

    spec = history(lambda b: [Span(0, start, tuple(ids[start:start + 3]) + tuple(wrong), b, commit=3),
                              Span(0, start + 3, tuple(ids[start + 3:start + 8]), b)])
    clean = history(lambda b: [Span(0, start, tuple(ids[start:start + 3]), b),
                               Span(0, start + 3, tuple(ids[start + 3:start + 8]), b)])
    assert rel(spec, clean) <= (1e-12 if mode == "exact" else 0.0)


def test_swa_override_and_wide_window_for_draft_layers(tiny_ckpt):
    """A CSA-id layer run as SWA (ratio=0) touches only the ori pool; a 192-wide window with the
    extra columns invalid equals the 128-wide one."""
    from golden.compose import attention_sublayer, device_meta, rope_inputs
    cfg, nm = TINY, DEVICE
    s = Session(tiny_ckpt, cfg, "device", 1, 40)
    meta = lower(cfg, [Span(0, 0, tuple(_tokens(cfg, 20)), s.blocks[0])])
    x = np.random.default_rng(0).standard_normal((20, cfg.hc_mult, cfg.hidden_size))
    m, rope, w = device_meta(meta, nm), rope_inputs(cfg, meta.position_ids, nm), tiny_ckpt.layer(2)
    a, pa = attention_sublayer(x, 2, w, s.caches[2], m, rope, cfg=cfg, nm=nm, form=DECODE, ratio=0)
    assert all(np.array_equal(np.asarray(pa[k], np.float64), np.asarray(s.caches[2][k], np.float64))
               for k in pa if k != "kv_cache")
    wide = dict(m, swa_indices=np.concatenate([m["swa_indices"], np.full((20, 64), -1)], 1))
    b, _ = attention_sublayer(x, 2, w, s.caches[2], wide, rope, cfg=cfg, nm=nm, form=DECODE, ratio=0)
    assert np.array_equal(a, b)
