"""Device-side faults for the real-golden lockstep, each with the site it must be localized to.

    weight   layer L's o_proj output scales (wo_b_scale) doubled during dispatch AT (an exponent bit flip
             in HBM)                                                   -> (L, "attn_out")
    route    layer L's router weights (gate_w) perturbed during AT    -> (L, "moe_indices"/"moe_weights")
    kv_row   after AT, one mapped kv_cache row of layer L is off by 0.5 (a bad store)  -> (L, "kv")
    stray    after AT, a kv_cache row of layer L that AT does not map is overwritten (a wild write)
                                                                      -> (L, "kv"), unmapped rows modified
    token    after AT, the first sampled token is replaced (a bad sampler)            -> ("head", "sample")

L is the index of a layer (0..num_hidden_layers-1).  A fault fires once, at dispatch AT.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from twin.abi.errors import AbiError

from .stream import mapped_rows

REAL_KINDS = ("weight", "route", "kv_row", "stray", "token")
EXPECTED_STAGES = {"weight": ("attn_out",), "route": ("moe_indices", "moe_weights"), "kv_row": ("kv",),
                   "stray": ("kv",), "token": ("sample",)}


class _FaultyCheckpoint:
    def __init__(self, base, fault):
        self.base, self.fault = base, fault

    def __getattr__(self, name):
        return getattr(self.base, name)

    def layer(self, layer):
        w = self.base.layer(layer)
        f = self.fault
        if not f.armed or layer != f.layer or f.kind not in ("weight", "route"):
            return w
        w = dict(w)
        if f.kind == "weight":
            w["wo_b_scale"] = np.asarray(w["wo_b_scale"]) * np.float32(2.0)
        else:
            rng = np.random.default_rng(f.seed)
            g = np.asarray(w["gate_w"], np.float32)
            w["gate_w"] = (g + rng.standard_normal(g.shape).astype(np.float32) * np.abs(g).max()).astype(g.dtype)
        f.fired = f.fired or f"{f.kind} at dispatch {f.at}, layer {layer}"
        return w


@dataclass
class RealFault:
    kind: str
    at: int = 0
    layer: int = 0
    seed: int = 0
    armed: bool = False
    fired: str | None = None

    def __post_init__(self):
        if self.kind not in REAL_KINDS:
            raise AbiError("kind", self.kind, f"one of {REAL_KINDS}", where="hw.real fault")
        if self.at < 0 or self.layer < 0:
            raise AbiError("at/layer", (self.at, self.layer), "non-negative", where="hw.real fault")

    def attach(self, side) -> None:
        n = side.g.cfg.num_hidden_layers
        if self.layer >= n:
            raise AbiError("layer", self.layer, f"0..{n - 1}", where="hw.real fault")
        side.g.ckpt = _FaultyCheckpoint(side.g.ckpt, self)

    def arm(self, index: int) -> None:
        self.armed = index == self.at

    def after(self, side, rd, out: dict) -> dict:
        if not self.armed:
            return out
        self.armed = False
        if self.kind == "token":
            name = next(k for k in ("sampled_ids", "accepted_ids") if k in out) if rd.kind != "seed" else None
            if name is None:
                return out
            out = dict(out)
            v = np.array(out[name])
            v.reshape(-1)[0] = (v.reshape(-1)[0] + 1) % side.g.cfg.vocab_size
            out[name] = v
            self.fired = f"token at dispatch {self.at}: {name}[0]"
        elif self.kind in ("kv_row", "stray"):
            pools = dict(side.run.caches[self.layer])
            kv = np.array(pools["kv_cache"])
            flat = kv.reshape(-1, kv.shape[-1])
            mapped = mapped_rows(side.par.calls)["kv_cache"]
            if self.kind == "kv_row" and not mapped.size:
                return out                      # a seed dispatch writes no target row: nothing to corrupt
            if self.kind == "kv_row":
                row = int(mapped[len(mapped) // 2])
                flat[row] = (flat[row].astype(np.float32) + 0.5).astype(flat.dtype)
            else:
                row = int(np.setdiff1d(np.arange(flat.shape[0]), mapped)[-1])
                flat[row] = np.asarray(np.full(flat.shape[1], 3.0, np.float32)).astype(flat.dtype)
            pools["kv_cache"] = kv
            side.run.caches[self.layer] = pools
            self.fired = f"{self.kind} at dispatch {self.at}: layer {self.layer} kv_cache row {row}"
        return out
