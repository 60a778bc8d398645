"""The malformed corpus: every entry rejected with the right rule named, none accepted, no crash."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from malformed_corpus import bases, context, corpus  # noqa: E402

from twin.abi.lowering import RULES, DispatchError, validate  # noqa: E402

CTX = context()
ENTRIES = corpus(CTX)


@pytest.fixture(scope="module")
def base():
    return bases(CTX)


def test_the_bases_are_valid(base):
    for d in base.values():
        validate(d, CTX)


@pytest.mark.parametrize("entry", ENTRIES, ids=[e[0] for e in ENTRIES])
def test_malformed_dispatch_is_rejected_with_its_rule(base, entry):
    name, b, mutate, rule = entry
    bad = mutate(base[b])
    with pytest.raises(DispatchError) as err:
        validate(bad, CTX)
    e = err.value
    assert e.rule == rule, str(e)
    # the message names the program, the argument and the rule
    assert e.program in str(e) and e.arg in str(e) and f"[{rule}]" in str(e)


def test_corpus_covers_every_rule_and_every_program(base):
    assert len(ENTRIES) >= 50
    assert {e[3] for e in ENTRIES} == set(RULES)
    programs = {base[e[1]].program for e in ENTRIES}
    assert programs == {"l3_prefill_fwd", "l3_decode_fwd", "l3_decode_fwd_dspark", "l3_dspark_drafter",
                        "l3_dspark_draft_step_device_state", "l3_distributed_markov_sample"}


def test_request_cap_follows_max_num_seqs(base):
    """Three requests in one group are legal at max_num_seqs=64 and rejected at max_num_seqs=2."""
    small = context(max_num_seqs=2)
    with pytest.raises(DispatchError) as err:
        validate(base["prefill"], small)
    assert err.value.rule == "group_requests"


def test_executor_owned_arguments_are_checked_when_present(base):
    """Weights, pools, scratch and outputs are optional; present with their bound shape they pass."""
    import numpy as np
    from twin.abi.batches import Dispatch
    from twin.abi.lowering.context import NP_DTYPES
    d = base["decode"]
    bound = CTX.bind(d.program)
    extra = {n: np.zeros(bound[n].shape, NP_DTYPES[bound[n].dtype]) for n in
             ("embed_weight", "raw_kv_pool", "csa_compress_state", "x_ping", "sampled_ids")}
    validate(Dispatch(d.program, {**d.args, **extra}), CTX)
