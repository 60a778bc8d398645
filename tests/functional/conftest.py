"""Session fixtures of the functional tests: the golden model, the oracle and the two runs of the
must-show workload (functional_workload.py describes it)."""
import pytest

from functional_workload import SLOTS, make_dep, make_requests, oracle_drafts
from twin.functional import functional_simulate, golden_model, reference_outputs


@pytest.fixture(scope="session")
def golden():
    return golden_model("tiny")


@pytest.fixture(scope="session")
def oracle(golden):
    return reference_outputs(golden, make_requests())


def _run(golden, oracle, recompute):
    dep = make_dep()
    reqs = make_requests()
    return functional_simulate(dep, reqs, golden, slots=SLOTS, recompute=recompute,
                               draft_policy=oracle_drafts(oracle, make_requests(), dep.model.vocab_size))


@pytest.fixture(scope="session")
def upstream_run(golden, oracle):
    return _run(golden, oracle, "prompt")


@pytest.fixture(scope="session")
def replay_run(golden, oracle):
    return _run(golden, oracle, "replay")
