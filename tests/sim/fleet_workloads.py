"""The workloads on which the fleet fidelity is validated against the exact one (FLASH EP16 K=7),
and the summary metrics compared (tests/sim/test_fleet.py, benchmarks/sim_speed.py)."""
from twin.abi import deployment
from twin.sim.acceptance import ForcedAcceptance
from twin.sim.run import SimConfig
from twin.sim.workload import LengthDist, WorkloadSpec, generate


def _dep(**kw):
    lim = dict(max_model_len=1024, long_prefill_token_threshold=128, max_num_seqs=64,
               max_num_batched_tokens=8192, num_speculative_tokens=7)
    lim.update(kw)
    return deployment("flash", ep=16, **lim)


def saturated():
    """The speed benchmark's shape: 256 running, a burst, preemptions keep it just under 256."""
    reqs = generate(WorkloadSpec(num_requests=300, arrival="burst", prompt=LengthDist("uniform", 192, 128, 64, 320),
                                 output=LengthDist("uniform", 320, 160, 160, 400), eos_fraction=0.2, seed=0))
    return SimConfig(_dep(max_num_seqs=256), reqs)


def poisson():
    """Moderate Poisson load, no memory pressure: EOS and stop sequences."""
    reqs = generate(WorkloadSpec(num_requests=240, arrival="poisson", rate=40,
                                 prompt=LengthDist("lognormal", 300, 0.6, 16, 700),
                                 output=LengthDist("lognormal", 200, 0.6, 8, 300), eos_fraction=0.3,
                                 stop_fraction=0.1, seed=3))
    return SimConfig(_dep(max_num_seqs=256), reqs)


def shared_prefix():
    """Two shared-prefix groups at a 2,048-token limit, 16 slots: hits, cold fallbacks, preemptions."""
    reqs = generate(WorkloadSpec(num_requests=200, arrival="poisson", rate=200,
                                 prompt=LengthDist("uniform", 700, 300, 200, 1200),
                                 output=LengthDist("uniform", 60, 50, 4, 200), prefix_groups=2, prefix_len=640,
                                 prefix_fraction=0.9, eos_fraction=0.1, seed=21))
    return SimConfig(_dep(max_model_len=2048), reqs, slots=16)


def tight():
    """Three slots per partition: constant preemption, prefix groups, stop strings, forced acceptance."""
    reqs = generate(WorkloadSpec(num_requests=160, arrival="poisson", rate=300,
                                 prompt=LengthDist("uniform", 300, 200, 16, 700),
                                 output=LengthDist("uniform", 120, 100, 4, 300), prefix_groups=3, prefix_len=384,
                                 prefix_fraction=0.5, eos_fraction=0.2, stop_fraction=0.1, seed=11))
    return SimConfig(_dep(), reqs, slots=3, acceptance=ForcedAcceptance(5))


WORKLOADS = {"saturated": saturated, "poisson": poisson, "shared_prefix": shared_prefix, "tight": tight}

LATENCY = [(k, s) for k in ("ttft", "tpot", "e2el") for s in ("mean_ms", "p50_ms", "p99_ms")]


def metrics_of(summary: dict) -> dict:
    out = {k: summary[k] for k in ("completed", "failed", "request_throughput", "output_token_throughput",
                                   "preemptions")}
    out.update({f"{k}_{s}": summary[k][s] for k, s in LATENCY})
    out["prefix_hit_rate"] = summary["prefix_cache"]["hit_rate"]
    out["prefix_token_hit_rate"] = summary["prefix_cache"]["token_hit_rate"]
    return out
