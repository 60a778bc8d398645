"""The pieces of the 16-rank emulation against the single-rank kernels: layout, CP bands, TP o_proj
(at the FLASH shape), vocab-sharded LM head, EP dispatch / combine."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from exactness import assert_exact_close
from twin.abi import FLASH, SMALL, TINY
from twin.abi.errors import AbiError
from twin.abi.topology import Topology
from golden.checkpoint import SyntheticCheckpoint
from golden.dspark.parallel import SINGLE
from golden.kernels.o_proj import o_proj
from golden.numerics import numerics
from golden.ranks import RankEmulation, RankLayout, layout_for
from golden.ranks.collectives import all_gather, rank_bands, rows_by_rank
from golden.ranks.ep import dispatch
from golden.ranks.tp import lm_head_tp, o_proj_tp

BF16 = ml_dtypes.bfloat16


def test_production_layout_at_flash():
    lay = layout_for(FLASH)
    assert (lay.ranks, lay.tp, lay.groups) == (16, 4, 4)
    assert [list(lay.o_groups_of(r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert list(lay.o_groups_of(13)) == [2, 3] and lay.group_of(13) == 3
    assert lay.vocab_per_rank == 32320 and lay.vocab_of(6) == range(64640, 96960)
    assert lay.n_local_experts == 16 and lay.expert_rank(255) == 15 and lay.expert_rank(16) == 1
    with pytest.raises(AbiError, match="ep"):
        RankLayout(FLASH, Topology(tp=4, ep=4))            # reduced topologies are for small presets only


def test_small_presets_get_the_real_topology_or_a_reduced_one():
    assert (layout_for(TINY).ranks, layout_for(TINY).n_local_experts, layout_for(TINY).o_groups_per_rank) == (16, 1, 1)
    assert layout_for(SMALL).n_local_experts == 2
    assert layout_for(TINY, tp=4, ep=4).groups == 1 and layout_for(TINY, tp=1, ep=1).n_local_experts == 16


@settings(max_examples=50)
@given(st.integers(1, 64), st.sampled_from([1, 4]))
def test_cp_bands_are_rank_major_and_gather_back(L, tp):
    P = L * tp
    bands = rank_bands(P, tp)
    assert [b[0] for b in bands] == [r * L for r in range(tp)]
    x = np.random.default_rng(P).standard_normal((P, 3))
    np.testing.assert_array_equal(all_gather([x[b] for b in bands]), x)
    with pytest.raises(AbiError, match="P"):
        rank_bands(P + 1, 4) if tp == 4 else rank_bands(5, 4)


def test_rows_by_rank_names_a_bad_owner():
    with pytest.raises(AbiError, match="owner_rank"):
        rows_by_rank([0, 16], 16)


def _flash_o_proj_weights(rng):
    c = FLASH
    G, OL, GI, D = c.o_groups, c.o_lora_rank, c.o_group_in, c.hidden_size
    wo_a = (rng.standard_normal((G, OL, GI), np.float32) / 64).astype(BF16)
    wo_b = rng.integers(-127, 128, (G, D, OL), dtype=np.int8)
    sc = (rng.uniform(0.8, 1.2, D) / (73.3 * 32)).astype(np.float32)
    return wo_a, wo_b, sc


@pytest.mark.parametrize("mode", ["exact", "device"])
def test_tp_o_proj_at_the_flash_shape(mode):
    """2 of 8 groups per rank: the ordered reduction is bitwise the single-rank K12, the device's
    partial-sum reduction is within K12's tolerance (ratio_allclose 1e-4 / 1/128, 0 outliers)."""
    nm = numerics(mode)
    rng = np.random.default_rng(0)
    wo_a, wo_b, sc = _flash_o_proj_weights(rng)
    T = 16
    o = nm.bf16(rng.standard_normal((FLASH.o_groups, T, FLASH.o_group_in)))
    lay = layout_for(FLASH)
    want = np.asarray(o_proj(o, wo_a, wo_b, sc, cfg=FLASH, nm=nm))
    got = np.asarray(o_proj_tp(o, wo_a, wo_b, sc, lay, nm=nm, reduction="ordered"))
    # bitwise: each o_proj group is the same [T, GI] x [GI, OL] GEMM with the same rows at the same
    # positions on both sides (o_proj batches over groups; a rank takes two of them), the int GEMMs
    # are exact, and the ordered fold adds the same terms in the same order
    np.testing.assert_array_equal(got, want)
    part = np.asarray(o_proj_tp(o, wo_a, wo_b, sc, lay, nm=nm, reduction="partial_sums"))
    bad = np.abs(part - want) > 1e-4 + np.abs(want) / 128
    assert not bad.any()
    with pytest.raises(AbiError, match="reduction"):
        o_proj_tp(o, wo_a, wo_b, sc, lay, nm=nm, reduction="tree")


@pytest.mark.parametrize("mode", ["exact", "device"])
def test_vocab_sharded_lm_head_gathers_to_the_full_logits(mode):
    nm = numerics(mode)
    W = SyntheticCheckpoint(SMALL, 0).model()["lm_head_weight"]
    h = nm.bf16(np.random.default_rng(1).standard_normal((12, SMALL.hidden_size)))
    lay = layout_for(SMALL)
    full = np.asarray(SINGLE.vocab_logits(h, W, nm=nm))
    shards = np.asarray(lm_head_tp(h, W, lay, nm=nm))
    owners = np.repeat([0, 5, 9, 15], 3)
    emulated = np.asarray(RankEmulation(lay).vocab_logits(h, W, nm=nm, owners=owners))
    if mode == "device":
        # bitwise: bf16 x bf16 products summed in float64 are exact in any order, so a logit does
        # not depend on its row's or its column's position in the GEMM (golden.numerics)
        np.testing.assert_array_equal(shards, full)
        np.testing.assert_array_equal(emulated, full)
    else:
        # a shard puts the same column at another GEMM position, the emulation a row (exactness.py)
        assert_exact_close(shards, full)
        assert_exact_close(emulated, full)
    assert (shards.argmax(-1) == full.argmax(-1)).all() and (emulated.argmax(-1) == full.argmax(-1)).all()


def test_dispatch_packs_source_rank_major_in_t_k_order():
    lay = layout_for(TINY)                                 # 16 experts on 16 ranks: expert e on rank e
    idx = [np.array([[3, 5], [5, 3]]), None, np.array([[5, 0]])]
    recv = dispatch(idx, lay)
    assert recv[(5, 0)] == [(0, 0, 1), (0, 1, 0), (2, 0, 0)]
    assert recv[(3, 0)] == [(0, 0, 0), (0, 1, 1)] and recv[(0, 0)] == [(2, 0, 1)]
    lay2 = layout_for(SMALL)                               # 2 experts per rank
    assert set(dispatch([np.array([[31, 30]])], lay2)) == {(15, 1), (15, 0)}
    flash = layout_for(FLASH)                              # EP16: 16 routed experts per rank
    assert set(dispatch([np.array([[255, 16, 15, 0, 100, 101]])], flash)) == {
        (15, 15), (1, 0), (0, 15), (0, 0), (6, 4), (6, 5)}


@pytest.mark.parametrize("preset,topo", [(TINY, (4, 16)), (SMALL, (4, 16)), (TINY, (4, 4)), (TINY, (1, 1))])
@pytest.mark.parametrize("mode", ["exact", "device"])
def test_ep_moe_equals_the_single_rank_moe(preset, topo, mode):
    nm = numerics(mode)
    ck = SyntheticCheckpoint(preset, 0)
    layer = preset.num_hidden_layers - 1                   # a score-routed layer
    lw = ck.layer(layer)
    rng = np.random.default_rng(2)
    T = 24
    x = nm.bf16(rng.standard_normal((T, preset.hidden_size)))
    ids = rng.integers(0, preset.vocab_size, T)
    lay = layout_for(preset, *topo)
    owners = rng.integers(0, lay.ranks, T)
    expert = lambda e: ck.expert(layer, e)                 # noqa: E731
    want = SINGLE.moe(x, lw, expert, ids, layer=layer, cfg=preset, nm=nm)
    got = RankEmulation(lay).moe(x, lw, expert, ids, layer=layer, cfg=preset, nm=nm, owners=owners)
    if mode == "device":
        # bitwise: EP packs an expert's rows source-rank-major, at other GEMM positions than the
        # single-rank MoE, but W8A8 products are integers and the gate's products of bf16 values
        # sum without rounding in float64 at these magnitudes, so no row's value depends on its
        # position (golden.numerics, Accumulation)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        assert_exact_close(got, want)


def test_ep_receive_capacity_is_enforced():
    from golden.ranks.ep import ep_moe
    ck = SyntheticCheckpoint(TINY, 0)
    lw = ck.layer(6)
    nm = numerics("exact")
    x = nm.bf16(np.random.default_rng(3).standard_normal((8, TINY.hidden_size)))
    with pytest.raises(AbiError, match="recv_expert_count"):
        ep_moe(x, lw, lambda e: ck.expert(6, e), np.zeros(8, np.int64), np.zeros(8, np.int64), layout_for(TINY),
               layer=6, cfg=TINY, nm=nm, recv_max=1)
