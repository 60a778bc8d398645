"""The site check: one target layer's stages judged from the device's recorded state alone.

Checking a site (program, group, layer, stage) runs golden's sub-layer that computes the stage
from the device's own tap of that sub-layer's input (`attn_in` for the attention stages,
`attn_x_hc` for the MoE stages) and the device's pools before the dispatch, with the dispatch's
staged metadata, and compares the stage's tap on the group's token rows (and, for the pool stages
kv and cmp_kv, the pool rows the group's tokens map, with every unmapped row held to its bytes
before) under the lockstep's tolerance policy.  So a check needs no layer before it, and a mismatch
is localized within the sub-layer: the first of its stages, in dependency order, that fails.
Near-tie routes and indexer rows are adopted from the device as in the full lockstep
(`hw.real.side.TapPar.resync_hooks`).

The drafter site ("drafter", "ctx_kv", every group) re-runs golden's drafter stage of the dispatch
from the records too: at a fused K=7 dispatch, golden's acceptance of the device's samples from
the K=7 state before it gives the requests that redraft, their rows (lease, drafter anchor, bonus
token, accepted positions) and, from the device's taps, the target hidden of their accepted rows
(`golden.dspark.step.redraft_calls`, the same rule golden's own step follows); at a seeding wave,
the rows and captured prompt hidden the device seeded from (recorded, `site:seed_*`).  Golden's
drafter runs them on the device's drafter pools before the dispatch, adopting the device's
near-tie drafter routes, and every group's pool after is held to the device's: rows either side
wrote within tolerance, every other row bit-identical.  A drafter that wrote the wrong rows (a
stale or an uncommitted context row) fails there, since its rows are golden's, not the device's.

Every dispatch also gets the head check (and a dispatch without a target forward, the check that it
wrote no target pool): golden's final head from the device's last layer output
gives the logits; the device's greedy samples are judged against them with the sample tie rule, its
sampled-token outputs must be those samples, and a fused K=7 dispatch's accepted tokens must be
golden's acceptance (`golden.dspark.state.accept`) of them from the K=7 state before the dispatch.

`check_recorded(run_dir, index, sites)` is the unit a checker pool or a Ray task runs: paths, ints
and site lists in, plain dicts out.  `check_view` is the same on a live dispatch (`DispatchView`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from golden.compose import attention_sublayer, device_meta, final_head, moe_sublayer, rope_inputs
from golden.dspark.state import DeviceState, SlotRef, accept, prepare
from golden.numerics import numerics
from golden.paged import DECODE, PREFILL, StepMeta
from golden.ties import INDEX_TIE_TOL
from twin.abi.errors import AbiError

from ..compare import Finding, compare_pool, compare_tensor
from ..localize import compose_kind
from ..tolerance import Policy
from .coverage import ATTENTION_STAGES, DRAFTER_SITE, MOE_STAGES, drafter_reads, layer_stages, site_reads, sublayer
from .side import POOL_KIND, POOL_SLOTS, POOL_STAGE, LayerTaps, TapPar

FORMS = (PREFILL, DECODE)
META_FIELDS = tuple(f.name for f in fields(StepMeta) if f.name not in ("form", "tables", "slots"))


@dataclass
class DispatchView:
    """What the site check reads of one dispatch, all of it the device's or the staged dispatch's.

    meta: the staged `StepMeta` of the dispatch's target forward (None: no target forward);
    taps: the device's taps of it; before / after: the device's target pools per layer around the
    dispatch; row_group: each token row's TP group; sampled: the device's greedy tokens of the
    forward; outputs: the device's outputs; state: the K=7 state before the dispatch and refs the
    slots of its requests in row order (fused dispatches)."""

    program: str
    meta: StepMeta | None
    taps: dict
    before: list
    after: list
    row_group: np.ndarray
    sampled: np.ndarray | None = None
    outputs: dict | None = None
    state: DeviceState | None = None
    refs: list | None = None
    draft_before: list | None = None        # the device's drafter pool of each group around the dispatch
    draft_after: list | None = None
    draft_routes: list | None = None        # the device's drafter MoE routes, in call order
    seed_rows: list | None = None           # a seeding wave: (group, DraftRow, captured hidden) per request


class SiteGolden:
    """Golden's weights, numerics and the tie margins a site check uses; golden: which golden runs a
    target layer's sub-layers (`hw.real.jax_check`: numpy, jax or auto)."""

    def __init__(self, cfg, ckpt, nm="device", policy: Policy | None = None, index_tie_tol: float = INDEX_TIE_TOL,
                 dckpt=None, golden: str = "numpy"):
        from .jax_check import GOLDENS

        if golden not in GOLDENS:
            raise AbiError("checker_golden", golden, f"one of {', '.join(GOLDENS)}", where="site check")
        self.cfg, self.ckpt, self.nm = cfg, ckpt, numerics(nm, cfg=cfg)
        self.policy = policy or Policy()
        self.index_tie_tol = index_tie_tol
        self.dckpt = dckpt                  # the drafter's checkpoint (None at K = 0)
        self.golden = golden
        self._jax = None

    def jax_for(self, program: str):
        """-> (the JAX path's sites checker for `program`, or None, why)."""
        from .jax_check import JaxSites, admitted

        ok, why = admitted(self.golden, self.cfg, program, self.nm.mode, self.index_tie_tol)
        if not ok:
            return None, why
        if self._jax is None:
            self._jax = JaxSites(self)
        return self._jax, why

    def par(self, dtaps) -> TapPar:
        par = TapPar()
        par.route_from = dtaps
        par.tie_tol = lambda d: self.policy.lookup("route", "i32", depth=d).tie_tol or 0.0
        par.index_tie_tol = self.index_tie_tol
        return par

    @property
    def tie_samples(self) -> float:
        return self.policy.lookup("sample", "i32", depth=self.cfg.num_hidden_layers).tie_tol or 0.0


def sample_finding(device_tokens, golden_logits, tie: float) -> Finding | None:
    """The device's greedy tokens against the golden's logits: a token is right when its golden logit
    is within `tie` (relative) of the golden's best (a near-tie either side may pick)."""
    gl = np.asarray(golden_logits, np.float64)
    ds = np.asarray(device_tokens).reshape(-1)
    if ds.size != gl.shape[0]:
        return Finding("sampled_ids", False, ("sample", "i32", "none"), points=int(gl.shape[0]),
                       reasons=[f"{ds.size} greedy samples for {gl.shape[0]} logit rows"], site=("head", "sample"))
    gs = gl.argmax(-1)
    rows = np.flatnonzero(gs != ds)
    hard = [int(r) for r in rows if gl[r, ds[r]] < gl[r].max() - tie * max(1.0, abs(gl[r].max()))]
    if not hard:
        return None
    return Finding("sampled_ids", False, ("sample", "i32", "none"), points=int(gs.size), bad_points=len(hard),
                   bad_rows=hard, reasons=[f"{len(hard)} of {gs.size} greedy samples differ beyond ties"],
                   metrics={"mismatches": len(hard)}, site=("head", "sample"))


# ---- the target layer sites ---------------------------------------------------------------------------
def readable(sg: "SiteGolden", view: "DispatchView", site) -> bool:
    """Whether the view holds every tap a check of target site (program, group, layer, stage) reads."""
    return all(k in view.taps for k in site_reads(sg.cfg, site[2], site[3]))


def _golden_sublayer(sg: SiteGolden, view: DispatchView, layer: int, part: str, par: TapPar) -> LayerTaps:
    cfg, nm, meta = sg.cfg, sg.nm, view.meta
    m = device_meta(meta, nm)
    taps = LayerTaps()
    moe, indexer = par.resync_hooks(taps, sg.ckpt)
    w = sg.ckpt.layer(layer)
    if part == "attn":
        _, pools = attention_sublayer(view.taps[(layer, "attn_in")], layer, w, view.before[layer], m,
                                      rope_inputs(cfg, meta.position_ids, nm), cfg=cfg, nm=nm, form=meta.form,
                                      taps=taps, indexer=indexer)
        taps.pools = pools
    else:
        expert = sg.ckpt.experts_of(layer) if hasattr(sg.ckpt, "experts_of") else (lambda e: sg.ckpt.expert(layer, e))
        moe_sublayer(view.taps[(layer, "attn_x_hc")], layer, w, expert, m["input_ids"], cfg=cfg, nm=nm, taps=taps,
                     moe=moe)
    return taps


def _pool_findings(sg: SiteGolden, view: DispatchView, layer: int, stage: str, rows, golden_pools) -> list[Finding]:
    """The pools of `stage` in `layer`: rows the group's tokens map within tolerance; rows no token of
    the dispatch maps bit-identical to before (rows other groups map are theirs to check)."""
    out = []
    for pool, st in POOL_STAGE.items():
        if st != stage or pool not in golden_pools:
            continue
        a, e, b = (np.asarray(x[pool]) for x in (view.after[layer], golden_pools, view.before[layer]))
        a2, e2, b2 = (x.reshape(-1, x.shape[-1]) for x in (a, e, b))
        slots = np.asarray(view.meta.slots[POOL_SLOTS[pool]], np.int64)
        mine = np.unique(slots[rows][slots[rows] >= 0])
        others = np.setdiff1d(np.unique(slots[slots >= 0]), mine)
        keep = np.ones(a2.shape[0], bool)
        keep[others] = False
        kind = POOL_KIND[pool]
        f = compare_pool(f"{layer}/{pool}", a2[keep], e2[keep], b2[keep], np.searchsorted(np.flatnonzero(keep), mine),
                         sg.policy.lookup(*kind), kind)
        f.site = (layer, stage)
        out.append(f)
    return out


def _stage_findings(sg: SiteGolden, view: DispatchView, layer: int, stage: str, rows, gtaps) -> list[Finding]:
    site = (layer, stage)
    out = []
    if stage in ("kv", "cmp_kv"):
        out += _pool_findings(sg, view, layer, stage, rows, gtaps.pools)
    if site in gtaps and site in view.taps:
        kind = compose_kind(site)
        dv, gv = view.taps[site], gtaps[site]
        if isinstance(gv, (tuple, list)):           # cmp_kv: (token rows pooled, their compressed rows)
            parts = list(zip(dv, gv))
        else:
            parts = [(np.asarray(dv)[rows], np.asarray(gv)[rows])]
        for i, (a, e) in enumerate(parts):
            f = compare_tensor(f"{layer}/{stage}" + (f"[{i}]" if len(parts) > 1 else ""), a, e,
                               sg.policy.lookup(*kind), kind)
            f.site = site
            out.append(f)
    return out


def check_layer_sites(sg: SiteGolden, view: DispatchView, sites, jax=None,
                      note: dict | None = None) -> tuple[list[dict], list[dict]]:
    """Per target site (program, group, layer, stage): {"site", "verdict", "rows"} and, failing, the
    finding and the first divergent stage of its sub-layer ("first_divergence"); with the re-syncs
    (near-tie routes and indexer rows the golden adopted).  jax: a `hw.real.jax_check.JaxSites`
    that runs the sub-layers first; a sub-layer it cannot take, or finds failing at any of the
    sites, is judged on NumPy (its re-syncs NumPy's), each such site listed in note["numpy"] with why."""
    par = sg.par(view.taps)
    runs: dict = {}
    judged: dict = {}           # (group, layer, stage) -> findings the JAX run's screen already made
    out = []
    for site in sites:
        _, group, layer, stage = site
        rows = np.flatnonzero(np.asarray(view.row_group) == group)
        res = {"site": list(site), "rows": int(rows.size), "verdict": "pass"}
        if not rows.size and stage in ("kv", "cmp_kv"):
            # the group has no rows here: its pool site still holds every row no token maps to its bytes
            bad = [f for f in _pool_findings(sg, view, layer, stage, rows, view.before[layer]) if not f.passed]
            if bad:
                res.update(verdict="fail", finding=bad[0].to_dict(), first_divergence=localized(bad[0]))
        elif rows.size:
            key = (layer, sublayer(stage))
            if key not in runs:
                runs[key] = _run_sublayer(sg, view, layer, key[1], par, jax, sites, note, judged)
            fs = judged.pop((group, layer, stage), None)
            if fs is None:
                fs = _stage_findings(sg, view, layer, stage, rows, runs[key])
            bad = [f for f in fs if not f.passed]
            if bad:
                res["verdict"] = "fail"
                res["finding"] = bad[0].to_dict()
                res["first_divergence"] = _localize_in_sublayer(sg, view, layer, stage, rows, runs[key])
        out.append(res)
    return out, par.resyncs


def _run_sublayer(sg, view, layer, part, par, jax, sites, note, judged) -> LayerTaps:
    """Golden's taps of one sub-layer: JAX's where it takes it and passes every site of `sites` in
    it (their findings left in `judged`), else NumPy's (the JAX attempt's re-syncs dropped)."""
    if jax is None:
        return _golden_sublayer(sg, view, layer, part, par)
    mark = len(par.resyncs)
    taps, why = jax.sublayer(view, layer, part, par)
    mine = [s for s in sites if s[2] == layer and sublayer(s[3]) == part]
    screened = {}
    if taps is not None:
        for s in mine:
            rows = np.flatnonzero(np.asarray(view.row_group) == s[1])
            if not rows.size:
                continue
            fs = screened[(s[1], layer, s[3])] = _stage_findings(sg, view, layer, s[3], rows, taps)
            if not all(f.passed for f in fs):
                why = f"JAX found {s[3]} of group {s[1]} failing: NumPy judges the sub-layer"
                taps = None
                break
    if taps is not None:
        judged.update(screened)
        return taps
    del par.resyncs[mark:]
    if note is not None:
        note.setdefault("numpy", []).extend([s[1], s[2], s[3], why] for s in mine)
    return _golden_sublayer(sg, view, layer, part, par)


def _localize_in_sublayer(sg, view, layer, stage, rows, gtaps) -> dict:
    order = ATTENTION_STAGES if sublayer(stage) == "attn" else MOE_STAGES
    for s in (s for s in order if s in layer_stages(sg.cfg, layer)):
        bad = [f for f in _stage_findings(sg, view, layer, s, rows, gtaps) if not f.passed]
        if bad:
            return localized(bad[0])
        if s == stage:
            break
    raise AssertionError("a failing stage localizes to itself at the latest")


def localized(f: Finding) -> dict:
    return {"layer": str(f.site[0]), "stage": f.site[1], "tensor": f.name, "reasons": f.reasons,
            "metrics": f.to_dict()["metrics"], "bad_rows": f.bad_rows[:8]}


# ---- the drafter site ------------------------------------------------------------------------------------
def rows_ne(a, b) -> np.ndarray:
    """Per row of two 2-D arrays: whether its bytes differ."""
    return (a.view(np.uint8).reshape(a.shape[0], -1) != b.view(np.uint8).reshape(b.shape[0], -1)).any(-1)


def draft_pool_findings(policy: Policy, dev_after, gold_after, dev_before, gold_before=None,
                        groups=None) -> list[Finding]:
    """The drafter pool of each group in `groups` (default all; the lists are indexed by group): rows
    either side wrote (or where the sides started apart) within tolerance, every other device row
    bit-identical to before (the drafter's ring addressing lives inside golden.dspark, so "mapped" is
    what either side touched); a group's finding is kept when it fails or has rows written."""
    out = []
    kind = ("kv_pool", "bf16", "none")
    for grp in range(len(dev_after)) if groups is None else groups:
        pd, pg, db = dev_after[grp], gold_after[grp], dev_before[grp]
        gb = db if gold_before is None else gold_before[grp]
        a2, e2, b2, c2 = (np.asarray(x).reshape(-1, np.shape(x)[-1]) for x in (pd, pg, db, gb))
        mapped = np.flatnonzero(rows_ne(a2, b2) | rows_ne(e2, b2) | rows_ne(c2, b2))
        f = compare_pool(f"draft_kv[{grp}]", a2, e2, b2, mapped, policy.lookup(*kind), kind)
        f.site = ("drafter", "ctx_kv")
        if not f.passed or len(mapped):
            out.append(f)
    return out


def _accepted(view: DispatchView):
    """Golden's acceptance of the device's samples from the K=7 state before a fused dispatch:
    (Prepared, Accepted)."""
    prep = prepare(view.state, view.refs)
    flat = np.asarray(view.sampled, np.int64).reshape(-1)
    sampled = np.full(prep.tokens.shape, -1, np.int64)
    starts = np.concatenate([[0], np.cumsum(prep.active_width)])
    for i in range(len(view.refs)):
        sampled[i, :prep.active_width[i]] = flat[starts[i]:starts[i + 1]]
    return prep, accept(view.state, prep, sampled)[0]


def drafter_findings(sg: SiteGolden, view: DispatchView) -> tuple[list[Finding], list[dict]]:
    """The drafter site of one dispatch (module docstring): the findings on every group's drafter
    pool and the re-syncs (near-tie drafter routes adopted)."""
    from types import SimpleNamespace

    from golden.compose import target_hidden
    from golden.dspark import step as S
    from twin.abi.lowering.decode import owner_member

    cfg = sg.cfg
    par = TapPar()
    par.draft_from = list(view.draft_routes or [])
    par.tie_tol = lambda d: sg.policy.lookup("route", "i32", depth=d).tie_tol or 0.0
    g = S.Golden(cfg, sg.ckpt, sg.dckpt, sg.nm, max_model_len=cfg.max_position_embeddings,
                 groups=len(view.draft_before), par=par)
    run = SimpleNamespace(pools=list(view.draft_before))
    if view.seed_rows is not None:
        for group, row, hidden in view.seed_rows:
            S.draft_rows(g, run, group, [row], hidden, num_sampled=0)
    elif view.refs is not None and view.meta is not None:
        missing = [k for k in drafter_reads(cfg, g.drafter.target_hidden_tap) if k not in view.taps]
        if missing:
            raise AbiError("sites", [list(DRAFTER_SITE)], "sites whose taps the dispatch's record keeps (the drafter "
                           f"site reads the target hidden {missing[:2]}...; a sampled run records the taps its planned "
                           "sites read: its records replay its plan)", where="site check")
        prep, acc = _accepted(view)
        mh = np.asarray(target_hidden(view.taps, sg.ckpt.model(), cfg=cfg, nm=sg.nm, tap=g.drafter.target_hidden_tap))
        owners = [g.tp * r.group + owner_member(1, r.lease, 0, g.tp) for r in view.refs]
        for group, _, rows, hidden in S.redraft_calls(acc, view.refs, owners, mh, prep.active_width):
            S.draft_rows(g, run, group, rows, hidden, num_sampled=1)
    return draft_pool_findings(sg.policy, view.draft_after, run.pools, view.draft_before), par.resyncs


# ---- the head, every dispatch --------------------------------------------------------------------------
def head_findings(sg: SiteGolden, view: DispatchView) -> list[Finding]:
    """Logits from golden's head on the device's last layer output; samples, sampled-token outputs and
    (fused) accepted tokens from them."""
    cfg, nm = sg.cfg, sg.nm
    out: list[Finding] = []
    last = (cfg.num_hidden_layers - 1, "x_hc")
    if view.meta is None or last not in view.taps or ("head", "logits") not in view.taps:
        return out
    m = device_meta(view.meta, nm)
    gtaps = LayerTaps()
    logits, _ = final_head(view.taps[last], sg.ckpt.model(), m["logit_row_indices"], cfg=cfg, nm=nm, taps=gtaps)
    for stage in ("hidden", "logits"):
        site = ("head", stage)
        kind = compose_kind(site)
        f = compare_tensor(f"head/{stage}", view.taps[site], gtaps[site], sg.policy.lookup(*kind), kind)
        f.site = site
        out.append(f)
    s = sample_finding(view.sampled, logits, sg.tie_samples)
    if s is not None:
        out.append(s)
    outs = view.outputs or {}
    if "sampled_ids" in outs and not np.array_equal(np.asarray(outs["sampled_ids"]).reshape(-1),
                                                    np.asarray(view.sampled).reshape(-1)):
        out.append(Finding("sampled_ids", False, ("sample", "i32", "none"), points=int(np.size(view.sampled)),
                           reasons=["the dispatch's sampled tokens are not its greedy samples (exact)"],
                           site=("head", "sample")))
    if "accepted_ids" in outs and view.state is not None:
        _, acc = _accepted(view)
        if not (np.array_equal(acc.token_ids, outs["accepted_ids"])
                and np.array_equal(acc.counts, outs["accepted_counts"])):
            out.append(Finding("accepted_ids", False, ("sample", "i32", "none"), points=int(acc.token_ids.size),
                               reasons=["differs from golden's acceptance of the device's samples (exact)"],
                               site=("head", "sample")))
    return out


def unwritten_findings(view: DispatchView) -> list[Finding]:
    """A dispatch without a target forward (a seeding wave) writes no target pool: any target pool row
    it changed is a stray write, found on every such dispatch (identity first: pools are replaced,
    never mutated, so an untouched pool is the same array)."""
    out = []
    if view.meta is not None:
        return out
    for layer, (pb, pa) in enumerate(zip(view.before, view.after)):
        for pool, b in pb.items():
            a = pa[pool]
            if a is b:
                continue
            a2, b2 = (np.asarray(x).reshape(-1, np.shape(x)[-1]) for x in (a, b))
            moved = np.flatnonzero((a2.view(np.uint8).reshape(a2.shape[0], -1)
                                    != b2.view(np.uint8).reshape(b2.shape[0], -1)).any(-1))
            if moved.size:
                out.append(Finding(f"{layer}/{pool}", False, POOL_KIND[pool], points=int(b2.size),
                                   bad_rows=moved[:8].tolist(),
                                   reasons=[f"{moved.size} rows changed by a dispatch that writes no target pool"],
                                   metrics={"unmapped_modified_rows": int(moved.size)},
                                   site=(layer, POOL_STAGE[pool])))
    return out


def check_view(sg: SiteGolden, view: DispatchView, sites, numpy_only: bool = False) -> dict:
    """The head check, the target `sites` and (planned) the drafter site of one dispatch:
    {"head": [findings], "sites": [...], "drafter": [findings], "resyncs": [...]} (plain data) and,
    under a checker golden other than numpy, "checker": which golden checked the target sites
    (`hw.real.jax_check`).  numpy_only: every sub-layer on NumPy whatever sg.golden says."""
    target = [tuple(s) for s in sites if s[2] != "drafter"]
    missing = [s for s in target if not readable(sg, view, s)] if view.meta is not None else []
    if missing:
        raise AbiError("sites", [list(s) for s in missing[:4]], "sites whose taps the dispatch's record keeps (a "
                       "sampled run records the taps its planned sites read: its records replay its plan)",
                       where="site check")
    note: dict = {}
    jax = None
    if sg.golden != "numpy":
        jax, why = (None, "numpy_only") if numpy_only else sg.jax_for(view.program)
        note.update(golden="jax" if jax is not None else "numpy", why=why)
        if jax is not None:
            note["backend"] = jax.backend
    res, resyncs = check_layer_sites(sg, view, target, jax, note) if view.meta is not None else ([], [])
    drafter = []
    for s in sites:
        if s[2] == "drafter":
            fs, more = drafter_findings(sg, view)
            drafter += [f.to_dict() for f in fs]
            resyncs = resyncs + more
            res.append({"site": list(s), "rows": 0, "verdict": "fail" if any(not f.passed for f in fs) else "pass"})
    every = head_findings(sg, view) + unwritten_findings(view)
    out = {"head": [f.to_dict() for f in every], "sites": res, "drafter": drafter, "resyncs": resyncs}
    if note:
        out["checker"] = note
    return out


# ---- from records ----------------------------------------------------------------------------------
def site_arrays(side, seqs, kind: str) -> dict:
    """What a site check reads of a live dispatch beyond the device's outputs and taps (recorded
    with them): the staged meta of the device side's last target forward, each token row's group,
    the form, and the K=7 slots of a fused dispatch's requests in row order."""
    calls = side.par.calls
    out = {}
    if calls:
        meta = calls[-1][0]
        group_of = {s.index: s.group for s in side.run.seqs}
        out["site:row_group"] = np.array([group_of[int(r)] for r in meta.req], np.int64)
        out["site:form"] = np.array([FORMS.index(meta.form)], np.int64)
        out.update({f"site:meta/{k}": np.asarray(getattr(meta, k)) for k in META_FIELDS})
        out.update({f"site:tables/{k}": np.asarray(v) for k, v in meta.tables.items()})
        out.update({f"site:slots/{k}": np.asarray(v) for k, v in meta.slots.items()})
    if kind == "decode" and side.served.k:
        out["site:refs"] = np.array([[s.group, s.lease, s.generation] for s in seqs], np.int64).reshape(-1, 3)
    if kind == "seed":
        # what each request of the wave seeded the drafter from (golden.dspark.step.seed_row)
        from golden.dspark.step import seed_row

        calls = [(s.group, c) for s in seqs for c in [seed_row(side.g, s)] if c is not None]
        out["site:seed_rows"] = np.array([[g, r.lease, r.anchor, r.anchor_token, r.owner_rank, len(r.context_positions)]
                                          for g, (r, _) in calls], np.int64).reshape(-1, 6)
        out["site:seed_hidden"] = (np.concatenate([h for _, (_, h) in calls]) if calls
                                   else np.zeros((0, 3 * side.g.cfg.hidden_size), np.float32))
    return out


def _seed_rows(a: dict) -> list | None:
    from golden.dspark.drafter import DraftRow

    if "site:seed_rows" not in a:
        return None
    out, at = [], 0
    for g, lease, anchor, token, owner, n in a["site:seed_rows"]:
        row = DraftRow(int(lease), int(anchor), int(token), tuple(range(int(anchor) + 1 - int(n), int(anchor) + 1)),
                       owner_rank=int(owner))
        out.append((int(g), row, a["site:seed_hidden"][at:at + int(n)]))
        at += int(n)
    return out


def view_from_step(program: str, step, before: list, after: list, state, draft=(None, None)) -> DispatchView:
    """The view of one dispatch from its `DeviceStep` (live, or read back from its record); draft: the
    device's drafter pools before and after it."""
    a = step.site
    meta = None
    if "site:form" in a:
        get = {k[len("site:meta/"):]: v for k, v in a.items() if k.startswith("site:meta/")}
        tables = {k[len("site:tables/"):]: v for k, v in a.items() if k.startswith("site:tables/")}
        slots = {k[len("site:slots/"):]: v for k, v in a.items() if k.startswith("site:slots/")}
        meta = StepMeta(FORMS[int(a["site:form"][0])], **{k: get[k] for k in META_FIELDS}, tables=tables, slots=slots)
    refs = [SlotRef(int(g), int(le), int(ge)) for g, le, ge in a["site:refs"]] if "site:refs" in a else None
    return DispatchView(program, meta, step.taps, before, after, a.get("site:row_group", np.zeros(0, np.int64)),
                        step.sampled[-1] if step.sampled else None, step.outputs, state, refs, draft[0], draft[1],
                        list(step.draft_routes), _seed_rows(a))


_GOLDEN: dict = {}
_READER: dict = {}


def recorded_golden(run_dir, policy=None, golden: str = "numpy") -> tuple[SiteGolden, dict]:
    """The golden of a recorded run (its config's preset, seed and numerics) under the tolerance
    policy `policy` (a `Policy`, or the JSON file of one; default the built-in one), its sub-layers
    on `golden` (`hw.real.jax_check`), and the run's config; cached per process and run config."""
    import json

    from golden.checkpoint import SyntheticCheckpoint
    from golden.dspark.weights import DrafterCheckpoint
    from twin.abi.presets import get_preset

    from .records import per_run

    def build(b):
        cfg = get_preset(b["preset"])
        pol = policy if isinstance(policy, Policy) else Policy.from_json(policy) if policy else None
        return SiteGolden(cfg, SyntheticCheckpoint(cfg, b["seed"]), b["golden_mode"], pol,
                          dckpt=DrafterCheckpoint(cfg) if b["k"] else None, golden=golden), b

    pkey = json.dumps(policy.to_dict(), sort_keys=True) if isinstance(policy, Policy) else policy
    return per_run(_GOLDEN, run_dir, build, pkey, golden)


def _reader(run_dir) -> dict:
    """This process's reader of one run's records (one run held per process, and a run rewritten
    at its path with another config is another run): its store, whose index and manifest are read
    incrementally as the device side appends, and the last state reached."""
    from ..records import RecordStore
    from .records import per_run

    def build(b):
        _READER.clear()
        return {"store": RecordStore(Path(run_dir) / "records"), "at": None, "state": None, "generation": 0}

    return per_run(_READER, run_dir, build)


def _state_before(reader: dict, recs, index: int) -> dict:
    """The device's state before record `index`: the initial state with the deltas applied.  A worker
    checks a run's dispatches in increasing order, so the last state reached is advanced from (one
    delta per record overall, not one per record per check); records found rewritten start over."""
    from .records import apply_deltas

    store = reader["store"]
    at, state = reader["at"], reader["state"]
    if at is None or at > index or reader["generation"] != store.generation:
        at, state = 0, {k: store.get(h) for k, h in store.initial_hashes().items()}
    for rec in recs[at:index]:
        state = apply_deltas(store, state, rec.state_delta)
    reader.update(at=index, state=state, generation=store.generation)
    return state


def recorded_view(run_dir: str, index: int, policy=None, golden: str = "numpy") -> tuple[SiteGolden, dict, DispatchView]:
    """The golden (its sub-layers on `golden`), the record (program, kind, rows, nth: the program's
    dispatches before it) and the view of recorded dispatch `index` of the run in `run_dir`, from
    its records alone."""
    from .records import apply_deltas, outputs_step

    sg, _ = recorded_golden(run_dir, policy, golden)
    reader = _reader(run_dir)
    store = reader["store"]
    recs = store.records()
    if not 0 <= int(index) < len(recs):
        raise AbiError("index", index, f"a recorded dispatch 0..{len(recs) - 1}", where=f"site check {run_dir}")
    rec = recs[index]
    state = _state_before(reader, recs, int(index))
    after = apply_deltas(store, state, rec.state_delta)
    step = outputs_step({k: store.get(h) for k, h in rec.outputs.items()})
    n = sg.cfg.num_hidden_layers

    def layers(st):
        return [{k.split("/", 1)[1]: v for k, v in st.items() if k.split("/", 1)[0] == str(layer)} for layer in range(n)]

    st = None
    if "dspark/tokens" in state:
        st = DeviceState(state["dspark/tokens"], state["dspark/meta"], sg.cfg.dspark_noise_token_id)
    real = rec.meta["real"]
    about = {"program": rec.program, "kind": real["kind"], "rows": len(real["rows"]),
             "nth": sum(r.program == rec.program for r in recs[:index])}
    groups = sorted(int(k.split("/")[1]) for k in state if k.startswith("draft/"))
    draft = ([state[f"draft/{g}"] for g in groups], [after[f"draft/{g}"] for g in groups]) if groups else (None, None)
    return sg, about, view_from_step(rec.program, step, layers(state), layers(after), st, draft)


def check_recorded(run_dir: str, index: int, sites, policy=None, golden: str = "numpy") -> dict:
    """Check `sites` (lists or tuples (program, group, layer, stage)) of recorded dispatch `index` of
    the run in `run_dir` from its records alone (a run recorded with coverage keeps what this reads),
    under the tolerance policy `policy` (a `Policy` or the lockstep's --policy file; default the
    built-in one), the sub-layers on `golden` (`hw.real.jax_check`)."""
    sg, about, view = recorded_view(run_dir, index, policy, golden)
    return {"index": int(index), "program": about["program"], **check_view(sg, view, sites)}


# ---- a sampled dispatch's report entry -----------------------------------------------------------------
def sampled_entry(sg: SiteGolden, view: DispatchView, about: dict, sites, every) -> dict:
    """The report line of a sampled dispatch: the head and the plan's `sites` checked (`check_view`);
    about: index, program, kind, rows, nth.  every: the program's sites.  A failure is localized by
    checking every target site the view holds the taps of (`localized_over` of the program's
    `localized_of`): the first failing (layer, stage) in dependency order, else a layer's pool, else
    the head, else the drafter."""
    res = check_view(sg, view, sites)
    findings = res["head"] + [r["finding"] for r in res["sites"] if r["verdict"] == "fail" and "finding" in r] \
        + res["drafter"]
    failed = [f for f in findings if not f["passed"]]
    ran = {tuple(r["site"]): r["verdict"] for r in res["sites"]}
    entry = {"index": about["index"], "program": about["program"], "kind": about["kind"], "rows": about["rows"],
             "verdict": "fail" if failed else "pass", "findings": findings, "first_divergence": None,
             "resyncs": res["resyncs"], "coverage": {"nth": about["nth"], "sites": len(sites)},
             "sites": [[s[1], s[2], s[3], ran[tuple(s)]] for s in sites]}
    if "checker" in res:
        entry["checker"] = res["checker"]
    if failed:
        cfg = sg.cfg
        order = {(layer, st): (layer, i) for layer in range(cfg.num_hidden_layers)
                 for i, st in enumerate(layer_stages(cfg, layer))}
        every_target = [s for s in every if s[2] != "drafter"]
        # among the sites whose taps the view holds: all of them live, or from a record written after its
        # verdict (a failing synchronous dispatch keeps every tap); from an asynchronous run's record, the
        # sub-layers of its planned sites, every group's rows (`hw.real.coverage.recorded_taps`)
        target = sorted((s for s in every_target if view.meta is not None and readable(sg, view, s)),
                        key=lambda s: order[(s[2], s[3])])
        # localized on NumPy: a failing dispatch's first divergence is the reference's
        full = check_view(sg, view, target, numpy_only=True)["sites"] if target else []
        bad = [r for r in full if r["verdict"] == "fail"]
        entry["localized_over"] = len(full)
        entry["localized_of"] = len(every_target)
        if bad:
            entry["first_divergence"] = bad[0]["first_divergence"]
        else:
            rank = {("head", "hidden"): 0, ("head", "logits"): 1, ("head", "sample"): 2, ("drafter", "ctx_kv"): 3}
            f = min(failed, key=lambda f: (0, f["site"][0], 0) if isinstance(f["site"][0], int)
                    else (1, 0, rank.get(tuple(f["site"]), 4)))
            entry["first_divergence"] = {"layer": str(f["site"][0]), "stage": f["site"][1], "tensor": f["name"],
                                         "reasons": f["reasons"], "metrics": f["metrics"],
                                         "bad_rows": f["bad_rows"][:8]}
    return entry
