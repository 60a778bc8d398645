"""Suite-wide settings: each test process's share of the cores, and a hypothesis profile sized for
CI (2 cores, whole suite well under 15 min)."""
import os

import pytest
from hypothesis import HealthCheck, settings

from golden.heap import retain_heap
from hw.threads import share_cores


def pytest_configure(config):
    """Each pytest-xdist worker, and every process it starts (CLI commands, notebook kernels,
    checkers, ranks), gets its share of the cores as torch (OpenMP) and OpenBLAS threads, and one
    XLA compute thread where that share is one (`hw.threads.share_cores`): the libraries' defaults
    take every core in every worker, and their spinning threads then wait on each
    other (on 2 cores with 2 workers a transformers reference test ran 20x slower than alone).  Set
    before any test module imports torch or JAX; a variable set before the run wins (.ci/run's BLAS
    reruns set OPENBLAS_NUM_THREADS).  xdist's controller runs no test and sets nothing, so its
    workers do not inherit its whole-machine counts."""
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        share_cores(int(worker["workercount"]))
    elif not getattr(config.option, "tx", None):        # no xdist nodes (-n N and --tx give them)
        share_cores(1)

retain_heap()       # the suite's golden steps reuse freed temporaries (golden.heap): ~15% of a step

# derandomize: a landing run draws the examples the local run drew (a random find belongs to an
# exploring run, HYPOTHESIS_PROFILE=thorough, not to a merge gate)
settings.register_profile("ci", deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                       HealthCheck.data_too_large])
settings.register_profile("thorough", deadline=None, max_examples=1000,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def one_cpu_thread():
    """torch and OpenBLAS on one thread for a module (restored afterwards), for the modules whose
    golden and device share a process, where a small preset's GEMMs are tiny (hw/threads.py)."""
    from hw.threads import limit_cpu_threads, restore

    prev = limit_cpu_threads(1)
    yield
    restore(prev)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for every Ray test (2 CPUs, no dashboard), started on first use; its address."""
    import ray

    # the smallest object store Ray takes: the tasks pass file paths and report entries
    ctx = ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20, logging_level="ERROR",
                   log_to_driver=False)
    yield ctx.address_info["address"]
    ray.shutdown()


# golden's synthetic checkpoints, shared by the NumPy golden tests (tests/golden) and the JAX path's
# (tests/golden_jax): built once per process, weights generated on first use
@pytest.fixture(scope="session")
def tiny_ckpt():
    from golden.checkpoint import SyntheticCheckpoint
    from twin.abi.presets import TINY
    return SyntheticCheckpoint(TINY, seed=0)


@pytest.fixture(scope="session")
def small_ckpt():
    from golden.checkpoint import SyntheticCheckpoint
    from twin.abi.presets import SMALL
    return SyntheticCheckpoint(SMALL, seed=0)


@pytest.fixture(scope="session")
def flash_ckpt():
    """FLASH-shaped weights, generated per (layer, expert) on first use and shared by the tests."""
    from golden.checkpoint import SyntheticCheckpoint
    from twin.abi.presets import FLASH
    return SyntheticCheckpoint(FLASH, seed=0, cache_layers=2, cache_experts=64)
