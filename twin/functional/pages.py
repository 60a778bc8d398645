"""Partition-local page ids (the scheduler's) to golden's one-pool-per-family page ids: `PageMap`
lives in `golden.staging` (the real-golden lockstep uses the same one)."""
from __future__ import annotations

from golden.staging import PageMap

__all__ = ["PageMap"]
