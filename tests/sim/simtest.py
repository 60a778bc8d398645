"""Shared builders for the simulator tests: FLASH shapes, small pools."""
import numpy as np


from twin.abi import deployment
from twin.sim.kvcache import KvCacheManager
from twin.sim.leases import LeaseManager
from twin.abi.batches import Request, Sampling
from twin.sim.scheduler import Scheduler, SchedulerConfig


def make_dep(**kw):
    lim = dict(max_model_len=1024, long_prefill_token_threshold=128, max_num_seqs=64,
               max_num_batched_tokens=8192, num_speculative_tokens=7)
    lim.update(kw)
    return deployment("flash", ep=16, **lim)


def make_sched(slots=4, probe=None, sched_kw=None, **kw):
    dep = make_dep(**kw)
    kv = KvCacheManager.from_deployment(dep, slots)
    cfg = SchedulerConfig.from_deployment(dep, **(sched_kw or {}))
    return Scheduler(cfg, kv, leases=LeaseManager(dep.partitions) if dep.k else None, probe=probe), dep


def req(rid, plen=100, out=10, arrival=0.0, prompt=None, eos=1, stop=(), script=None, seed=None):
    if prompt is None:
        prompt = np.random.default_rng(seed if seed is not None else hash(rid) % 2**32).integers(2, 5000, plen)
    return Request(rid, prompt, Sampling(out, eos, False, stop), arrival, script or {})


def step(s, counts=None, default=1):
    """Schedule, advance and apply one step synchronously; decode requests accept `counts[rid]`."""
    cmd = s.schedule()
    s.advance_after_schedule(cmd)
    apply(s, cmd, counts, default)
    return cmd


def apply(s, cmd, counts=None, default=1):
    counts = counts or {}
    toks = {}
    for x in cmd.scheduled:
        if x.samples:
            n = 1 if x.prefill else counts.get(x.req.request_id, default)
            base = len(x.req.outputs)
            toks[x.req.request_id] = [x.req.script.get(base + j, 100 + j) for j in range(n)]
    touched = s.update_from_output(cmd, toks)
    s.check_stop(touched)
    return touched


