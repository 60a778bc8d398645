"""Real checkpoints in the layouts serving meets, target and drafter alike, into golden's W8A8 forms.

  the official release   FP8 e4m3 `.weight` with ue8m0 (e8m0: 2^(e - 127)) block scales in `.scale`
                         [ceil(out / B), ceil(in / B)] (B = 128 for V4-Flash, 32 for V4.1), FP4 e2m1
                         routed experts (two per byte, the even element in the low nibble) with one
                         ue8m0 scale per 32 inputs [out, in / 32], BF16 / FP32 where it keeps them
  the W8A8 serving one   compressed-tensors: INT8 `.weight` + FP32 `.weight_scale` [out, 1] (what the
                         device runs; golden.checkpoint.SafetensorsCheckpoint's layout)

The names are the official ones (golden.checkpoint.real_names) plus the drafter's `mtp.<l>.*`
(golden.dspark.weights).  Every tensor is decoded by what its file says it is: an FP8 or FP4 tensor
becomes f32 through its scales, then takes the ABI dtype (an INT8 entry is quantized per output row
by the W8A8 rule, numerics.q8, as the serving checkpoint's converter does; a BF16 entry is rounded).

    ck = RealCheckpoint(path, cfg)        # .model() .layer(l) .expert(l, e): the target
    dk = ck.drafter()                     # .model() .layer(l) .expert(l, e): the drafter (mtp.*)
"""
from __future__ import annotations

from functools import lru_cache

import ml_dtypes
import numpy as np

from twin.abi.errors import AbiError

from .checkpoint import (BF16, SafetensorsCheckpoint, _expert_specs, _layer_specs, _model_specs, from_real,
                         w8a8_tensors, write_safetensors)
from .numerics import numerics

FP4_BLOCK = 32
# the 16 e2m1 codes: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    np.float32)
_ABI_DTYPES = {"bf16": BF16, "f32": np.float32, "i8": np.int8, "i32": np.int32}
_W8 = numerics("device")


def ue8m0(e) -> np.ndarray:
    """e8m0 scale bytes -> f32 powers of two 2^(e - 127); 255 is e8m0's NaN."""
    e = np.asarray(e).view(np.uint8) if np.asarray(e).dtype != np.uint8 else np.asarray(e)
    if np.any(e == 255):
        raise AbiError("scale", "e8m0 0xFF", "finite ue8m0 scales (0xFF is NaN)", where="release checkpoint")
    return np.ldexp(np.float32(1.0), e.astype(np.int32) - 127).astype(np.float32)


def fp4_e2m1(packed) -> np.ndarray:
    """[..., n / 2] bytes -> [..., n] f32: element 2i in the low nibble, 2i + 1 in the high one."""
    b = np.asarray(packed).view(np.uint8)
    out = np.empty(b.shape[:-1] + (2 * b.shape[-1],), np.float32)
    out[..., 0::2] = FP4_E2M1[b & 0x0F]
    out[..., 1::2] = FP4_E2M1[b >> 4]
    return out


FP8_BLOCKS = (128, 64, 32)


def fp8_block(weight_shape, scale_shape) -> int:
    """The block edge that gives `scale_shape` for `weight_shape` (powers of two: unambiguous, as two
    that give the same counts put the whole tensor in one block)."""
    for b in FP8_BLOCKS:
        if tuple(scale_shape) == tuple(-(-n // b) for n in weight_shape):
            return b
    raise AbiError("scale", tuple(scale_shape), f"ceil(shape / B) of {tuple(weight_shape)} for B in {FP8_BLOCKS}",
                   where="release checkpoint")


def dequant_fp8(w, scale, block: int) -> np.ndarray:
    """FP8 e4m3 [out, in] with ue8m0 scales [ceil(out / block), ceil(in / block)] -> f32."""
    w = np.asarray(w).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    out, n = w.shape
    want = (-(-out // block), -(-n // block))
    if tuple(np.shape(scale)) != want:
        raise AbiError("scale", tuple(np.shape(scale)), f"{want} (one per {block} x {block} block of {w.shape})",
                       where="release checkpoint")
    s = ue8m0(scale)
    return w * np.repeat(np.repeat(s, block, axis=0), block, axis=1)[:out, :n]


def dequant_fp4(packed, scale, block: int = FP4_BLOCK) -> np.ndarray:
    """FP4 e2m1 [out, in / 2] bytes with ue8m0 scales [out, in / block] -> f32 [out, in]."""
    w = fp4_e2m1(packed)
    want = (w.shape[0], -(-w.shape[1] // block))
    if tuple(np.shape(scale)) != want:
        raise AbiError("scale", tuple(np.shape(scale)), f"{want} (one per {block} inputs of {w.shape})",
                       where="release checkpoint")
    return w * np.repeat(ue8m0(scale), block, axis=1)[:, :w.shape[1]]


def w8_rows(w) -> tuple[np.ndarray, np.ndarray]:
    """f32 [out, in] -> (int8 [out, in], f32 scale [out]): the W8A8 rule per output row."""
    q, dq = _W8.q8(np.asarray(w, np.float32))
    return np.asarray(q).astype(np.int8), np.asarray(dq, np.float32).reshape(-1)


def real_shape(abi: str, shape) -> tuple:
    """The official [out, in] shape of an ABI tensor (golden.checkpoint.to_real's reshapes, on shapes)."""
    from .checkpoint import IN_OUT
    if abi in IN_OUT:
        return tuple(reversed(shape))
    if abi == "wo_a":
        return (shape[0] * shape[1], shape[2])
    if abi == "wo_b":
        return (shape[1], shape[0] * shape[2])
    return tuple(shape)


# the V4.1 release names the Markov head's tables after its modules
ALIASES = {"markov_head.markov_w1.weight": "markov_head.embed.weight",
           "markov_head.markov_w2.weight": "markov_head.head.weight"}


class RealCheckpoint(SafetensorsCheckpoint):
    """A checkpoint directory in either layout (or a mix): the golden checkpoint protocol over it.
    The FP8 block edge of each weight follows from its scale's shape (128 in V4-Flash, 32 in V4.1)."""

    def raw(self, name: str) -> np.ndarray:
        """The stored tensor: F8_E4M3 as ml_dtypes e4m3, F8_E8M0 as its bytes, F4 as packed bytes
        [..., n / 2] (safetensors gives an F4 tensor its element shape)."""
        if name in self._where:
            f, base, meta = self._where[name]
            if meta["dtype"] in ("F8_E8M0", "F4"):
                a, b = meta["data_offsets"]
                mm = np.asarray(np.memmap(f, dtype=np.uint8, mode="r", offset=base + a, shape=(b - a,)))
                shape = list(meta["shape"])
                if meta["dtype"] == "F4":
                    if shape[-1] % 2:
                        raise AbiError(name, tuple(shape), "an even last dimension (two FP4 values a byte)",
                                       where=self.path)
                    shape[-1] //= 2
                return mm.reshape(shape)
        return super().raw(name)

    def stored_dtype(self, name: str) -> str:
        if name not in self._where:
            raise AbiError("tensor", name, "a tensor name present in the checkpoint", where=self.path)
        return self._where[name][2]["dtype"]

    def decoded(self, real: str) -> tuple[np.ndarray, np.ndarray | None]:
        """-> (values in the official [out, in] orientation, the W8A8 scale when stored as INT8).
        FP8 / FP4 tensors come back dequantized to f32."""
        dt = self.stored_dtype(real)
        stem = real[:-len("weight")] if real.endswith(".weight") else real + "."
        if dt == "F8_E4M3":
            w, sc = self.raw(real), self.raw(stem + "scale")
            return dequant_fp8(w, sc, fp8_block(w.shape, sc.shape)), None
        if dt == "F4" or (dt in ("I8", "U8") and stem + "scale" in self._where):
            # FP4 stored as F4 (element shape) or as packed bytes [out, in / 2] beside an e8m0 `.scale`
            return dequant_fp4(self.raw(real), self.raw(stem + "scale")), None
        if dt == "I8":
            return self.raw(real), self.raw(real + "_scale").astype(np.float32).reshape(-1)
        return self.raw(real), None

    def _load(self, specs, optional=()):
        out = {}
        for abi, (real, shape, dtype) in specs.items():
            if real not in self._where and abi in optional:
                continue
            x, scale = self.decoded(real)
            if dtype == "i8":
                if scale is None:
                    x, scale = w8_rows(x)
                x = from_real(abi, x, shape)
                out[abi + "_scale"] = scale
            elif scale is not None:
                raise AbiError(real, "I8", f"a {dtype} tensor (or FP8 / FP4 with its scales)", where=self.path)
            else:
                x = from_real(abi, np.asarray(x).astype(np.float32) if dtype in ("bf16", "f32") else x, shape)
                x = x.astype(_ABI_DTYPES[dtype])
            if tuple(x.shape) != tuple(shape):
                raise AbiError(real, tuple(np.shape(x)), f"a tensor of ABI shape {shape}", where=self.path)
            out[abi] = x
        return out

    def drafter(self) -> "RealDrafter":
        return RealDrafter(self)


class RealDrafter:
    """The drafter's `mtp.*` tensors of a RealCheckpoint, in the drafter checkpoint protocol."""

    def __init__(self, ck: RealCheckpoint):
        from .dspark.weights import draft_expert_specs, draft_layer_specs, draft_model_specs
        self.ck, self.cfg = ck, ck.cfg
        self._specs = (draft_model_specs, draft_layer_specs, draft_expert_specs)
        n = self.cfg.dspark_num_layers
        self.model = lru_cache(maxsize=1)(self._model)
        self.layer = lru_cache(maxsize=n)(self._layer)
        self.expert = lru_cache(maxsize=4096)(lambda l, e: ck._load(draft_expert_specs(self.cfg, l, e)))

    def _model(self):
        specs = {}
        for abi, (real, shape, dtype) in self._specs[0](self.cfg).items():
            tail = next((a for a in ALIASES if real.endswith(a)), None)
            if real not in self.ck._where and tail is not None:
                real = real[:-len(tail)] + ALIASES[tail]
            specs[abi] = (real, shape, dtype)
        # the V4.1 drafter has no hc_head of its own (golden.dspark.variants.V41)
        return self.ck._load(specs, optional=("hc_head_fn", "hc_head_scale", "hc_head_base"))

    def _layer(self, l: int):
        if not 0 <= l < self.cfg.dspark_num_layers:
            raise AbiError("draft_layer", l, f"0..{self.cfg.dspark_num_layers - 1}", where=self.ck.path)
        return self.ck._load(self._specs[1](self.cfg, l))


def release_names(cfg, *, drafter: bool = True) -> dict:
    """Official name -> (ABI name, ABI dtype, ABI shape) of every weight golden reads, the drafter's
    included: what a release must carry (each FP8 / FP4 weight with its `.scale` beside it)."""
    from .dspark.weights import draft_expert_specs, draft_layer_specs, draft_model_specs
    specs = [_model_specs(cfg)]
    for l in range(cfg.num_hidden_layers):
        specs.append(_layer_specs(cfg, l))
        specs += [_expert_specs(cfg, l, e) for e in range(cfg.n_routed_experts)]
    if drafter:
        specs.append(draft_model_specs(cfg))
        for l in range(cfg.dspark_num_layers):
            specs.append(draft_layer_specs(cfg, l))
            specs += [draft_expert_specs(cfg, l, e) for e in range(cfg.n_routed_experts)]
    return {real: (abi, dtype, shape) for s in specs for abi, (real, shape, dtype) in s.items()}




def save_drafter(dckpt, path: str) -> str:
    """Write a drafter checkpoint's `mtp.*` tensors into `path` in the W8A8 serving layout, beside a
    target written by golden.checkpoint.save_checkpoint (one directory loads as both)."""
    import os
    from .dspark.weights import draft_expert_specs, draft_layer_specs, draft_model_specs
    cfg = dckpt.cfg
    sets = [(dckpt.model(), draft_model_specs(cfg))]
    for l in range(cfg.dspark_num_layers):
        sets.append((dckpt.layer(l), draft_layer_specs(cfg, l)))
        sets += [(dckpt.expert(l, e), draft_expert_specs(cfg, l, e)) for e in range(cfg.n_routed_experts)]
    os.makedirs(path, exist_ok=True)
    name = os.path.join(path, "mtp.safetensors")
    write_safetensors(name, w8a8_tensors(sets))
    return name
