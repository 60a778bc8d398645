"""The real-golden lockstep: a dispatch host for the one scheduler.

The simulator's scheduler and worker decide, `twin.functional.GoldenExecutor` lowers and validates,
and this checker is the executor's host: every dispatch runs on the device backend, then on golden
(`golden.dispatch.run_dispatch`) re-synced from the device's decisions, and outputs, per-stage taps
and every touched pool are compared under the tolerance policy; a failure is localized to the first
(layer, stage) of golden.compose's taps, in dependency order, whose device value disagrees.  The
device's outputs are what the scheduler commits, so prefix hits, chunked and packed prefill,
preemption and re-prefill, lease reuse, seeding waves and the K=7 fallback all run in parity.

Re-sync (recorded in each report entry): before a dispatch the golden adopts the device's decision
state (the K=7 device state, each request's current token, anchor, generated tokens), so one tie
flip does not cascade; pools and taps are never re-synced in a clean run, they are compared.
Top-k selections (routes, indexer rows) that differ only among exactly tied scores are equal
(`golden.ties`, kind "tie"); near-ties within the documented margins are adopted too (the
self-check device's FP32 sums legitimately move scores).  Target samples are judged with ties: a
device token whose golden logit is within `tie_tol` of the golden's best is a tie (re-sync),
anything else a failure at ("head", "sample").  New drafts that differ are adopted as a "draft"
re-sync (a draft never changes an output token; the drafter's pools are compared numerically).
In continuous mode a failing dispatch re-syncs the golden's whole run from the device.

With a run directory, each dispatch appends its record (`hw.real.records`) and then its report line;
`finish` writes `summary.{json,md,html}` and `run.json`.  `device_step` is the one place the device
runs, so a resume or an offline replay substitutes the recorded step and the same `check` judges it.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from golden.dispatch import Halt, Ran, run_dispatch
from golden.kernels.compressor import EAGER_PUBLISH
from golden.ties import INDEX_TIE_TOL
from twin.abi.batches import Dispatch
from twin.abi.errors import AbiError
from twin.abi.outputs import write_text

from ..compare import Finding, compare_pool, compare_tensor
from ..localize import compose_kind, first_divergent_tap
from ..options import MODES
from ..report import ReportWriter, write_summary
from ..tolerance import Policy
from .faults import RealFault
from .records import RealRecorder
from .replay import restore
from .side import POOL_KIND, POOL_STAGE, install_state, mapped_rows, side_state
from .site_check import draft_pool_findings
from .step import DECISION_STAGES, DeviceStep, RealDispatch

OUTPUT_KIND = {"main_hidden": ("activation", "bf16", "w8a8"), "state_meta": ("index", "i32", "none")}
# where a mismatching output is localized: the target's final hidden rows, or the K=7 drafter state
OUTPUT_SITE = {"main_hidden": ("head", "hidden"), "state_meta": ("dspark", "state_meta")}
# which pools the golden carries into the next dispatch: the device's (each dispatch judged from the
# same inputs, like an offline replay of records) or its own (drift accumulates, see docs/lockstep.md)
CARRY = ("device", "golden")
SEQ_FIELDS = ("anchor", "current", "generated", "draft_anchor", "released")


def _resync(kind, site, detail) -> dict:
    return {"kind": kind, "site": site, "row": -1, "golden": detail, "device": detail}


class RealLockstep:
    """backend: the device (`SelfCheckBackend` or any `hw.backend.Backend` that follows the request
    lifecycle); dev: the backend's side (its state and bookkeeping); gold: golden's side.
    steps: dispatches to check before the run halts (`golden.dispatch.Halt`)."""

    def __init__(self, backend, device, golden, *, policy: Policy | None = None, mode: str = "strict",
                 fault=None, run_dir=None, config: dict | None = None, carry: str = "device",
                 record: bool = True, build: dict | None = None, steps: int | None = None, plan=None,
                 auto: int | None = None, checker_golden: str = "numpy"):
        if mode not in MODES:
            raise AbiError("mode", mode, f"one of {MODES}", where="hw.real lockstep")
        if carry not in CARRY:
            raise AbiError("carry", carry, f"one of {CARRY}", where="hw.real lockstep")
        if steps is not None and steps < 1:
            raise AbiError("steps", steps, ">= 1", where="hw.real lockstep")
        self.carry, self.steps = carry, steps
        # sampled mode: a `hw.real.coverage.CoveragePlan`; per dispatch only its sites (and the head)
        # are checked, each from the device's recorded state (`hw.real.site_check`)
        self.plan, self.nth = plan, {}
        # --coverage auto: `auto` dispatches checked in full (the plan starts at N = 1), then N chosen
        # from the rates measured on them and fixed (`choose_coverage`); choice: what was chosen
        self.auto = None if auto is None else {"calibration": auto, "choice": None}
        self.throughput = {"sites": 0, "site_s": 0.0, "dispatches": 0, "device_s": 0.0}   # sampled mode, measured
        self.index_tie_tol = INDEX_TIE_TOL
        self.backend, self.dev, self.gold = backend, device, golden
        self.policy, self.mode, self.fault = policy or Policy(), mode, fault
        self.dir = None if run_dir is None else Path(run_dir)
        # both sides compose golden's kernels, whose compressors run serving's eager-publish contract
        self.config = {**(config or {}), "golden": "real", "mode": mode, "carry": carry, "device": backend.name,
                       "golden_side": golden.name, "compressor_contract": EAGER_PUBLISH}
        # the golden of the site checks (hw.real.jax_check): the run's choice per target program
        from .coverage import TARGET_PROGRAMS
        from .jax_check import check_choice

        self.checker_golden = checker_golden
        programs = [] if plan is None else [p for p in plan.sites if p in TARGET_PROGRAMS]
        choice = check_choice(checker_golden, golden.g.cfg, programs, golden.g.nm.mode, coverage=plan is not None)
        if checker_golden != "numpy":
            self.config["checker_golden"] = {"chosen": checker_golden, "programs": choice}
        if plan is not None:
            from .site_check import SiteGolden

            self.config["coverage"] = plan.summary()
            if self.auto is not None:
                self.config["coverage"]["auto"] = {"calibration_dispatches": auto, "chosen_at": None}
            self.site_golden = SiteGolden(golden.g.cfg, golden.g.ckpt, golden.g.nm, self.policy, INDEX_TIE_TOL,
                                          golden.g.dckpt, golden=checker_golden)
        self.entries: list[dict] = []
        # records need a run directory and the arguments that rebuild this run offline
        self.build = build
        self.recorder = None
        if self.dir is not None and record and build is not None:
            self.recorder = RealRecorder(self.dir / "records", build)
        self.crash_after: int | None = None        # tests: die after this many records, before the report line
        self.last_step: DeviceStep | None = None    # the device's step of the dispatch just checked (recorded)
        self.progress = None                        # progress(entry) after each dispatch
        self.resumed: list[dict] = []               # report entries of a resumed run not yet re-driven
        self.seek = None                            # hw.real.replay.Seek: only chosen records are checked
        self.pool = None                            # hw.real.pool.CheckPool: checks run asynchronously
        self.report = None
        self.index = 0
        self.t0 = time.perf_counter()
        self._opened = False

    # ---- the host interface (twin.functional.GoldenExecutor) ------------------------------------------
    @property
    def seqs(self) -> dict:
        return self.dev.served.seqs

    def admit(self, rid, prompt, max_new_tokens) -> None:
        self.backend.admit(rid, prompt, max_new_tokens)
        self.gold.served.admit(rid, prompt, max_new_tokens)

    def drop(self, rid) -> None:
        self.backend.drop(rid)
        self.gold.served.drop(rid)

    def last_token(self, rid) -> int:
        return self.dev.served.last_token(rid)

    def speculation(self) -> dict:
        return self.dev.served.speculation()

    def dispatch(self, kind: str, d, items):
        """One lowered dispatch: checked (or, resuming, replayed from its record); the device's
        outputs go back to the scheduler."""
        if self.dir is not None and not self._opened:
            self._open()
        if d is None:
            # a seeding wave none of whose rows fits the context: no dispatch, both sides seed without drafts
            ran = run_dispatch(self.dev.served, kind, d, items)
            run_dispatch(self.gold.served, kind, d, items)
            return ran
        rd = RealDispatch(self.index, kind, Dispatch(d.program, d.args, {**d.meta, "index": self.index}), [],
                          list(items))
        self.index += 1
        skipped = self.resumed or (self.seek is not None and rd.index not in self.seek.live)
        if skipped and self.plan is not None:
            # a dispatch resumed or replayed past still counts in the plan's count of its program's dispatches
            self.nth[rd.dispatch.program] = self.nth.get(rd.dispatch.program, 0) + 1
        if self.resumed:
            from .replay import fast_forward
            return fast_forward(self, rd, self.resumed.pop(0))
        if skipped:
            return self.seek.forward(rd)
        if self.pool is not None:
            return self.pool.dispatch(self, rd)
        e = self.check(rd)
        if self.recorder is not None:
            self.recorder.record(self, rd, e)
        if self.crash_after is not None and len(self.entries) == self.crash_after:
            raise KeyboardInterrupt("simulated kill between the record and its report line")
        self.entries.append(e)
        if self.report is not None:
            self.report.append(e)
        if self.progress:
            self.progress(e)
        self.halt_after(e)
        return self.last_ran

    def halt_after(self, e: dict) -> None:
        """End the run once `steps` dispatches are checked, or (strict) at the first failure."""
        if (self.steps is not None and len(self.entries) >= self.steps) or \
                (self.mode == "strict" and e["verdict"] == "fail"):
            raise Halt(f"{len(self.entries)} dispatches checked")

    # ---- decisions ---------------------------------------------------------------------------------
    # ---- decisions ---------------------------------------------------------------------------------
    def _adopt_decisions(self) -> list[dict]:
        out, d, g = [], self.dev.run, self.gold.run
        if d.state is not None and not (np.array_equal(d.state.tokens, g.state.tokens)
                                        and np.array_equal(d.state.meta, g.state.meta)):
            bad = np.argwhere((d.state.tokens != g.state.tokens).any(-1))
            out.append(_resync("draft", ["dspark", "state"], [list(map(int, b)) for b in bad[:8]]))
            g.state = d.state
        for sd, sg in zip(d.seqs, g.seqs):
            diff = [f for f in SEQ_FIELDS if getattr(sd, f) != getattr(sg, f)]
            if diff:
                out.append(_resync("tokens", [sd.req.request_id, "seq"], diff))
                for f in SEQ_FIELDS:
                    setattr(sg, f, list(getattr(sd, f)) if f == "generated" else getattr(sd, f))
        # the captured target hidden (the seed's input) is the device's, compared when it was produced
        moved = [sd.req.request_id for sd, sg in zip(d.seqs, g.seqs)
                 if sd.tail.keys() != sg.tail.keys() or any(not np.array_equal(sd.tail[p], sg.tail[p]) for p in sd.tail)]
        if moved:
            out.append(_resync("hidden", ["head", "hidden"], moved))
            for sd, sg in zip(d.seqs, g.seqs):
                sg.tail = dict(sd.tail)
        return out

    def _samples(self, dtaps, gtaps, findings, tie: float) -> None:
        """Greedy target samples (argmax of each side's logits), ties judged on the golden's logits."""
        from .site_check import sample_finding

        if ("head", "logits") not in gtaps:
            return
        f = sample_finding(np.asarray(dtaps[("head", "logits")]).argmax(-1), gtaps[("head", "logits")], tie)
        if f is not None:
            findings.append(f)

    # ---- one dispatch ------------------------------------------------------------------------------
    def device_step(self, rd) -> DeviceStep:
        """The device runs the dispatch (a resume or a replay substitutes the recorded step)."""
        d = Dispatch(rd.dispatch.program, rd.dispatch.args, {**rd.dispatch.meta, "kind": rd.kind, "items": rd.items})
        t0 = time.perf_counter()
        r = self.backend.run(d, side_state(self.dev))
        self.throughput["device_s"] += time.perf_counter() - t0
        self.throughput["dispatches"] += 1
        if r.state:
            install_state(self.dev, {**side_state(self.dev), **r.state})
        rd.rows = [s.index for s in r.seqs]
        self.last_ran = Ran(r.outputs, list(r.seqs))
        step = DeviceStep(r.outputs, r.taps, r.sampled, r.draft_routes)
        if self.plan is not None:
            from .site_check import site_arrays

            step.site = site_arrays(self.dev, r.seqs, rd.kind)
        return step

    def check(self, rd) -> dict:
        """Judge dispatch `rd`: in full (every output, tap and pool against golden's whole dispatch)
        or, with a coverage plan, sampled (`check_sampled`)."""
        if self.plan is not None:
            return self.check_sampled(rd)
        return self.check_full(rd)

    def check_full(self, rd) -> dict:
        resyncs = self._adopt_decisions()
        before = [dict(p) for p in self.dev.run.caches]
        gold_before = [dict(p) for p in self.gold.run.caches]
        dpools_before = list(self.dev.run.pools or [])
        gpools_before = list(self.gold.run.pools or [])
        step = self.last_step = self.device_step(rd)
        r, dtaps = step.outputs, step.taps
        gp = self.gold.par
        gp.route_from, gp.resyncs = dtaps, []
        gp.tie_tol = lambda d: self.policy.lookup("route", "i32", depth=d).tie_tol or 0.0    # per layer depth
        gp.draft_from = list(step.draft_routes)
        gp.sample_from = list(step.sampled)
        # the sampler's near-tie margin at the head's depth: the golden's adoption and the check below share it
        gp.tie_samples = self.policy.lookup("sample", "i32", depth=self.dev.g.cfg.num_hidden_layers).tie_tol or 0.0
        gp.index_tie_tol = self.index_tie_tol
        gp.reset()
        g = run_dispatch(self.gold.served, rd.kind, rd.dispatch, rd.items).outputs
        resyncs += gp.resyncs
        gcalls = list(gp.calls)
        gtaps = gcalls[-1][1] if gcalls else {}
        findings: list[Finding] = []
        self._samples(dtaps, gtaps, findings, gp.tie_samples)
        for name, e in g.items():
            a = r.get(name, np.zeros(0))
            if name in ("drafts", "accepted_ids", "accepted_counts", "num_draft_tokens", "sampled_ids"):
                if not np.array_equal(a, e):
                    # near-tie samples were adopted by the golden before acceptance (TapPar), so tokens that
                    # still differ are wrong (a tie excuse here hid a corrupted output token)
                    if name == "drafts":
                        resyncs.append(_resync("draft", ["dspark", name],
                                               np.flatnonzero((np.asarray(a) != e).reshape(len(e), -1).any(-1))[:8]
                                               .tolist()))
                    elif not any(f.site == ("head", "sample") for f in findings):
                        findings.append(Finding(name, False, ("sample", "i32", "none"), points=int(e.size),
                                                reasons=["differs (exact)"], site=("head", "sample")))
                continue
            kind = OUTPUT_KIND[name]
            f = compare_tensor(name, a, e, self.policy.lookup(*kind), kind)
            f.site = OUTPUT_SITE[name]
            findings.append(f)
        for site in gtaps:
            # the logits too: a last-layer fault moves only them and the hidden, within the ties' reach
            if (site[1] in DECISION_STAGES or site == ("head", "logits")) and site in dtaps:
                kind = compose_kind(site)
                f = compare_tensor(f"{site[0]}/{site[1]}", dtaps[site], gtaps[site], self.policy.lookup(*kind), kind)
                f.site = site
                if not f.passed:
                    findings.append(f)
        mapped = mapped_rows(gcalls)
        for layer, (pd, pg, pb, gb) in enumerate(zip(self.dev.run.caches, self.gold.run.caches, before, gold_before)):
            for pool, e in pg.items():
                if pd[pool] is pb[pool] and e is gb[pool] and pb[pool] is gb[pool]:
                    continue                    # neither side wrote it and both started from the same array
                kind = POOL_KIND[pool]
                f = compare_pool(f"{layer}/{pool}", np.asarray(pd[pool]), np.asarray(e), np.asarray(pb[pool]),
                                 mapped[pool], self.policy.lookup(*kind), kind)
                f.site = (layer, POOL_STAGE[pool])
                if not f.passed or len(mapped[pool]):
                    findings.append(f)
        if dpools_before:
            # a group's pools neither side wrote, from the same array, are skipped by identity
            moved = [grp for grp, (pd, pg) in enumerate(zip(self.dev.run.pools, self.gold.run.pools))
                     if not (pd is dpools_before[grp] and pg is gpools_before[grp] and pd is pg)]
            findings += draft_pool_findings(self.policy, self.dev.run.pools, self.gold.run.pools, dpools_before,
                                            gpools_before, moved)
        failed = [f for f in findings if not f.passed]
        entry = {"index": rd.index, "program": rd.dispatch.program, "kind": rd.kind, "rows": len(rd.rows),
                 "verdict": "fail" if failed else "pass",
                 # every failing finding, every numeric output's, and the passing ones of pools with rows
                 # this dispatch wrote (a pool nobody touched is skipped by identity live but not in an
                 # offline replay)
                 "findings": [f.to_dict() for f in findings],
                 "first_divergence": self.localize(list(gtaps), dtaps, gtaps, failed) if failed else None,
                 "resyncs": resyncs}
        if failed and self.mode == "continuous":
            self.gold.adopt(self.dev.run)
            entry["resyncs"].append(_resync("state", None, "whole run"))
        elif not failed and self.carry == "device":
            # the next dispatch starts from the device's pools (just judged equal within tolerance)
            self.gold.run.caches = [dict(p) for p in self.dev.run.caches]
            if self.dev.run.pools is not None:
                self.gold.run.pools = list(self.dev.run.pools)
        return entry

    def planned(self, program: str) -> tuple[int, tuple]:
        """The plan's count of `program`'s dispatches so far (this one's nth) and this one's sites;
        counts it (sampled mode, live or asynchronous).  With --coverage auto the first dispatch
        after the calibration chooses N first."""
        if self.auto is not None and self.auto["choice"] is None and self.index - 1 >= self.auto["calibration"]:
            self.choose_coverage()
        nth = self.nth.get(program, 0)
        self.nth[program] = nth + 1
        return nth, self.plan.plan(program, nth)

    def checker_rate(self) -> tuple[int, float, int]:
        """(site checks, their seconds, workers) measured this session: the pool's workers' own time
        per check (asynchronous), or this process's (synchronous: one worker)."""
        if self.pool is not None:
            return self.pool.checked_sites, self.pool.check_s, self.pool.workers.n
        return self.throughput["sites"], self.throughput["site_s"], 1

    def choose_coverage(self) -> None:
        """--coverage auto at the end of its calibration: N from the checker's measured site checks per
        second (per worker, times the workers) against the device's dispatches per second
        (`coverage.choose_n`), fixed for the rest of the run.  An asynchronous run first waits for the
        calibration's checks (their times are the measurement).  Nothing measured yet this session (a
        resume at the boundary): this dispatch is checked in full too."""
        from .coverage import choose_n

        wait = self.pool.settle() if self.pool is not None else 0.0
        sites, secs, workers = self.checker_rate()
        t = self.throughput
        if not sites or secs <= 0 or not t["dispatches"] or t["device_s"] <= 0:
            return
        rates = choose_n(max(len(x) for x in self.plan.sites.values()), workers * sites / secs,
                         t["dispatches"] / t["device_s"])
        rates.update(workers=workers, sites_per_s_per_worker=sites / secs, calibration_wait_s=wait,
                     measured={"site_checks": sites, "check_s": secs, "dispatches": t["dispatches"],
                               "device_s": t["device_s"]})
        choice = {"n": rates["n"], "full_until": dict(self.nth), "chosen_at": self.index - 1, "rates": rates}
        self.apply_coverage(choice)
        if self.recorder is not None:
            write_text(self.recorder.store.root / AUTO_FILE, json.dumps(choice, indent=2, sort_keys=True) + "\n")

    def apply_coverage(self, choice: dict) -> None:
        """A --coverage auto run's choice (`choose_coverage`, or read back by a resume or replay)."""
        from .coverage import CoveragePlan

        self.plan = CoveragePlan(self.plan.sites, choice["n"], self.plan.seed, choice["full_until"])
        self.auto["choice"] = choice
        self.config["coverage"] = {**self.plan.summary(), "auto": {
            "calibration_dispatches": self.auto["calibration"], "chosen_at": choice["chosen_at"]}}

    def auto_report(self) -> dict:
        """run.json's account of --coverage auto: the chosen N with the calibration's rates, the
        guarantee, and over the session's whole run whether the checker kept up at that N (the
        smallest N its run-long rates allow is no larger) and, asynchronously, what the backlog did:
        the guarantee holds while no check is skipped (throttle slows the device instead)."""
        from .coverage import choose_n

        ch = self.auto["choice"]
        if ch is None:
            return {"n": None, "calibration_dispatches": self.auto["calibration"],
                    "why": "the run ended within its calibration: every dispatch checked every site"}
        out = {"n": ch["n"], "chosen_at": ch["chosen_at"], "calibration": ch["rates"],
               "guarantee": self.plan.guarantee()}
        sites, secs, workers = self.checker_rate()
        t = self.throughput
        if sites and secs > 0 and t["dispatches"] and t["device_s"] > 0:
            run = choose_n(max(len(x) for x in self.plan.sites.values()), workers * sites / secs,
                           t["dispatches"] / t["device_s"])
            out["run"] = run
            out["kept_up"] = bool(run["keeps_up"] and run["n"] <= ch["n"])
        skipped = [] if self.pool is None else [i for i, st in enumerate(self.pool.status) if st == "skipped"]
        if self.pool is not None:
            out["device_waited_s"] = self.pool.waited_s
        out["skipped"] = len(skipped)
        out["guarantee_holds"] = not skipped
        return out

    def check_sampled(self, rd) -> dict:
        """The head and the plan's sites of this dispatch, each from the device's own state
        (`hw.real.site_check.sampled_entry`), the drafter site's too: the same unit an asynchronous
        check runs on the dispatch's records."""
        from .site_check import sampled_entry, view_from_step

        program = rd.dispatch.program
        nth, sites = self.planned(program)
        before, state = [dict(p) for p in self.dev.run.caches], self.dev.run.state
        draft_before = None if self.dev.run.pools is None else list(self.dev.run.pools)
        step = self.last_step = self.device_step(rd)
        draft = (draft_before, None if draft_before is None else list(self.dev.run.pools))
        view = view_from_step(program, step, before, [dict(p) for p in self.dev.run.caches], state, draft)
        about = {"index": rd.index, "program": program, "kind": rd.kind, "rows": len(rd.rows), "nth": nth}
        t0 = time.perf_counter()
        entry = sampled_entry(self.site_golden, view, about, sites, self.plan.sites[program])
        self.throughput["site_s"] += time.perf_counter() - t0
        self.throughput["sites"] += sum(s[2] != "drafter" for s in sites)
        return entry

    def localize(self, order, dtaps, gtaps, failed) -> dict:
        pos = {s: i for i, s in enumerate(order)}
        for s in (("head", "sample"), ("drafter", "ctx_kv")):
            pos.setdefault(s, len(pos))
        cands = [(pos.get(f.site, len(pos)), f) for f in failed]
        first = min(c[0] for c in cands)
        if all(f.site == ("head", "sample") for f in failed) and ("head", "logits") in gtaps:
            # the sampler's own input agrees: the divergence is the sample, not anything upstream
            if first_divergent_tap([("head", "logits")], dtaps, gtaps, self.policy, compose_kind) is None:
                first = 0
        f = first_divergent_tap(order[:first], dtaps, gtaps, self.policy, compose_kind)
        if f is not None:
            cands.append((pos[f.site], f))
        _, f = min(cands, key=lambda c: c[0])
        return {"layer": str(f.site[0]), "stage": f.site[1], "tensor": f.name, "reasons": f.reasons,
                "metrics": f.to_dict()["metrics"], "bad_rows": f.bad_rows[:8]}

    # ---- a run -------------------------------------------------------------------------------------
    def _open(self) -> None:
        """The first dispatch with a run directory: resume from its report and records, or start both."""
        self._opened = True
        self.dir.mkdir(parents=True, exist_ok=True)
        entries = ReportWriter(self.dir).entries()
        self.report = ReportWriter(self.dir)
        if not entries:
            if self.recorder is not None:
                self.recorder.start(self)
            return
        if self.recorder is None:
            raise AbiError("run_dir", str(self.dir), "a run with records to resume (record=True), or a fresh directory",
                           where="hw.real lockstep")

        restore(self, entries)
        if self.auto is not None:
            choice = read_coverage_choice(self.dir)
            if choice is not None:
                self.apply_coverage(choice)

    def finish(self, serving: dict | None = None) -> dict:
        """The summary of the dispatches checked (serving: the scheduler's counts, kept in the summary's
        config); with a run directory also summary.{json,md,html} and run.json."""
        if self.dir is not None and not self._opened:
            self._open()
        config = {**self.config, **({"serving": serving} if serving is not None else {})}
        if "checker_golden" in config:
            from .jax_check import tally

            config["checker_golden"] = {**config["checker_golden"], "tally": tally(self.entries)}
        wall = round(time.perf_counter() - self.t0, 3)
        timing = {"wall_s_this_session": wall}
        if self.plan is not None and self.throughput["sites"] and self.throughput["device_s"] > 0:
            from .coverage import choose_n

            t = self.throughput
            # the N at which this checker would keep up with this device (measured this session)
            timing["coverage_throughput"] = choose_n(max(len(s) for s in self.plan.sites.values()),
                                                     t["sites"] / max(t["site_s"], 1e-9), t["dispatches"] / t["device_s"])
        if self.auto is not None:
            timing["coverage_auto"] = self.auto_report()
        if self.dir:
            # timings stay out of the report and summary, so a resumed run writes the same bytes
            write_text(self.dir / "run.json", json.dumps({**timing, "config": config},
                                                         indent=2, sort_keys=True) + "\n")
            return write_summary(self.dir, self.entries, config)
        from ..report import summarize
        return summarize(self.entries, {**config, **{("wall_s" if k == "wall_s_this_session" else k): v
                                                     for k, v in timing.items()}})


AUTO_FILE = "coverage.json"          # records/: a --coverage auto run's choice (a resume and a replay apply it)


def read_coverage_choice(run_dir) -> dict | None:
    """The choice a --coverage auto run recorded (None: it ended before its calibration did)."""
    path = Path(run_dir) / "records" / AUTO_FILE
    if not path.exists():
        return None
    from twin.abi.inputs import read_json

    return read_json(path, "--run-dir", "the N a --coverage auto run chose, as lockstep wrote it")


def parse_real_fault(spec: str):
    """'KIND', 'KIND@AT' or 'KIND@AT:LAYER' (AT a dispatch index, LAYER a layer index)."""
    from ..options import split_fault

    kind, at, layer = split_fault(spec)
    return RealFault(kind, at=at, layer=layer, seed=at)


BACKENDS = ("selfcheck", "torch")


def build_checker(ctx, *, backend: str = "selfcheck", device: str = "cpu", mode: str = "strict", seed: int = 0,
                  golden_mode: str = "device",
                  fault=None, policy: Policy | None = None, run_dir=None, carry: str = "device",
                  record: bool = True, build: dict | None = None, steps: int | None = None,
                  config: dict | None = None, nproc: int = 1, coverage: int | str | None = None,
                  coverage_seed: int = 0, checker_golden: str = "numpy") -> RealLockstep:
    """The checker of a parity run on `ctx` (a `twin.abi.lowering.LoweringContext` of a small
    preset's deployment): golden's side in `golden_mode` numerics and the device, both on the
    synthetic checkpoint of `seed`.  backend "selfcheck": `SelfCheckBackend` (the same compositions
    with `TorchNumerics(golden_mode, device)`); "torch": the independent `hw.torchdev.TorchBackend`
    behind `TorchLockstepDevice` (K=0 and K=7, no device faults), split over `nproc` processes.
    checker_golden: the site checks' golden (`hw.real.jax_check`)."""
    from golden.checkpoint import SyntheticCheckpoint
    from golden.dspark.weights import DrafterCheckpoint

    from .numerics import TorchNumerics
    from .selfcheck import SelfCheckBackend
    from .side import Side

    dep = ctx.deployment
    cfg = dep.model
    if not cfg.small:
        raise AbiError("preset", cfg.name, "a small preset (tiny or small): the real path runs whole models",
                       where="hw.real")
    if backend not in BACKENDS:
        raise AbiError("backend", backend, f"one of {BACKENDS}", where="hw.real lockstep")
    ck = SyntheticCheckpoint(cfg, seed)
    dk = DrafterCheckpoint(cfg) if dep.k else None
    gold = Side(f"golden:{golden_mode}", cfg, ck, dk, golden_mode, ctx)
    if backend == "torch":
        from .torch_adapter import TorchLockstepDevice

        if fault is not None:
            raise AbiError("fault", fault.kind, "none with the torch device (device faults hook the self-check "
                           "device's compositions)", where="hw.real lockstep")
        # the device side keeps golden-layout pools and request bookkeeping; the torch device computes
        dev = Side(f"torch:{device}", cfg, ck, dk, golden_mode, ctx)
        if nproc != 1 and ctx.deployment.k:
            raise AbiError("nproc", nproc, "1 at K=7 (the fused K=7 step runs the device's ranks in one process)",
                           where="lockstep")
        backend = TorchLockstepDevice(dev, ctx, device, ck, dk, nproc)
    else:
        if nproc != 1:
            raise AbiError("nproc", nproc, "1 with the self-check device (only the torch device splits its "
                           "ranks over processes)", where="hw.real lockstep")
        dev = Side(f"torch:{device}", cfg, ck, dk, TorchNumerics(golden_mode, device=device), ctx)
        backend = SelfCheckBackend(dev, device, fault)
    config = {**(config or {}), "preset": cfg.name, "seed": seed, "k": dep.k, "golden_mode": golden_mode,
              "fault": None if fault is None else fault.spec()}
    plan, auto = None, None
    if coverage is not None:
        from .coverage import AUTO, CALIBRATION, CoveragePlan

        if coverage == AUTO:            # N = 1 through the calibration (RealLockstep.choose_coverage)
            coverage, auto = 1, CALIBRATION
        plan = CoveragePlan.for_deployment(dep, coverage, coverage_seed)
    return RealLockstep(backend, dev, gold, policy=policy, mode=mode, fault=fault, run_dir=run_dir, config=config,
                        carry=carry, record=record, build=build, steps=steps, plan=plan, auto=auto,
                        checker_golden=checker_golden)
