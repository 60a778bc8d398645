"""Seeded synthetic DSpark drafter weights, in the checkpoint protocol of `golden.checkpoint`.

  model()        -> main_proj_weight [D, 3D], main_norm_weight, final_norm_weight, markov_w1/w2
                    [V, r], confidence_head_weight [1, D + r], hc_head_fn/scale/base (the drafter's)
  layer(l)       -> draft layer l (0..2): the SWA-layer parameter set + a score-routed MoE gate
  expert(l, e)   -> routed expert e of draft layer l

The embedding and the LM head are the target's (serving binds the drafter LM head to the target's
TP shard, kernel-math.md §7 #18).  Real names use the official V4.1 `mtp.<l>.` prefix.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..checkpoint import BF16, SyntheticCheckpoint, _expert_specs, _layer_specs
from twin.abi.errors import AbiError


def draft_layer_specs(cfg, l: int) -> dict:
    """A draft layer: the SWA attention set of target layer 0, routed by score (no tid2eid)."""
    specs = {}
    for name, (real, shape, dtype) in _layer_specs(cfg, 0).items():
        if name == "tid2eid":
            continue
        specs[name] = (real.replace("layers.0.", f"mtp.{l}."), shape, dtype)
    specs["gate_bias"] = (f"mtp.{l}.ffn.gate.bias", (cfg.n_routed_experts,), "f32")
    return specs


class DrafterCheckpoint(SyntheticCheckpoint):
    """Drafter weights drawn with the same per-tensor seeding as the target's synthetic checkpoint."""

    def __init__(self, cfg, seed: int = 0):
        super().__init__(cfg, seed)
        self.layer = lru_cache(maxsize=cfg.dspark_num_layers)(self._draft_layer)
        self.expert = lru_cache(maxsize=4096)(self._draft_expert)
        self.model = lru_cache(maxsize=1)(self._draft_model)

    def _check(self, l):
        if not 0 <= l < self.cfg.dspark_num_layers:
            raise AbiError("draft_layer", l, f"0..{self.cfg.dspark_num_layers - 1}", where="drafter checkpoint")

    def _draft_layer(self, l: int):
        self._check(l)
        return self._fill(("dspark", "layer", l), draft_layer_specs(self.cfg, l))

    def _draft_expert(self, l: int, e: int):
        self._check(l)
        if not 0 <= e < self.cfg.n_routed_experts:
            raise AbiError("expert", e, f"0..{self.cfg.n_routed_experts - 1}", where="drafter checkpoint")
        return self._fill(("dspark", "expert", l, e), _expert_specs(self.cfg, l, e))

    def _draft_model(self):
        c = self.cfg
        D, V, r, HC = c.hidden_size, c.vocab_size, c.dspark_markov_rank, c.hc_mult
        rng = self._rng("dspark", "model")
        bf = lambda a: a.astype(np.float32).astype(BF16)      # noqa: E731
        out = {
            "main_proj_weight": bf(rng.standard_normal((D, 3 * D)) / np.sqrt(3 * D)),
            "main_norm_weight": bf(1.0 + 0.1 * rng.standard_normal(D)),
            "final_norm_weight": bf(1.0 + 0.1 * rng.standard_normal(D)),
            "markov_w1": bf(rng.standard_normal((V, r))),
            "markov_w2": bf(rng.standard_normal((V, r)) / np.sqrt(r)),
            "confidence_head_weight": (rng.standard_normal((1, D + r)) / np.sqrt(D + r)).astype(np.float32),
        }
        out.update(self._fill(("dspark", "head"), {
            "hc_head_fn": ("mtp.hc_head_fn", (HC, HC * D), "f32"),
            "hc_head_scale": ("mtp.hc_head_scale", (1,), "f32"),
            "hc_head_base": ("mtp.hc_head_base", (HC,), "f32")}))
        return out
