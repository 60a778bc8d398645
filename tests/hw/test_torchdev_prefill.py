"""TorchBackend's l3_prefill_fwd against golden on TINY: a packed, chunked prefill.

Partition 0 continues a 150-token history with 110 tokens (crossing the ratio-128 boundary at
255 against a resident prefix); partition 1 packs a fresh 140-token prompt (boundary 127) with a
20-token continuation of a 60-token history, so its stream has two requests, and partition 0's
stream is padded to the same 160 rows.
Golden re-syncs layer by layer; every site and every pool row is checked."""
import numpy as np
import pytest

from torchdev_case import build, first_failure, golden_prefill, prefill_chunks, run_prefill


@pytest.fixture(scope="module")
def clean():
    case = build("tiny", lengths=((0, 150), (1, 0), (1, 60)))
    chunks = prefill_chunks(case, (110, 140, 20))
    run = run_prefill(case, chunks)
    return run, chunks, *run.compare()


def test_the_dispatch_is_packed_and_padded(clean):
    run, chunks, *_ = clean
    d = run.dispatch
    assert d.meta["Q"] == 2 and d.meta["P"] % run.case.ctx.tp == 0
    assert d.meta["P"] == 160                                         # partition 0's 110 rows are padded to 160
    assert (d.args["hca_cmp_slot_mapping_full"] >= 0).sum() >= 2 * run.case.ctx.tp


def test_every_site_within_kernel_math_tolerance(clean):
    run, _, findings, _, adopted = clean
    bad = [(s, f.reasons) for s, f in findings if not f.passed]
    assert not bad, bad
    assert first_failure(findings) is None
    rows = len(run.rows[0])
    assert sum(len(v) for v in adopted.values()) <= 0.01 * rows * run.case.cfg.num_hidden_layers


def test_pools_mapped_rows_match_and_the_rest_is_untouched(clean):
    run, _, _, pools, _ = clean
    assert {n for n, *_ in pools} >= {"kv_cache", "csa_compress_state", "csa_inner_compress_state", "csa_cmp_kv",
                                      "idx_kv_cache", "idx_kv_scale", "hca_compress_state", "hca_cmp_kv"}
    bad = [(n, l, r, f.reasons) for n, l, r, f in pools if not f.passed]
    assert not bad, bad[:4]
    assert all(f.metrics["mapped_rows"] > 0 for n, l, r, f in pools if r < 8 and n == "kv_cache")


def test_sampled_tokens_and_the_whole_forward(clean):
    run, chunks, *_ = clean
    gout, _ = golden_prefill(run.case, chunks)
    logit = run.rows[1]
    got = np.stack([run.dres.taps[("head", "logits")][r, e] for _, r, e in logit])
    want = np.asarray(gout.logits, np.float64)
    cos = np.sum(got * want, -1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() >= 0.99 and np.linalg.norm(got - want) / np.linalg.norm(want) <= 0.10
    sampled = [int(run.dres.outputs["sampled_ids"][r, e, 0]) for _, r, e in logit]
    assert sampled == got.argmax(-1).tolist()
    assert sampled == np.asarray(gout.sampled).reshape(-1).tolist()
