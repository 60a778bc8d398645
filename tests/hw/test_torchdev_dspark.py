"""The fused K=7 program's own parts on TINY: the device-state acceptance (K27) against golden's
`golden.dspark.state`, and the target arguments the device derives from that state (K20) against
what the split decode lowering stages for the same verify windows.  The whole step against golden
runs in tests/functional/test_parity_torch.py (the K=7 lockstep)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from golden.dspark import state as GS  # noqa: E402
from golden.dspark.weights import DrafterCheckpoint  # noqa: E402
from hw.golden_args import stage_weights  # noqa: E402
from hw.torchdev.args import Args, to_numpy  # noqa: E402
from hw.torchdev.decode_dspark import _drafter_args, _target_args, extents  # noqa: E402
from hw.torchdev.device_state import accept, commit, prepare  # noqa: E402
from twin.abi import constants as C  # noqa: E402
from twin.abi.batches import DecodeBatch, DecodeItem, DrafterBatch, DrafterItem  # noqa: E402
from twin.abi.lowering import lower_decode, lower_drafter, validate  # noqa: E402
from twin.abi.lowering.fused import lower_fused  # noqa: E402
from twin.abi.programs import get_program  # noqa: E402
from torchdev_case import build  # noqa: E402

NOISE = 7


def _state(rng, n_live: int, limit: int = 300):
    """One group's replica: n_live seeded slots (some with drafts near the limit), one released."""
    st = GS.new_state(1, NOISE)
    refs = []
    leases = rng.choice(64, n_live + 1, replace=False)
    for i, lease in enumerate(leases):
        ref = GS.SlotRef(0, int(lease), int(rng.integers(1, 5)))
        L = int(rng.choice([5, 100, limit - 8, limit - 7, limit - 2]))
        fits = L - 1 + 7 < limit
        drafts = rng.integers(10, 40, 7) if fits else []
        st = GS.seed(st, ref, int(rng.integers(10, 40)), drafts, prompt_len=L, position_limit=limit)
        refs.append(ref)
    st = GS.release(st, refs[-1])            # a finished request's slot: its row must verify nothing
    return st, refs


@pytest.mark.parametrize("seed", range(6))
def test_acceptance_and_commit_equal_golden_exactly(seed):
    rng = np.random.default_rng(seed)
    st, refs = _state(rng, 6)
    live = refs[:-1]
    slot_ids = torch.tensor([r.lease for r in refs] + [-1])
    gens = torch.tensor([r.generation for r in refs] + [-1])
    tok, meta = torch.from_numpy(st.tokens[0].copy()), torch.from_numpy(st.meta[0].copy())
    p = prepare(tok, meta, slot_ids, gens)
    gp = GS.prepare(st, live)
    n = len(live)
    assert p.live.tolist() == [True] * n + [False, False]
    assert p.width[:n].tolist() == gp.active_width.tolist() and p.width[n:].tolist() == [0, 0]
    assert np.array_equal(p.positions[:n].numpy(), gp.positions) and np.array_equal(p.tokens[:n].numpy(), gp.tokens)
    # the target's samples: each live row matches its drafts for a random prefix, then differs
    sampled = np.array(rng.integers(40, 60, (n + 2, 8)))
    for i in range(n):
        k = int(rng.integers(0, 8))
        sampled[i, :k] = gp.tokens[i, 1:1 + k]
    acc = accept(tok, meta, p, torch.from_numpy(sampled), NOISE)
    ga, gst = GS.accept(st, gp, sampled[:n])
    assert acc.counts[:n].tolist() == ga.counts.tolist() and acc.counts[n:].tolist() == [0, 0]
    assert np.array_equal(acc.token_ids[:n].numpy(), ga.token_ids)
    assert acc.next_token[:n].tolist() == ga.next_token.tolist()
    assert acc.drafter_anchor[:n].tolist() == ga.drafter_anchor.tolist()
    assert acc.redraft[:n].tolist() == ga.redraft.tolist() and not acc.redraft[n:].any()
    drafts = rng.integers(60, 80, (n + 2, 7))
    commit(tok, meta, p.lease, torch.from_numpy(drafts), acc.redraft)
    gst = GS.commit_drafts(gst, [r for r, ok in zip(live, ga.redraft) if ok], drafts[:n][ga.redraft])
    # the released slot and every untouched lease are bit-identical: integer state, the same rule
    assert np.array_equal(tok.numpy(), gst.tokens[0]) and np.array_equal(meta.numpy(), gst.meta[0])
    assert ga.counts.max() > 1 and (ga.proposed == 0).any()        # the case has matches and a fallback


@pytest.fixture(scope="module")
def derived():
    """Three verify windows (two groups, two owner ranks in one) with 7 drafts each, at anchors that
    cross ratio-4 and ratio-128 boundaries: the fused program's derived arguments and the split
    lowering of the same windows."""
    case = build("tiny", lengths=((0, 200), (1, 255), (1, 131)))
    ctx, dep, cfg = case.ctx, case.dep, case.cfg
    rng = np.random.default_rng(1)
    leases = {"r0": 63, "r1": 63, "r2": 62}
    items = tuple(DecodeItem(rid, case.tau[i], n, case.blocks[rid], p,
                             tuple(int(t) for t in rng.integers(2, cfg.vocab_size, 7)), leases[rid], 1)
                  for i, (rid, p, n) in enumerate(case.requests))
    split = lower_decode(DecodeBatch(items, k=7), ctx)
    fused = lower_fused(DecodeBatch(items, k=7), ctx)
    validate(split, ctx)
    validate(fused, ctx)
    tp = ctx.tp
    toks = np.full((dep.ranks, 64, 8), NOISE, np.int64)
    meta = np.zeros((dep.ranks, 64, 6), np.int32)
    for it in items:
        for r in ctx.group_ranks(it.partition):
            toks[r, it.lease] = (it.last_token,) + it.pending_drafts
            meta[r, it.lease] = (1, 1, it.anchor, it.anchor, 7, dep.limits.max_model_len)
    w = stage_weights(fused.program, dep, case.slots, case.ckpt, DrafterCheckpoint(cfg))
    a = Args(fused, w, {"state_tokens": toks, "state_meta": meta,
                        "draft_kv_caches": np.zeros([x for x in _bound(fused, dep, case.slots)["draft_kv_caches"]],
                                                    np.uint16),
                        **_target_pools(fused, dep, case.slots)}, dep, case.slots, torch.device("cpu"),
             extents=extents(fused))
    preps = [prepare(a["state_tokens"][g * tp], a["state_meta"][g * tp], a["group_state_slot_ids"][g * tp],
                     a["group_state_generations"][g * tp]) for g in range(dep.partitions)]
    out = _target_args(a, cfg, dep, preps)
    out = {k: to_numpy(v, a.bound[k].dtype if k in a.bound else _split_dtype(k)) for k, v in out.items()}
    return split, fused, out, (case, items, a, preps)


def _bound(d, dep, slots):
    from twin.abi.programs import bind
    return {b.name: b.shape for b in bind(d.program, dep, slots, **extents(d))}


def _target_pools(d, dep, slots):
    from twin.abi.lowering.context import NP_DTYPES
    from twin.abi.programs import STATE, bind
    return {b.name: np.zeros(b.shape, NP_DTYPES[b.dtype]) for b in bind(d.program, dep, slots, **extents(d))
            if b.arg.role == STATE and b.arg.pool not in ("drafter", "device_state")}


def _split_dtype(name):
    from twin.abi.programs import get_program
    return get_program("l3_decode_fwd").arg(name).dtype


EXACT = ("position_ids", "position_ids_local", "swa_slot_mapping", "csa_ori_slot_mapping", "hca_ori_slot_mapping",
         "csa_cmp_slot_mapping", "csa_idx_slot_mapping", "hca_cmp_slot_mapping", "csa_state_slot_mapping",
         "csa_inner_state_slot_mapping", "hca_state_slot_mapping", "swa_indices", "swa_lens",
         "csa_window_swa_indices", "csa_window_swa_lens", "hca_window_swa_indices", "hca_window_swa_lens",
         "freqs_cos", "freqs_sin", "compressed_freqs_cos", "compressed_freqs_sin", "csa_cmp_freqs_cos",
         "csa_cmp_freqs_sin", "logit_row_indices")


@pytest.mark.parametrize("name", EXACT)
def test_derived_target_arguments_equal_the_split_lowering(derived, name):
    """Integer descriptors and RoPE rows (the same table rows, bit for bit: one function writes both)."""
    split, _, out, _ = derived
    assert np.array_equal(out[name], np.asarray(split.args[name])), name
    if "slot" in name or "indices" in name:
        assert (out[name] >= 0).any()          # live rows write (and read) somewhere: not a vacuous -1 match


def test_derived_per_request_arguments_equal_on_live_rows(derived):
    split, fused, out, _ = derived
    ntpo = np.asarray(fused.args["num_tokens_per_owner"])
    for r in range(ntpo.shape[0]):
        n = int(ntpo[r])
        assert np.array_equal(out["input_ids"][r, :n], np.asarray(split.args["input_ids"])[r, :n])
        for k in ("csa_kv_seq_lens", "hca_kv_seq_lens"):
            assert np.array_equal(out[k][r, :n // 8], np.asarray(split.args[k])[r, :n // 8])
    live = np.asarray(fused.args["group_state_slot_ids"]) >= 0
    for k in ("hca_cmp_freqs_cos", "hca_cmp_freqs_sin"):
        assert np.array_equal(out[k][live], np.asarray(split.args[k])[live])
    assert live.sum() == 3 * C.TP_SIZE


def test_derived_drafter_arguments_equal_the_drafter_lowering(derived):
    """After the acceptance (here 3, 1 and 8 accepted tokens), the drafter's inputs the device builds
    equal the redraft batch `l3_dspark_drafter` would be staged with: the accepted rows as context
    at old_anchor + o, the query block after the new drafter anchor, every slot in the lease's ring."""
    _, fused, _, (case, items, a, preps) = derived
    ctx, dep, cfg = case.ctx, case.dep, case.cfg
    tp = ctx.tp
    counts = {"r0": 3, "r1": 1, "r2": 8}
    accs = []
    for g in range(dep.partitions):
        p = preps[g]
        smp = torch.full((C.DECODE_BATCH, 8), 5, dtype=torch.long)
        for it in items:
            if it.partition == g:
                s = int(np.flatnonzero(np.asarray(fused.args["group_state_slot_ids"])[g * tp] == it.lease)[0])
                k = counts[it.request_id] - 1
                smp[s, :k] = torch.tensor(it.pending_drafts[:k])
        accs.append(accept(p.tokens.clone(), torch.zeros(64, 6, dtype=torch.int32), p, smp, NOISE))
    B = int(fused.args["draft_block_tables"].shape[2])
    hidden = torch.zeros(dep.ranks, 128, 3 * cfg.hidden_size)
    got = _drafter_args(a, cfg, dep, preps, accs, B, hidden)
    rows = []
    for it in items:
        c = counts[it.request_id]
        # the bonus token is the target's sample after the last accepted draft: 5 everywhere here
        rows.append(DrafterItem(it.request_id, it.partition, it.lease, 1, it.anchor + c - 1,
                                tuple(range(it.anchor, it.anchor + c)), 1, last_sampled=5))
    want = lower_drafter(DrafterBatch(tuple(rows)), ctx)
    assert want.meta["B"] == B
    for name in ("num_sampled", "last_sampled", "next_prefill_tokens", "anchor_positions",
                 "context_group_slot_mapping", "context_group_freqs_cos", "context_group_freqs_sin",
                 "query_group_slot_mapping", "query_freqs_cos", "query_freqs_sin"):
        dt = get_program("l3_dspark_drafter").arg(name).dtype
        assert np.array_equal(to_numpy(got[name], dt), np.asarray(want.args[name])), name
    # every accepted row's context slot, in each of the 3 draft layers, on each of its group's ranks
    assert (np.asarray(want.args["context_group_slot_mapping"]) >= 0).sum() == 3 * tp * sum(counts.values())
    assert sorted(int(x) for acc in accs for x in acc.counts if x) == [1, 3, 8]
