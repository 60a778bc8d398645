"""TorchBackend's l3_dspark_drafter against golden's drafter (K22-K24) on TINY.

Redraft rows (1..8 committed context rows each, two leases on one owner rank, a short window at
anchor 60) and seed rows (the 128-row prompt tail split over the group's ranks) against drafter
pools filled with random BF16 rows, so every block attends to a full window.  Golden re-syncs to
the device at every draft layer (its residual stream and, on near ties, its routing), as lockstep
does: the block's rows all attend to each other, so one rounding difference would otherwise spread
through the block.  Each layer's attention under K24's tolerance (ratio_allclose 1e-2, 1e-2, 5 %),
its output under §2's hidden comparator, head_hidden under K5's; the pools' written rows (context
and block KV) under K23's, every other row bit-identical."""
import ml_dtypes
import numpy as np
import pytest

from golden.checkpoint import SyntheticCheckpoint
from golden.dspark.drafter import DraftRow, dspark_attention, dspark_proj, write_context
from golden.kernels.hyper_connections import hc_head, hc_post, hc_pre
from golden.kernels.rmsnorm import rms_norm
from golden.dspark.markov import confidence_probs, dspark_markov
from golden.dspark.parallel import SingleRank
from golden.kernels.moe import gate, moe_experts
from golden.dspark.weights import DrafterCheckpoint
from golden.numerics import numerics
from hw.compare import compare_pool, compare_tensor
from hw.golden_args import stage_weights
from hw.tolerance import Policy, Tolerance
from hw.torchdev import TorchBackend
from torchdev_case import adopt_near_ties
from twin.abi import constants as C
from twin.abi.batches import DrafterBatch, DrafterItem
from twin.abi.lowering import LoweringContext, from_bf16_bits, lower_drafter, validate
from twin.abi.topology import deployment

HEAD = Tolerance(atol=1e-4, rtol=1 / 128, bad_budget=0.005)      # K5 hc_head of the device's stream
ATTN = Tolerance(atol=1e-2, rtol=1e-2, bad_budget=0.05)           # K24 dspark_attention x_out
LAYER = Tolerance(atol=5e-2, rtol=1e-2, bad_budget=0.02)          # the MoE sub-layer: §2's hidden comparator
KV = Tolerance(atol=1e-4, rtol=1 / 128, bad_budget=0.005)


class RouteResync(SingleRank):
    """Golden's single-rank drafter whose routing re-syncs to the device's (the lockstep's rule):
    where the device chose other experts and golden's own biased scores make that a near tie
    (torchdev_case.adopt_near_ties), golden takes the device's experts.  `device` holds the device's
    expert ids of each draft layer in golden's row order; `adopted` records the rows taken."""

    def __init__(self, device):
        self.device, self.calls, self.adopted = device, 0, {}

    def moe(self, x_mixed, lw, expert, input_ids, *, layer, cfg, nm, owners=None):
        dev = self.device[self.calls]
        self.calls += 1
        tol = Policy().lookup("route", "i32", depth=layer).tie_tol

        def top_k(biased, k):
            b = np.asarray(biased, np.float64)
            idx = np.argsort(-b, axis=-1, kind="stable")[:, :k].astype(np.int32)
            return adopt_near_ties(b, idx, dev, tol, self.adopted, layer)
        x_i8, x_scale, idx, wts = gate(x_mixed, lw["norm_w"], lw["gate_w"], lw["gate_bias"], lw.get("tid2eid"),
                                       input_ids, layer=layer, cfg=cfg, nm=nm, top_k=top_k)
        return moe_experts(x_i8, x_scale, idx, wts, expert, lw, cfg=cfg, nm=nm)


def golden_drafter(pool, main_hidden, rows, dk, device_h, par, *, cfg, nm):
    """golden's drafter (K22-K24, golden.dspark.drafter's pieces in drafter_forward's order), each
    draft layer started from the device's residual stream `device_h[l]` and the head from the
    device's last one: the lockstep's re-sync, so a rounding difference does not cascade through
    the block (whose rows all attend to each other).  -> (head_hidden [B, 7, D], pool, per-layer
    taps: attn_out and x_hc, the layer's output)."""
    dm = dk.model()
    layers = [dk.layer(l) for l in range(cfg.dspark_num_layers)]
    main_x = dspark_proj(main_hidden, dm["main_proj_weight"], dm["main_norm_weight"], cfg=cfg, nm=nm)
    pool = write_context(pool, main_x, layers, rows, cfg=cfg, nm=nm)
    taps = {}
    for l, lw in enumerate(layers):
        h = nm.xp.asarray(device_h[l]).astype(nm.f)
        x_mixed, post, comb = hc_pre(h, lw["hc_attn_fn"], lw["hc_attn_scale"], lw["hc_attn_base"], cfg=cfg, nm=nm)
        x_n = rms_norm(x_mixed, lw["attn_norm_w"], cfg=cfg, nm=nm)
        attn_out, pool = dspark_attention(x_n, lw, pool, l, rows, cfg=cfg, nm=nm, par=par)
        h = hc_post(attn_out, h, post, comb, cfg=cfg, nm=nm)
        x_mixed, post, comb = hc_pre(h, lw["hc_ffn_fn"], lw["hc_ffn_scale"], lw["hc_ffn_base"], cfg=cfg, nm=nm)
        ids = np.array([[r.anchor_token] + [cfg.dspark_noise_token_id] * 6 for r in rows], np.int64).reshape(-1)
        ffn = par.moe(x_mixed, lw, lambda e, _l=l: dk.expert(_l, e), ids, layer=cfg.dspark_target_layer_ids[l],
                      cfg=cfg, nm=nm)
        taps[(l, "attn_out")] = np.asarray(attn_out, np.float64)
        taps[(l, "x_hc")] = np.asarray(hc_post(ffn, h, post, comb, cfg=cfg, nm=nm), np.float64)
    head = hc_head(nm.xp.asarray(device_h[-1]).astype(nm.f), dm["hc_head_fn"], dm["hc_head_scale"],
                   dm["hc_head_base"], cfg=cfg, nm=nm)
    return head.reshape(len(rows), 7, -1), pool, taps


def _bf16(x):
    return from_bf16_bits(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.fixture(scope="module", params=["redraft", "seed"])
def run(request):
    return _run(request.param)


def _run(mode, program="l3_dspark_drafter"):
    dep = deployment("tiny", max_model_len=512)
    cfg = dep.model
    ctx = LoweringContext(dep, 2)
    ck, dk = SyntheticCheckpoint(cfg, seed=0), DrafterCheckpoint(cfg, seed=0)
    rng = np.random.default_rng(3)
    if mode == "redraft":
        spec = [("r0", 0, 0, 200, 3), ("r1", 0, 4, 140, 8), ("r2", 1, 2, 60, 1)]   # leases 0 and 4 share a rank
        items = [DrafterItem(rid, p, lease, 1, a, tuple(range(a - n + 1, a + 1)), 1,
                             last_sampled=int(rng.integers(2, cfg.vocab_size)))
                 for rid, p, lease, a, n in spec]
    else:
        items = [DrafterItem(f"s{p}", p, lease, 1, a, tuple(range(a - 127, a + 1)), 0,
                             next_prefill_token=int(rng.integers(2, cfg.vocab_size)))
                 for p, lease, a in ((0, 3, 130), (1, 7, 300))]
    hidden = {it.request_id: rng.standard_normal((len(it.context_positions), 3 * cfg.hidden_size)).astype(np.float32)
              for it in items}
    d = lower_drafter(DrafterBatch(tuple(items)), ctx, target_hidden=hidden, program=program)
    validate(d, ctx)
    pools = [(rng.standard_normal((cfg.dspark_num_layers, C.DRAFTER_POOL_BLOCKS, C.BLOCK_SIZE, 1, cfg.head_dim))
              * 0.5).astype(ml_dtypes.bfloat16) for _ in range(dep.partitions)]
    state = {"kv_caches": np.stack([pools[r // ctx.tp].view(np.uint16) for r in range(dep.ranks)])}
    weights = stage_weights(d.program, dep, 2, ck, dk, B=d.meta["B"], T_MAIN=d.meta["T_MAIN"])
    res = TorchBackend(dep, 2).run(d, state, weights)
    golden = {}
    nm = numerics("device", cfg=cfg)
    for g in sorted({it.partition for it in items}):
        its = [it for it in items if it.partition == g]
        tau = [it.last_sampled if it.num_sampled else it.next_prefill_token for it in its]
        rows = [DraftRow(it.lease, it.anchor, t, it.context_positions) for it, t in zip(its, tau)]
        mh = np.concatenate([_bf16(hidden[it.request_id]) for it in its]).astype(np.float64)
        qrows = [(d.meta["placement"][it.request_id]["rank"], d.meta["placement"][it.request_id]["row"]) for it in its]
        dev = [np.concatenate([res.taps[(f"draft{l}", "moe_indices")][r, b * 7:(b + 1) * 7] for r, b in qrows])
               for l in range(cfg.dspark_num_layers)]
        par = RouteResync(dev)
        hs = [np.concatenate([res.taps[(f"draft{l}", "attn_in")][r, b * 7:(b + 1) * 7] for r, b in qrows])
              for l in range(cfg.dspark_num_layers)]
        last = np.concatenate([res.taps[(f"draft{cfg.dspark_num_layers - 1}", "x_hc")][r, b * 7:(b + 1) * 7]
                               for r, b in qrows])
        head, pool, taps = golden_drafter(pools[g], mh, rows, dk, hs + [last], par, cfg=cfg, nm=nm)
        emb = np.asarray(ck.model()["embed_weight"], np.float32)
        tok = np.array([[t] + [cfg.dspark_noise_token_id] * 6 for t in tau]).reshape(-1)
        np.testing.assert_array_equal(hs[0], np.repeat(emb[tok][:, None, :], cfg.hc_mult, 1))   # K1: copies
        dev = {(l, "attn_out"): np.concatenate([res.taps[(f"draft{l}", "attn_out")][r, b * 7:(b + 1) * 7]
                                                for r, b in qrows]) for l in range(cfg.dspark_num_layers)}
        dev.update({(l, "x_hc"): (hs + [last])[l + 1] for l in range(cfg.dspark_num_layers)})
        golden[g] = (its, head, pool, sum(len(v) for v in par.adopted.values()), taps, dev)
    return d, state, res, golden, ctx


def test_head_hidden_within_kernel_math_tolerance(run):
    d, _, res, golden, _ = run
    for its, head, _, adopted, *_ in golden.values():
        assert adopted <= 1
        for i, it in enumerate(its):
            pl = d.meta["placement"][it.request_id]
            got = from_bf16_bits(res.outputs["head_hidden"][pl["rank"], pl["row"]])
            f = compare_tensor(it.request_id, got, np.asarray(head[i], np.float64), HEAD, ("act", "f32", "none"))
            assert f.passed, f.reasons


def test_every_draft_layer_within_tolerance(run):
    *_, golden, _ = run
    for its, _, _, _, taps, dev in golden.values():
        for (l, stage), want in taps.items():
            f = compare_tensor(f"draft{l}/{stage}", dev[(l, stage)], want, ATTN if stage == "attn_out" else LAYER,
                               ("act", "f32", "none"))
            assert f.passed, (l, stage, f.reasons)


def test_pools_written_rows_match_and_the_rest_is_untouched(run):
    d, state, res, golden, ctx = run
    for g, (_, _, pool, *_) in golden.items():
        for r in ctx.group_ranks(g):
            after = from_bf16_bits(res.state["kv_caches"][r])
            before = from_bf16_bits(state["kv_caches"][r])
            for l in range(after.shape[0]):
                slots = np.concatenate([d.args["context_group_slot_mapping"][r, l],
                                        d.args["query_group_slot_mapping"][r, l]])
                rows = np.unique(slots[slots >= 0])
                assert rows.size
                f = compare_pool(f"kv_caches[{l}]@{r}", after[l].reshape(-1, after.shape[-1]),
                                 np.asarray(pool[l], np.float32).reshape(-1, after.shape[-1]),
                                 before[l].reshape(-1, after.shape[-1]), rows, KV, ("pool", "f32", "none"))
                assert f.passed, f.reasons
    idle = [r for r in range(d.args["num_sampled"].shape[0]) if r // ctx.tp not in golden]
    for r in idle:                                   # a group without rows writes nothing
        np.testing.assert_array_equal(res.state["kv_caches"][r], state["kv_caches"][r])


def test_the_bootstrap_is_the_drafter_then_the_markov_chain():
    """l3_dspark_draft_step_device_state on a seeding wave: its head rows and pools are the drafter
    program's (the same batch), and its drafts are golden's K26 chain on those head rows."""
    d, state, res, golden, ctx = _run("seed", "l3_dspark_draft_step_device_state")
    d0, _, res0, _, _ = _run("seed")
    np.testing.assert_array_equal(res.outputs["head_hidden"], res0.outputs["head_hidden"])   # same program code
    np.testing.assert_array_equal(res.state["kv_caches"], res0.state["kv_caches"])
    cfg = ctx.deployment.model
    ck, dk = SyntheticCheckpoint(cfg, seed=0), DrafterCheckpoint(cfg, seed=0)
    m, dm = ck.model(), dk.model()
    nm = numerics("device", cfg=cfg)
    for its, *_ in golden.values():
        for it in its:
            pl = d.meta["placement"][it.request_id]
            r, b = pl["rank"], pl["row"]
            head = from_bf16_bits(res.outputs["head_hidden"][r, b:b + 1]).astype(np.float64)
            drafts, logit = dspark_markov(head, dm["final_norm_weight"], m["lm_head_weight"], [0], [0],
                                          [it.next_prefill_token], dm["markov_w1"], dm["markov_w2"],
                                          dm["confidence_head_weight"], cfg=cfg, nm=nm)
            np.testing.assert_array_equal(res.outputs["draft_token_ids"][r, b], np.asarray(drafts)[0])
            np.testing.assert_allclose(res.outputs["confidence_probs"][r, b], np.asarray(confidence_probs(logit, nm))[0],
                                       rtol=2e-3, atol=2e-3)
