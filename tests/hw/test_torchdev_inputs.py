"""TorchBackend refuses what it cannot run with an AbiError naming the argument, the value and
what is allowed: an unknown device, a program it does not implement, a missing or mis-shaped
argument.  Nothing is clamped or dropped."""
import numpy as np
import pytest

from hw.torchdev import TorchBackend
from twin.abi.batches import DrafterBatch, DrafterItem
from twin.abi.errors import AbiError
from twin.abi.lowering import LoweringContext, lower_markov
from twin.abi.topology import deployment


@pytest.fixture(scope="module")
def markov():
    dep = deployment("tiny", max_model_len=512)
    ctx = LoweringContext(dep, 1)
    d = lower_markov(DrafterBatch((DrafterItem("r0", 0, 0, 1, 10, (10,), 1, last_sampled=5),)), ctx)
    from golden.checkpoint import SyntheticCheckpoint
    from golden.dspark.weights import DrafterCheckpoint
    from hw.golden_args import stage_weights
    w = stage_weights(d.program, dep, 1, SyntheticCheckpoint(dep.model), DrafterCheckpoint(dep.model), B=d.meta["B"])
    return dep, d, w


def test_unknown_device_is_refused():
    with pytest.raises(AbiError, match="device.*'tpu'.*one of"):
        TorchBackend(deployment("tiny"), 1, "tpu")


def test_every_abi_program_is_implemented_and_another_is_refused_by_name(markov):
    dep, d, w = markov
    from hw.torchdev.backend import IMPLEMENTED
    from twin.abi.batches import Dispatch
    from twin.abi.programs import PROGRAMS
    assert sorted(IMPLEMENTED) == sorted(PROGRAMS)
    with pytest.raises(AbiError, match="program.*'l3_mtp_fwd'.*TorchBackend implements"):
        TorchBackend(dep, 1).run(Dispatch("l3_mtp_fwd", {}), {}, w)


def test_missing_and_misshaped_arguments_are_named(markov):
    dep, d, w = markov
    be = TorchBackend(dep, 1)
    with pytest.raises(AbiError, match="markov_w2.*missing"):
        be.run(d, {}, {k: v for k, v in w.items() if k != "markov_w2"})
    bad = dict(w, markov_w1=np.zeros((1, 2), np.uint16))
    with pytest.raises(AbiError, match=r"markov_w1.*\(1, 2\).*bind"):
        be.run(d, {}, bad)
    with pytest.raises(AbiError, match="weights"):
        be.run(d, {})


def test_one_backend_serves_programs_from_a_weight_function(markov):
    """weights=program -> mapping: staged once per program, then the protocol's run(dispatch, state)."""
    dep, d, w = markov
    calls = []
    be = TorchBackend(dep, 1, weights=lambda program: calls.append(program) or w)
    first = be.run(d, {})
    second = be.run(d, {})
    assert calls == [d.program]
    np.testing.assert_array_equal(first.outputs["draft_token_ids"], second.outputs["draft_token_ids"])


def test_target_programs_stage_the_targets_head_even_with_a_drafter():
    """The drafter has its own hc_head; a target program must never take it."""
    from golden.checkpoint import SyntheticCheckpoint
    from golden.dspark.weights import DrafterCheckpoint
    from hw.golden_args import stage_weights
    dep = deployment("tiny", max_model_len=512)
    ck, dk = SyntheticCheckpoint(dep.model), DrafterCheckpoint(dep.model)
    plain = stage_weights("l3_decode_fwd", dep, 1, ck)
    both = stage_weights("l3_decode_fwd", dep, 1, ck, dk)
    assert all(np.array_equal(plain[k], both[k]) for k in plain)
    drafter = stage_weights("l3_dspark_drafter", dep, 1, ck, dk)
    assert not np.array_equal(drafter["hc_head_fn"], plain["hc_head_fn"])    # the drafter's own head
