"""TorchBackend on SMALL (11 layers, 32 experts over 16 ranks, 64-wide index top-k): the decode and
prefill programs against golden re-synced layer by layer, every site and pool row checked."""
import pytest

from torchdev_case import build, first_failure, prefill_chunks, run_decode, run_prefill


@pytest.fixture(scope="module")
def case():
    return build("small", lengths=((0, 255), (1, 131)))


def _check(run):
    sites, pools, adopted = run.compare()
    bad = [(s, f.reasons) for s, f in sites if not f.passed] + \
          [(n, l, r, f.reasons) for n, l, r, f in pools if not f.passed]
    assert not bad, bad[:4]
    assert first_failure(sites) is None
    assert len(sites) >= 13 * run.case.cfg.num_hidden_layers
    return adopted


def test_decode(case):
    adopted = _check(run_decode(case))
    assert sum(len(v) for v in adopted.values()) <= 1


def test_prefill(case):
    run = run_prefill(case, prefill_chunks(case, (40, 60)))     # 255..294 and 131..190: both boundaries
    adopted = _check(run)
    assert sum(len(v) for v in adopted.values()) <= 0.01 * len(run.rows[0]) * case.cfg.num_hidden_layers
