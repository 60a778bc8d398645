"""Families with equal specs share one pool: the same decisions, page for page, as keeping them apart.

FLASH's `cmp_c128`, `cmp_c4` and `idx` (and `csa_state`, `csa_inner_state`) differ only in name,
so the block manager keeps one pool per set and shows it under each name.  The plain form
(`share_identical=False`, a pool per family) and the shared one are driven through the same
random workloads; their decision logs (every item, admission, preemption, lease, wave and page id
taken or freed per family and partition), pool statistics and free-queue orders must be equal.
"""
from functools import lru_cache

from hypothesis import given, settings
from hypothesis import strategies as st

from simtest import make_dep
from twin.sim.costmodel import CostModel
from twin.sim.decisions import DecisionLog
from twin.sim.executor import CostModelExecutor
from twin.sim.kvcache import KvCacheManager, family_specs
from twin.sim.leases import LeaseManager
from twin.sim.loop import run_sync
from twin.sim.scheduler import Scheduler, SchedulerConfig
from twin.sim.workload import LengthDist, WorkloadSpec, generate

DEP = make_dep(max_num_seqs=64)


@lru_cache(maxsize=None)
def cost(slots):
    return CostModel(DEP, slots)


def run(spec, slots, share, depth):
    kv = KvCacheManager(family_specs(DEP, slots), DEP.partitions, share_identical=share)
    sched = Scheduler(SchedulerConfig.from_deployment(DEP, async_depth=depth), kv,
                      leases=LeaseManager(DEP.partitions))
    log = DecisionLog(sched)
    run_sync(sched, CostModelExecutor(cost(slots), seed=spec.seed), DEP, generate(spec), depth=depth)
    kv.check()
    free = [[list(kv.free[f][p]) for p in range(DEP.partitions)] for f in range(len(kv.families))]
    return log.done(), dict(kv.stats), free, kv.twins


def test_flash_has_families_to_share():
    kv = KvCacheManager(family_specs(DEP, 2), DEP.partitions)
    names = kv.names
    shared = {names[f]: {names[g] for g in twins} for f, twins in kv.twins.items() if twins}
    assert shared == {"cmp_c128": {"cmp_c4", "idx"}, "csa_state": {"csa_inner_state"}}
    plain = KvCacheManager(family_specs(DEP, 2), DEP.partitions, share_identical=False)
    assert not any(plain.twins.values())


@given(n=st.integers(4, 40), mean=st.integers(100, 700), out=st.integers(4, 200), groups=st.integers(0, 2),
       slots=st.integers(1, 4), depth=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
@settings(max_examples=12, deadline=None)
def test_shared_pools_decide_as_separate_pools(n, mean, out, groups, slots, depth, seed):
    spec = WorkloadSpec(num_requests=n, arrival="burst", prompt=LengthDist("uniform", mean, mean // 2, 16, 900),
                        output=LengthDist("uniform", out, out // 2, 1, 400), prefix_groups=groups, prefix_len=256,
                        prefix_fraction=0.7 if groups else 0.0, eos_fraction=0.2, seed=seed)
    log_s, stats_s, free_s, _ = run(spec, slots, True, depth)
    log_p, stats_p, free_p, _ = run(spec, slots, False, depth)
    assert log_s == log_p
    assert stats_s == stats_p and free_s == free_p
    assert any(r["taken"] for r in log_s)                      # pages moved, so the logs say something
