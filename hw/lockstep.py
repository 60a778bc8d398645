"""The lockstep executor: every dispatch runs on the device backend, then on the golden (re-synced
from the device's decisions), and every output, routing decision and touched pool is compared
under the tolerance policy.  On a failure the divergence is localized to the first
(layer, stage) in dependency order whose device value disagrees: the device's taps against the
golden's, pool rows attributed to the layer region and the stage that writes them, outputs to the
stage that produces them.

Modes: "strict" stops at the first failing dispatch; "continuous" keeps going and, after a failure,
re-syncs the golden's touched state from the device (recorded) so one fault is reported once.

A run directory holds `records/` (content-addressed dispatch records), `report.jsonl`,
`summary.{json,md,html}` and `run.json`.  A killed run resumes: the scheduler is replayed from
the recorded device outputs (each regenerated dispatch is checked against the recorded input
hashes), both sides' state is restored from the last records, and the next dispatch is the first
one without a report line: none is lost and none is repeated.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from twin.abi.batches import Dispatch
from twin.abi.errors import AbiError
from twin.abi.outputs import write_text

from .compare import Finding, compare_pool, compare_tensor
from .model.spec import POOL_WRITER, Geometry, output_site, tensor_kind
from .records import Record, RecordStore, content_hash
from .report import ReportWriter, write_summary
from .tolerance import Policy

MODES = ("strict", "continuous")


@dataclass
class DispatchCheck:
    entry: dict
    device: object
    golden: object
    findings: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.entry["verdict"] == "pass"


class Lockstep:
    """Compares one dispatch: device result vs golden result, localizes, re-syncs."""

    def __init__(self, geo: Geometry, device, golden, policy: Policy | None = None):
        self.geo, self.device, self.golden = geo, device, golden
        self.policy = policy or Policy()

    def _tol(self, name):
        kind = tensor_kind(name)
        return self.policy.lookup(*kind), kind

    def decisions(self, program: str) -> list[tuple[str, str]]:
        """Routing decisions are compared on every dispatch (they are what the golden re-syncs)."""
        return [s for s in self.geo.sites(program) if s[1] == "route"]

    def check(self, d: Dispatch, dev_state: dict, gold_state: dict) -> DispatchCheck:
        r = self.device.run(d, dev_state)
        g = self.golden.run(d, gold_state, device=r, tie_tols=self.policy.tie_tols())
        findings: list[Finding] = []
        for name, e in g.outputs.items():
            tol, kind = self._tol(name)
            f = compare_tensor(name, r.outputs.get(name, np.zeros(0)), e, tol, kind)
            f.site = output_site(self.geo.cfg, name)
            findings.append(f)
        for site in self.decisions(d.program):
            if site in g.taps:
                name = f"{site[0]}/{site[1]}"
                tol, kind = self._tol(name)
                f = compare_tensor(name, r.taps.get(site, np.zeros(0)), g.taps[site], tol, kind)
                f.site = site
                if not f.passed:
                    findings.append(f)
        for pool, e in g.state.items():
            tol, kind = self._tol(pool)
            # a pool the device did not hand back is judged as left untouched
            f = compare_pool(pool, r.state.get(pool, dev_state[pool]), e, dev_state[pool],
                             g.mapped.get(pool, np.zeros(0, np.int64)), tol, kind)
            f.site = self._pool_site(pool, f.bad_rows) if f.bad_rows else (self.geo.pool_layers(pool)[0],
                                                                              POOL_WRITER[pool])
            findings.append(f)
        failed = [f for f in findings if not f.passed]
        first = self.localize(d, r, g, failed) if failed else None
        entry = {
            "index": int(d.meta.get("index", -1)), "program": d.program,
            "rows": int(len(d.args["input_ids"])) if "input_ids" in d.args else int(len(d.args["anchor"])),
            "verdict": "fail" if failed else "pass",
            "findings": [f.to_dict() for f in findings if not f.passed or f.name in g.outputs or f.name in g.state],
            "first_divergence": first,
            "resyncs": [x.to_dict() for x in g.resyncs],
        }
        return DispatchCheck(entry, r, g, findings)

    def _pool_site(self, pool: str, rows: list[int]) -> tuple[str, str]:
        layers = self.geo.pool_layers(pool)
        first = min(layers.index(self.geo.layer_of_row(pool, row)) for row in rows)
        return layers[first], POOL_WRITER[pool]

    def localize(self, d: Dispatch, r, g, failed: list[Finding]) -> dict:
        """First failing site in dependency order among taps, pools and outputs."""
        sites = self.geo.sites(d.program)
        order = {s: i for i, s in enumerate(sites)}
        cands = [(order.get(f.site, len(order)), f) for f in failed]
        before = min(c[0] for c in cands)
        f = first_divergent_tap(sites[:before], r.taps, g.taps, self.policy, lambda s: tensor_kind(f"{s[0]}/{s[1]}"))
        if f is not None:
            cands.append((order[f.site], f))
        _, f = min(cands, key=lambda c: c[0])
        return {"layer": f.site[0], "stage": f.site[1], "tensor": f.name, "reasons": f.reasons,
                "metrics": f.to_dict()["metrics"], "bad_rows": f.bad_rows[:8]}


def first_divergent_tap(order, device_taps: dict, golden_taps: dict, policy: Policy, kind_of) -> Finding | None:
    """The first site in `order` (dependency order) whose device tap fails against the golden's
    under the policy; `kind_of(site)` gives its (op class, dtype, quant).  Sites either side lacks
    are skipped.  Works on any golden's taps keyed by site (golden.compose's (layer, stage) too)."""
    for site in order:
        if site not in device_taps or site not in golden_taps:
            continue
        kind = kind_of(site)
        dv, gv = device_taps[site], golden_taps[site]
        parts = list(zip(dv, gv)) if isinstance(gv, (tuple, list)) else [(dv, gv)]   # multi-part taps
        for i, (a, e) in enumerate(parts):
            name = f"{site[0]}/{site[1]}" + (f"[{i}]" if len(parts) > 1 else "")
            f = compare_tensor(name, a, e, policy.lookup(*kind), kind)
            if not f.passed:
                f.site = site
                return f
    return None


# ---- runs ----------------------------------------------------------------------------------------------
def _decision_taps(program_sites, taps) -> dict:
    return {f"tap:{l}/{s}": np.asarray(taps[(l, s)]) for (l, s) in program_sites if (l, s) in taps}


class LockstepRun:
    """A resumable lockstep run over a workload's dispatch stream."""

    def __init__(self, run_dir, geo: Geometry, weights, device, golden, workload_factory: Callable,
                 initial_state: dict, *, policy: Policy | None = None, mode: str = "strict", config: dict | None = None,
                 record: bool = True):
        if mode not in MODES:
            raise AbiError("mode", mode, f"one of {MODES}", where="lockstep")
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.geo, self.weights, self.mode = geo, weights, mode
        self.lock = Lockstep(geo, device, golden, policy)
        self.workload_factory = workload_factory
        self.initial = initial_state
        self.config = {**(config or {}), "mode": mode, "device": getattr(device, "name", "?"),
                       "golden": getattr(golden, "name", "?"), "weights": weights.fingerprint}
        self.store = RecordStore(self.dir / "records") if record else None
        self.report = ReportWriter(self.dir)
        self.crash_after: int | None = None        # tests: die after writing this many dispatches

    def _resume(self, wl):
        entries = self.report.entries()
        dev, gold = dict(self.initial), dict(self.initial)
        if not entries:
            if self.store:
                self.store.truncate(0)
                self.store.put_initial(self.initial)
            return entries, dev, gold
        if self.store is None:
            raise AbiError("resume", str(self.dir), "a run directory with records (record=True)", where="lockstep")
        recs = self.store.records()
        if len(recs) < len(entries):
            raise AbiError("records", len(recs), f">= {len(entries)} (one per report line)", where=str(self.dir))
        self.store.truncate(len(entries))
        recs = recs[: len(entries)]
        for rec in recs:
            d = wl.next_dispatch()
            want = None if d is None else {k: content_hash(np.asarray(v)) for k, v in d.args.items()}
            if d is None or d.program != rec.program or want != rec.inputs:
                raise AbiError("dispatch", rec.index, "the same dispatch the record holds (the workload, weights "
                               "or code changed since the run began)", where="lockstep resume")
            wl.observe(d, self.store.get_all({k: h for k, h in rec.outputs.items() if not k.startswith("tap:")}))
        for _, _, dev, gold in self.store.states(recs, with_before=False):
            pass
        return entries, dev, gold

    def run(self, steps: int, progress: Callable | None = None) -> dict:
        if steps < 1:
            raise AbiError("steps", steps, ">= 1", where="lockstep")
        wl = self.workload_factory()
        entries, dev, gold = self._resume(wl)
        t0 = time.perf_counter()
        stopped = bool(entries) and self.mode == "strict" and any(e["verdict"] == "fail" for e in entries)
        while len(entries) < steps and not stopped:
            d = wl.next_dispatch()
            if d is None:
                break
            chk = self.lock.check(d, dev, gold)
            r, g = chk.device, chk.golden
            new_gold = dict(g.state)
            if not chk.passed and self.mode == "continuous":
                new_gold = {k: np.array(v) for k, v in r.state.items()}
                chk.entry["resyncs"].append({"kind": "state", "site": None, "row": -1, "golden": sorted(new_gold),
                                             "device": sorted(new_gold)})
            if self.store:
                outs = {**r.outputs, **_decision_taps(self.lock.decisions(d.program) + [("head", "sample"),
                                                                                         ("markov", "sample")], r.taps)}
                rec = Record(index=chk.entry["index"], program=d.program, meta=dict(d.meta),
                             inputs=self.store.put_all(dict(d.args)), outputs=self.store.put_all(outs),
                             state_delta={k: self.store.put_delta(dev[k], v) for k, v in r.state.items()},
                             golden_state_delta={k: self.store.put_delta(gold[k], v) for k, v in new_gold.items()},
                             weights=self.weights.fingerprint)
                self.store.append(rec)
            if self.crash_after is not None and len(entries) == self.crash_after:
                raise KeyboardInterrupt("simulated kill between the record and its report line")
            self.report.append(chk.entry)
            entries.append(chk.entry)
            dev.update(r.state)
            gold.update(new_gold)
            wl.observe(d, r.outputs)
            if progress:
                progress(chk.entry)
            if not chk.passed and self.mode == "strict":
                stopped = True
        summary = write_summary(self.dir, entries, self.config)
        write_text(self.dir / "run.json", json.dumps({"wall_s_this_session": time.perf_counter() - t0,
                                                      "config": self.config}, indent=2) + "\n")
        return summary


def replay(run_dir, geo: Geometry, golden, policy: Policy | None = None, *, limit: int | None = None) -> list[dict]:
    """Offline: re-run recorded dispatches (the first `limit`, or all) on the golden from the
    device's recorded state and compare with the device's recorded outputs and state (no device
    needed: this runs on any machine, or fanned out on a cluster)."""
    from .backend import StepResult

    store = RecordStore(Path(run_dir) / "records")
    lock = Lockstep(geo, None, golden, policy)
    out = []
    for rec, before, after, _ in store.states(store.records()[:limit]):
        d = Dispatch(rec.program, store.get_all(rec.inputs), rec.meta)
        outs = store.get_all(rec.outputs)
        taps = {tuple(k[4:].split("/")): v for k, v in outs.items() if k.startswith("tap:")}
        dev_out = {k: v for k, v in outs.items() if not k.startswith("tap:")}
        if "logits" in dev_out:
            taps[("head", "logits")] = dev_out["logits"]      # what sampling re-sync weighs the device by
        lock.device = _Recorded(StepResult(dev_out, {k: after[k].copy() for k in rec.state_delta}, taps))
        out.append(lock.check(d, before, before).entry)
    return out


class _Recorded:
    name = "recorded"

    def __init__(self, result):
        self.result = result

    def run(self, dispatch, state):
        return self.result
