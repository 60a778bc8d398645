"""Lowering: scheduler batches -> validated kernel arguments (serving-contract.md §5.8, §6, §7.1-7.4).

    ctx = LoweringContext(deployment("flash", ep=16), slots=2)
    d = lower_prefill(batch, ctx)           # l3_prefill_fwd
    validate(d, ctx)                        # raises DispatchError(program, arg, rule)

`lower_decode` (l3_decode_fwd, split), `lower_fused` (l3_decode_fwd_dspark), `lower_drafter`,
`lower_bootstrap` (l3_dspark_draft_step_device_state), `lower_markov` and `lower(batch, ctx)` (by
batch type and K) build the other programs.  Lowering builds the host-staged inputs; weights, cache
pools, scratch and outputs belong to the executor, and `validate` checks them when present.
"""
from .context import DispatchError, LoweringContext, from_bf16_bits, to_bf16_bits
from .decode import lower_decode
from .drafter import (filler_ring_table, filler_slot, lease_ring_table, lease_slot, lower_bootstrap, lower_drafter,
                      lower_markov, seeding_waves)
from .fused import lower_fused
from .grammar import Constraint, pack_rows, row_mode, unpack_allowed
from .prefill import lower_prefill
from .validate import RULES, validate


def lower(batch, ctx: LoweringContext, **kw):
    """Lower a batch to the program the deployment compiles for it: packed prefill; split decode
    at K=0 and the fused K=7 decode at K=7; the bootstrap seed for a drafter batch."""
    from ..batches import DecodeBatch, DrafterBatch, PrefillBatch
    if isinstance(batch, PrefillBatch):
        return lower_prefill(batch, ctx, **kw)
    if isinstance(batch, DecodeBatch):
        return lower_fused(batch, ctx, **kw) if ctx.deployment.k else lower_decode(batch, ctx, **kw)
    if isinstance(batch, DrafterBatch):
        return lower_bootstrap(batch, ctx, **kw)
    raise DispatchError("lower", "batch", "batch_type", type(batch).__name__,
                        "a PrefillBatch, DecodeBatch or DrafterBatch")


__all__ = ["DispatchError", "LoweringContext", "from_bf16_bits", "to_bf16_bits", "lower_decode", "lower_fused",
           "lower_prefill", "lower_drafter", "lower_bootstrap", "lower_markov", "seeding_waves", "lease_ring_table",
           "filler_ring_table", "filler_slot", "lease_slot", "Constraint", "pack_rows", "row_mode", "unpack_allowed",
           "RULES", "validate", "lower"]
