"""Resume and offline replay of a real-golden lockstep run from its records (`hw.real.records`).

Both re-drive the parity run's scheduler from the start (`twin.functional.parity.rebuild`) with
the device's recorded outputs, so the scheduler makes the same decisions and issues the same
dispatches; each regenerated dispatch is held to its record's input hashes.

resume   a killed run continues where its report stops: the records past the last report line are
         dropped; each dispatch that has a report line is fast-forwarded (both sides' state and
         per-request bookkeeping installed from its record, the device's recorded outputs committed,
         its report line kept), and the first dispatch without one is checked live, so the report is
         byte-identical to an uninterrupted run's.
replay   no device: golden runs every recorded dispatch live from the device's recorded state and
         is judged against the device's recorded outputs and state by the same `check`; every blob
         read is re-hashed, so bytes that no longer match their address stop the replay with an
         error naming dispatch and tensor.
"""
from __future__ import annotations

from golden.dispatch import Ran
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
    recs = store.records()
    if len(recs) < len(entries):
        raise AbiError("records", len(recs), f">= {len(entries)} (one per report line)", where=where)
    store.truncate(len(entries))          # a record written after the last report line is redone
    _check_initial(store, lr.dev, where)
    lr.resumed = list(entries)
    lr.ff = {"recs": recs[:len(entries)], "dev": side_state(lr.dev), "gold": side_state(lr.gold)}


def fast_forward(lr, rd, entry: dict):
    """Dispatch `rd` of a resumed run: its record's state on both sides, its recorded device outputs."""
    store, ff = lr.recorder.store, lr.ff
    rec = ff["recs"][rd.index]
    check_inputs(store, rec, rd)
    dev = apply_deltas(store, ff["dev"], rec.state_delta)
    gold = share_equal(dev, apply_deltas(store, ff["gold"], rec.golden_state_delta))
    install_state(lr.dev, dev)
    install_state(lr.gold, gold)
    real = rec.meta["real"]
    install_seqs(store, lr.dev.run.seqs, real["dev_seqs"])
    install_seqs(store, lr.gold.run.seqs, real["gold_seqs"])
    ff["dev"], ff["gold"] = dev, gold
    lr.recorder.last = {"dev": side_state(lr.dev), "gold": side_state(lr.gold)}
    rd.rows = list(real["rows"])
    step = outputs_step({k: store.get(h) for k, h in rec.outputs.items()})
    lr.entries.append(entry)
    lr.halt_after(entry)
    return Ran(step.outputs, [])


def use_records(lr, run_dir) -> int:
    """Make `lr` (a checker rebuilt from the run's records/config.json) replay the records offline:
    its device step installs each record's device state and returns its recorded outputs.  Returns
    the number of records (the dispatches to replay)."""
    store = RecordStore(run_dir / "records")
    _check_initial(store, lr.dev, f"hw.real replay {run_dir}")
    recs = store.records()
    state = {"dev": side_state(lr.dev)}

    def recorded(rd):
        if rd.index >= len(recs):
            raise AbiError("records", len(recs), f"a record of dispatch {rd.index}", where=f"hw.real replay {run_dir}")
        rec, where = recs[rd.index], f"dispatch {rd.index}"
        check_inputs(store, rec, rd)
        state["dev"] = after = apply_deltas(store, state["dev"], rec.state_delta, verify=True, where=where)
        install_state(lr.dev, after)
        real = rec.meta["real"]
        install_seqs(store, lr.dev.run.seqs, real["dev_seqs"])
        rd.rows = list(real["rows"])
        step = outputs_step({k: checked_get(store, h, f"{where} output {k}") for k, h in rec.outputs.items()})
        lr.last_ran = Ran(step.outputs, [])
        return step

    lr.device_step = recorded
    return len(recs)
