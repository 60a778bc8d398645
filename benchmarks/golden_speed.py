"""Golden speed, measured as ratios side by side in one run; prints JSON.

1. small-preset decode step (SMALL, 16 distinct requests x 8 rows against a resident prefix of 160
   tokens; --requests 64 gives the 512-row decode tile):
   - the NumPy step against the same GEMMs alone (every GEMM the step ran, recorded with
     `MatmulRecorder`): run again on the step's own operands (`MatmulRecorder.replay`: what is
     left is golden's own overhead; the figure the target holds), and, as a bound without weight
     traffic, on ready cache-resident operands, one per shape; interleaved, wall and CPU time
     (CPU: the steadier on a loaded machine);
   - the JAX path (the whole step in one jit; device mode accumulates in FP32, the device
     contract's accumulator, with BF16 GEMM operands where both are BF16 values; per-request
     candidate gathers, expert-block MoE, sort-free top-k, compressor pooling only in a call
     with a real boundary, one GEMM for the projections of the normed activations) against the NumPy
     step, with its first calls (trace + compile + run) reported apart, twice: NumPy pools in
     (compose.forward's signature: the pools are copied into JAX first) and resident pools (a
     decode loop carries the returned pools, donated, so the writes happen in place); wall and
     CPU time, interleaved; agreement with NumPy per logit row (kernel-math §2 tolerances), as
     it is and with NumPy's routing and indexer rows re-synced at near ties (golden.jax_resync;
     --prefix past 259 makes SMALL's indexer rank its candidates), and jax_admissible's answer.
2. one FLASH-shaped layer at the 512-row decode tile (64 requests x 8 rows at position ~4096;
   --flash-requests 16: one rank's 128 rows; 64,16: both tiles, interleaved in one loop; resident
   pools filled with random rows, the experts generated once): the NumPy layer step against its
   GEMMs alone on its own operands (`MatmulRecorder.replay`: the same calls on the same arrays, so
   every routed expert's INT8 weight is read from memory and widened as in the step; the figure the
   target holds), and, as bounds, against its GEMMs on one cache-resident operand per shape (in the
   layout golden runs them: a routed expert's INT8 GEMM one cache-resident f32 weight block at a
   time), the INT8 weights' widening to f32 alone, and the two together; the least of the repeats
   (CPU and wall) and the medians.  --jax-flash: the same layer on the JAX path
   (JaxGolden.layer_step, this layer's weights only, pools resident, routing and indexer rows
   re-synced from NumPy's taps) in the same loop, over the NumPy layer and over its GEMMs, and its
   output's worst rows against NumPy's, as it is and re-synced.

Targets (`target_figure` names the field each holds): the small step <= 2x its GEMMs on its own
operands, the FLASH layer (a checker's unit of work) <= 1.5x the same;
JAX >= 5x faster than NumPy on the small decode step.  The JSON names the device JAX ran on
(golden.jax_path.accelerator: a GPU where `jax[cuda]` has one, else the CPU).
Threads: NumPy's BLAS and XLA both get one thread by default (--blas-threads, --xla-threads; XLA's
setting is fixed when JAX starts, so it applies to the whole process).  Heap: freed temporaries are
kept for reuse (golden.heap.retain_heap; --default-heap for glibc's own thresholds).

    python benchmarks/golden_speed.py [--skip-flash | --skip-small] [--reps 3] [--modes device,exact]
        [--requests 16] [--prefix 160] [--flash-requests 64,16] [--jax-flash]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from golden.blas import blas_threads
from golden.checkpoint import SyntheticCheckpoint
from golden.compose import Session, Taps, device_meta, forward, layer_step, rope_inputs
from golden.heap import retain_heap
from golden.jax_resync import RESYNC_STAGES, agreement, jax_admissible
from golden.kernels.sparse_attention import TILE
from golden.numerics import EXACT_F32_K, WIDEN_BLOCK_BYTES, MatmulRecorder, Numerics
from golden.paged import DECODE, Span, alloc_caches, assign_blocks, lower
from twin.abi import constants as C
from twin.abi.presets import FLASH, SMALL


def _blocked(kind, sa) -> bool:
    """golden.numerics._int_mm_np's block path: a transposed INT8 weight against at most 64 rows."""
    return kind == "iT" and len(sa) == 2 and sa[0] <= 64


def _replayer(records):
    """A function that runs the recorded GEMMs alone (operands made here, once), in the layout
    golden.numerics runs them: an INT8 GEMM whose weight came transposed (kind "iT") against at
    most 64 rows (a routed expert's) as one output-channel block of widened weight at a time
    multiplied from the left, C^T = W A^T, with the block already in f32 and in cache (its
    widening is timed on its own, `_widener`); other INT8 GEMMs against whole f32 weights; each
    INT8 GEMM in K slices of EXACT_F32_K."""
    rng = np.random.default_rng(0)
    made = {}                 # operands by (kind, shape): one 2048 x 4096 weight serves all experts

    def operand(kind, shape):
        if (kind, shape) not in made:
            x = rng.standard_normal(shape)
            made[(kind, shape)] = x if kind == "f" else x.astype(np.float32)
        return made[(kind, shape)]

    def op(kind, sa, sb):
        if _blocked(kind, sa):
            K, N = sb
            rows = max(16, WIDEN_BLOCK_BYTES // (4 * max(K, 1)))
            return "blocks", operand("i", sa), operand("i", (min(rows, N), K)), N
        return kind[0], operand(kind[0], sa), operand(kind[0], sb), None

    ops = [op(*r) for r in records]

    def run():
        for kind, a, b, N in ops:
            if kind == "f":
                a @ b
            elif kind == "blocks":
                rows = b.shape[0]
                for o0 in range(0, N, rows):
                    blk = b[:min(rows, N - o0)]
                    for k0 in range(0, a.shape[-1], EXACT_F32_K):
                        blk[:, k0:k0 + EXACT_F32_K] @ a[:, k0:k0 + EXACT_F32_K].T
            else:
                for k0 in range(0, a.shape[-1], EXACT_F32_K):
                    a[..., k0:k0 + EXACT_F32_K] @ b[..., k0:k0 + EXACT_F32_K, :]
    return run


def _interleaved(runs: dict, reps: int):
    """Each of `runs` once per round, `reps` rounds (load from other processes falls on all of them
    alike): median wall and CPU seconds by name."""
    wall, cpu = {k: [] for k in runs}, {k: [] for k in runs}
    for _ in range(reps):
        for k, fn in runs.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            wall[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    return ({k: float(np.median(v)) for k, v in wall.items()}, {k: float(np.median(v)) for k, v in cpu.items()})


def _step_vs_gemms(step, records, reps):
    """The NumPy step and its GEMMs alone, interleaved (load from other processes falls on both
    alike): medians of wall and CPU time, and the step's ratio to its GEMMs in each; the GEMMs on
    ready cache-resident operands, and again on the step's own operands (`MatmulRecorder.replay`)."""
    runs = {"step": step, "gemms": _replayer(records), "own": records.replay}
    w, c = _interleaved(runs, reps)
    return {"numpy_step_s": w["step"], "gemms_alone_s": w["gemms"], "step_over_gemms": w["step"] / w["gemms"],
            "numpy_step_cpu_s": c["step"], "gemms_alone_cpu_s": c["gemms"],
            "step_over_gemms_cpu": c["step"] / c["gemms"],
            "gemms_on_own_operands_s": w["own"], "step_over_gemms_on_own_operands": w["step"] / w["own"],
            "gemms_on_own_operands_cpu_s": c["own"], "step_over_gemms_on_own_operands_cpu": c["step"] / c["own"]}


def _widener(records):
    """A function that widens the recorded INT8 GEMMs' weights int8 -> f32 alone, as Numerics.int_mm
    does before its f32 GEMMs: against at most 64 rows (a routed expert's) a block of output
    channels at a time into one reused buffer (golden.numerics.WIDEN_BLOCK_BYTES), else whole; the
    weights made here, once, as [out, in]."""
    rng = np.random.default_rng(0)
    made = {sb: rng.integers(-127, 128, sb[::-1], dtype=np.int8) for kind, _, sb in records if kind in ("i", "iT")}
    ops = [(made[sb], _blocked(kind, sa)) for kind, sa, sb in records if kind in ("i", "iT")]
    bufs = {}

    def run():
        for w, blocks in ops:
            if not blocks:
                w.astype(np.float32)    # dropped at once: all of them together would not fit
                continue
            rows = max(16, WIDEN_BLOCK_BYTES // (4 * w.shape[1]))
            buf = bufs.setdefault(w.shape[1], np.empty((rows, w.shape[1]), np.float32))
            for o0 in range(0, w.shape[0], rows):
                np.copyto(buf[:min(rows, w.shape[0] - o0)], w[o0:o0 + rows])
    return run


def small_decode(reps: int, jax_too: bool = True, mode: str = "device", requests: int = C.LOCAL_REQUESTS,
                 prefix: int = 160) -> dict:
    cfg, B, S = SMALL, requests, C.DECODE_SEQ
    ck = SyntheticCheckpoint(cfg, seed=0)
    s = Session(ck, cfg, mode, B, prefix + S)
    # distinct requests: identical ones route alike (every expert's count a multiple of the request
    # count: no padded expert blocks on JAX, a third of the experts idle at 16 requests)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (B, prefix + S))
    s.run({r: ids[r, :prefix] for r in range(B)})
    meta = lower(cfg, [Span(r, prefix, tuple(ids[r, prefix:]), s.blocks[r]) for r in range(B)], form=DECODE)
    step = lambda: forward(ck, meta, s.caches, cfg=cfg, nm=s.nm)
    step()
    with MatmulRecorder(operands=True) as rec:
        step()
    ref = forward(ck, meta, s.caches, cfg=cfg, nm=s.nm, taps=Taps(RESYNC_STAGES))
    side = _step_vs_gemms(step, rec, reps)
    t_mm = side["gemms_alone_s"]
    out = {"preset": cfg.name, "mode": mode, "requests": B, "rows_per_request": S, "resident_prefix": prefix,
           "gemm_calls": len(rec), **side, "target_step_over_gemms": 2.0,
           "target_figure": "step_over_gemms_on_own_operands_cpu"}
    if not jax_too:
        return out
    from golden.jax_path import JaxGolden, device_note
    jg = JaxGolden(ck, cfg, mode)
    t0 = time.perf_counter()
    first = jg.forward(meta, s.caches)
    compile_s = time.perf_counter() - t0                 # trace + XLA compile + one run
    t0 = time.perf_counter()
    resident = jg.forward(meta, s.caches, donate=True).caches      # the donating variant compiles too
    compile_donating_s = time.perf_counter() - t0

    def jax_resident():
        nonlocal resident     # a decode loop: the previous step's pools in, donated, updated in place
        resident = jg.forward(meta, resident, donate=True).caches
    # interleaved, so that load from other processes falls on both sides alike; wall and CPU time
    # (one thread each: CPU time is what the process itself spent, less sensitive to the load)
    runs = {"numpy": step, "jax": lambda: jg.forward(meta, s.caches), "jax_resident": jax_resident}
    w, c = _interleaved(runs, reps)
    synced = jg.forward(meta, s.caches, resync_from=ref.taps)
    L = prefix + S
    out.update({"numpy_step_beside_jax_s": w["numpy"],   # the step/GEMMs fields stay those of their own loop
                "jax_accumulator": "float64" if mode == "exact" else "float32",
                "jax_device": device_note(jg.device),
                "jax_first_call_s": compile_s, "jax_first_call_donating_s": compile_donating_s,
                "jax_step_s": w["jax"], "jax_step_resident_pools_s": w["jax_resident"],
                "jax_speedup": w["numpy"] / w["jax"], "jax_speedup_resident_pools": w["numpy"] / w["jax_resident"],
                "cpu_s": c, "jax_speedup_resident_pools_cpu": c["numpy"] / c["jax_resident"],
                # XLA's runtime runs independent ops of the step on a second thread whatever the
                # thread flags say: > 1 where that thread found work (and a free core)
                "jax_cpu_over_wall": c["jax_resident"] / w["jax_resident"],
                "jax_over_numpy_gemms_alone": w["jax_resident"] / t_mm,
                # kernel-math §2 per logit row against NumPy, as it is and with NumPy's routing
                # adopted at near ties (golden.jax_resync: the bound, the counts)
                "jax_agreement": agreement(first, ref), "jax_agreement_resynced": agreement(synced, ref, jg.resyncs),
                # past 4 * min(index_topk, TILE) + 3 tokens the indexer ranks (its top-k re-synced too)
                "indexer_ranks": L // 4 > min(cfg.index_topk, TILE), "jax_admissible": jax_admissible(cfg, "l3_decode_fwd", mode, max_len=L),
                "target_jax_speedup": 5.0})
    return out


def _flash_tile(cfg, ck, layer: int, requests: int, nm, rng):
    """One FLASH layer's step at `requests` x 8 decode rows at position ~4096 (resident pools filled
    with random rows) and the GEMMs it runs (recorded)."""
    B, S, pos0 = requests, C.DECODE_SEQ, 4088
    blocks, pages = assign_blocks(cfg, B, pos0 + S, chunk=S)
    pools = alloc_caches(cfg, pages, nm, layers=[layer])[0]
    for name, p in pools.items():            # a resident history: random rows in every page
        if p.dtype == np.int8:
            p[:] = rng.integers(-127, 128, p.shape, dtype=np.int8)
        elif name == "idx_kv_scale":
            p[:] = rng.uniform(0.005, 0.02, p.shape)
        else:
            p[:] = rng.standard_normal(p.shape).astype(np.float32).astype(p.dtype)
    spans = [Span(r, pos0, tuple(rng.integers(0, cfg.vocab_size, S)), blocks[r]) for r in range(B)]
    meta = lower(cfg, spans, form=DECODE)
    x_hc = rng.standard_normal((B * S, cfg.hc_mult, cfg.hidden_size))
    m = device_meta(meta, nm)
    rope = rope_inputs(cfg, meta.position_ids, nm)
    step = lambda taps=None: layer_step(x_hc, layer, ck, pools, m, rope, cfg=cfg, nm=nm, form=DECODE, taps=taps)
    taps = Taps(RESYNC_STAGES)
    step(taps)
    with MatmulRecorder(operands=True) as rec:
        step()
    # "_" entries: what the JAX run of the same layer reads (taken out before the report)
    return step, rec, {"rows": B * S, "requests": B, "position": pos0, "_x_hc": x_hc, "_meta": meta, "_pools": pools,
                       "_taps": taps}


def _jax_flash(ck, cfg, layer, tiles):
    """The same FLASH layer on the JAX path (JaxGolden.layer_step, this layer's weights only), per
    tile: (a run re-synced from NumPy's taps on resident JAX pools, its first calls' seconds, its
    output as it is and re-synced, the re-syncs' counts)."""
    from golden.jax_path import JaxGolden, device_note
    jg = JaxGolden(ck, cfg, "device", layers=[layer])
    runs = []
    for step, _, info in tiles:
        x_hc, meta, pools, taps = (info.pop(k) for k in ("_x_hc", "_meta", "_pools", "_taps"))
        resident = jg.resident(pools)        # copied in once, as a checker holds a layer's state
        t0 = time.perf_counter()
        plain = np.asarray(jg.layer_step(x_hc, layer, meta, resident)[0])
        t1 = time.perf_counter()
        synced = np.asarray(jg.layer_step(x_hc, layer, meta, resident, resync_from=taps)[0])
        t2 = time.perf_counter()
        runs.append({"run": lambda x=x_hc, m=meta, p=resident, t=taps: jg.layer_step(x, layer, m, p, resync_from=t),
                     "first_call_s": t1 - t0, "first_call_resync_s": t2 - t1, "plain": plain, "synced": synced,
                     "resyncs": jg.resyncs.counts()})
    return runs, device_note(jg.device)


def _rows_against(got, want) -> dict:
    """Per token row of a layer's output [T, hc, D]: worst cosine and relative L2 against NumPy's."""
    a, b = (np.asarray(v, np.float64).reshape(len(v), -1) for v in (got, want))
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    rl2 = np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)
    return {"rows": len(a), "min_row_cosine": float(cos.min()), "max_row_rel_l2": float(rl2.max()),
            "median_row_rel_l2": float(np.median(rl2))}


def flash_layer(reps: int, layer: int = 4, requests=(C.DECODE_BATCH,), jax_too: bool = False) -> list:
    """One FLASH layer at each of `requests` (x 8 rows): its step, its GEMMs alone and its INT8
    weights' widening alone (and with jax_too the same layer on the JAX path, resident pools), all
    tiles' runs interleaved in one loop; least and median of `reps`."""
    cfg, nm = FLASH, Numerics("device")
    ck = SyntheticCheckpoint(cfg, seed=0)
    rng = np.random.default_rng(2)
    t0 = time.perf_counter()
    ck.layer(layer)
    for e in range(cfg.n_routed_experts):
        ck.expert(layer, e)
    gen_s = time.perf_counter() - t0
    tiles = [_flash_tile(cfg, ck, layer, b, nm, rng) for b in requests]
    names = ("step", "gemms", "widen", "own", "jax") if jax_too else ("step", "gemms", "widen", "own")
    jax_runs, jax_device = _jax_flash(ck, cfg, layer, tiles) if jax_too else ([], None)
    for _, _, info in tiles:
        for k in ("_x_hc", "_meta", "_pools", "_taps"):
            info.pop(k, None)
    runs = {}
    for i, (step, rec, _) in enumerate(tiles):
        runs.update({(i, "step"): step, (i, "gemms"): _replayer(rec), (i, "widen"): _widener(rec),
                     (i, "own"): rec.replay})
        if jax_too:
            runs[(i, "jax")] = jax_runs[i]["run"]
    # interleaved: load from other processes falls on every run alike
    out = []
    times = {k: ([], []) for k in runs}
    for _ in range(reps):
        for k, fn in runs.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            times[k][0].append(time.perf_counter() - t)
            times[k][1].append(time.process_time() - c)
    for i, (_, rec, info) in enumerate(tiles):
        best = {n: (min(times[(i, n)][0]), min(times[(i, n)][1])) for n in names}
        med = {n: (float(np.median(times[(i, n)][0])), float(np.median(times[(i, n)][1]))) for n in names}
        out.append({"preset": cfg.name, "layer": layer, "kind": cfg.layer_kind(layer), **info, "repeats": reps,
                    # least of the repeats (the run least disturbed by other processes), CPU time
                    # the steadier on a loaded machine; medians beside them
                    "numpy_layer_cpu_s": best["step"][1], "gemms_alone_cpu_s": best["gemms"][1],
                    "step_over_gemms_cpu": best["step"][1] / best["gemms"][1],
                    "numpy_layer_s": best["step"][0], "gemms_alone_s": best["gemms"][0],
                    "step_over_gemms": best["step"][0] / best["gemms"][0],
                    "step_over_gemms_cpu_median": med["step"][1] / med["gemms"][1],
                    "step_over_gemms_median": med["step"][0] / med["gemms"][0],
                    # where the rest goes: INT8 weights widened to f32 for the exact f32 GEMMs (the
                    # device's int8 GEMM reads them as they are), then everything else
                    "int8_weight_widening_alone_cpu_s": best["widen"][1],
                    # NumPy has no INT8 GEMM: the widening is part of what one costs it, so the
                    # layer is held to its GEMMs and their widening together too
                    "gemms_and_widening_cpu_s": best["gemms"][1] + best["widen"][1],
                    "step_over_gemms_and_widening_cpu": best["step"][1] / (best["gemms"][1] + best["widen"][1]),
                    "other_cpu_s": best["step"][1] - best["gemms"][1] - best["widen"][1],
                    # the same GEMM calls again on the step's own operands (the recorded arrays, by
                    # golden.numerics' code): every routed expert's INT8 weight read from memory and
                    # widened, as the step must (at FLASH ~6.4 GB of them per layer, which no cache
                    # holds, where the replays above reuse one cache-resident block per shape)
                    "gemms_on_own_operands_s": best["own"][0], "gemms_on_own_operands_cpu_s": best["own"][1],
                    "step_over_gemms_on_own_operands": best["step"][0] / best["own"][0],
                    "step_over_gemms_on_own_operands_cpu": best["step"][1] / best["own"][1],
                    "step_over_gemms_on_own_operands_cpu_median": med["step"][1] / med["own"][1],
                    "gemm_calls": len(rec), "weights_generation_s": gen_s, "target_step_over_gemms": 1.5,
                    "target_figure": "step_over_gemms_on_own_operands_cpu"})
        if jax_too:
            j = jax_runs[i]
            # the layer's output against NumPy's on the same input and pools, as it is (a routing
            # or indexer near tie shows as a worse row) and with both re-synced (what is timed)
            want = np.asarray(tiles[i][0]()[0])
            out[-1].update({"jax_device": jax_device, "jax_first_call_s": j["first_call_s"],
                            "jax_first_call_resync_s": j["first_call_resync_s"],
                            "jax_layer_s": best["jax"][0], "jax_layer_cpu_s": best["jax"][1],
                            "jax_layer_s_median": med["jax"][0],
                            "jax_over_numpy_layer": best["jax"][0] / best["step"][0],
                            "jax_over_numpy_layer_cpu": best["jax"][1] / best["step"][1],
                            "jax_over_numpy_gemms_alone": best["jax"][0] / best["gemms"][0],
                            "jax_over_numpy_gemms_alone_cpu": best["jax"][1] / best["gemms"][1],
                            "jax_over_gemms_on_own_operands": best["jax"][0] / best["own"][0],
                            "jax_over_gemms_on_own_operands_cpu": best["jax"][1] / best["own"][1],
                            "jax_cpu_over_wall": best["jax"][1] / best["jax"][0],
                            "jax_layer_output_vs_numpy": _rows_against(j["plain"], want),
                            "jax_layer_output_vs_numpy_resynced": _rows_against(j["synced"], want),
                            "jax_resyncs": j["resyncs"]})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=C.LOCAL_REQUESTS,
                    help=f"requests of the small decode step, {C.DECODE_SEQ} rows each (default: one owner rank's "
                         f"{C.LOCAL_REQUESTS}; {C.DECODE_BATCH}: the {C.DECODE_TOKENS}-row decode tile)")
    ap.add_argument("--skip-flash", action="store_true")
    ap.add_argument("--skip-small", action="store_true", help="skip the small-preset decode step (part 1)")
    ap.add_argument("--flash-requests", default=str(C.DECODE_BATCH),
                    help=f"requests of the FLASH layer, {C.DECODE_SEQ} rows each, comma separated: each a tile, all "
                         f"measured interleaved (default {C.DECODE_BATCH}: the {C.DECODE_TOKENS}-row group tile; "
                         f"{C.LOCAL_REQUESTS}: one rank's rows)")
    ap.add_argument("--prefix", type=int, default=160,
                    help="resident tokens per request of the small decode step (past 259 its indexer ranks "
                         "candidates: the top-k re-sync is exercised)")
    ap.add_argument("--skip-jax", action="store_true")
    ap.add_argument("--jax-flash", action="store_true",
                    help="also run the FLASH layer on the JAX path (its weights only: ~7 GB more memory)")
    ap.add_argument("--blas-threads", type=int, default=1)
    ap.add_argument("--xla-threads", type=int, default=1, help="1: one XLA CPU thread; 0: XLA's default")
    ap.add_argument("--modes", default="device", help="numerics modes of the small decode step, comma separated")
    ap.add_argument("--default-heap", action="store_true",
                    help="leave glibc's heap thresholds as they are (default: golden.heap.retain_heap)")
    a = ap.parse_args(argv)
    try:
        flash = [int(v) for v in a.flash_requests.split(",")]
    except ValueError:
        ap.error(f"--flash-requests: {a.flash_requests!r}; comma-separated integers")
    for name, v in (("--requests", a.requests), ("--prefix", a.prefix), *(("--flash-requests", f) for f in flash)):
        if v < 1:
            ap.error(f"{name}: {v}; at least 1")
    old = blas_threads(a.blas_threads)
    heap = "default" if a.default_heap else (retain_heap() or "default (not glibc)")
    if a.xla_threads == 1:     # read when the JAX backend starts (no JAX computation has run yet)
        from hw.threads import limit_xla_threads

        limit_xla_threads()
    elif a.xla_threads != 0:
        ap.error("--xla-threads: 0 (XLA default) or 1")
    res = {"benchmark": "golden_speed", "machine": platform.processor() or platform.machine(),
           "cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0],
           "blas_threads": a.blas_threads if old is not None else "unchanged",
           "xla_threads": "default" if a.xla_threads == 0 else 1, "heap": heap}
    for mode in ([] if a.skip_small else a.modes.split(",")):
        name = "small_decode" if mode == "device" else f"small_decode_{mode}"
        res[name] = small_decode(a.reps, not a.skip_jax, mode, a.requests, a.prefix)
    if not a.skip_flash:
        res["flash_layer"] = flash_layer(a.reps, requests=flash, jax_too=a.jax_flash and not a.skip_jax)
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
