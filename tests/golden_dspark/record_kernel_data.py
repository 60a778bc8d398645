"""Record the drafter kernels' pypto-lib goldens at the TINY shape into kernel_data.npz.

    python tests/golden_dspark/record_kernel_data.py PYPTO_LIB_DIR [--out PATH]

PYPTO_LIB_DIR is a checkout of hw-native-sys/pypto-lib (the data in this repository was recorded
from 634e77bd).  Its `golden_*` functions are plain torch; the modules import `pypto.language` at
import time for their device programs, so this script installs a permissive stand-in for that
package (decorators return the function, type subscripts and attributes return the stand-in) and
shrinks pypto-lib's FLASH config to the TINY dimensions before any kernel module is imported (it
runs under `python -O`: the modules assert their device tiling at import, which TINY does not meet
and the goldens do not need).  The
inputs are drawn here (seeded) in the kernels' own layouts; every output is what pypto-lib's golden
writes.  Nothing of pypto-lib is kept in this repository but the recorded arrays.

Recorded per kernel (keys "<kernel>/<tensor>"):
  dspark_proj        main_hidden, main_proj_w, main_norm_w -> main_x
  dspark_context_kv  main_x, wkv, gamma_ckv, position_ids, slot_mapping, kv_cache (in) -> kv_cache_out
  dspark_attention   x, wq_a, wq_b, wq_b_scale, wkv, gamma_cq, gamma_ckv, attn_sink, position_ids,
                     slot_mapping, swa_indices, swa_lens, kv_cache (in) -> kv_cache_out, heads (the
                     bf16 [T, H, HD] attention heads after inverse RoPE, the input of the o_proj)
  markov_head        token_ids, markov_w1, markov_w2 -> markov_embed, logits_bias
  dspark_markov      pypto-lib's own deterministic fixture (build_tensor_specs(4)) -> draft_token_ids
plus "rope/cos", "rope/sin": pypto-lib's ratio-0 RoPE table rows at the positions used.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "data", "kernel_data.npz")
SOURCE = "hw-native-sys/pypto-lib@634e77bd models/deepseek_v4_flash_dspark"

# TINY (twin.abi.presets) in pypto-lib's config field names
TINY_DIMS = dict(hidden_size=64, num_attention_heads=8, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32,
                 o_lora_rank=32, o_groups=4, vocab_size=1616, max_position_embeddings=16384)


def install_pypto_standin():
    """The PyPTO runtime as tests/golden/kernel_data/record.py stands it in."""
    sys.path.insert(0, os.path.join(HERE, "..", "golden", "kernel_data"))
    from record import install_runtime
    install_runtime()


def load_kernels(root: str):
    install_pypto_standin()
    sys.path[:0] = [os.path.join(root, "models", "deepseek_v4_flash_dspark"), root]
    import config
    config.FLASH = dataclasses.replace(config.FLASH, **TINY_DIMS)
    import dspark_attention, dspark_context_kv, dspark_markov, dspark_proj, markov_head, utils  # noqa: E401
    return types.SimpleNamespace(config=config, proj=dspark_proj, ctx=dspark_context_kv, attn=dspark_attention,
                                 mh=markov_head, markov=dspark_markov, utils=utils)


def np_of(t):
    import torch
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.float().numpy().astype(ml_dtypes.bfloat16)
    return t.numpy().copy()


def record(k) -> dict:
    import torch
    g = torch.Generator().manual_seed(19)
    M = k.config.FLASH
    D, H, HD, R, QL, V = M.hidden_size, M.num_attention_heads, M.head_dim, M.qk_rope_head_dim, M.q_lora_rank, \
        M.vocab_size
    bf = torch.bfloat16
    rnd = lambda *s: torch.randn(*s, generator=g)      # noqa: E731
    out = {}
    cos_t, sin_t = k.utils.build_rope_tables(M, 0, dtype=bf)

    # K22 dspark_proj
    T = 24
    t = {"main_hidden": rnd(T, 3 * D).to(bf), "main_proj_w": (rnd(D, 3 * D) / (3 * D) ** 0.5).to(bf),
         "main_norm_w": (1.0 + 0.1 * rnd(D)).to(bf), "main_x": torch.zeros(T, D, dtype=bf)}
    k.proj.golden_dspark_proj(t)
    out.update({f"dspark_proj/{n}": np_of(v) for n, v in t.items()})

    # K23 dspark_context_kv: positions across a page boundary, one unmapped row (slot -1)
    blocks = 8
    pos = torch.tensor([3, 4, 5, 31, 32, 33, 200, 201, 9000, 9001, 16383, 7], dtype=torch.int32)
    slots = torch.tensor([5, 6, 7, 33, 34, 35, 70, 71, 100, 101, 255, -1], dtype=torch.int64)
    t = {"main_x": (rnd(len(pos), D) * 0.5).to(bf), "wkv": (rnd(D, HD) / D ** 0.5).to(bf),
         "gamma_ckv": (1.0 + 0.1 * rnd(HD)).to(bf), "freqs_cos": cos_t, "freqs_sin": sin_t,
         "position_ids": pos, "slot_mapping": slots,
         "kv_cache": (rnd(blocks, 32, 1, HD)).to(bf)}
    kv_in = t["kv_cache"].clone()
    k.ctx.golden_dspark_context_kv(t)
    for n in ("main_x", "wkv", "gamma_ckv", "position_ids", "slot_mapping"):
        out[f"dspark_context_kv/{n}"] = np_of(t[n])
    out["dspark_context_kv/kv_cache"] = np_of(kv_in)
    out["dspark_context_kv/kv_cache_out"] = np_of(t["kv_cache"])

    # K24 dspark_attention: the golden's own batch (DECODE_BATCH // TP requests of 7 rows)
    A = k.attn
    B, S, W = A.B, A.S, A.INDEX_WIDTH
    anchors = torch.tensor([0, 5, 126, 127, 128, 300, 4000, 16300, 40, 41, 9, 1000, 250, 251, 777, 8191][:B])
    nblk = B * 8
    kv_cache = torch.zeros(nblk, 32, 1, HD)
    kv_cache = (kv_cache + rnd(nblk, 32, 1, HD)).to(bf)
    table = torch.randperm(nblk, generator=g).reshape(B, -1)       # 8 pages per request: a 256-position ring

    def slot_of(b, p):
        return int(table[b, (p // 32) % table.shape[1]]) * 32 + p % 32

    position_ids = (anchors[:, None] + 1 + torch.arange(S)[None, :]).reshape(-1).to(torch.int32)
    slot_mapping = torch.tensor([slot_of(b, int(anchors[b]) + 1 + s) for b in range(B) for s in range(S)],
                                dtype=torch.int64)
    swa_indices = torch.full((B, W), -1, dtype=torch.int32)
    swa_lens = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        first = int(anchors[b]) + 1
        lo = max(0, first - M.sliding_window)
        vis = list(range(lo, first + S))
        swa_lens[b] = len(vis)
        swa_indices[b, :len(vis)] = torch.tensor([slot_of(b, p) for p in vis], dtype=torch.int32)
    wq_b_bf = (rnd(QL, H * HD) / QL ** 0.5).to(bf)
    wq_b_i8, wq_b_scale = k.utils.quant_w_per_channel(wq_b_bf.t().contiguous())
    O = M.o_groups
    t = {"x": (rnd(B * S, D)).to(bf), "wq_a": (rnd(D, QL) / D ** 0.5).to(bf), "wq_b": wq_b_i8.t().contiguous(),
         "wq_b_scale": wq_b_scale, "wkv": (rnd(D, HD) / D ** 0.5).to(bf), "gamma_cq": (1.0 + 0.1 * rnd(QL)).to(bf),
         "gamma_ckv": (1.0 + 0.1 * rnd(HD)).to(bf), "freqs_cos": cos_t, "freqs_sin": sin_t,
         "position_ids": position_ids, "kv_cache": kv_cache.clone(), "slot_mapping": slot_mapping,
         "swa_indices": swa_indices, "swa_lens": swa_lens, "attn_sink": 0.5 * rnd(H),
         "wo_a": (rnd(O, M.o_lora_rank, H * HD // O) * 0.05).to(bf),
         "wo_b": torch.zeros(D, O * M.o_lora_rank, dtype=torch.int8), "wo_b_scale": torch.ones(D),
         "x_out": torch.zeros(B * S, D, dtype=bf)}
    heads = []
    einsum = torch.einsum

    def capture(eq, *ops):
        if eq == "bsgd,grd->bsgr":          # the golden's o_proj input: the bf16 attention heads
            heads.append(ops[0].reshape(B * S, H, HD).clone())
        return einsum(eq, *ops)

    torch.einsum = capture
    try:
        A.golden_dspark_attention(t)
    finally:
        torch.einsum = einsum
    for n in ("x", "wq_a", "wq_b", "wq_b_scale", "wkv", "gamma_cq", "gamma_ckv", "attn_sink", "position_ids",
              "slot_mapping", "swa_indices", "swa_lens"):
        out[f"dspark_attention/{n}"] = np_of(t[n])
    out["dspark_attention/kv_cache"] = np_of(kv_cache)
    out["dspark_attention/kv_cache_out"] = np_of(t["kv_cache"])
    out["dspark_attention/heads"] = np_of(heads[0].to(bf))

    # K25 markov_head
    r = 16
    ids = torch.tensor([0, 1, 17, V - 1, 5, 5, 800, 1615], dtype=torch.int64)
    t = {"token_ids": ids, "markov_w1": rnd(V, r).to(bf), "markov_w2": (rnd(V, r) / r ** 0.5).to(bf),
         "markov_embed": torch.zeros(len(ids), r, dtype=bf), "logits_bias": torch.zeros(len(ids), V)}
    k.mh.golden_markov_head(t)
    out.update({f"markov_head/{n}": np_of(v) for n, v in t.items()})

    # K26 dspark_markov: pypto-lib's deterministic fixture and golden
    t = {s.name: s.create_tensor() for s in k.markov.build_tensor_specs(4)}
    k.markov.golden_nonzero_markov(t)
    out.update({f"dspark_markov/{n}": np_of(v) for n, v in t.items()})

    used = np.unique(np.concatenate([out["dspark_context_kv/position_ids"], out["dspark_attention/position_ids"]]))
    out["rope/positions"] = used.astype(np.int64)
    out["rope/cos"] = np_of(cos_t[torch.from_numpy(used.astype(np.int64))])
    out["rope/sin"] = np_of(sin_t[torch.from_numpy(used.astype(np.int64))])
    return out


def main(argv=None):
    if __debug__:
        # pypto-lib's modules assert their device tiling (D % 512, V % 256) at import; the goldens
        # do not depend on it, and the TINY shape does not meet it: run without asserts
        os.execv(sys.executable, [sys.executable, "-O", os.path.abspath(__file__), *(argv or sys.argv[1:])])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pypto_lib", help="a checkout of hw-native-sys/pypto-lib")
    ap.add_argument("--out", default=DEFAULT_OUT)
    a = ap.parse_args(argv)
    if not os.path.isdir(os.path.join(a.pypto_lib, "models", "deepseek_v4_flash_dspark")):
        ap.exit(2, f"pypto_lib: {a.pypto_lib!r} has no models/deepseek_v4_flash_dspark (a pypto-lib checkout)\n")
    arrays = record(load_kernels(a.pypto_lib))
    # bf16 is stored as its uint16 bit pattern (npz has no bf16); the loader views it back
    packed = {}
    for n, v in arrays.items():
        if v.dtype.name == "bfloat16":
            packed[n + "@bf16"] = v.view(np.uint16)
        else:
            packed[n] = v
    packed["source"] = np.array(SOURCE)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    np.savez_compressed(a.out, **packed)
    print(f"{a.out}: {len(arrays)} arrays, {os.path.getsize(a.out) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
