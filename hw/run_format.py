"""Which lockstep run directories this lockstep reads.

A run directory holds `report.jsonl`, `run.json` and `records/`.  Those written by golden's
compositions (`hw.real`) are the only ones read.  A directory recorded by the compact NumPy
reference step (the golden named "golden:numpy", with its own geometry, pools and weights) has
files of the same names whose contents mean something else: resuming or replaying it would misread
every line, so it is refused, naming the file that marks it and what to do instead.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from twin.abi.errors import AbiError

REFERENCE_GOLDEN = "golden:numpy"                   # run.json config.golden of the reference step
# the reference step named its weights by a 12-byte blake2b digest in every record; golden's
# checkpoints are named by preset and seed ("synthetic:tiny:seed0:k7")
REFERENCE_WEIGHTS = re.compile(r"^[0-9a-f]{24}$")
ALLOWED = ("a run directory written by this lockstep (golden's compositions); start afresh with --fresh "
           "or use another --run-dir")


def _json(path: Path, *, first_line: bool = False):
    try:
        with open(path, "rb") as fh:
            return json.loads(fh.readline() if first_line else fh.read())
    except (OSError, ValueError):
        return None                 # absent or unreadable: the readers of that file say so


def reference_marker(run_dir) -> str | None:
    """What marks `run_dir` as recorded by the reference step ('FILE: field=value'), or None."""
    run_dir = Path(run_dir)
    run = _json(run_dir / "run.json")
    config = run.get("config") if isinstance(run, dict) else None
    if isinstance(config, dict) and config.get("golden") == REFERENCE_GOLDEN:
        return f"{run_dir / 'run.json'}: golden={REFERENCE_GOLDEN!r}"
    # a killed run has records before its run.json
    rec = _json(run_dir / "records" / "manifest.jsonl", first_line=True)
    weights = rec.get("weights") if isinstance(rec, dict) else None
    if isinstance(weights, str) and REFERENCE_WEIGHTS.match(weights):
        return f"{run_dir / 'records' / 'manifest.jsonl'}:1: weights={weights!r}"
    return None


def check_run_dir(run_dir) -> None:
    """Refuse a run directory recorded by the reference step (AbiError naming the marking file)."""
    marker = reference_marker(run_dir)
    if marker is not None:
        raise AbiError("--run-dir", str(run_dir), f"{ALLOWED} ({marker} marks one recorded by the NumPy "
                       f"reference step, which lockstep does not read)", where="lockstep")
