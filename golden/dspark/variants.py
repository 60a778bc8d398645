"""Which drafter golden computes: the device's (pypto-lib's kernels, the default everywhere) or the
released model's (the official DeepSeek-V4.1-Flash `inference/model.py`), as one record of the
points where the two differ (docs/drafter.md lists them with their sources).

  DEVICE  each sub-layer collapses its input streams with its own pre-weights, the drafter's own
          hc_head collapses the last streams; per-head q renormalization in the block attention;
          the program outputs confidence_probs (sigmoid of the confidence logit); main_hidden is
          hc_head (final-head params) of the outputs of the target layers; the target's experts
          counts; greedy.
  V41     a sub-layer collapses with the pre-weights the previous sub-layer computed (the first
          attention with a one-hot on stream 0, each FFN with its attention's, the head with the
          last FFN's); no hc_head; no q renormalization; the confidence logit is the output;
          main_hidden is the mean over the streams of the inputs of the target layers; its own
          routed / activated expert counts (0 = the target's); temperature 0 (greedy).
"""
from __future__ import annotations

from dataclasses import dataclass

from twin.abi.errors import AbiError

HC_ORDERS = ("own", "carried")
CONFIDENCE_OUTPUTS = ("probability", "logit")


@dataclass(frozen=True)
class DrafterVariant:
    name: str
    target_hidden_tap: str          # golden.compose.TARGET_HIDDEN_TAPS
    hc_order: str                   # "own": each sub-layer's own pre-weights; "carried": the previous one's
    q_head_norm: bool               # per-head RMS renormalization of q in the block attention
    confidence_output: str          # what the Markov program hands out: "probability" or "logit"
    n_routed_experts: int = 0       # the drafter layers' MoE; 0 = the target's
    n_activated_experts: int = 0
    temperature: float = 0.0

    def __post_init__(self):
        from ..compose import TARGET_HIDDEN_TAPS
        where = f"drafter variant {self.name!r}"
        if self.target_hidden_tap not in TARGET_HIDDEN_TAPS:
            raise AbiError("target_hidden_tap", self.target_hidden_tap, f"one of {TARGET_HIDDEN_TAPS}", where=where)
        if self.hc_order not in HC_ORDERS:
            raise AbiError("hc_order", self.hc_order, f"one of {HC_ORDERS}", where=where)
        if self.confidence_output not in CONFIDENCE_OUTPUTS:
            raise AbiError("confidence_output", self.confidence_output, f"one of {CONFIDENCE_OUTPUTS}", where=where)
        for name in ("n_routed_experts", "n_activated_experts"):
            if getattr(self, name) < 0:
                raise AbiError(name, getattr(self, name), ">= 0 (0 = the target's)", where=where)
        if self.temperature != 0:
            # serving verifies greedily: a sampled draft (Gumbel-max) is neither reproducible by
            # lockstep nor what the device's first-max argmax computes
            raise AbiError("temperature", self.temperature, "0 (greedy drafts, as serving verifies them)",
                           where=where)

    def moe_cfg(self, cfg):
        """The model config the drafter layers' MoE runs with (the expert counts overridden)."""
        E = self.n_routed_experts or cfg.n_routed_experts
        k = self.n_activated_experts or min(cfg.num_experts_per_tok, E)
        if not 1 <= k <= E:
            raise AbiError("n_activated_experts", k, f"1..{E} (the drafter's routed experts)",
                           where=f"drafter variant {self.name!r}")
        if (E, k) == (cfg.n_routed_experts, cfg.num_experts_per_tok):
            return cfg
        return cfg.replace(n_routed_experts=E, num_experts_per_tok=k)


DEVICE = DrafterVariant("device", "hc_head_of_outputs", "own", True, "probability")
V41 = DrafterVariant("v4.1", "mean_of_inputs", "carried", False, "logit")
VARIANTS = {v.name: v for v in (DEVICE, V41)}


def drafter_variant(v: str | DrafterVariant) -> DrafterVariant:
    if isinstance(v, DrafterVariant):
        return v
    try:
        return VARIANTS[v]
    except KeyError:
        raise AbiError("drafter", v, f"one of {sorted(VARIANTS)}", where="drafter variant") from None
