"""Seeded synthetic weights for the reference step: BF16 dense weights, INT8 experts with FP32
per-channel scales (W8A8 layout), a hash table for the hash-routed layers, a low-rank Markov head.

Weights are frozen data, separate from the config and from run state; `fingerprint` names them in
every record so a replay knows which checkpoint it needs.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from twin.abi.presets import ModelConfig


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _int8_weight(rng, shape) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel symmetric INT8 of a Gaussian matrix [..., out, in]: (int8, f32 scale [..., out])."""
    w = rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[-1])
    amax = np.maximum(np.abs(w).max(-1), 1e-4)
    q = np.rint(w / (amax / 127.0)[..., None]).astype(np.int8)
    return q, (amax / 127.0).astype(np.float32)


@dataclass(frozen=True)
class Weights:
    cfg: ModelConfig
    seed: int
    tensors: dict = field(repr=False)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.tensors[name]

    @property
    def fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=12)
        for k in sorted(self.tensors):
            a = self.tensors[k]
            h.update(k.encode())
            h.update(str(a.dtype).encode())
            h.update(a.tobytes())
        return h.hexdigest()


def synthetic_weights(cfg: ModelConfig, seed: int = 0) -> Weights:
    rng = np.random.default_rng(seed)
    m = cfg
    NL, D, H, HD = m.num_hidden_layers, m.hidden_size, m.num_attention_heads, m.head_dim
    E, I, V, DL = m.n_routed_experts, m.moe_intermediate_size, m.vocab_size, m.dspark_num_layers

    def dense(*shape, scale=None):
        s = scale if scale is not None else 1.0 / np.sqrt(shape[-2] if len(shape) > 1 else 1)
        return _bf16(rng.standard_normal(shape) * s)

    def norm_w(*shape):
        return _bf16(1.0 + 0.1 * rng.standard_normal(shape))

    t = {
        "embed_weight": dense(V, D, scale=1.0),
        "attn_norm_w": norm_w(NL, D),
        "wq": dense(NL, D, H * HD),
        "wkv": dense(NL, D, HD),
        "attn_sink": (rng.standard_normal((NL, H)) * 0.5).astype(np.float32),
        "wo": dense(NL, H * HD, D, scale=0.5 / np.sqrt(H * HD)),
        "cmp_wgate": dense(NL, HD, HD, scale=0.2 / np.sqrt(HD)),
        "norm_w": norm_w(NL, D),
        "gate_w": (rng.standard_normal((NL, E, D)) / np.sqrt(D)).astype(np.float32),
        "gate_bias": (0.01 * rng.standard_normal((NL, E))).astype(np.float32),
        "tid2eid": np.stack([rng.permuted(np.tile(np.arange(E), (V, 1)), axis=1)[:, : m.num_experts_per_tok]
                             for _ in range(m.num_hash_layers)]).astype(np.int32),
        "final_norm_w": norm_w(D),
        "lm_head_weight": dense(V, D, scale=2.0 / np.sqrt(D)),
        "draft_ctx_norm_w": norm_w(DL, 3 * D),
        "draft_wctx": dense(DL, 3 * D, HD),
        "draft_attn_norm_w": norm_w(DL, D),
        "draft_wq": dense(DL, D, H * HD),
        "draft_wkv": dense(DL, D, HD),
        "draft_attn_sink": (rng.standard_normal((DL, H)) * 0.5).astype(np.float32),
        "draft_wo": dense(DL, H * HD, D, scale=0.5 / np.sqrt(H * HD)),
        "markov_u": dense(V, m.dspark_markov_rank, scale=1.0),
        "markov_v": dense(m.dspark_markov_rank, V, scale=1.0 / np.sqrt(m.dspark_markov_rank)),
    }
    for name, shape in (("routed_w1", (NL, E, I, D)), ("routed_w3", (NL, E, I, D)), ("routed_w2", (NL, E, D, I)),
                        ("shared_w1", (NL, I, D)), ("shared_w3", (NL, I, D)), ("shared_w2", (NL, D, I))):
        t[name], t[name + "_scale"] = _int8_weight(rng, shape)
    return Weights(cfg, seed, t)
