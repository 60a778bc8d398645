"""The point of an independent device: a bug seeded into golden is caught by the comparison
against TorchBackend and localized to its (layer, stage).

Three kinds, each a plausible golden mistake: a rounding point moved (the low-rank query rounded
to BF16 before its INT8 quantization; kernel-math K6 keeps it FP32), a mask off by one (the
sliding window one position early: the current token left out, one older row let in), and a scale
transposed (the indexer's per-column wq_b scale read as [IDX_HEAD_DIM, IDX_N_HEADS] instead of
[IDX_N_HEADS, IDX_HEAD_DIM]; it first matters at the first CSA layer's top-k).  The device ran once
on the clean inputs; only golden changes, on a decode and on a prefill dispatch."""
import numpy as np
import pytest

import golden.kernels.qkv_proj_rope as golden_qkv
import golden.paged
from torchdev_case import build, first_failure, prefill_chunks, run_decode, run_prefill

ORIG_RMS = golden_qkv.rmsnorm_f


def rms_rounded(x, w, nm, eps):
    y = ORIG_RMS(x, w, nm, eps)
    return nm.bf16(y) if w is not None else y          # the weighted call is the low-rank query's


def window_one_early(pos, ori_table, page: int, W: int):
    pos = np.asarray(pos)
    start = np.maximum(pos - W, 0)
    lens = np.maximum(pos - start, 1).astype(np.int32)
    q = start[:, None] + np.arange(W)[None, :]
    slots = golden.paged.paged_slot(q, ori_table, page)
    return np.where(np.arange(W)[None, :] < lens[:, None], slots, -1).astype(np.int32), lens


class IndexScaleTransposed:
    """The checkpoint with the indexer's wq_b scale read in the wrong layout."""

    def __init__(self, ckpt, cfg):
        self.ckpt, self.cfg = ckpt, cfg

    def model(self):
        return self.ckpt.model()

    def expert(self, layer, e):
        return self.ckpt.expert(layer, e)

    def layer(self, layer):
        w = dict(self.ckpt.layer(layer))
        if "csa_idx_wq_b_scale" in w:
            s = np.asarray(w["csa_idx_wq_b_scale"])
            w["csa_idx_wq_b_scale"] = s.reshape(self.cfg.index_n_heads, -1).T.reshape(-1)
        return w


@pytest.fixture(scope="module", params=["decode", "prefill"])
def run(request):
    if request.param == "decode":
        return run_decode(build("tiny"))
    case = build("tiny", lengths=((0, 150), (1, 0), (1, 60)))
    return run_prefill(case, prefill_chunks(case, (110, 140, 20)))


def test_clean_golden_has_no_divergence(run):
    sites, pools, _ = run.compare()
    assert first_failure(sites) is None
    assert all(f.passed for *_, f in pools)


@pytest.mark.parametrize("bug, site", [("rounding", (0, "q")), ("mask", (0, "attn")),
                                       ("scale", (2, "idx_topk"))])
def test_seeded_golden_bug_is_caught_and_localized(run, monkeypatch, bug, site):
    ckpt = None
    if bug == "rounding":
        monkeypatch.setattr(golden_qkv, "rmsnorm_f", rms_rounded)
    elif bug == "mask":
        monkeypatch.setattr(golden.paged, "window_indices", window_one_early)
    else:
        ckpt = IndexScaleTransposed(run.case.ckpt, run.case.cfg)
    findings, _, _ = run.compare(ckpt, pools=False)
    assert first_failure(findings) == site
    names = [s for s, _ in findings]
    earlier = [f for _, f in findings[:names.index(site)]]
    assert earlier and all(f.passed for f in earlier)      # everything before the site still agrees
