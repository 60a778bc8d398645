"""Localizing a divergence: the policy kind of each golden.compose tap stage, and the first tap in
dependency order whose device value fails against the golden's.

The lockstep (hw.real) and the multi-rank check (hw.real.ranks) both name a failure's (layer,
stage) through `first_divergent_tap`, so a divergence is localized by one rule whatever found it.
"""
from __future__ import annotations

from twin.abi.errors import AbiError

from .compare import Finding, compare_tensor
from .tolerance import Policy

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
    try:
        return COMPOSE_STAGE_KIND[site[1]]
    except KeyError:
        raise AbiError("stage", site[1], f"one of {sorted(COMPOSE_STAGE_KIND)}", where="golden.compose taps") from None


def first_divergent_tap(order, device_taps: dict, golden_taps: dict, policy: Policy, kind_of) -> Finding | None:
    """The first site in `order` (dependency order) whose device tap fails against the golden's
    under the policy; `kind_of(site)` gives its (op class, dtype, quant).  Sites either side lacks
    are skipped; a multi-part tap (a tuple or list) fails at its first failing part."""
    for site in order:
        if site not in device_taps or site not in golden_taps:
            continue
        kind = kind_of(site)
        dv, gv = device_taps[site], golden_taps[site]
        parts = list(zip(dv, gv)) if isinstance(gv, (tuple, list)) else [(dv, gv)]
        for i, (a, e) in enumerate(parts):
            name = f"{site[0]}/{site[1]}" + (f"[{i}]" if len(parts) > 1 else "")
            f = compare_tensor(name, a, e, policy.lookup(*kind), kind)
            if not f.passed:
                f.site = site
                return f
    return None
