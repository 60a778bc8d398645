"""The golden runs what the dispatch stages: a cross-check of two lowerings.

Golden addresses its pools through its own lowering (`golden.paged.lower`); the device program
receives `twin.abi.lowering`'s.  For every prefill dispatch the functional twin checks, request by
request, that both put the same tokens at the same positions and write through the same slots of
all seven families (after the partition-local to golden page shift), so a functional run cannot
pass while the staged dispatch is wrong.  For a fused K=7 step it checks that each request's
stream slot carries the lease and generation of the drafter state golden verifies.  The checks
live in `golden.staging` (the real-golden lockstep runs them too).
"""
from __future__ import annotations

from golden.paged import PREFILL, lower as golden_lower
from golden.staging import SLOTS, check_decode
from golden.staging import check_prefill as _check_prefill

__all__ = ["SLOTS", "check_decode", "check_prefill"]


def check_prefill(d, cfg, spans, pages, items) -> None:
    """`golden.staging.check_prefill` against golden's own lowering of `spans` (one per item)."""
    _check_prefill(d, golden_lower(cfg, spans, form=PREFILL), items, pages)
