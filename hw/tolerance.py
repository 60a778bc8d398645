"""The tolerance policy, kept as data: a table keyed by (op class, dtype, quantization).

A point is bad when it is outside the element tolerance (|a-e| > atol + atol_rms*RMS(e) + rtol*|e|,
the RMS term scaling the floor with the tensor's own magnitude) AND more than
`max_ulp` units in the last place of the storage dtype away (the CANN "mixed tolerance" idea: ULP
rescues tiny values, atol/rtol rescue large ones).  A tensor passes when bad points are within the
budget, no point breaks the single-point cap (`hard_atol + hard_rtol*|e|`, pypto-lib's
max_diff_hd: a stale or misplaced row is never "within budget"), no NaN/Inf differs, and the
aggregate gates hold (cosine, rel-L2, KL for logits).  Integer tensors are exact; `unordered`
compares sets along the last axis (routing); `tie_tol` is the near-tie margin under which the
golden re-syncs a device decision (relative to the decision's score scale).

Depth: FP32-vs-float64 noise grows with the number of layers a value has passed through, so an
entry may carry `depth_ref` and `depth_growth`: looked up at depth d (a target layer index; the
head is num_hidden_layers), its noise gates (atol, rtol, atol_rms, the rel-L2 gates, 1 - min_cosine
and tie_tol) are multiplied by 1 + depth_growth * max(0, d - depth_ref); single-point caps, ULPs and
budgets stay fixed, so a fault does not hide deeper down.  The route and sample margins use it
(measured on the real path, docs/lockstep.md): their near-tie gaps grow with the residual stream's
device-vs-golden divergence, which grows about linearly with depth.

Numbers start from the published tables (anchors.md B.2: bf16 rtol 1.6e-2, msprobe cosine 0.99,
double-thousandth budgets; kernel-math.md §2: hidden rtol 1e-2 / atol 5e-2 with 2 % outliers,
logits cosine 0.99 and rel-L2 0.10) and are tightened to what a clean CPU run measures, so that
a real fault cannot hide inside them.  Override any entry with `Policy.from_json`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from twin.abi.errors import AbiError
from twin.abi.inputs import integer, located, number, read_json


@dataclass(frozen=True)
class Tolerance:
    atol: float = 0.0
    rtol: float = 0.0
    atol_rms: float = 0.0             # adds atol_rms * RMS(golden tensor): activation scale differs per preset
    max_ulp: int = 0
    bad_budget: float = 0.0           # fraction of points allowed bad
    hard_atol: float = float("inf")   # single-point cap
    hard_rtol: float = 0.0
    hard_atol_rms: float = 0.0
    max_row_rel_l2: float | None = None   # per leading-axis row: a wrong row is never noise
    min_cosine: float | None = None
    max_rel_l2: float | None = None
    max_kl: float | None = None
    exact: bool = False
    unordered: bool = False
    tie_tol: float | None = None
    depth_ref: int | None = None      # the deepest layer the flat numbers were measured to hold at
    depth_growth: float = 0.0         # noise gates grow by this fraction per layer beyond depth_ref

    def __post_init__(self):
        for f in ("atol", "rtol", "atol_rms", "bad_budget", "hard_atol", "hard_rtol", "hard_atol_rms"):
            v = getattr(self, f)
            if not v >= 0:
                raise AbiError(f, v, ">= 0", where="tolerance")
        for f in ("bad_budget",):
            if not 0 <= getattr(self, f) <= 1:
                raise AbiError(f, getattr(self, f), "a fraction in [0, 1]", where="tolerance")
        if self.max_ulp < 0:
            raise AbiError("max_ulp", self.max_ulp, ">= 0", where="tolerance")
        if not self.depth_growth >= 0:
            raise AbiError("depth_growth", self.depth_growth, ">= 0", where="tolerance")
        if self.depth_ref is not None and self.depth_ref < 0:
            raise AbiError("depth_ref", self.depth_ref, "a layer index >= 0 (or None: no depth scaling)",
                           where="tolerance")

    def at_depth(self, depth: int) -> "Tolerance":
        """This entry at layer depth `depth` (see the module docstring): itself when flat."""
        if self.depth_ref is None or not self.depth_growth or depth <= self.depth_ref:
            return self
        m = 1.0 + self.depth_growth * (depth - self.depth_ref)
        ch = {f: getattr(self, f) * m for f in ("atol", "rtol", "atol_rms", "max_row_rel_l2", "max_rel_l2", "tie_tol")
              if getattr(self, f) is not None}
        if self.min_cosine is not None:
            ch["min_cosine"] = max(0.0, 1.0 - (1.0 - self.min_cosine) * m)
        return replace(self, **ch)


_BF16_ACT = dict(atol=6e-2, rtol=5e-2, atol_rms=0.1, max_ulp=8, bad_budget=0.05, hard_atol=0.75, hard_rtol=0.5,
                 hard_atol_rms=0.5,
                 max_row_rel_l2=0.12, min_cosine=0.996, max_rel_l2=0.08)
_DEPTH = dict(depth_ref=1, depth_growth=0.225)
DEFAULT_TABLE: dict[tuple[str, str, str], Tolerance] = {
    ("norm", "bf16", "none"): Tolerance(**_BF16_ACT),
    ("matmul", "bf16", "none"): Tolerance(**_BF16_ACT),
    ("attention", "bf16", "none"): Tolerance(**_BF16_ACT),
    ("moe", "bf16", "w8a8"): Tolerance(**{**_BF16_ACT, "atol": 0.1, "max_rel_l2": 0.1, "min_cosine": 0.995,
                                          "max_row_rel_l2": 0.15}),
    ("activation", "bf16", "w8a8"): Tolerance(**{**_BF16_ACT, "atol": 0.1, "max_row_rel_l2": 0.15}),
    ("activation", "f32", "w8a8"): Tolerance(**{**_BF16_ACT, "atol": 0.1, "max_ulp": 0}),
    ("kv_pool", "bf16", "none"): Tolerance(**_BF16_ACT),
    ("state", "f32", "none"): Tolerance(**{**_BF16_ACT, "max_ulp": 0}),
    ("logits", "f32", "none"): Tolerance(atol=0.15, rtol=5e-2, atol_rms=0.1, bad_budget=0.05, hard_atol=1.5,
                                         hard_rtol=0.5, max_row_rel_l2=0.15, min_cosine=0.996, max_rel_l2=0.08,
                                         max_kl=2e-2),
    # near-tie margins: 0.02 through layer 1, then + 0.0045 per layer (0.02 x 0.225), the linear envelope
    # of the residual stream's measured device-vs-golden row rel-L2 on the real path (docs/lockstep.md)
    ("route", "i32", "none"): Tolerance(exact=True, unordered=True, tie_tol=2e-2, **_DEPTH),
    ("sample", "i32", "none"): Tolerance(exact=True, tie_tol=2e-2, **_DEPTH),
    ("index", "i32", "none"): Tolerance(exact=True),
}


def _key_str(k: tuple[str, str, str]) -> str:
    return "/".join(k)


class Policy:
    """Lookup: the exact key, then (op, dtype, "*"), then ("*", dtype, "*")."""

    def __init__(self, table: dict[tuple[str, str, str], Tolerance] | None = None):
        self.table = dict(DEFAULT_TABLE if table is None else table)

    def lookup(self, op: str, dtype: str, quant: str = "none", *, depth: int | None = None) -> Tolerance:
        """The entry for (op, dtype, quant); at a layer `depth`, scaled for it (Tolerance.at_depth)."""
        if depth is not None and not (isinstance(depth, (int, np.integer)) and depth >= 0):
            raise AbiError("depth", depth, "a layer index >= 0 (or None)", where="policy")
        for k in ((op, dtype, quant), (op, dtype, "*"), ("*", dtype, "*")):
            if k in self.table:
                return self.table[k] if depth is None else self.table[k].at_depth(int(depth))
        raise AbiError("tolerance key", _key_str((op, dtype, quant)),
                       f"one of {sorted(_key_str(k) for k in self.table)} (or a wildcard entry)", where="policy")

    def tie_tols(self) -> dict:
        return {"route": self.lookup("route", "i32").tie_tol, "sample": self.lookup("sample", "i32").tie_tol}

    def with_entry(self, op: str, dtype: str, quant: str, **changes) -> "Policy":
        t = dict(self.table)
        t[(op, dtype, quant)] = replace(t.get((op, dtype, quant), Tolerance()), **changes)
        return Policy(t)

    # ---- data in and out ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {_key_str(k): {f: v for f, v in asdict(t).items() if v != getattr(Tolerance(), f)}
                for k, t in sorted(self.table.items())}

    def to_json(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_dict(cls, d: dict, *, base: "Policy | None" = None) -> "Policy":
        table = dict((base or cls()).table)
        known = {f.name for f in fields(Tolerance)}
        plain = Tolerance()
        for key, entry in d.items():
            parts = tuple(key.split("/"))
            if len(parts) != 3:
                raise AbiError("tolerance key", key, "'op/dtype/quant', e.g. 'matmul/bf16/none'", where="policy")
            if not isinstance(entry, dict):
                raise AbiError("tolerance entry", entry, "an object of tolerance fields", where=f"policy[{key}]")
            bad = set(entry) - known
            if bad:
                raise AbiError("tolerance field", sorted(bad)[0], f"one of {sorted(known)}", where=f"policy[{key}]")
            for f, v in entry.items():       # each value of its field's kind, before any comparison
                default = getattr(plain, f)
                if isinstance(default, bool):
                    if not isinstance(v, bool):
                        raise AbiError(f, v, "true or false", where=f"policy[{key}]")
                elif v is None and default is None:
                    continue
                elif f in ("max_ulp", "depth_ref"):
                    integer(v, f, f"policy[{key}]", lo=0)
                else:
                    number(v, f, f"policy[{key}]", finite=False)
            table[parts] = Tolerance(**entry)
        return cls(table)

    @classmethod
    def from_json(cls, path, *, base: "Policy | None" = None, flag: str = "--policy") -> "Policy":
        d = read_json(path, flag, "tolerance entries: {\"op/dtype/quant\": {field: value}} (docs/lockstep.md)")
        with located(f"{flag} {path}"):
            return cls.from_dict(d, base=base)
