"""The JAX step's host inputs: RoPE rows read from a position table equal rope_inputs at any
positions (both modes, across table growth), and the per-dtype packing cuts back into the same
arrays (names, dtypes, shapes, values), and that packing's spec determines everything static
about a call's layout (the jit cache key holds the spec, not the layout)."""
import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from golden.compose import rope_inputs
from golden.jax_kernels import layout
from golden.jax_path import _META, RopeRows, _pack, _unpack, win_tiles
from golden.paged import DECODE, PREFILL, Span, assign_blocks, lower
from golden.numerics import Numerics
from twin.abi.presets import SMALL, TINY


@settings(max_examples=12)
@given(mode=st.sampled_from(["device", "exact"]), cfg=st.sampled_from([TINY, SMALL]),
       calls=st.lists(st.lists(st.integers(0, 5000), min_size=1, max_size=40), min_size=1, max_size=3))
def test_rope_rows_equal_rope_inputs(mode, cfg, calls):
    nm = Numerics(mode)
    dtype = np.dtype(np.float64 if mode == "exact" else np.float32)
    rows = RopeRows(cfg, nm, dtype)
    for pos in calls:                               # later calls may grow the table
        pos = np.asarray(pos, np.int32)
        got, want = rows(pos), rope_inputs(cfg, pos, nm)
        assert rows.n > pos.max() and rows.n & (rows.n - 1) == 0
        assert set(got) == set(want)
        for k in want:
            for g, w in zip(got[k], want[k]):
                assert g.dtype == dtype and g.shape == w.shape
                np.testing.assert_array_equal(g, np.asarray(w).astype(dtype))


def test_rope_rows_keep_their_table_below_the_bucket():
    rows = RopeRows(TINY, Numerics("device"), np.dtype(np.float32))
    rows(np.array([3, 1000]))
    table = rows.table
    rows(np.array([1023, 0]))
    assert rows.n == 1024 and rows.table is table         # no rebuild within the bucket
    rows(np.array([1024]))
    assert rows.n == 2048 and rows.table is not table


@settings(max_examples=20)
@given(shapes=st.lists(st.tuples(st.sampled_from(["int32", "int64", "bool", "float32"]),
                                 st.lists(st.integers(0, 5), min_size=0, max_size=3)), min_size=1, max_size=8),
       seed=st.integers(0, 99))
def test_pack_unpack_round_trip(shapes, seed):
    rng = np.random.default_rng(seed)
    arrays = {}
    for i, (dt, shape) in enumerate(shapes):
        name = ("m:", "g_", "rope:")[i % 3] + f"a{i}" + (":0" if i % 3 == 2 else "")
        arrays[name] = (rng.integers(-9, 9, shape) if dt != "bool" else rng.integers(0, 2, shape)).astype(dt)
    bufs, spec = _pack(arrays)
    assert len(bufs) == len({v.dtype for v in arrays.values()})       # one buffer per dtype
    with jax.enable_x64(True):
        m, g, rope = jax.jit(lambda b: _unpack(b, spec))(jax.device_put(bufs))
    got = {**{"m:" + k: v for k, v in m.items()}, **g,
           **{f"rope:{k}:0": v[0] for k, v in rope.items()}}
    assert set(got) == set(arrays)
    for k, v in arrays.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        np.testing.assert_array_equal(np.asarray(got[k]), v)


@settings(max_examples=25, deadline=None)
@given(cfg=st.sampled_from([TINY, SMALL]), form=st.sampled_from([DECODE, PREFILL]),
       spans=st.lists(st.tuples(st.integers(0, 900), st.integers(1, 200)), min_size=1, max_size=5))
def test_the_packed_spec_determines_the_layouts_static_sizes(cfg, form, spans):
    """JaxGolden's step cache is keyed by the spec: the layout's static sizes (grid shape, window
    union width, window tiles, boundary-row counts) must follow from the spec's shapes alone, so a
    changed layout changes the spec (recompiles) and an unchanged spec reuses the step."""
    blocks, _ = assign_blocks(cfg, len(spans), 1200)
    ids = np.arange(200) % cfg.vocab_size
    meta = lower(cfg, [Span(r, start, tuple(int(t) for t in ids[:(min(n, 8) if form == DECODE else n)]), blocks[r])
                       for r, (start, n) in enumerate(spans)], form=form)
    lay = layout(meta)
    _, spec = _pack({**{_META + k: v for k, v in meta.arrays().items()}, **lay.arrays()})
    shape = {name: s for name, _, _, s in spec}
    assert shape["g_tok"] == lay.tok.shape and shape["g_win_slot"][1] == lay.win_slot.shape[1]
    assert win_tiles(spec) == lay.n_win_tiles          # what the jitted step reads (JaxGolden._step_fn)
    assert {r: shape[f"g_sel{r}"][0] for r in lay.sel} == {r: len(v) for r, v in lay.sel.items()}
