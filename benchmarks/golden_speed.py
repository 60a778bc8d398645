"""Golden speed, measured as ratios side by side in one run; prints JSON.

1. small-preset decode step (SMALL, 16 requests x 8 rows against a resident prefix):
   - the NumPy step against the same GEMMs alone (every GEMM the step ran, recorded with
     `MatmulRecorder` and replayed on ready operands: what is left is golden's own overhead);
   - the JAX path (jit per layer kind, per-request candidate gathers, expert-block MoE; compile
     excluded and reported) against the NumPy step, twice: NumPy pools in (compose.forward's
     signature: the pools are copied into JAX first) and pools already JAX arrays (a decode loop
     carries the returned pools; the device keeps its pools resident too).
2. one FLASH-shaped layer at the 512-row decode tile (64 requests x 8 rows at position ~4096,
   resident pools filled with random rows, all 256 experts generated lazily): the NumPy layer step
   against its GEMMs alone.

Targets (issue 4): step <= 2x its GEMMs; JAX >= 5x faster than NumPy on the small decode step.
Threads: NumPy's BLAS and XLA both get one thread by default (--blas-threads, --xla-threads; XLA's
setting is fixed when JAX starts, so it applies to the whole process).

    python benchmarks/golden_speed.py [--skip-flash] [--reps 3] [--modes device,exact]
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
from golden.compose import Session, forward, layer_step, rope_inputs, device_meta
from golden.numerics import EXACT_F32_K, MatmulRecorder, Numerics
from golden.paged import DECODE, Span, alloc_caches, assign_blocks, lower
from twin.abi.presets import FLASH, SMALL


def _median_time(fn, reps):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def _replay(records, reps):
    """Time the recorded GEMMs alone on operands made once (int GEMMs as the f32 K-slices the
    golden runs, float GEMMs in float64)."""
    rng = np.random.default_rng(0)
    made = {}                 # operands by (kind, shape): one 2048 x 4096 weight serves all experts

    def operand(kind, shape):
        if (kind, shape) not in made:
            x = rng.standard_normal(shape)
            made[(kind, shape)] = x if kind == "f" else x.astype(np.float32)
        return made[(kind, shape)]

    ops = [(kind, operand(kind, sa), operand(kind, sb)) for kind, sa, sb in records]

    def run():
        for kind, a, b in ops:
            if kind == "f":
                a @ b
            else:
                for k0 in range(0, a.shape[-1], EXACT_F32_K):
                    a[..., k0:k0 + EXACT_F32_K] @ b[k0:k0 + EXACT_F32_K]
    return _median_time(run, reps)


def small_decode(reps: int, jax_too: bool = True, mode: str = "device") -> dict:
    cfg, B, S, prefix = SMALL, 16, 8, 160
    ck = SyntheticCheckpoint(cfg, seed=0)
    s = Session(ck, cfg, mode, B, prefix + S)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, prefix + S)
    s.run({r: ids[:prefix] for r in range(B)})
    meta = lower(cfg, [Span(r, prefix, tuple(ids[prefix:]), s.blocks[r]) for r in range(B)], form=DECODE)
    step = lambda: forward(ck, meta, s.caches, cfg=cfg, nm=s.nm)
    step()
    with MatmulRecorder() as rec:
        ref = step()
    t_mm = _replay(rec, reps)
    out = {"preset": cfg.name, "mode": mode, "requests": B, "rows_per_request": S, "resident_prefix": prefix,
           "gemms_alone_s": t_mm, "gemm_calls": len(rec), "target_step_over_gemms": 2.0}
    if not jax_too:
        t_step = _median_time(step, reps)
        out.update({"numpy_step_s": t_step, "step_over_gemms": t_step / t_mm})
        return out
    import jax
    from golden.jax_path import JaxGolden
    jg = JaxGolden(ck, cfg, mode)
    t0 = time.perf_counter()
    first = jg.forward(meta, s.caches)
    compile_s = time.perf_counter() - t0
    with jax.enable_x64(True):
        resident = [{k: jax.numpy.asarray(v) for k, v in c.items()} for c in s.caches]
    jg.forward(meta, resident)
    # interleaved, so that load from other processes falls on both sides alike
    t_np, t_jax, t_res = [], [], []
    for _ in range(reps):
        t_np.append(_median_time(step, 1))
        t_jax.append(_median_time(lambda: jg.forward(meta, s.caches), 1))
        t_res.append(_median_time(lambda: jg.forward(meta, resident), 1))
    t_step, t_jax, t_res = (float(np.median(t)) for t in (t_np, t_jax, t_res))
    L = np.asarray(first.logits)
    out.update({"numpy_step_s": t_step, "step_over_gemms": t_step / t_mm,
                "jax_step_s": t_jax, "jax_step_resident_pools_s": t_res, "jax_first_call_s": compile_s,
                "jax_speedup": t_step / t_jax, "jax_speedup_resident_pools": t_step / t_res,
                "jax_over_numpy_gemms_alone": t_res / t_mm,
                "jax_rel_err": float(np.abs(L - ref.logits).max() / np.abs(ref.logits).max()),
                "jax_same_greedy": bool(np.array_equal(np.asarray(first.sampled), ref.sampled)),
                "target_jax_speedup": 5.0})
    return out


def flash_layer(reps: int, layer: int = 4) -> dict:
    cfg, B, S, pos0 = FLASH, 64, 8, 4088
    nm = Numerics("device")
    ck = SyntheticCheckpoint(cfg, seed=0)
    rng = np.random.default_rng(2)
    t0 = time.perf_counter()
    ck.layer(layer)
    for e in range(cfg.n_routed_experts):
        ck.expert(layer, e)
    gen_s = time.perf_counter() - t0
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
    caches = {i: None for i in range(cfg.num_hidden_layers)}
    caches[layer] = pools
    step = lambda: layer_step(x_hc, layer, ck, pools, m, rope, cfg=cfg, nm=nm, form=DECODE)
    step()
    with MatmulRecorder() as rec:
        step()
    t_step = _median_time(step, reps)
    t_mm = _replay(rec, reps)
    return {"preset": cfg.name, "layer": layer, "kind": cfg.layer_kind(layer), "rows": B * S,
            "position": pos0, "numpy_layer_s": t_step, "gemms_alone_s": t_mm, "step_over_gemms": t_step / t_mm,
            "gemm_calls": len(rec), "weights_generation_s": gen_s, "target_step_over_gemms": 2.0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-flash", action="store_true")
    ap.add_argument("--skip-jax", action="store_true")
    ap.add_argument("--blas-threads", type=int, default=1)
    ap.add_argument("--xla-threads", type=int, default=1, help="1: one XLA CPU thread; 0: XLA's default")
    ap.add_argument("--modes", default="device", help="numerics modes of the small decode step, comma separated")
    a = ap.parse_args(argv)
    old = blas_threads(a.blas_threads)
    if a.xla_threads == 1:     # read when the JAX backend starts (no JAX computation has run yet)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
    elif a.xla_threads != 0:
        ap.error("--xla-threads: 0 (XLA default) or 1")
    res = {"benchmark": "golden_speed", "machine": platform.processor() or platform.machine(),
           "cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0],
           "blas_threads": a.blas_threads if old is not None else "unchanged",
           "xla_threads": "default" if a.xla_threads == 0 else 1}
    for mode in a.modes.split(","):
        res["small_decode" if mode == "device" else f"small_decode_{mode}"] = small_decode(a.reps, not a.skip_jax, mode)
    if not a.skip_flash:
        res["flash_layer"] = flash_layer(a.reps)
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
