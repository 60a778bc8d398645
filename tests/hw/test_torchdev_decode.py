"""TorchBackend's l3_decode_fwd against golden on TINY: the same batch lowered by twin.abi, the
weights and pools staged from golden's synthetic checkpoint and its own history.

The batch crosses both compressors' boundaries (anchors 255: ratio 4 and 128; 131: ratio 4) and
has a request without one (200); two requests share a partition, so its ranks' replicas carry
both.  Each site (layer, stage) is compared under kernel-math's tolerance for that kernel."""
import numpy as np
import pytest

from hw.torchdev import TorchBackend
from torchdev_case import build, compare_pools, compare_sites, decode_dispatch, decode_rows, device_inputs, \
    first_failure, golden_decode


@pytest.fixture(scope="module")
def clean():
    case = build("tiny")
    d = decode_dispatch(case)
    weights, pools = device_inputs(case)
    snapshot = {k: v.copy() for k, v in pools.items()}
    dres = TorchBackend(case.dep, case.slots).run(d, pools, weights)
    gout, gtaps = golden_decode(case)
    return case, d, pools, snapshot, dres, gout, gtaps


def test_the_batch_exercises_every_boundary(clean):
    case, d, *_ = clean
    anchors = [n for _, _, n in case.requests]
    assert any((a + 1) % 128 == 0 for a in anchors)                    # an HCA boundary
    assert any((a + 1) % 4 == 0 and (a + 1) % 128 for a in anchors)    # a CSA-only boundary
    assert any((a + 1) % 4 for a in anchors)                           # and a row with none
    assert (d.args["hca_cmp_slot_mapping"] >= 0).any() and (d.args["csa_cmp_slot_mapping"] >= 0).any()


def test_sampled_tokens_equal_golden(clean):
    case, d, _, _, dres, gout, _ = clean
    want = np.asarray(gout.sampled).reshape(len(case.requests), -1)[:, 0]
    got = [int(dres.outputs["sampled_ids"][r, e, 0]) for _, r, _, e in decode_rows(case, d)]
    assert got == want.tolist()


def test_every_site_within_kernel_math_tolerance(clean):
    case, d, _, _, dres, _, gtaps = clean
    findings = compare_sites(case, d, gtaps, dres)
    assert len(findings) >= 13 * case.cfg.num_hidden_layers        # every stage of every layer was compared
    bad = [(s, f.reasons) for s, f in findings if not f.passed]
    assert not bad, bad
    assert first_failure(findings) is None


def test_logits_agree_with_golden(clean):
    case, d, _, _, dres, gout, _ = clean
    rows = decode_rows(case, d)
    got = np.stack([dres.taps[("head", "logits")][r, e] for _, r, _, e in rows])
    want = np.asarray(gout.logits, np.float64)
    cos = np.sum(got * want, -1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() > 0.9999
    # the output buffer is the rank's vocabulary shard of its own entries
    vt = dres.outputs["logits"].shape[-1]
    for i, r, _, e in rows:
        m = r % case.ctx.tp
        np.testing.assert_array_equal(dres.outputs["logits"][r, e], got[i, m * vt:(m + 1) * vt].astype(np.float32))


def test_pools_mapped_rows_match_and_the_rest_is_untouched(clean):
    case, d, pools, snapshot, dres, gout, _ = clean
    found = compare_pools(case, d, snapshot, gout, dres)
    names = {n for n, *_ in found}
    assert {"raw_kv_pool", "csa_compress_state", "csa_inner_compress_state", "csa_cmp_kv", "csa_idx_kv_cache",
            "csa_idx_kv_scale", "hca_compress_state", "hca_cmp_kv"} <= names
    bad = [(n, l, r, f.reasons) for n, l, r, f in found if not f.passed]
    assert not bad, bad[:4]
    # writes reach every rank replica of an active group, none of an idle one
    active = {p for _, p, _ in case.requests}
    for n, l, r, f in found:
        if n == "raw_kv_pool" and l == 0:
            assert (f.metrics["mapped_rows"] > 0) == (r // case.ctx.tp in active)
    for k, v in pools.items():                      # the caller's arrays are never written
        np.testing.assert_array_equal(v, snapshot[k])


def test_only_touched_pools_come_back(clean):
    case, d, _, snapshot, dres, _, _ = clean
    assert set(dres.state) <= set(snapshot)
    for k, v in dres.state.items():
        assert v.shape == snapshot[k].shape and v.dtype == snapshot[k].dtype
        assert not np.array_equal(v, snapshot[k])
