"""Record pypto-lib's kernel golden functions at small fixture shapes, as test data.

    python tests/golden/kernel_data/record.py PYPTO_LIB [--rev HEAD] [--only KERNEL ...]

PYPTO_LIB is a pypto-lib checkout or bare git directory (github.com/hw-native-sys/pypto-lib).
The golden functions of models/deepseek_v4_flash_dspark/*.py are plain torch: this script reads
their source from pypto-lib, runs them on CPU at small shapes (the `pypto` runtime is not needed)
and writes the inputs and the outputs they produced to `<kernel>.npz` next to this file, with the
pypto-lib revision and file hash.  CI cannot fetch pypto-lib; tests/golden/test_kernel_data.py
holds golden's device mode to these files.

Two kinds of fixture:
* `FIXTURES` (every other kernel, and the MoE layer, collective and drafter programs): pypto-lib's
  own `build_tensor_specs` and golden function, the module executed statement by statement with
  its config's FLASH replaced by `SMALL` (TINY's shapes, per-kernel changes where a weight
  generator needs them), stand-ins for the PyPTO runtime imports (only kernel definitions use
  them) and its module-level tiling checks (asserts, `if ...: raise`) dropped (they constrain the
  kernels' tiles, not the math); torch seeded with 0, the decode form (16 requests x 8 rows)
  unless the entry says otherwise.
* `KERNELS` (the three decode compressors), whose `golden_compressor` alone is run on this
  script's fixture: 4 requests x 8 decode rows (S = 1 + 7 drafts) at first positions that cross two
ratio-4 boundaries in one call, start at position 0, miss a state page, or wrap a short state
ring (the call's writes alias rows of its own window); ratio 128 at positions crossing 127,
255 and 1023, one request without a boundary and one whose state page is unmapped.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import math
import os
import subprocess
import sys

import ml_dtypes
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
MODELS = "models/deepseek_v4_flash_dspark"

# fixture shapes (FLASH: D 4096, HEAD_DIM 512, rope 64, index_head_dim 128)
B, S, D, HEAD_DIM, ROPE, IDX_HEAD_DIM = 4, 8, 64, 32, 16, 32
BLOCK_SIZE = 32              # compressed rows per cmp_kv / idx_kv page (pypto-lib's BLOCK_SIZE)
EPS = 1e-6
KERNELS = {
    # kernel -> (file, ratio, state page size, first positions, head dim)
    "decode_compressor_ratio4": ("decode_compressor_ratio4.py", 4, 2, (0, 5, 12, 21), HEAD_DIM),
    "decode_indexer_compressor": ("decode_indexer_compressor.py", 4, 2, (0, 5, 12, 21), IDX_HEAD_DIM),
    "decode_compressor_ratio128": ("decode_compressor_ratio128.py", 128, 8, (120, 250, 300, 1016), HEAD_DIM),
}
MAX_SEQ = 1032


def read_source(repo: str, rev: str, path: str) -> str:
    full = os.path.join(repo, path)
    if os.path.isfile(full):
        with open(full) as f:
            return f.read()
    return subprocess.run(["git", "--git-dir", repo, "show", f"{rev}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def revision(repo: str, rev: str) -> str:
    git = ["git", "--git-dir", repo] if not os.path.isdir(os.path.join(repo, ".git")) else ["git", "-C", repo]
    return subprocess.run(git + ["rev-parse", rev], check=True, capture_output=True, text=True).stdout.strip()


def golden_function(source: str, name: str = "golden_compressor"):
    """The source of pypto-lib's golden function alone (the module imports the pypto runtime)."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(source, node)
    raise SystemExit(f"{name} not found")


def bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def tables(ratio, page, firsts):
    """State block tables [B, MAX_SEQ/page]: physical pages for the logical pages a request's call
    reads or writes, -1 elsewhere; request 3 of the ratio-4 fixture on a 4-page ring (8 positions:
    its call's writes alias rows of its own window); one page unmapped in each fixture."""
    t = np.full((B, MAX_SEQ // page), -1, np.int32)
    nxt = 0
    for b, f in enumerate(firsts):
        lo, hi = max(0, f - 2 * ratio) // page, (f + S - 1) // page
        ring = ratio == 4 and b == 3
        for lp in range(lo, hi + 1):
            t[b, lp] = nxt + (lp % 4 if ring else lp - lo)
        nxt += 4 if ring else hi - lo + 1
    if ratio == 4:
        t[2, 8 // page] = -1                         # request 2: positions 8-9 (its first window)
    else:
        t[0, 120 // page] = -1                       # request 0: positions 120-127 (its own call)
    return t


def fixture(kernel, seed=0):
    file, ratio, page, firsts, hd = KERNELS[kernel]
    rng = np.random.default_rng(seed)
    out_dim = 2 * hd if ratio == 4 else hd
    pos = (np.asarray(firsts)[:, None] + np.arange(S)[None, :]).astype(np.int32)          # [B, S]
    table = tables(ratio, page, firsts)
    n_pages = int(table.max()) + 1
    slots = np.where(table[np.arange(B)[:, None], pos // page] >= 0,
                     table[np.arange(B)[:, None], pos // page].astype(np.int64) * page + pos % page, -1)
    cmp_table = np.full((B, MAX_SEQ // ratio // BLOCK_SIZE + 1), -1, np.int32)
    cmp_table[:, 0] = np.arange(B)[::-1]              # every call's compressed rows sit in page 0
    col = pos // ratio
    cmp_slots = np.where((pos + 1) % ratio == 0,
                         cmp_table[np.arange(B)[:, None], col // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
                         + col % BLOCK_SIZE, -1)
    # the compress RoPE profile at each request's first window start (the kernel's [B, R/2] rows)
    from golden.kernels.rope import COMPRESS_PROFILE, rope_rows
    from golden.numerics import DEVICE
    from twin.abi.presets import TINY
    cfg = TINY.replace(name="kernel-data", qk_rope_head_dim=ROPE, head_dim=HEAD_DIM, index_head_dim=IDX_HEAD_DIM)
    first_b = pos[:, 0] + (ratio - 1 - pos[:, 0] % ratio)
    cos, sin = rope_rows(cfg, COMPRESS_PROFILE, np.maximum(first_b - ratio + 1, 0), DEVICE)
    t = {
        "x": bf16(rng.random((B * S, D))),
        "compress_state": np.concatenate([rng.standard_normal((n_pages, page, out_dim)),
                                          rng.standard_normal((n_pages, page, out_dim))], -1).astype(np.float32),
        "compress_state_block_table": table,
        "wkv": bf16(rng.standard_normal((out_dim, D)) * 0.1),
        "wgate": bf16(rng.standard_normal((out_dim, D)) * 0.1),
        "ape": (rng.standard_normal((ratio, out_dim)) * 0.12).astype(np.float32),
        "norm_w": bf16(0.96 + 0.19 * rng.standard_normal(hd)),
        "cos": np.asarray(cos[:, :ROPE // 2], np.float32),
        "sin": np.asarray(sin[:, :ROPE // 2], np.float32),
        "position_ids": pos.reshape(-1),
        "state_slot_mapping": slots.reshape(-1),
        "kv": np.zeros((B * S, hd), np.float32),
    }
    cmp_pages = int(cmp_table.max()) + 1
    if kernel == "decode_indexer_compressor":
        n = hd
        h = np.ones((1, 1))
        while h.shape[0] < n:
            h = np.block([[h, h], [h, -h]])
        t.update(hadamard=bf16(h / math.sqrt(n)), idx_kv_cache=np.zeros((cmp_pages, BLOCK_SIZE, 1, hd), np.int8),
                 idx_kv_scale=np.zeros((cmp_pages, BLOCK_SIZE, 1, 1), np.float32),
                 idx_slot_mapping=cmp_slots.reshape(-1), inner_state_slot_mapping=t.pop("state_slot_mapping"))
    else:
        t.update(cmp_kv_cache=np.zeros((cmp_pages, BLOCK_SIZE, 1, hd), np.float32), cmp_slot_mapping=cmp_slots.reshape(-1))
    return t, dict(ratio=ratio, page=page, head_dim=hd)


def run(kernel, source):
    import torch
    file, ratio, page, firsts, hd = KERNELS[kernel]
    t, meta = fixture(kernel)
    inputs = {k: v.copy() for k, v in t.items()}
    out_dim = 2 * hd if ratio == 4 else hd
    env = dict(S=S, D=D, HEAD_DIM=hd, ROPE_HEAD_DIM=ROPE, COMPRESS_RATIO=ratio, OUT_DIM=out_dim,
               COMPRESS_STATE_BLOCK_SIZE=page, BLOCK_SIZE=BLOCK_SIZE, EPS=EPS, INT8_AMAX_EPS=1e-4,
               INT8_SCALE_MAX=127.0, FP32_NEG_INF=-3.4028234663852886e38)
    exec(compile(golden_function(source), f"pypto-lib/{MODELS}/{file}", "exec"), env)
    bf16_names = {"x", "wkv", "wgate", "norm_w", "cmp_kv_cache", "hadamard"}
    tens = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in t.items()}
    for k in bf16_names & set(tens):
        tens[k] = tens[k].to(torch.bfloat16)
    env["golden_compressor"](tens)
    outs = {k: (v.float() if v.dtype == torch.bfloat16 else v).numpy() for k, v in tens.items()}
    names = ["kv", "compress_state"] + (["idx_kv_cache", "idx_kv_scale"] if "idx_kv_cache" in t else ["cmp_kv_cache"])
    return inputs, {k: outs[k] for k in names}, meta


# ---- pypto-lib's own fixtures ---------------------------------------------------------------------
SMALL = dict(hidden_size=64, num_attention_heads=8, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32,
             o_lora_rank=32, o_groups=4, vocab_size=1616, moe_intermediate_size=32, n_routed_experts=16,
             num_experts_per_tok=2, index_n_heads=4, index_head_dim=32, index_topk=16,
             max_position_embeddings=16384)
FIXTURES = {   # kernel -> (file, golden function, build_tensor_specs arguments[, config overrides
               # ("model": fields of SMALL to change for this kernel; "build": another builder; "argv": the
               # module's command line; "patch": module constants set after it is loaded)])
    "rmsnorm": ("rmsnorm.py", "golden_rms_norm_test", (16, 8)),
    "hc_pre": ("hc_pre.py", "golden_hc_pre", (16, 8)),
    "hc_post": ("hc_post.py", "golden_hc_post", (16, 8)),
    "hc_head": ("hc_head.py", "golden_hc_head", (128,)),
    "qkv_proj_rope": ("qkv_proj_rope.py", "golden_qkv_proj_rope", (16, 8)),
    "expert_routed": ("expert_routed.py", "golden_expert_routed", ()),
    "gate": ("gate.py", "golden_gate_core", (10,)),                  # a score-routed layer
    "gate_hash": ("gate.py", "golden_gate_core", (0,)),              # a hash-routed layer
    "lookup_embedding": ("lookup_embedding.py", "golden_lookup_embedding_test", (128, 256)),
    "decode_sparse_attn_swa": ("decode_sparse_attn_swa.py", "golden_sparse_attn", (), {"KV_ORI_BLOCK_NUM": 64}),
    "lm_head": ("lm_head.py", "golden_lm_head", (8,)),
    "decode_indexer": ("decode_indexer.py", "golden_indexer", (), {"model": {"q_lora_rank": 128}}),
    # one TP rank's grouped projection; its fixture's wo_a spans 4 x o_lora_rank of a group's input
    "decode_o_proj": ("decode_o_proj.py", "golden_decode_o_proj", (31,),
                      {"model": {"o_lora_rank": 16}, "build": "build_o_proj_tensor_specs"}),
    # its weight generator simulates FP8 in 128 x 128 blocks: D and the intermediate size 128
    "expert_shared": ("expert_shared.py", "golden_expert_shared", (),
                      {"model": {"hidden_size": 128, "moe_intermediate_size": 128}}),                 # 8 active rows per owner rank
    # one 512-token prefill chunk; RoPE tables cut to 1024 positions
    "prefill_compressor_ratio4": ("prefill_compressor_ratio4.py", "golden_prefill_compressor_ratio4", (),
                                  {"model": {"max_position_embeddings": 1024}}),
    "prefill_compressor_ratio128": ("prefill_compressor_ratio128.py", "golden_prefill_compressor_ratio128", (),
                                    {"model": {"max_position_embeddings": 1024}}),
    "decode_sparse_attn_csa": ("decode_sparse_attn_csa.py", "golden_sparse_attn", (),
                               {"KV_ORI_BLOCK_NUM": 64, "KV_CMP_BLOCK_NUM": 32}),
    "decode_sparse_attn_hca": ("decode_sparse_attn_hca.py", "golden_sparse_attn", (),
                               {"KV_ORI_BLOCK_NUM": 64, "KV_CMP_BLOCK_NUM": 64}),
    # a 48-token prefill chunk continuing at position 77: state rows of 69..76 and 19 compressed
    # index rows from before the chunk; pools and position tables cut to 256 positions
    "prefill_indexer_compressor": ("prefill_indexer_compressor.py", "golden_prefill_indexer_compressor", (77, 48),
                                   {"model": {"max_position_embeddings": 256}, "CSA_INNER_STATE_PHYSICAL_BLOCKS": 37,
                                    "IDX_CACHE_BLOCK_NUM": 8}),
    # its wq_b generator simulates FP8 in 128 x 128 blocks: q_lora_rank 128
    "prefill_indexer": ("prefill_indexer.py", "golden_prefill_indexer", (77, 48),
                        {"model": {"max_position_embeddings": 256, "q_lora_rank": 128},
                         "CSA_INNER_STATE_PHYSICAL_BLOCKS": 37, "IDX_CACHE_BLOCK_NUM": 8}),
    # 136 tokens of a CSA layer: the window slides past 128 rows; up to 16 compressed rows
    "prefill_sparse_attn": ("prefill_sparse_attn.py", "golden_prefill_sparse_attn", (4, 136, 5, 2),
                            {"model": {"max_position_embeddings": 1024}}),
    # the MoE layer program (hc_pre, gate, shared expert, EP dispatch, routed experts, combine,
    # hc_post) on 4 EP ranks of 4 tokens, 4 routed experts (1 per rank), a score-routed layer; its
    # shared-expert generator simulates FP8 in 128 x 128 blocks: D and the intermediate size 128
    "moe": ("moe.py", "golden_moe", (10,), {"model": {"n_routed_experts": 16, "vocab_size": 256, "hidden_size": 128,
                                                      "moe_intermediate_size": 128},
                                            "MOE_TOKENS": 4, "argv": ["--ep", "4"]}),
    # one TP group of 4 ranks: the KV all-gather, the o_proj groups' all-to-all and the o_proj
    # reduce-scatter, 15 live rows per rank of 16 (the last a poisoned capacity row)
    "decode_o_proj_collectives": ("decode_o_proj.py", "golden_decode_attention_collectives_fixture", (),
                                  {"DECODE_TOKENS": 64, "argv": ["--tp", "4"],
                                   "build": "build_collective_tensor_specs"}),
    # the SWA attention sub-layer program (hc_pre, rmsnorm, qkv_proj_rope, KV write, sparse
    # attention, o_proj, hc_post): a 24-token chunk at position 100 over the 100 rows before it
    "prefill_swa": ("prefill_swa.py", "golden_prefill_attention_swa", (100, 24),
                    {"model": {"max_position_embeddings": 1024}, "KV_ORI_BLOCK_NUM": 8}),
    # the prefill context-parallel KV all-gather of one TP group (4 ranks x 9 rows)
    "prefill_kv_allgather": ("prefill_kv_allgather.py", "golden_prefill_kv_allgather", (9,), {"argv": ["--tp", "4"]}),
    # the whole drafter program (pypto-lib's golden composes it on its fixture's weights: identity
    # main_proj and wkv, zero hc / attention / expert weights) for 4 requests on 2 EP ranks; a
    # 256-position ring per request; the noise token is TINY's (pypto-lib's 128799 is past its vocab)
    "dspark_drafter": ("dspark_drafter.py", "golden_dspark_drafter", (4,),
                       {"model": {"max_position_embeddings": 1024}, "KV_ORI_BLOCK_NUM": 128, "argv": ["--ep", "2"],
                        "patch": {"DSPARK_NOISE_TOKEN_ID": 1135}}),
}
RUNTIME = ("pypto", "pypto.language", "pypto.language.distributed", "pypto.ir",
           "pypto.ir.distributed_compiled_program")


class _Runtime:
    """Stands in for the PyPTO runtime's names: attributes, calls, subscripts and decorators all
    succeed (only the kernel definitions, never the golden functions, use them)."""

    def __getattr__(self, k):
        return _Runtime()

    def __call__(self, *a, **k):
        return a[0] if len(a) == 1 and callable(a[0]) and not k else _Runtime()

    def __getitem__(self, k):
        return _Runtime()


def install_runtime():
    """The PyPTO runtime's modules as stand-ins (`_Runtime`): pypto-lib's kernel modules import them."""
    import types
    for n in RUNTIME:
        m = types.ModuleType(n)
        m.__getattr__ = lambda k: _Runtime() if not k.startswith("__") else _no_attr(k)
        sys.modules[n] = m


def _no_attr(k):
    raise AttributeError(k)


def pypto_module(repo, rev, name, overrides=None):
    """pypto-lib's module `name` executed as described in the module docstring; `overrides`: config
    constants set before the module reads them (pool sizes, to keep the data small)."""
    import dataclasses
    import types
    saved = {k: sys.modules.get(k) for k in RUNTIME + ("config", "golden", "utils", "rope_interleave",
                                                        "pypto_" + name[:-3])}
    saved_argv = sys.argv
    try:
        install_runtime()
        cfg = read_source(repo, rev, f"{MODELS}/config.py").replace(
            "\nPRESETS = ", "\nFLASH = __import__('dataclasses').replace(FLASH, **_SMALL)\nPRESETS = ", 1)
        overrides = {k: v for k, v in (overrides or {}).items() if k not in ("build", "patch")}
        # a module that reads its rank count from the command line (moe.py --ep, decode_o_proj.py --tp)
        sys.argv = [name] + list(overrides.pop("argv", []))
        c = types.ModuleType("config")
        c._SMALL = {**SMALL, **overrides.pop("model", {})}
        sys.modules["config"] = c
        exec(compile(cfg, "config.py", "exec"), c.__dict__)
        c.__dict__.update(overrides or {})
        harness = types.ModuleType("golden")         # pypto-lib's harness package, not ours

        class TensorSpec:
            def __init__(self, name, shape, dtype, init_value=None, is_output=False, **_placement):
                self.name, self.shape, self.dtype = name, shape, dtype
                self.init_value, self.is_output = init_value, is_output

        @dataclasses.dataclass
        class ScalarSpec:
            name: str
            dtype: object
            value: object

            def init_value(self):
                import torch
                return torch.tensor(self.value, dtype=self.dtype)
            is_output = False
        harness.TensorSpec, harness.ScalarSpec = TensorSpec, ScalarSpec
        sys.modules["golden"] = harness
        def sibling(mod_name, as_name):
            """A module of models/deepseek_v4_flash_dspark, its own sibling imports first."""
            source = read_source(repo, rev, f"{MODELS}/{mod_name}.py")
            tree = ast.parse(source)
            mod = types.ModuleType(as_name)
            sys.modules[as_name] = mod
            # statement by statement, a sibling imported where its import stands (moe.py edits the
            # config before it imports the kernels that read it)
            for n in tree.body:
                if isinstance(n, ast.Assert) or _raises_only(n):
                    continue
                if isinstance(n, ast.ImportFrom) and n.module not in sys.modules and n.module != "config" \
                        and not (n.module or "").startswith(("pypto", "__future__")):
                    saved.setdefault(n.module, sys.modules.get(n.module))
                    sibling(n.module, n.module)
                exec(compile(ast.Module([n], []), mod_name + ".py", "exec"), mod.__dict__)
            return mod, source
        for dep in ("utils", "rope_interleave"):
            sibling(dep, dep)
        mod, source = sibling(name[:-3], "pypto_" + name[:-3])
        return mod, source, saved
    except BaseException:
        _restore(saved)
        raise
    finally:
        sys.argv = saved_argv


def _raises_only(node):
    """A module-level `if <tiling constraint>: raise ...` (a kernel tile check, like the asserts)."""
    return isinstance(node, ast.If) and not node.orelse and all(isinstance(b, ast.Raise) for b in node.body)


def _restore(saved):
    for k, v in saved.items():
        if v is None:
            sys.modules.pop(k, None)
        else:
            sys.modules[k] = v


def run_fixture(repo, rev, kernel):
    import torch
    file, fn, args, *overrides = FIXTURES[kernel]
    mod, source, saved = pypto_module(repo, rev, file, *overrides)
    for k, v in (overrides[0] if overrides else {}).get("patch", {}).items():   # module constants
        setattr(mod, k, v)
    try:
        torch.manual_seed(0)
        specs = getattr(mod, (overrides[0] if overrides else {}).get("build", "build_tensor_specs"))(*args)
        t = {sp.name: (sp.init_value() if callable(sp.init_value) else torch.zeros(sp.shape, dtype=sp.dtype)
                       if sp.init_value is None else torch.full(sp.shape, float(sp.init_value), dtype=sp.dtype))
             for sp in specs}
        t = {k: v.to(sp.dtype) for (k, v), sp in zip(t.items(), specs)}
        inputs = {k: v.clone() for k, v in t.items()}
        getattr(mod, fn)(t)
    finally:
        _restore(saved)
    np_ = lambda v: v.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if v.dtype == torch.bfloat16 else v.numpy()
    outs = [sp.name for sp in specs if sp.is_output]
    return ({k: np_(v) for k, v in inputs.items()}, {k: np_(t[k]) for k in outs}, source,
            {"file": file, "golden": fn, "build_tensor_specs": args, "small": SMALL, "config": overrides,
             "ranks": int(getattr(mod, "N_RANKS", 0) or getattr(mod, "TP_SIZE", 0))})


def save(kernel, rev, file, source, inputs, outputs, meta):
    """<kernel>.npz: in.<name>, out.<name>; BF16 arrays as their 16-bit patterns, named <name>.bf16;
    an input of a multi-rank fixture whose N rank copies ([N, ...]) are equal stored once, named
    <name>.rep<N>."""
    ranks = meta.get("ranks")

    def entries(prefix, d):
        for k, v in d.items():
            if prefix == "in" and ranks and v.ndim and v.shape[0] == ranks and (v == v[:1]).all():
                k, v = f"{k}.rep{ranks}", v[0]
            if v.dtype == ml_dtypes.bfloat16:
                yield f"{prefix}.{k}.bf16", v.view(np.uint16)
            else:
                yield f"{prefix}.{k}", v
    blob = dict(entries("in", inputs))
    blob.update(entries("out", outputs))
    blob["meta"] = np.array([f"pypto-lib {rev} {MODELS}/{file} sha256 {hashlib.sha256(source.encode()).hexdigest()}",
                             str(meta)])
    path = os.path.join(HERE, f"{kernel}.npz")
    np.savez_compressed(path, **blob)
    print(path, os.path.getsize(path), "bytes")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pypto_lib", help="a pypto-lib checkout or bare git directory")
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--only", nargs="+", metavar="KERNEL", help="record these kernels only")
    a = ap.parse_args(argv)
    unknown = sorted(set(a.only or ()) - set(KERNELS) - set(FIXTURES))
    if unknown:
        ap.error(f"--only: {unknown[0]!r} is not a recorded kernel (one of {sorted({**KERNELS, **FIXTURES})})")
    sys.path.insert(0, ROOT)
    rev = revision(a.pypto_lib, a.rev)
    for kernel, (file, *_rest) in KERNELS.items():
        if a.only and kernel not in a.only:
            continue
        src = read_source(a.pypto_lib, a.rev, f"{MODELS}/{file}")
        inputs, outputs, meta = run(kernel, src)
        save(kernel, rev, file, src, inputs, outputs, meta)
    for kernel, (file, *_rest) in FIXTURES.items():
        if a.only and kernel not in a.only:
            continue
        inputs, outputs, src, meta = run_fixture(a.pypto_lib, a.rev, kernel)
        save(kernel, rev, file, src, inputs, outputs, meta)


if __name__ == "__main__":
    main()
