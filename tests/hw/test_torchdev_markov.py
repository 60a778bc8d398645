"""TorchBackend's l3_distributed_markov_sample against golden's K26 chain on TINY: redraft rows
(num_sampled 1, the chain starts at last_sampled; two leases on one owner rank) and seed rows
(num_sampled 0, it starts at the prefill's next token), the head hiddens random BF16 rows."""
import numpy as np
import pytest

from golden.checkpoint import SyntheticCheckpoint
from golden.dspark.markov import confidence_probs, dspark_markov
from golden.dspark.weights import DrafterCheckpoint
from golden.numerics import numerics
from hw.golden_args import stage_weights
from hw.torchdev import TorchBackend
from twin.abi.batches import DrafterBatch, DrafterItem
from twin.abi.lowering import LoweringContext, from_bf16_bits, lower_markov, to_bf16_bits, validate
from twin.abi.topology import deployment


def _run(items, seed=1):
    dep = deployment("tiny", max_model_len=512)
    cfg = dep.model
    ctx = LoweringContext(dep, 2)
    ck, dk = SyntheticCheckpoint(cfg, seed=0), DrafterCheckpoint(cfg, seed=0)
    shape = lower_markov(DrafterBatch(items), ctx).args["head_hidden"].shape
    hh = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    d = lower_markov(DrafterBatch(items), ctx, head_hidden=to_bf16_bits(hh))
    validate(d, ctx)
    res = TorchBackend(dep, 2).run(d, {}, stage_weights(d.program, dep, 2, ck, dk, B=d.meta["B"]))
    nm = numerics("device", cfg=cfg)
    m, dm = ck.model(), dk.model()
    rows = []
    for r in range(dep.ranks):
        n = int(((d.args["num_sampled"][r] > 0) | (d.args["next_prefill_tokens"][r] > 0)).sum())
        if not n:
            continue
        a = d.args
        drafts, logit = dspark_markov(from_bf16_bits(a["head_hidden"][r, :n]).astype(np.float64),
                                      dm["final_norm_weight"], m["lm_head_weight"], a["num_sampled"][r, :n],
                                      a["last_sampled"][r, :n], a["next_prefill_tokens"][r, :n], dm["markov_w1"],
                                      dm["markov_w2"], dm["confidence_head_weight"], cfg=cfg, nm=nm)
        rows.append((r, n, np.asarray(drafts), np.asarray(confidence_probs(logit, nm))))
    return d, res, rows


@pytest.mark.parametrize("mode", ["redraft", "seed"])
def test_drafts_and_confidence_equal_golden(mode):
    if mode == "redraft":
        items = tuple(DrafterItem(f"r{i}", p, lease, 1, 200 + i, (200 + i,), 1, last_sampled=t)
                      for i, (p, lease, t) in enumerate([(0, 0, 17), (0, 4, 901), (1, 1, 33), (2, 2, 1500)]))
    else:
        items = tuple(DrafterItem(f"s{p}", p, p, 1, 130, tuple(range(3, 131)), 0, next_prefill_token=t)
                      for p, t in ((0, 42), (1, 1234), (3, 7)))
    d, res, rows = _run(items)
    assert sum(n for _, n, _, _ in rows) == len(items)
    assert any(n == 2 for _, n, _, _ in rows) == (mode == "redraft")       # two leases share an owner rank
    for r, n, drafts, probs in rows:
        # the chain's ids are exact (kernel-math K26: ids allclose 2e-3, i.e. equal)
        np.testing.assert_array_equal(res.outputs["draft_token_ids"][r, :n], drafts)
        np.testing.assert_allclose(res.outputs["confidence_probs"][r, :n], probs, rtol=2e-3, atol=2e-3)
    assert res.state == {}
