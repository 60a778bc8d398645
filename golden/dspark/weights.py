"""Seeded synthetic DSpark drafter weights, in the checkpoint protocol of `golden.checkpoint`.

  model()        -> main_proj_weight [D, 3D], main_norm_weight, final_norm_weight, markov_w1/w2
                    [V, r], confidence_head_weight [1, D + r], hc_head_fn/scale/base (the drafter's)
  layer(l)       -> draft layer l (0..2): the SWA-layer parameter set + a score-routed MoE gate
  expert(l, e)   -> routed expert e of draft layer l

The embedding and the LM head are the target's (serving binds the drafter LM head to the target's
TP shard, kernel-math.md §7 #18).  Real names (draft_model_specs, draft_layer_specs,
draft_expert_specs) are the DSpark serving checkpoint's `mtp.<l>.` ones; golden.release loads them.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..checkpoint import BF16, SyntheticCheckpoint, _expert_specs, _layer_specs
from twin.abi.errors import AbiError


def draft_model_specs(cfg) -> dict:
    """The drafter's own non-layer tensors: ABI name -> (real name, shape, dtype).  main_proj /
    main_norm sit on draft stage 0, the final norm, the Markov and confidence heads and the
    drafter's hc_head on stage 2 (the DSpark serving checkpoint's `mtp.*` names)."""
    D, V, r, HC = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank, cfg.hc_mult
    last = f"mtp.{cfg.dspark_num_layers - 1}."
    return {
        "main_proj_weight": ("mtp.0.main_proj.weight", (D, 3 * D), "bf16"),
        "main_norm_weight": ("mtp.0.main_norm.weight", (D,), "bf16"),
        "final_norm_weight": (last + "norm.weight", (D,), "bf16"),
        "markov_w1": (last + "markov_head.markov_w1.weight", (V, r), "bf16"),
        "markov_w2": (last + "markov_head.markov_w2.weight", (V, r), "bf16"),
        "confidence_head_weight": (last + "confidence_head.proj.weight", (1, D + r), "f32"),
        "hc_head_fn": (last + "hc_head_fn", (HC, HC * D), "f32"),
        "hc_head_scale": (last + "hc_head_scale", (1,), "f32"),
        "hc_head_base": (last + "hc_head_base", (HC,), "f32"),
    }


def draft_expert_specs(cfg, l: int, e: int) -> dict:
    """Routed expert e of draft layer l: the drafter's own experts, under its `mtp.<l>.` prefix."""
    return {k: (real.replace(f"layers.{l}.", f"mtp.{l}.", 1), shape, dtype)
            for k, (real, shape, dtype) in _expert_specs(cfg, l, e).items()}


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
        return self._fill(("dspark", "expert", l, e), draft_expert_specs(self.cfg, l, e))

    def _draft_model(self):
        c = self.cfg
        D, V, r = c.hidden_size, c.vocab_size, c.dspark_markov_rank
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
        specs = draft_model_specs(c)
        head = ("hc_head_fn", "hc_head_scale", "hc_head_base")
        out.update(self._fill(("dspark", "head"), {k: specs[k] for k in head}))
        return out
