"""`l3_dspark_draft_step_device_state` (the seeding bootstrap): one drafter call and the Markov
sampler on its head rows, in one program.  Its four state arguments bind private zeroed scratch
(the host copies the real device state itself), so nothing persistent is written but the drafter
pools."""
from __future__ import annotations

from .drafter_program import extents, run_drafter
from .markov_sample import sample

__all__ = ["extents", "run_bootstrap"]


def run_bootstrap(a, cfg, dep):
    head, taps = run_drafter(a, cfg, dep)
    drafts, probs, logits = sample(a, cfg, dep, lambda r: a.ranks.of(head, r))
    taps.put("markov", "base_logits", logits)
    return {"head_hidden": head, "draft_token_ids": drafts, "confidence_probs": probs}, taps
