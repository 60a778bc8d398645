"""Resume and offline replay of a real-golden lockstep run from its records (`hw.real.records`).

resume   a killed run continues where its report stops: the records past the last report line
         are dropped, both sides' state (pools from the deltas, per-request bookkeeping, the
         stream's counters) is rebuilt as it was after that dispatch, and the next dispatch is the
         first without a report line, so the report is byte-identical to an uninterrupted run's.
replay   no device: a fresh golden (rebuilt from `records/config.json`) runs every recorded
         dispatch from the device's recorded state and is judged against the device's recorded
         outputs and state by the same lockstep; every blob read is re-hashed, so bytes that no
         longer match their address stop the replay with an error naming dispatch and tensor.
         A recorded run replays to the same report entries; a range of dispatches replays on its
         own from the recorded state before it (fan a long run out over workers).
"""
from __future__ import annotations

from pathlib import Path

from twin.abi.errors import AbiError

from ..records import RecordStore, content_hash
from ..tolerance import Policy
from .records import (apply_deltas, checked_get, dispatch_of, install_seqs, install_state, install_stream,
                      outputs_step, read_config, share_equal, side_state)


def _check_initial(store: RecordStore, side, where: str) -> None:
    want = store.initial_hashes()
    now = side_state(side)
    bad = sorted(k for k in set(want) | set(now) if k not in now or k not in want or content_hash(now[k]) != want[k])
    if bad:
        raise AbiError("initial state", bad[:4], "the recorded pools before dispatch 0", where=where)


def _install_after(lr, store: RecordStore, recs) -> dict:
    """Both sides and the stream as they were after the last of `recs` (the records from dispatch 0 on);
    returns the device's arrays."""
    dev, gold = side_state(lr.dev), side_state(lr.gold)
    for r in recs:
        dev = apply_deltas(store, dev, r.state_delta)
        gold = apply_deltas(store, gold, r.golden_state_delta)
    if not recs:
        return dev
    gold = share_equal(dev, gold)
    install_state(lr.dev, dev)
    install_state(lr.gold, gold)
    real = recs[-1].meta["real"]
    install_seqs(store, lr.dev.run.seqs, real["dev_seqs"])
    install_seqs(store, lr.gold.run.seqs, real["gold_seqs"])
    install_stream(lr.stream, real["stream"])
    return dev


def restore(lr, entries: list[dict]) -> None:
    """Bring a freshly built `RealLockstep` to the state after its report's last line."""
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
    recs = recs[:len(entries)]
    _check_initial(store, lr.dev, where)
    _install_after(lr, store, recs)
    rec.last = {"dev": side_state(lr.dev), "gold": side_state(lr.gold)}
    lr.entries = list(entries)


def replay(run_dir, *, policy: Policy | None = None, start: int = 0, limit: int | None = None) -> list[dict]:
    """Report entries of the recorded dispatches `start` .. `start + limit - 1` (or to the end),
    re-judged offline.  A range starts from both sides' recorded state after dispatch `start - 1`, so
    ranges replay independently: fan a long run out over workers (processes, Ray tasks), one range each."""
    from .lockstep import build_real

    run_dir = Path(run_dir)
    build = dict(read_config(run_dir))
    build.pop("fault", None)              # the device side is the records
    store = RecordStore(run_dir / "records")
    lr = build_real(**build, policy=policy, record=False)
    _check_initial(store, lr.dev, f"hw.real replay {run_dir}")
    recs = store.records()
    if not 0 <= start <= len(recs):
        raise AbiError("start", start, f"0..{len(recs)} (the run has {len(recs)} records)", where="hw.real replay")
    dev = _install_after(lr, store, recs[:start])
    prev = recs[start - 1].meta["real"] if start else None
    out = []
    for rec in recs[start:None if limit is None else start + limit]:
        where = f"dispatch {rec.index}"
        if prev is not None:              # the device as it was before this dispatch
            install_state(lr.dev, dev)
            install_seqs(store, lr.dev.run.seqs, prev["dev_seqs"])
            install_stream(lr.stream, prev["stream"])
        rd = dispatch_of(store, rec, verify=True)
        after = apply_deltas(store, dev, rec.state_delta, verify=True, where=where)
        step = outputs_step({k: checked_get(store, h, f"{where} output {k}") for k, h in rec.outputs.items()})
        real = rec.meta["real"]

        def recorded(rd, after=after, step=step, seqs=real["dev_seqs"]):
            install_state(lr.dev, after)
            install_seqs(store, lr.dev.run.seqs, seqs)
            return step

        lr.device_step = recorded
        out.append(lr.check(rd))
        dev, prev = after, real
    return out
