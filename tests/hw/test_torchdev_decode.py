"""TorchBackend's l3_decode_fwd against golden on TINY: the same batch lowered by twin.abi, the
weights and pools staged from golden's synthetic checkpoint and its own history.

The batch crosses both compressors' boundaries (anchors 255: ratio 4 and 128; 131: ratio 4) and
has a request without one (200); two requests share a partition, so its ranks' replicas carry
both.  Golden re-syncs to the device layer by layer (torchdev_case.golden_resynced), and each site
(layer, stage) is compared under kernel-math's tolerance for it."""
import numpy as np
import pytest

from hw.torchdev import TorchBackend
from torchdev_case import build, decode_rows, first_failure, golden_decode, run_decode


@pytest.fixture(scope="module")
def clean():
    run = run_decode(build("tiny"))
    return run, *run.compare()


def test_the_batch_exercises_every_boundary(clean):
    run, *_ = clean
    anchors = [n for _, _, n in run.case.requests]
    assert any((a + 1) % 128 == 0 for a in anchors)                    # an HCA boundary
    assert any((a + 1) % 4 == 0 and (a + 1) % 128 for a in anchors)    # a CSA-only boundary
    assert any((a + 1) % 4 for a in anchors)                           # and a row with none
    d = run.dispatch
    assert (d.args["hca_cmp_slot_mapping"] >= 0).any() and (d.args["csa_cmp_slot_mapping"] >= 0).any()


def test_every_site_within_kernel_math_tolerance(clean):
    run, findings, _, adopted = clean
    cfg = run.case.cfg
    assert len(findings) == 13 * cfg.num_hidden_layers + len(cfg.csa_layers) + 3   # every stage of every layer
    bad = [(s, f.reasons) for s, f in findings if not f.passed]
    assert not bad, bad
    assert first_failure(findings) is None
    assert sum(len(v) for v in adopted.values()) <= 1


def test_pools_mapped_rows_match_and_the_rest_is_untouched(clean):
    run, _, pools, _ = clean
    names = {n for n, *_ in pools}
    assert {"raw_kv_pool", "csa_compress_state", "csa_inner_compress_state", "csa_cmp_kv", "csa_idx_kv_cache",
            "csa_idx_kv_scale", "hca_compress_state", "hca_cmp_kv"} <= names
    bad = [(n, l, r, f.reasons) for n, l, r, f in pools if not f.passed]
    assert not bad, bad[:4]
    # writes reach every rank replica of an active group, none of an idle one
    active = {p for _, p, _ in run.case.requests}
    for n, l, r, f in pools:
        if n == "raw_kv_pool" and l == 0:
            assert (f.metrics["mapped_rows"] > 0) == (r // run.case.ctx.tp in active)


def test_the_whole_forward_agrees_without_resync(clean):
    """Golden's own forward (no re-sync): kernel-math's full-forward gates, greedy tokens equal."""
    run, *_ = clean
    case, d, dres = run.case, run.dispatch, run.dres
    gout, _ = golden_decode(case)
    rows = decode_rows(case, d)
    got = np.stack([dres.taps[("head", "logits")][r, e] for _, r, _, e in rows])
    want = np.asarray(gout.logits, np.float64)
    cos = np.sum(got * want, -1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() >= 0.99
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 0.10
    sampled = [int(dres.outputs["sampled_ids"][r, e, 0]) for _, r, _, e in rows]
    assert sampled == np.asarray(gout.sampled).reshape(len(rows), -1)[:, 0].tolist()
    assert sampled == got.argmax(-1).tolist()               # sampled ids are the device logits' argmax


def test_logits_buffer_is_the_ranks_vocabulary_shard(clean):
    run, *_ = clean
    dres = run.dres
    vt = dres.outputs["logits"].shape[-1]
    for _, r, _, e in decode_rows(run.case, run.dispatch):
        m = r % run.case.ctx.tp
        full = dres.taps[("head", "logits")][r, e]
        np.testing.assert_array_equal(dres.outputs["logits"][r, e], full[m * vt:(m + 1) * vt])


def test_inputs_are_never_written_and_only_touched_pools_come_back(clean):
    run, *_ = clean
    case = run.case
    from torchdev_case import device_inputs
    weights, pools = device_inputs(case)
    TorchBackend(case.dep, case.slots).run(run.dispatch, pools, weights)
    for k, v in pools.items():
        np.testing.assert_array_equal(v, run.before[k])
    assert set(run.dres.state) <= set(run.before)
    for k, v in run.dres.state.items():
        assert v.shape == run.before[k].shape and v.dtype == run.before[k].dtype
        assert not np.array_equal(v, run.before[k])
