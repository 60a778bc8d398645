"""Recompute preemption: upstream's re-prefill from the prompt only, and the corrected replay.

Upstream (serving-contract.md §4.7, §10.2 item 2) slices a preempted request's re-prefill from
`prompt_token_ids` only, so the tokens it already generated leave the KV context: the device
restarts at the prompt and generates the same continuation again after them.  `twin.sim.Scheduler`
reproduces that faithfully (and the risk report flags `preempt_with_outputs`).

`ReplayScheduler` is the corrected behaviour: at a preemption the generated tokens are folded into
the context the re-prefill replays (prompt + outputs), so the request resumes where it stopped.
While folded, `prompt` holds the replayed context, `outputs` only the tokens since the last
preemption and `max_new_tokens` what is left; `_retire` unfolds, so a finished request looks like
any other (prompt, all outputs).  A stop string that straddles the preemption is not detected:
the engine checks only the outputs after the fold.
"""
from __future__ import annotations

import numpy as np

from twin.abi.batches import Status
from twin.sim.scheduler import Scheduler

RECOMPUTE = ("prompt", "replay")


class ReplayScheduler(Scheduler):
    def _preempt(self, victim, by, out):
        back = super()._preempt(victim, by, out)
        if victim.status is Status.PREEMPTED and victim.outputs:
            fold = getattr(victim, "fold", None)
            if fold is None:
                victim.fold = fold = {"prompt": victim.prompt, "outputs": [], "max_new_tokens": victim.max_new_tokens}
            fold["outputs"] += victim.outputs
            victim.prompt = np.concatenate([victim.prompt, np.asarray(victim.outputs, np.int32)])
            victim.prompt_len = int(victim.prompt.shape[0])
            victim.max_new_tokens -= len(victim.outputs)
            victim.outputs = []
            if self.cfg.prefix_caching:
                victim.hashes = self.kv.prompt_hashes(victim.prompt)
        return back

    def _retire(self, req) -> None:
        super()._retire(req)
        fold = getattr(req, "fold", None)
        if fold is not None:
            req.outputs = fold["outputs"] + req.outputs
            req.prompt, req.prompt_len = fold["prompt"], int(fold["prompt"].shape[0])
            req.max_new_tokens = fold["max_new_tokens"]
            req.fold = None


def scheduler_for(recompute: str) -> type:
    """'prompt': upstream's re-prefill from the prompt only; 'replay': prompt + generated tokens."""
    from twin.abi.errors import ConfigError
    if recompute not in RECOMPUTE:
        raise ConfigError("recompute", recompute, f"one of {RECOMPUTE}")
    return Scheduler if recompute == "prompt" else ReplayScheduler
