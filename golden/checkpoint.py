"""Weights: seeded synthetic checkpoints with the real tensor names and the W8A8 layout, generated
lazily per (layer, expert); a loader for a real safetensors checkpoint directory.

Inside the golden, weights are addressed by the ABI's names (twin/abi/programs.py) in the ABI's
per-layer orientation; on disk they carry the official DeepSeek-V4 names ("layers.3.attn.wq_b.weight")
in the official [out, in] orientation, with W8A8 tensors as int8 `.weight` plus an f32
`.weight_scale` [out, 1] (compressed-tensors layout).  `REAL_NAMES` is the one mapping between the
two; synthetic and real checkpoints both go through it, so a test that writes a synthetic
checkpoint to disk and loads it back exercises the real loader.

Protocol used by the compositions (a "checkpoint"):
  model()        -> embed_weight, hc_head_fn/scale/base, final_norm_w, lm_head_weight
  layer(l)       -> every non-expert tensor of target layer l (ABI names)
  expert(l, e)   -> routed_w1/w3/w2 (+ scales) of routed expert e of layer l
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from functools import lru_cache

import ml_dtypes
import numpy as np

from twin.abi.errors import AbiError

BF16 = ml_dtypes.bfloat16
EXPERT_NAMES = ("routed_w1", "routed_w3", "routed_w2")
IN_OUT = ("wq_a", "wq_b", "wkv", "csa_idx_wq_b", "csa_weights_proj")    # ABI [in, out]; official [out, in]


# ---- layout: ABI name -> (real name, ABI shape, dtype, transform) ----------------------------
def _model_specs(c):
    D, V, HC = c.hidden_size, c.vocab_size, c.hc_mult
    return {
        "embed_weight": ("embed.weight", (V, D), "bf16"),
        "hc_head_fn": ("hc_head_fn", (HC, HC * D), "f32"),
        "hc_head_scale": ("hc_head_scale", (1,), "f32"),
        "hc_head_base": ("hc_head_base", (HC,), "f32"),
        "final_norm_w": ("norm.weight", (D,), "bf16"),
        "lm_head_weight": ("head.weight", (V, D), "bf16"),
    }


def _layer_specs(c, layer: int):
    """ABI name -> (real name, ABI shape, dtype).  i8 entries have an f32 `<name>_scale` partner."""
    D, H, HD, QL, OL, G = c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank, c.o_lora_rank, c.o_groups
    I, E, K, MIX, HCD = c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok, c.mix_hc, c.hc_dim
    IH, IHD = c.index_n_heads, c.index_head_dim
    p = f"layers.{layer}."
    s = {
        "hc_attn_fn": (p + "hc_attn_fn", (MIX, HCD), "f32"),
        "hc_attn_scale": (p + "hc_attn_scale", (3,), "f32"),
        "hc_attn_base": (p + "hc_attn_base", (MIX,), "f32"),
        "attn_norm_w": (p + "attn_norm.weight", (D,), "bf16"),
        "wq_a": (p + "attn.wq_a.weight", (D, QL), "bf16"),
        "gamma_cq": (p + "attn.q_norm.weight", (QL,), "bf16"),
        "wq_b": (p + "attn.wq_b.weight", (QL, H * HD), "i8"),
        "wkv": (p + "attn.wkv.weight", (D, HD), "bf16"),
        "gamma_ckv": (p + "attn.kv_norm.weight", (HD,), "bf16"),
        "attn_sink": (p + "attn.attn_sink", (H,), "f32"),
        "wo_a": (p + "attn.wo_a.weight", (G, OL, c.o_group_in), "bf16"),
        "wo_b": (p + "attn.wo_b.weight", (G, D, OL), "i8"),
        "hc_ffn_fn": (p + "hc_ffn_fn", (MIX, HCD), "f32"),
        "hc_ffn_scale": (p + "hc_ffn_scale", (3,), "f32"),
        "hc_ffn_base": (p + "hc_ffn_base", (MIX,), "f32"),
        "norm_w": (p + "ffn_norm.weight", (D,), "bf16"),
        "gate_w": (p + "ffn.gate.weight", (E, D), "f32"),
        "shared_w1": (p + "ffn.shared_experts.w1.weight", (I, D), "i8"),
        "shared_w3": (p + "ffn.shared_experts.w3.weight", (I, D), "i8"),
        "shared_w2": (p + "ffn.shared_experts.w2.weight", (D, I), "i8"),
    }
    if layer < c.num_hash_layers:
        s["tid2eid"] = (p + "ffn.gate.tid2eid", (c.vocab_size, K), "i32")
    else:
        s["gate_bias"] = (p + "ffn.gate.bias", (E,), "f32")
    kind = c.layer_kind(layer)
    if kind == "csa":
        a = p + "attn."
        s.update({
            "csa_cmp_wkv": (a + "compressor.wkv.weight", (2 * HD, D), "bf16"),
            "csa_cmp_wgate": (a + "compressor.wgate.weight", (2 * HD, D), "bf16"),
            "csa_cmp_ape": (a + "compressor.ape", (4, 2 * HD), "f32"),
            "csa_cmp_norm_w": (a + "compressor.norm.weight", (HD,), "bf16"),
            "csa_idx_wq_b": (a + "indexer.wq_b.weight", (QL, IH * IHD), "i8"),
            "csa_weights_proj": (a + "indexer.weights_proj.weight", (D, IH), "bf16"),
            "csa_inner_wkv": (a + "indexer.compressor.wkv.weight", (2 * IHD, D), "bf16"),
            "csa_inner_wgate": (a + "indexer.compressor.wgate.weight", (2 * IHD, D), "bf16"),
            "csa_inner_ape": (a + "indexer.compressor.ape", (4, 2 * IHD), "f32"),
            "csa_inner_norm_w": (a + "indexer.compressor.norm.weight", (IHD,), "bf16"),
        })
    elif kind == "hca":
        a = p + "attn.compressor."
        s.update({
            "hca_cmp_wkv": (a + "wkv.weight", (HD, D), "bf16"),
            "hca_cmp_wgate": (a + "wgate.weight", (HD, D), "bf16"),
            "hca_cmp_ape": (a + "ape", (128, HD), "f32"),
            "hca_cmp_norm_w": (a + "norm.weight", (HD,), "bf16"),
        })
    return s


def _expert_specs(c, layer: int, e: int):
    D, I = c.hidden_size, c.moe_intermediate_size
    p = f"layers.{layer}.ffn.experts.{e}."
    return {"routed_w1": (p + "w1.weight", (I, D), "i8"), "routed_w3": (p + "w3.weight", (I, D), "i8"),
            "routed_w2": (p + "w2.weight", (D, I), "i8")}


# ABI orientation <-> official [out, in] orientation
def to_real(name: str, x: np.ndarray) -> np.ndarray:
    if name in IN_OUT:
        return np.ascontiguousarray(x.T)
    if name == "wo_a":
        return x.reshape(-1, x.shape[-1])
    if name == "wo_b":                       # [G, D, OL] -> [D, G*OL]
        return np.ascontiguousarray(x.transpose(1, 0, 2).reshape(x.shape[1], -1))
    return x


def from_real(name: str, x: np.ndarray, shape) -> np.ndarray:
    if name in IN_OUT:
        return np.ascontiguousarray(x.T)
    if name == "wo_b":
        G, D, OL = shape
        return np.ascontiguousarray(x.reshape(D, G, OL).transpose(1, 0, 2))
    return x.reshape(shape)


def real_names(cfg, *, experts: bool = True) -> dict:
    """Real tensor name -> (scope, ABI name) for every tensor of the checkpoint."""
    out = {v[0]: (("model",), k) for k, v in _model_specs(cfg).items()}
    for layer in range(cfg.num_hidden_layers):
        for k, v in _layer_specs(cfg, layer).items():
            out[v[0]] = (("layer", layer), k)
            if v[2] == "i8":
                out[v[0] + "_scale"] = (("layer", layer), k + "_scale")
        if experts:
            for e in range(cfg.n_routed_experts):
                for k, v in _expert_specs(cfg, layer, e).items():
                    out[v[0]] = (("expert", layer, e), k)
                    out[v[0] + "_scale"] = (("expert", layer, e), k + "_scale")
    return out


# ---- synthetic -------------------------------------------------------------------------------
def _hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    if h.shape[0] != n:
        raise AbiError("index_head_dim", n, "a power of two (Sylvester Hadamard)", where="synthetic checkpoint")
    return h / np.sqrt(n)


class SyntheticCheckpoint:
    """Seeded random weights with the real names and W8A8 layout, generated on first use.

    Each tensor is drawn from its own generator seeded by (seed, layer, expert, name), so any
    (layer, expert) can be produced alone: one FLASH-shaped layer fits a laptop.  Scales keep the
    activations O(1) through the residual streams."""

    def __init__(self, cfg, seed: int = 0, cache_layers: int = 64, cache_experts: int = 4096):
        self.cfg, self.seed = cfg, seed
        self.layer = lru_cache(maxsize=cache_layers)(self._layer)
        self.expert = lru_cache(maxsize=cache_experts)(self._expert)
        self.model = lru_cache(maxsize=1)(self._model)

    def _rng(self, *key):
        tag = zlib.crc32(repr(key).encode())
        return np.random.default_rng([self.seed, tag])

    def _draw(self, key, name, shape, dtype, fan_in=None):
        rng = self._rng(*key, name)
        c = self.cfg
        if dtype == "i8":
            n = int(np.prod(shape))          # random bytes are ~10x faster than integers(); -128 -> -127
            w = np.maximum(np.frombuffer(rng.bytes(n), np.int8), -127).reshape(shape)
            if name in IN_OUT:      # ABI [in, out]: one scale per column
                return w, (rng.uniform(0.8, 1.2, size=shape[-1]) / (73.3 * np.sqrt(shape[0]))).astype(np.float32)
            scale = (rng.uniform(0.8, 1.2, size=shape[:-1]) / (73.3 * np.sqrt(shape[-1]))).astype(np.float32)
            if len(shape) == 3:     # wo_b [G, D, OL]: one scale per output row d, fan-in G*OL
                scale = scale[0] / np.sqrt(shape[0])
            return w, scale
        if name.endswith(("norm_w", "gamma_cq", "gamma_ckv")):
            return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32).astype(BF16)
        if name in ("hc_attn_fn", "hc_ffn_fn", "hc_head_fn"):
            return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)
        if name in ("hc_attn_scale", "hc_ffn_scale", "hc_head_scale"):
            return rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
        if name in ("hc_attn_base", "hc_ffn_base", "hc_head_base"):
            return (0.5 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        if name == "attn_sink":
            return rng.standard_normal(shape, dtype=np.float32).astype(np.float32)
        if name.endswith("_ape"):
            return (0.3 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        if name == "gate_bias":
            return (0.05 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        if name == "gate_w":
            return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)
        if name == "tid2eid":        # K distinct experts per token: resample duplicates until none
            ids = rng.integers(0, c.n_routed_experts, shape).astype(np.int32)
            while True:
                s = np.sort(ids, axis=1)
                dup = np.zeros(shape, bool)
                dup[:, 1:] = s[:, 1:] == s[:, :-1]
                if not dup.any():
                    return ids
                ids = np.where(dup, rng.integers(0, c.n_routed_experts, shape), s).astype(np.int32)
        if name in ("embed_weight",):
            return rng.standard_normal(shape, dtype=np.float32).astype(np.float32).astype(BF16)
        fan_in = fan_in or (shape[-1] if name in ("lm_head_weight",) or "cmp" in name or "inner" in name
                            else shape[-2] if len(shape) == 2 else shape[-1])
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)).astype(np.float32).astype(BF16)

    def _fill(self, key, specs):
        out = {}
        for name, (_, shape, dtype) in specs.items():
            v = self._draw(key, name, shape, dtype)
            if dtype == "i8":
                out[name], out[name + "_scale"] = v[0], v[1]
            else:
                out[name] = v
        return out

    def _model(self):
        return self._fill(("model",), _model_specs(self.cfg))

    def _layer(self, layer: int):
        if not 0 <= layer < self.cfg.num_hidden_layers:
            raise AbiError("layer", layer, f"0..{self.cfg.num_hidden_layers - 1}", where="checkpoint")
        d = self._fill(("layer", layer), _layer_specs(self.cfg, layer))
        if "csa_cmp_wkv" in d:
            d["csa_hadamard_idx"] = _hadamard(self.cfg.index_head_dim).astype(np.float32).astype(BF16)
        if "tid2eid" not in d:
            d["gate_bias"] = d.get("gate_bias")
        else:
            d["gate_bias"] = np.zeros(self.cfg.n_routed_experts, np.float32)
        return d

    def _expert(self, layer: int, e: int):
        if not 0 <= e < self.cfg.n_routed_experts:
            raise AbiError("expert", e, f"0..{self.cfg.n_routed_experts - 1}", where="checkpoint")
        return self._fill(("expert", layer, e), _expert_specs(self.cfg, layer, e))


# ---- safetensors on disk -----------------------------------------------------------------------
_ST_DTYPES = {"BF16": BF16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I32": np.int32,
              "I64": np.int64, "F16": np.float16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "U8": np.uint8}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


def read_safetensors_header(path: str) -> tuple[int, dict]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def write_safetensors(path: str, tensors: dict) -> None:
    """Minimal safetensors writer (the format: u64 header length, JSON header, raw little-endian data)."""
    header, off, blobs = {}, 0, []
    for name, x in tensors.items():
        x = np.ascontiguousarray(x)
        b = x.tobytes()
        header[name] = {"dtype": _ST_NAMES[x.dtype], "shape": list(x.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


class SafetensorsCheckpoint:
    """A real checkpoint directory (*.safetensors, official names), memory-mapped and converted to
    the ABI layout per (layer, expert) on first use."""

    def __init__(self, path: str, cfg, cache_layers: int = 64, cache_experts: int = 4096):
        self.cfg, self.path = cfg, path
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise AbiError("checkpoint_dir", path, "a directory holding *.safetensors files", where="loader")
        self._where = {}
        for f in files:
            base, header = read_safetensors_header(os.path.join(path, f))
            for name, meta in header.items():
                self._where[name] = (os.path.join(path, f), base, meta)
        self.layer = lru_cache(maxsize=cache_layers)(self._layer)
        self.expert = lru_cache(maxsize=cache_experts)(self._expert)
        self.model = lru_cache(maxsize=1)(self._model)

    def names(self):
        return sorted(self._where)

    def raw(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise AbiError("tensor", name, "a tensor name present in the checkpoint", where=self.path)
        f, base, meta = self._where[name]
        dt = _ST_DTYPES.get(meta["dtype"])
        if dt is None:
            raise AbiError("dtype", meta["dtype"], f"one of {sorted(_ST_DTYPES)}", where=name)
        a, b = meta["data_offsets"]
        mm = np.memmap(f, dtype=np.uint8, mode="r", offset=base + a, shape=(b - a,))
        return np.asarray(mm.view(dt).reshape(meta["shape"]))

    def _load(self, specs, optional=()):
        out = {}
        for abi, (real, shape, dtype) in specs.items():
            if real not in self._where and abi in optional:
                continue
            x = self.raw(real)
            want = np.dtype({"bf16": BF16, "f32": np.float32, "i8": np.int8, "i32": np.int32}[dtype])
            if x.dtype != want:
                raise AbiError(real, str(x.dtype), f"dtype {want} (the W8A8 layout)", where=self.path)
            out[abi] = from_real(abi, x, shape)
            if tuple(out[abi].shape) != tuple(shape):
                raise AbiError(real, tuple(x.shape), f"a tensor of ABI shape {shape}", where=self.path)
            if dtype == "i8":
                out[abi + "_scale"] = self.raw(real + "_scale").astype(np.float32).reshape(-1)
        return out

    def _model(self):
        return self._load(_model_specs(self.cfg))

    def _layer(self, layer: int):
        d = self._load(_layer_specs(self.cfg, layer))
        if "csa_cmp_wkv" in d:
            d["csa_hadamard_idx"] = _hadamard(self.cfg.index_head_dim).astype(np.float32).astype(BF16)
        if "gate_bias" not in d:
            d["gate_bias"] = np.zeros(self.cfg.n_routed_experts, np.float32)
        return d

    def _expert(self, layer: int, e: int):
        return self._load(_expert_specs(self.cfg, layer, e))


def w8a8_tensors(spec_sets) -> dict:
    """[(ABI tensors, specs)] -> {real name: array} in the W8A8 serving layout (INT8 `.weight` with an
    f32 `.weight_scale` [out, 1], the official orientation)."""
    tensors = {}
    for src, specs in spec_sets:
        for abi, (real, _, dtype) in specs.items():
            tensors[real] = to_real(abi, np.asarray(src[abi]))
            if dtype == "i8":
                tensors[real + "_scale"] = np.asarray(src[abi + "_scale"], np.float32).reshape(-1, 1)
    return tensors


def save_checkpoint(ckpt, path: str, *, shard_layers: int = 4) -> list[str]:
    """Write any checkpoint (synthetic or loaded) to `path` as safetensors with the real names."""
    os.makedirs(path, exist_ok=True)
    cfg = ckpt.cfg
    files = []
    groups = [[("model",)]] + [[("layer", l) for l in range(i, min(i + shard_layers, cfg.num_hidden_layers))]
                               for i in range(0, cfg.num_hidden_layers, shard_layers)]
    for gi, group in enumerate(groups):
        tensors = {}
        for scope in group:
            if scope[0] == "model":
                src, specs = ckpt.model(), _model_specs(cfg)
                spec_sets = [(src, specs)]
            else:
                layer = scope[1]
                spec_sets = [(ckpt.layer(layer), _layer_specs(cfg, layer))]
                spec_sets += [(ckpt.expert(layer, e), _expert_specs(cfg, layer, e)) for e in range(cfg.n_routed_experts)]
            tensors.update(w8a8_tensors(spec_sets))
        name = os.path.join(path, f"model-{gi:05d}-of-{len(groups):05d}.safetensors")
        write_safetensors(name, tensors)
        files.append(name)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=1)
    return files
