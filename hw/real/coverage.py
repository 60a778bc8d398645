"""The coverage plan of a sampled lockstep: which sites the golden checks on each dispatch.

A site is (program, group, layer, stage): a target layer's stage tap (and the pool rows it writes)
for the rows and pages of one TP group (cache partition) in one program, or the drafter's context
pool of every group ("drafter", "ctx_kv", group -1: the drafter check re-runs golden's drafter stage of
the dispatch, every group's calls, so one site covers all groups).  The logits, the sampled and the accepted tokens are
checked on every dispatch and are not sites.

The plan is a deterministic round-robin over a seeded permutation of each program's sites, cut into
N slots of ceil(S/N) or floor(S/N) sites: the n-th dispatch of a program checks slot n mod N, so
every site of a program is checked exactly once in every N consecutive dispatches of that program,
and a dispatch checks ceil(S/N) sites at most.  N = 1 is full checking (every site every dispatch).

A fault that shows at a set A of a program's sites, on one dispatch only, is caught with the
probability that the dispatch's slot meets A: `hit_probability` (hypergeometric over the seeded
permutation).  `choose_n` picks N from the checker's measured throughput.

`--coverage auto` (`AUTO`): the run's first `CALIBRATION` dispatches check every site of their
program (N = 1) and measure the checker's site checks per second and the device's dispatches per
second; at the first dispatch after them N is chosen with `choose_n` and fixed for the rest of the
run (`CoveragePlan.full_until`: the dispatches of each program checked in full before it).  Every
N consecutive dispatches of a program then either hold a calibration dispatch (every site) or all
N slots, so the guarantee (every site at least once every N dispatches of its program) holds
across the switch.

What a site's check reads of the device's taps (`site_reads`: its sub-layer's input and stages up
to its own) is what a sampled dispatch's record keeps of them (`recorded_taps`, with the head's),
so a sampled recording replays its plan, and a failure checked from it is localized among the
sites whose taps it keeps.

This module is pure (no golden, no numerics): a checker pool or a replay can plan without weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from twin.abi.errors import AbiError

PREFILL, DECODE, FUSED, SEED = "l3_prefill_fwd", "l3_decode_fwd", "l3_decode_fwd_dspark", \
    "l3_dspark_draft_step_device_state"
TARGET_PROGRAMS = (PREFILL, DECODE, FUSED)
DRAFTER_PROGRAMS = (FUSED, SEED)
# golden.compose's per-layer stages in dependency order, by sub-layer (the site check re-syncs each
# sub-layer from the device's tap of its input: attn_in, attn_x_hc)
ATTENTION_STAGES = ("x_mixed", "x_norm", "q", "kv", "cmp_kv", "idx_topk", "attn", "attn_out", "attn_x_hc")
MOE_STAGES = ("ffn_x_mixed", "moe_indices", "moe_weights", "ffn_out", "x_hc")
LAYER_STAGES = ATTENTION_STAGES + MOE_STAGES
DRAFTER_SITE = ("drafter", "ctx_kv")
# checked on every dispatch, whatever the plan
EVERY_DISPATCH = (("head", "logits"), ("head", "sample"), ("head", "accepted"))
AUTO = "auto"
CALIBRATION = 4         # --coverage auto: the dispatches checked in full to measure the rates


def layer_stages(cfg, layer: int) -> tuple[str, ...]:
    """The stages golden taps in `layer`: cmp_kv in compressed layers, idx_topk in CSA layers."""
    kind = cfg.layer_kind(layer)
    return tuple(s for s in LAYER_STAGES
                 if (s != "cmp_kv" or kind in ("csa", "hca")) and (s != "idx_topk" or kind == "csa"))


def sublayer(stage: str) -> str:
    """The sub-layer a target stage belongs to: "attn" or "moe"."""
    return "attn" if stage in ATTENTION_STAGES else "moe"


SUBLAYER_INPUT = {"attn": "attn_in", "moe": "attn_x_hc"}


def site_reads(cfg, layer: int, stage: str) -> tuple:
    """The device taps a check of the target site (layer, stage) reads (`hw.real.site_check`): its
    sub-layer's input, and the sub-layer's stages in dependency order up to the site's own (a failing
    stage is localized among them); the decisions (`hw.real.step.DECISION_STAGES`) besides."""
    part = sublayer(stage)
    out = [(layer, SUBLAYER_INPUT[part])]
    for s in (s for s in (ATTENTION_STAGES if part == "attn" else MOE_STAGES) if s in layer_stages(cfg, layer)):
        out.append((layer, s))
        if s == stage:
            break
    return tuple(out)


def drafter_reads(cfg, target_hidden_tap: str) -> tuple:
    """The device taps the drafter site's check reads: the target hidden its stage is fed, per target
    layer of the drafter (`golden.compose.target_hidden` of the `target_hidden_tap` convention)."""
    tap = "x_hc" if target_hidden_tap == "hc_head_of_outputs" else "attn_in"
    return tuple((t, tap) for t in cfg.dspark_target_layer_ids)


def recorded_taps(cfg, sites, target_hidden_tap: str) -> set:
    """The taps a sampled dispatch's record keeps besides the decisions: what the head check reads (the
    last layer's output, the head's hidden and logits), and what each of the dispatch's planned
    `sites` ((group, layer, stage) or (group, "drafter", "ctx_kv")) reads: a target site its
    `site_reads`, the drafter site the target hidden its stage is fed (`golden.compose.target_hidden`
    of the `target_hidden_tap` convention)."""
    out = {(cfg.num_hidden_layers - 1, "x_hc"), ("head", "hidden"), ("head", "logits")}
    for _, layer, stage in sites:
        if layer == "drafter":
            out |= set(drafter_reads(cfg, target_hidden_tap))
        else:
            out |= set(site_reads(cfg, layer, stage))
    return out


def program_sites(cfg, groups: int, program: str, k: int) -> tuple[tuple, ...]:
    """Every site of `program` in a deployment of `groups` TP groups at K = `k`, in a fixed order."""
    out = []
    if program in TARGET_PROGRAMS:
        out += [(program, g, layer, s) for g in range(groups) for layer in range(cfg.num_hidden_layers)
                for s in layer_stages(cfg, layer)]
    if k and program in DRAFTER_PROGRAMS:
        out.append((program, -1) + DRAFTER_SITE)
    return tuple(out)


def check_n(n, where: str = "coverage") -> int:
    """N: an integer >= 1 (1 is full checking)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise AbiError("coverage", n, "an integer N >= 1 (every site checked at least once every N dispatches "
                       "of its program; 1 checks every site on every dispatch)", where=where)
    return int(n)


def check_coverage(v, where: str = "coverage"):
    """A coverage setting: None (every dispatch in full), an integer N >= 1, or "auto"."""
    if v is None or v == AUTO:
        return v
    if isinstance(v, str):
        raise AbiError("coverage", v, "an integer N >= 1 or auto (N chosen from the checker's measured "
                       "throughput)", where=where)
    return check_n(v, where)


@dataclass
class CoveragePlan:
    """sites: program -> its sites; n: the period; seed: the permutation's; full_until: program ->
    the count of its first dispatches that check every site (`--coverage auto`'s calibration)."""

    sites: dict
    n: int = 1
    seed: int = 0
    full_until: dict = field(default_factory=dict)
    slots: dict = field(init=False, repr=False)
    every_site: dict = field(init=False, repr=False)

    def __post_init__(self):
        self.n = check_n(self.n)
        rng = np.random.default_rng(self.seed)
        self.slots, self.every_site = {}, {}
        for program in sorted(self.sites):
            s = list(self.sites[program])
            perm = rng.permutation(len(s)) if s else np.zeros(0, np.int64)
            self.slots[program] = [tuple(s[i] for i in perm[j::self.n]) for j in range(self.n)]
            self.every_site[program] = tuple(s[i] for i in perm)        # the N = 1 slot

    @classmethod
    def for_deployment(cls, dep, n: int = 1, seed: int = 0) -> "CoveragePlan":
        """The sites of every program the deployment's executor runs at its K."""
        from twin.abi.programs import PROGRAMS

        programs = [p for p in dict.fromkeys(TARGET_PROGRAMS + DRAFTER_PROGRAMS) if dep.k in PROGRAMS[p].modes]
        sites = {p: program_sites(dep.model, dep.partitions, p, dep.k) for p in programs}
        return cls({p: s for p, s in sites.items() if s}, n, seed)

    def plan(self, program: str, nth: int) -> tuple[tuple, ...]:
        """The sites the `nth` dispatch (0-based, counted per program) of `program` checks."""
        if program not in self.slots:
            return ()
        if nth < self.full_until.get(program, 0):
            return self.every_site[program]
        return self.slots[program][nth % self.n]

    def phase(self, program: str, site: tuple) -> int:
        """The slot of `site`: it is checked on the dispatches n of its program with n mod N == phase."""
        for j, slot in enumerate(self.slots[program]):
            if site in slot:
                return j
        raise AbiError("site", site, f"a site of {program}", where="coverage plan")

    def hit_probability(self, program: str, affected) -> float:
        """Over the permutation's seeds: the probability that one dispatch of `program` checks at least
        one of the `affected` sites (its slot size k of S sites; hypergeometric)."""
        s = self.sites.get(program, ())
        a = len(set(affected) & set(s))
        total = len(s)
        if not total or not a:
            return 0.0
        # a dispatch's slot is a uniformly random k-subset over seeds; averaged over the N slot sizes
        ks = [len(slot) for slot in self.slots[program]]
        return float(np.mean([1.0 - math.comb(total - a, k) / math.comb(total, k) for k in ks]))

    def summary(self) -> dict:
        out = {"n": self.n, "seed": self.seed,
               "sites": {p: len(s) for p, s in sorted(self.sites.items())},
               "max_sites_per_dispatch": {p: max(len(x) for x in sl) for p, sl in sorted(self.slots.items())}}
        if self.full_until:
            out["full_until"] = dict(sorted(self.full_until.items()))
        return out

    def guarantee(self) -> str:
        """The plan's promise, in words (the report prints it)."""
        full = ", ".join(f"{p} {c}" for p, c in sorted(self.full_until.items()) if c)
        return (f"every site at least once every {self.n} dispatches of its program"
                + (f" (every site on the first dispatches of each program: {full})" if full else ""))


def choose_n(sites_per_dispatch: int, sites_per_s: float, dispatches_per_s: float) -> dict:
    """The smallest N at which the checker keeps up with the device: a dispatch's ceil(S/N) site
    checks take no longer than the device's dispatch interval.  Returns N with the figures behind it."""
    if sites_per_s <= 0 or dispatches_per_s <= 0:
        raise AbiError("throughput", (sites_per_s, dispatches_per_s), "positive sites/s and dispatches/s",
                       where="coverage")
    budget = sites_per_s / dispatches_per_s               # site checks the checker does per device dispatch
    per = max(1, math.floor(budget))
    n = max(1, min(sites_per_dispatch, math.ceil(sites_per_dispatch / per)))
    return {"n": n, "sites": sites_per_dispatch, "sites_per_s": sites_per_s, "dispatches_per_s": dispatches_per_s,
            "site_checks_per_dispatch": budget, "keeps_up": budget >= 1,
            "why": f"{sites_per_dispatch} sites, the checker does {budget:.3g} site checks per device dispatch: "
                   f"N = {n} checks {math.ceil(sites_per_dispatch / n)} per dispatch"
                   + ("" if budget >= 1 else " (still slower than the device: the backlog grows)")}
