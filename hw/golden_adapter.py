"""The one place that decides which golden the lockstep compares against.

`GoldenExecutor.run(dispatch, state, device=...)` returns the golden's outputs, touched state,
taps in dependency order, the rows each pool maps (for the mapped/unmapped rule) and the decisions
it re-synced from the device.  Today it runs the NumPy reference step (`hw.model.golden_np`); when
golden's compositions (`golden.compose.prefill_fwd/decode_fwd`, `golden.dspark` fused step and
seeding) and the lowering's `Dispatch` land with the same contract, this adapter is what switches.

Those compositions are checked today by `hw.real` (`dspark-twin lockstep --golden real`): golden.compose
and golden.dspark driven through twin.abi.lowering, their taps localized with COMPOSE_STAGE_KIND below.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from twin.abi.batches import Dispatch

from .backend import StepResult, touched_pools
from .model.golden_np import GoldenStep
from .model.spec import Geometry
from .model.weights import Weights


class GoldenExecutor:
    name = "golden:numpy"

    def __init__(self, geo: Geometry, weights: Weights):
        self.geo = geo
        self.step = GoldenStep(geo, weights)

    def run(self, dispatch: Dispatch, state: Mapping[str, np.ndarray], device: StepResult | None = None,
            tie_tols: dict | None = None) -> StepResult:
        pools = {k: state[k] for k in touched_pools(dispatch.program)}
        out = self.step.run(dispatch.program, dict(dispatch.args), pools,
                            dev=None if device is None else device.taps, tol=tie_tols)
        return StepResult(out.outputs, out.state, out.taps, out.mapped, out.resyncs)


# golden.compose's tap stages (golden/compose.py `Taps`) -> (op class, dtype, quantization)
COMPOSE_STAGE_KIND = {
    "attn_in": ("activation", "f32", "w8a8"), "x_hc": ("activation", "f32", "w8a8"),
    "attn_x_hc": ("activation", "f32", "w8a8"), "x_mixed": ("norm", "bf16", "none"),
    "ffn_x_mixed": ("norm", "bf16", "none"), "x_norm": ("norm", "bf16", "none"), "q": ("matmul", "bf16", "none"),
    "kv": ("matmul", "bf16", "none"), "cmp_kv": ("matmul", "bf16", "none"), "idx_topk": ("route", "i32", "none"),
    "attn": ("attention", "bf16", "none"), "attn_out": ("matmul", "bf16", "none"),
    "moe_indices": ("route", "i32", "none"), "moe_weights": ("state", "f32", "none"),
    "ffn_out": ("moe", "bf16", "w8a8"), "hidden": ("activation", "bf16", "w8a8"), "logits": ("logits", "f32", "none"),
}


def compose_kind(site) -> tuple[str, str, str]:
    """Kind of a golden.compose tap (layer, stage) for the tolerance policy."""
    from twin.abi.errors import AbiError

    try:
        return COMPOSE_STAGE_KIND[site[1]]
    except KeyError:
        raise AbiError("stage", site[1], f"one of {sorted(COMPOSE_STAGE_KIND)}", where="golden.compose taps") from None


class GoldenBackend:
    """The golden as a plain backend (no device to re-sync from): for device-free runs and replay."""

    name = "golden:numpy"

    def __init__(self, geo: Geometry, weights: Weights):
        self.exec = GoldenExecutor(geo, weights)

    def run(self, dispatch: Dispatch, state: Mapping[str, np.ndarray]) -> StepResult:
        return self.exec.run(dispatch, state)
