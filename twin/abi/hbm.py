"""The per-rank HBM account: what is resident on a rank when upstream's `init_kv_cache` reads
free memory, and what is allocated after it, each line with the upstream source that says so.

    kv_budget = HBM x utilization - (sum of the lines resident at KV sizing)

Lines come from the ABI (every weight, scratch and state buffer of the programs the mode compiles,
deduplicated by device buffer within a dispatch class) and from the runtime facts below.  What a
measured boot used beyond these lines is not hidden in any of them: it is the named line
`unexplained` (budget.py derives it from a measurement).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from . import constants as C
from .programs import INPUT, OUTPUT, SCRATCH, STATE, WEIGHT, bind, programs_for_k
from .ringheap import resolve_profiles
from .topology import Deployment

BEFORE, AFTER = "before_kv_sizing", "after_kv_sizing"

# npu-smi on an idle card, the driver's own reservation (source: SOURCES["driver_baseline"])
DRIVER_BASELINE_BYTES = 3 * C.GIB
# MoE dispatch/combine window geometry of pypto-lib moe.py: 8-wide FP32 aux and INT32 route tiles
MOE_AUX_PAD = 8
MOE_IDX_PAD = 8

SOURCES: dict[str, str] = {
    "driver_baseline": "pypto-serving tests/test_deepseek_dspark_accuracy.py: \"A clean card idles around "
                       "3 GiB used (driver baseline)\"; init_kv_cache counts it as used (total - free)",
    "target_weights": "pypto-serving model/deepseek_dspark/npu_runner.py _ensure_l3_shared_buffers -> "
                      "_materialize_resident_weights: the stacked layer banks, the prefill hyper-connection "
                      "banks, one full embedding table per rank, the LM-head shard and (fused K=7) the RoPE "
                      "tables are uploaded before init_kv_cache reads free memory; shapes from twin/abi/programs.py",
    "drafter_weights": "npu_runner.py _ensure_l3_shared_buffers: \"The drafter banks must be resident before "
                       "the KV-capacity snapshot\" (K=7 only)",
    "decode_scratch": "npu_runner.py _materialize_decode_scratch (\"Materialize every decode workspace before "
                      "the server becomes ready\") and, at K=7, drafter_scratch_specs, allocated \"before the "
                      "KV-capacity free-memory snapshot\"",
    "drafter_state": "npu_runner.py _ensure_l3_shared_buffers: the drafter KV pools, the persistent device "
                     "state and device_state_target_hidden are materialized before the snapshot (K=7 only)",
    "prefill_arena": "npu_runner.py _shared_l3_worker passes the prefill RunConfig to DistributedWorker "
                     "(\"Prewarm the full prefill arena before KV sizing reads free HBM\"); simpler "
                     "c_api_shared.cpp simpler_init builds that one sizing in arena bank 0 and "
                     "runtime_maker.cpp derive_arena_static_sizes makes its GM heap the sum of the four ring "
                     "heaps; pypto docs/en/dev/05-runtime-ring-sizing.md: the arena cache holds exactly one "
                     "sizing per worker, so the decode and drafter profiles are not resident at KV sizing",
    "unexplained": "what the measured boot used beyond every itemized line (twin/abi/budget.py); not found "
                   "in the upstream sources",
    "prefill_scratch": "pypto-serving model/deepseek_dspark/task_args.py _prefill_scratch_sources: "
                       "zero-initialized buffers of scope 'prefill', allocated when the first prefill dispatch "
                       "binds its arguments",
    "staged_inputs": "simpler runtime_maker.cpp stage_device_args: host tensors of a run are copied into the "
                     "runner's retained temporary device buffer, grown to the run's packed size (the prefill "
                     "dispatch at its maximum extents; one per pipeline slot in use)",
    "moe_windows": "pypto-lib models/deepseek_v4_flash_dspark/moe.py (and dspark_drafter.py at K=7): recv_x "
                   "[N_LOCAL*RECV_MAX, D] INT8, recv_aux and recv_route [N_LOCAL*RECV_MAX, 8] FP32/INT32, "
                   "routed_y [MOE_TOKENS*TOPK, D] BF16, RECV_MAX = EP*MOE_TOKENS; pypto distributed_runner.py "
                   "allocates a program's persistent CommDomain inside its first run",
    "arena_regrowth": "simpler device_runner_base.cpp setup_static_arena: a dispatch whose sizing needs a "
                      "larger region than bank 0 holds releases it and commits the larger one (the decode "
                      "or drafter profile after the prewarmed prefill one)",
}


@dataclass(frozen=True)
class Line:
    """One line of the per-rank account."""

    name: str
    nbytes: int
    when: str            # BEFORE: resident when init_kv_cache reads free memory; AFTER: allocated later
    source: str


def _scope(program_name: str) -> str:
    # upstream scopes scratch per dispatch class: a prefill buffer never aliases a decode one
    return "prefill" if program_name == "l3_prefill_fwd" else "decode"


def device_buffers(dep: Deployment, slots: int = 1) -> dict[str, dict[str, int]]:
    """Distinct device buffers of the mode's programs, by account line, in bytes per rank."""
    cats: dict[str, dict[str, int]] = {"target_weights": {}, "drafter_weights": {}, "decode_scratch": {},
                                       "prefill_scratch": {}, "drafter_state": {}}
    for prog in programs_for_k(dep.k):
        for b in bind(prog, dep, slots):
            a = b.arg
            if a.role == WEIGHT:
                cat = "drafter_weights" if a.buffer_id.startswith("draft_") else "target_weights"
            elif a.role in (SCRATCH, OUTPUT):
                cat = _scope(prog.name) + "_scratch"
            elif a.role == STATE and a.pool in ("drafter", "device_state"):
                cat = "drafter_state"
            else:
                continue     # KV pools are sized by admission; host slots are staged per run
            cats[cat][a.buffer_id] = max(cats[cat].get(a.buffer_id, 0), b.nbytes_per_rank)
    return cats


def _profile_bytes(name: str, env: Mapping[str, str] | None, ring_heap: str | None) -> int:
    return resolve_profiles(env, ring_heap)[name].total


def prefill_arena(env: Mapping[str, str] | None = None, ring_heap: str | None = None) -> int:
    """GM heap of the arena prewarmed before KV sizing: the prefill profile, summed over depths."""
    return _profile_bytes("prefill", env, ring_heap)


def arena_regrowth(dep: Deployment, env: Mapping[str, str] | None = None, ring_heap: str | None = None) -> int:
    """Bank 0 grows to the largest GM heap any compiled program's profile asks for."""
    largest = max(_profile_bytes(p.ring_heap, env, ring_heap) for p in programs_for_k(dep.k))
    return max(0, largest - prefill_arena(env, ring_heap))


def moe_windows(dep: Deployment) -> int:
    """MoE dispatch/combine receive windows per rank of the decode-side programs: the target's, and at
    K=7 the drafter's in the fused decode and again in the bootstrap draft step (a CommDomain is per
    program).  The prefill program's and the attention / LM-head windows are not itemized."""
    m, ep = dep.model, dep.topology.ep
    n_local, recv_max = dep.topology.experts_per_rank(m), ep * C.MOE_TOKENS
    lanes = n_local * recv_max
    one = lanes * (m.hidden_size + 4 * MOE_AUX_PAD + 4 * MOE_IDX_PAD) \
        + C.MOE_TOKENS * m.num_experts_per_tok * m.hidden_size * 2 \
        + 4 * (ep * n_local + 3 * ep)                               # meta and arrival signals
    return one * (3 if dep.k else 1)


def staged_inputs(dep: Deployment) -> int:
    """The largest run's host-staged inputs at their maximum extents, per rank."""
    return max(sum(b.nbytes_per_rank for b in bind(p, dep, 1) if b.arg.role == INPUT) for p in programs_for_k(dep.k))


def itemized_lines(dep: Deployment, env: Mapping[str, str] | None = None,
                   ring_heap: str | None = None) -> list[Line]:
    """Every line found in the sources, resident at KV sizing or allocated after it."""
    bufs = device_buffers(dep)
    before = {"driver_baseline": DRIVER_BASELINE_BYTES,
              **{k: sum(bufs[k].values()) for k in ("target_weights", "drafter_weights", "decode_scratch",
                                                     "drafter_state")},
              "prefill_arena": prefill_arena(env, ring_heap)}
    after = {"prefill_scratch": sum(bufs["prefill_scratch"].values()), "staged_inputs": staged_inputs(dep),
             "moe_windows": moe_windows(dep), "arena_regrowth": arena_regrowth(dep, env, ring_heap)}
    return [Line(k, v, BEFORE, SOURCES[k]) for k, v in before.items()] + \
           [Line(k, v, AFTER, SOURCES[k]) for k, v in after.items()]


def used_before_kv(lines: list[Line]) -> int:
    return sum(ln.nbytes for ln in lines if ln.when == BEFORE)
