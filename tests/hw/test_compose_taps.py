"""The localizer on the real golden's taps: golden.compose's (layer, stage) dump, in its own
dependency order, under the tolerance policy."""
import numpy as np
import pytest

from golden.checkpoint import SyntheticCheckpoint
from golden.compose import Session, Taps
from hw.localize import COMPOSE_STAGE_KIND, compose_kind, first_divergent_tap
from hw.tolerance import Policy
from twin.abi import TINY
from twin.abi.errors import AbiError


@pytest.fixture(scope="module")
def golden_taps():
    s = Session(SyntheticCheckpoint(TINY, seed=0), TINY, "device", 2, 256, seed=0)
    taps = Taps()
    s.run({0: list(range(5, 45)), 1: list(range(100, 130))}, taps=taps)
    return taps


def test_every_compose_stage_has_a_policy_kind(golden_taps):
    p = Policy()
    for site in golden_taps:
        p.lookup(*compose_kind(site))
    assert {s for _, s in golden_taps} <= set(COMPOSE_STAGE_KIND)
    with pytest.raises(AbiError, match="stage='nope'"):
        compose_kind((0, "nope"))


def dump(taps):
    """A device-side dump: copies, multi-part taps (cmp_kv) kept as tuples."""
    return {k: tuple(np.array(x, copy=True) for x in v) if isinstance(v, tuple) else np.array(v, copy=True)
            for k, v in taps.items()}


def test_identical_dump_has_no_divergence(golden_taps):
    dev = dump(golden_taps)
    assert first_divergent_tap(list(golden_taps), dev, golden_taps, Policy(), compose_kind) is None


@pytest.mark.parametrize("site", [(2, "kv"), (3, "moe_indices"), (5, "attn"), ("head", "logits")])
def test_first_corrupted_stage_is_found_in_dependency_order(golden_taps, site):
    if site not in golden_taps:
        site = next(k for k in golden_taps if k[1] == site[1])
    dev = dump(golden_taps)
    order = [k for k in golden_taps if not isinstance(golden_taps[k], tuple)]
    later = order[min(order.index(site) + 3, len(order) - 1)]
    for s in {site, later}:                        # the fault and its downstream effect
        v = dev[s]
        if v.dtype.kind in "iu":
            v.reshape(-1)[0] = (v.reshape(-1)[0] + 1) % TINY.n_routed_experts
            if v.ndim > 1 and v.shape[-1] > 1 and len(set(v.reshape(-1, v.shape[-1])[0].tolist())) < v.shape[-1]:
                v.reshape(-1, v.shape[-1])[0, 0] = (v.reshape(-1, v.shape[-1])[0, 0] + 2) % TINY.n_routed_experts
        else:
            flat = v.reshape(v.shape[0], -1).astype(np.float32)
            flat[1] = -flat[1] + 1.0
            dev[s] = flat.reshape(v.shape).astype(v.dtype)
    f = first_divergent_tap(list(golden_taps), dev, golden_taps, Policy(), compose_kind)
    assert f is not None and f.site == site
