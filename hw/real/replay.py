"""Resume and offline replay of a real-golden lockstep run from its records (`hw.real.records`).

Both re-drive the parity run's scheduler from the start (`twin.functional.parity.rebuild`) with
the device's recorded outputs, so the scheduler makes the same decisions and issues the same
dispatches; each regenerated dispatch is held to its record's input hashes.

resume   a killed run continues where its report stops: the records past the last report line are
         dropped; each dispatch that has a report line is fast-forwarded (both sides' state and
         per-request bookkeeping installed from its record, the device's recorded outputs committed,
         its report line kept), and the first dispatch without one is checked live, so the report is
         byte-identical to an uninterrupted run's.
replay   no device: any chosen recorded dispatch is checked live (`Seek`), each from the state its
         predecessor's record holds (both sides' pools and per-request bookkeeping), against the
         device's recorded outputs and state by the same `check`; every blob read is re-hashed, so
         bytes that no longer match their address stop the replay with an error naming dispatch and
         tensor.  All of them serially is the offline replay; any subset, on any worker, gives
         the same entries (the asynchronous checks and the replay on Ray).
"""
from __future__ import annotations

from golden.dispatch import Halt, Ran
from twin.abi.errors import AbiError

from ..records import RecordStore, content_hash
from .records import (apply_deltas, check_inputs, checked_get, install_seqs, outputs_step, read_config,
                      share_equal)
from .side import install_state, side_state


def _check_initial(store: RecordStore, side, where: str) -> None:
    want = store.initial_hashes()
    now = side_state(side)
    bad = sorted(k for k in set(want) | set(now) if k not in now or k not in want or content_hash(now[k]) != want[k])
    if bad:
        raise AbiError("initial state", bad[:4], "the recorded pools before dispatch 0", where=where)


def restore(lr, entries: list[dict]) -> None:
    """Prepare a freshly built `RealLockstep` to fast-forward through its report's lines."""
    rec, where = lr.recorder, f"hw.real resume {lr.dir}"
    store = rec.store
    built = read_config(lr.dir)
    if built != rec.build:
        diff = sorted(k for k in set(built) | set(rec.build) if built.get(k) != rec.build.get(k))
        raise AbiError("run_dir", str(lr.dir), f"a resume with the run's own configuration (differs in {diff})",
                       where=where)
    if [e["index"] for e in entries] != list(range(len(entries))):
        # an asynchronous run's report holds only the dispatches checked: nothing to fast-forward from
        raise AbiError("run_dir", str(lr.dir), "a report with one line per dispatch from 0 (a report of an "
                       "asynchronous run does not resume: --fresh)", where=where)
    recs = store.records()
    if len(recs) < len(entries):
        raise AbiError("records", len(recs), f">= {len(entries)} (one per report line)", where=where)
    store.truncate(len(entries))          # a record written after the last report line is redone
    _check_initial(store, lr.dev, where)
    lr.resumed = list(entries)
    lr.ff = {"recs": recs[:len(entries)], "dev": side_state(lr.dev), "gold": side_state(lr.gold)}


def _install(lr, store: RecordStore, ff: dict, rec, rd) -> None:
    """Both sides' state and per-request bookkeeping after record `rec` (the dispatch `rd` the
    scheduler regenerated, held to the record's inputs); `ff` tracks both sides' recorded state."""
    check_inputs(store, rec, rd)
    dev = apply_deltas(store, ff["dev"], rec.state_delta)
    gold = share_equal(dev, apply_deltas(store, ff["gold"], rec.golden_state_delta))
    install_state(lr.dev, dev)
    install_state(lr.gold, gold)
    real = rec.meta["real"]
    install_seqs(store, lr.dev.run.seqs, real["dev_seqs"])
    install_seqs(store, lr.gold.run.seqs, real["gold_seqs"])
    ff["dev"], ff["gold"] = dev, gold
    rd.rows = list(real["rows"])


def fast_forward(lr, rd, entry: dict):
    """Dispatch `rd` of a resumed run: its record's state on both sides, its recorded device outputs."""
    store, ff = lr.recorder.store, lr.ff
    rec = ff["recs"][rd.index]
    _install(lr, store, ff, rec, rd)
    lr.recorder.last = {"dev": side_state(lr.dev), "gold": side_state(lr.gold)}
    step = outputs_step({k: store.get(h) for k, h in rec.outputs.items()})
    lr.entries.append(entry)
    lr.halt_after(entry)
    return Ran(step.outputs, [])


class Seek:
    """Check chosen recorded dispatches of a run, each on its own: the scheduler is re-driven with
    the recorded device outputs, every other dispatch is fast-forwarded (both sides' recorded state
    and bookkeeping installed, as a resume does), and each chosen dispatch starts from the state its
    record's predecessor left, so its report entry depends on the records alone, never on which
    other dispatches were checked, or in what order (`twin.functional.parity.check_dispatches`).

    A run recorded asynchronously (`hw.real.pool`) recorded the device's state as the golden's, so
    there each check re-syncs golden from the device's recorded state before the dispatch."""

    def __init__(self, lr, run_dir, indices):
        where = f"hw.real replay {run_dir}"
        self.lr, self.store = lr, RecordStore(run_dir / "records")
        _check_initial(self.store, lr.dev, where)
        self.recs = self.store.records()
        self.want = sorted(set(int(i) for i in indices))
        bad = [i for i in self.want if not 0 <= i < len(self.recs)]
        if not self.want or bad:
            raise AbiError("index", bad[:4] or [], f"recorded dispatches 0..{len(self.recs) - 1}", where=where)
        self.ff = {"dev": side_state(lr.dev), "gold": side_state(lr.gold)}
        self.live = set(self.want)
        self._check = lr.check
        lr.seek, lr.device_step, lr.check, lr.halt_after = self, self.recorded, self.checked, self.halt

    def forward(self, rd):
        rec = self.recs[rd.index]
        _install(self.lr, self.store, self.ff, rec, rd)
        return Ran(outputs_step({k: self.store.get(h) for k, h in rec.outputs.items()}).outputs, [])

    def recorded(self, rd):
        """The device's step of a chosen dispatch: its recorded outputs and state (blobs re-hashed)."""
        rec, where = self.recs[rd.index], f"dispatch {rd.index}"
        check_inputs(self.store, rec, rd)
        after = apply_deltas(self.store, self.ff["dev"], rec.state_delta, verify=True, where=where)
        install_state(self.lr.dev, after)
        real = rec.meta["real"]
        install_seqs(self.store, self.lr.dev.run.seqs, real["dev_seqs"])
        rd.rows = list(real["rows"])
        step = outputs_step({k: checked_get(self.store, h, f"{where} output {k}") for k, h in rec.outputs.items()})
        self.lr.last_ran = Ran(step.outputs, [])
        return step

    def checked(self, rd) -> dict:
        """The lockstep's check of a chosen dispatch; then both sides take the record's state after it,
        so the next dispatch starts from the records whatever the check did to the golden."""
        entry = self._check(rd)
        _install(self.lr, self.store, self.ff, self.recs[rd.index], rd)
        return entry

    def halt(self, entry: dict) -> None:
        if len(self.lr.entries) >= len(self.want):
            raise Halt(f"{len(self.want)} recorded dispatches checked")
