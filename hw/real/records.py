"""Dispatch records of the real-golden lockstep: what a run writes so that a killed run resumes to
the same report and any run's dispatches can be re-judged against golden offline.

One `hw.records.Record` per dispatch, content-addressed in `<run>/records/` (`RecordStore`):

    inputs              the lowered dispatch's arguments (name -> hash)
    meta                the dispatch's meta, plus `real`: the dispatch kind, its rows, the scheduler's
                        items and each side's per-request bookkeeping after it (anchor, tokens, lease,
                        partition; the captured hidden tail as hashes)
    outputs             the device's outputs and what the golden re-syncs from: the taps `moe_indices`,
                        `idx_topk` of every layer and the head logits (`tap:LAYER/STAGE`), the sampled
                        tokens of each target forward (`sampled:I`), the drafter's routes (`route:N`);
                        a failing dispatch keeps every tap, so a replay localizes it the same way; a
                        sampled dispatch (a coverage plan) keeps besides the taps its planned sites and
                        its head check read, and what else the site check reads (`site:*`)
    state_delta         the device's touched state, rows changed since the previous record: target pools
                        (`LAYER/POOL`), drafter pools (`draft/GROUP`), the K=7 state (`dspark/tokens|meta`)
    golden_state_delta  the same for the golden (after its re-syncs and carry)

`records/config.json` holds the arguments that rebuild the parity run (`BUILD_KEYS`, the workload's
requests among them): a resume or a replay re-drives the same scheduler with the recorded device
outputs, so the dispatches come out the same and are checked against the recorded input hashes.  A
pool neither side wrote keeps its identity from one record to the next (copy-on-write), as live.

A record is taken in two halves: `RealRecorder.capture` (what the dispatch left, at once) and
`write` (hashing and storing it), which an asynchronous run does on a thread of its own
(`RecordThread`), so the device side does not wait for SHA-256 and the disk.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from twin.abi.batches import DecodeItem, PrefillItem
from twin.abi.errors import AbiError
from twin.abi.inputs import read_json
from twin.abi.outputs import write_text

from ..records import Record, RecordStore, changed_rows, content_hash
from .coverage import recorded_taps
from .step import DECISION_STAGES, DeviceStep
from .side import side_state

ITEM = {"prefill": PrefillItem, "decode": DecodeItem, "seed": PrefillItem}
TUPLES = ("chunk_tokens", "pending_drafts", "context_positions")
SEQ_KEYS = ("anchor", "current", "draft_anchor", "released", "lease", "generation", "group")
# records/config.json: the arguments that rebuild the parity run (twin.functional.parity.build_lockstep)
BUILD_KEYS = ("preset", "backend", "device", "mode", "seed", "golden_mode", "k", "slots", "total_kv_pages", "chunk",
              "max_model_len", "max_num_seqs", "max_num_batched_tokens", "ep", "carry", "requests", "fault",
              "coverage", "coverage_seed")
# its injected fault (`hw.real.faults.RealFault`): a persistent one fires again on every dispatch from AT
FAULT_KEYS = ("kind", "at", "layer", "seed", "persistent")


def capture_seqs(seqs) -> list[dict]:
    """Each request's bookkeeping as it is now (the scheduler changes it with the next dispatch)."""
    out = []
    for s in seqs:
        d = {k: getattr(s, k) for k in SEQ_KEYS}
        d["id"] = s.req.request_id
        d["generated"] = [int(t) for t in s.generated]
        pos = sorted(s.tail)
        d["tail"] = [np.asarray(pos, np.int64),
                     np.stack([np.asarray(s.tail[p]) for p in pos]) if pos else np.zeros((0, 0))]
        d["confidence_logit"] = None if s.confidence_logit is None else np.array(s.confidence_logit)
        out.append(d)
    return out


def put_seqs(store: RecordStore, captured: list[dict]) -> list[dict]:
    """The captured bookkeeping as a record holds it: arrays as hashes."""
    return [{**d, "tail": [store.put(d["tail"][0]), store.put(d["tail"][1])],
             "confidence_logit": None if d["confidence_logit"] is None else store.put(d["confidence_logit"])}
            for d in captured]


def install_seqs(store: RecordStore, seqs, states: list[dict]) -> None:
    if [s.req.request_id for s in seqs] != [d["id"] for d in states]:
        raise AbiError("records", [d["id"] for d in states], f"the requests the scheduler runs now "
                       f"{[s.req.request_id for s in seqs]}", where="hw.real records")
    for s, d in zip(seqs, states, strict=True):
        for k in SEQ_KEYS:
            setattr(s, k, d[k])
        s.generated = list(d["generated"])
        pos, rows = store.get(d["tail"][0]), store.get(d["tail"][1])
        s.tail = {int(p): rows[i] for i, p in enumerate(pos)}
        s.confidence_logit = None if d["confidence_logit"] is None else store.get(d["confidence_logit"])


def _put_outputs(store, step, *, keep) -> dict:
    """The step's outputs as hashes: every tap (keep None) or the decisions, the head logits and the
    taps in `keep`."""
    out = {name: store.put(v) for name, v in step.outputs.items()}
    # one array is often two taps (a layer's output is the next layer's input): hashed once, as
    # nothing runs between these puts that could change it
    seen: dict[int, tuple] = {}

    def put(a):
        hit = seen.get(id(a))
        if hit is None:
            hit = seen[id(a)] = (a, store.put(a))          # holding `a` keeps its id from being reused
        return hit[1]

    keep = None if keep is None else {*keep, ("head", "logits")}
    for (layer, stage), v in step.taps.items():
        if keep is None or stage in DECISION_STAGES or (layer, stage) in keep:
            if isinstance(v, (tuple, list)):
                out.update({f"tap:{layer}/{stage}#{i}": put(x) for i, x in enumerate(v)})
            else:
                out[f"tap:{layer}/{stage}"] = put(v)
    out.update({f"sampled:{i}": store.put(v) for i, v in enumerate(step.sampled)})
    out.update({f"route:{i}": store.put(v) for i, v in enumerate(step.draft_routes)})
    out.update({name: store.put(v) for name, v in step.site.items()})
    return out


def outputs_step(arrays: dict):
    """The recorded outputs back as a `DeviceStep`."""
    outs, taps, parts, sampled, routes, staged = {}, {}, {}, {}, {}, {}
    for name, v in arrays.items():
        kind, _, rest = name.partition(":")
        if not rest:
            outs[name] = v
        elif kind == "site":
            staged[name] = v
        elif kind == "sampled":
            sampled[int(rest)] = v
        elif kind == "route":
            routes[int(rest)] = v
        else:
            site, _, part = rest.partition("#")
            layer, _, stage = site.rpartition("/")
            key = (int(layer) if layer.isdigit() else layer, stage)
            if part:
                parts.setdefault(key, {})[int(part)] = v
            else:
                taps[key] = v
    taps.update({k: tuple(p[i] for i in sorted(p)) for k, p in parts.items()})
    return DeviceStep(outs, taps, [sampled[i] for i in sorted(sampled)], [routes[i] for i in sorted(routes)], staged)


def _items_json(items) -> list:
    return [asdict(it) for it in items]


def _kept_taps(lockstep, entry: dict):
    """The taps a dispatch's record keeps beyond the decisions and the head logits: every tap (None)
    once its check failed, so its replay localizes the same way; a sampled dispatch's, what its
    planned sites and head check read (`hw.real.coverage.recorded_taps`; entry["sites"]: (group,
    layer, stage, ...) each), which is all a replay of its plan reads; none for a passing dispatch
    checked in full (its replay re-runs golden's whole dispatch)."""
    if entry["verdict"] == "fail":
        return None
    if "sites" not in entry:
        return frozenset()
    g = lockstep.dev.g
    return recorded_taps(g.cfg, [tuple(x[:3]) for x in entry["sites"]], g.drafter.target_hidden_tap)


# ---- writing ----------------------------------------------------------------------------------------
class RealRecorder:
    """Appends one record per dispatch; each side's state is a delta against that side's previous record."""

    def __init__(self, root, build: dict):
        self.store = RecordStore(root)
        self.build = build
        self.last: dict[str, dict] = {}
        self._deltas: dict[tuple[int, int], dict] = {}

    def start(self, lockstep) -> None:
        """A fresh run: the initial state (both sides allocate the same pools) and the config."""
        dev, gold = side_state(lockstep.dev), side_state(lockstep.gold)
        bad = [k for k in dev if content_hash(np.asarray(dev[k])) != content_hash(np.asarray(gold[k]))]
        if bad:
            raise AbiError("initial state", bad[:4], "the same pools on both sides", where="hw.real records")
        self.store.truncate(0)
        (self.store.root / "initial.json").unlink(missing_ok=True)
        (self.store.root / "coverage.json").unlink(missing_ok=True)       # a --coverage auto run's choice
        self.store.put_initial(dev)
        write_text(self.store.root / "config.json", json.dumps(self.build, sort_keys=True) + "\n")
        self.last = {"dev": dict(dev), "gold": dict(gold)}

    def _delta(self, side: str, now: dict) -> dict:
        out, last = {}, self.last[side]
        for k, a in now.items():
            b = last[k]
            if a is b:
                continue
            key = (id(b), id(a))
            hit = self._deltas.get(key)
            if hit is None or hit[0] is not b or hit[1] is not a:
                a_np, b_np = np.asarray(a), np.asarray(b)
                rows = changed_rows(b_np, a_np)
                delta = {"rows": self.store.put(rows), "values": self.store.put(a_np.reshape(-1, a_np.shape[-1])[rows])}
                hit = self._deltas[key] = (b, a, delta, bool(rows.size))
            if hit[3]:
                out[k] = hit[2]
        self.last[side] = dict(now)
        return out

    def record(self, lockstep, rd, entry: dict) -> None:
        self.write(self.capture(lockstep, rd, entry))

    def capture(self, lockstep, rd, entry: dict) -> dict:
        """What dispatch `rd`'s record holds, taken now so that `write` may run later (`RecordThread`):
        the arguments and per-request bookkeeping copied (the scheduler reuses and changes them), the
        device's step and both sides' pools by reference (a step's arrays are its own, and pools are
        replaced, never changed in place, as the deltas' identity test already relies on)."""
        dev_seqs = capture_seqs(lockstep.dev.run.seqs)
        return {"index": rd.index, "program": rd.dispatch.program, "meta": dict(rd.dispatch.meta),
                "kind": rd.kind, "rows": list(rd.rows), "items": _items_json(rd.items), "dev_seqs": dev_seqs,
                # an asynchronous run records the device's side as the golden's (hw.real.pool): stated once
                "gold_seqs": None if lockstep.gold is lockstep.dev else capture_seqs(lockstep.gold.run.seqs),
                "inputs": {k: np.array(v) for k, v in rd.dispatch.args.items()}, "step": lockstep.last_step,
                "keep": _kept_taps(lockstep, entry),
                "dev": side_state(lockstep.dev), "gold": side_state(lockstep.gold)}

    def write(self, c: dict) -> None:
        """Hash, store and append the captured record."""
        s = self.store
        self._deltas.clear()
        dev_seqs = put_seqs(s, c["dev_seqs"])
        real = {"kind": c["kind"], "rows": c["rows"], "items": c["items"], "dev_seqs": dev_seqs,
                "gold_seqs": dev_seqs if c["gold_seqs"] is None else put_seqs(s, c["gold_seqs"])}
        rec = Record(index=c["index"], program=c["program"], meta={**c["meta"], "real": real},
                     inputs=s.put_all(c["inputs"]), outputs=_put_outputs(s, c["step"], keep=c["keep"]),
                     state_delta=self._delta("dev", c["dev"]), golden_state_delta=self._delta("gold", c["gold"]),
                     weights=self.build_fingerprint())
        s.append(rec)

    def build_fingerprint(self) -> str:
        b = self.build
        return f"synthetic:{b['preset']}:seed{b['seed']}:k{b['k']}"


# captured records waiting for the writer at most: they are held in memory (about 10 MB each on SMALL
# with a coverage plan), and the writer outpaces the device, so a few absorb any jitter
WRITE_AHEAD = 8


class RecordThread:
    """A recorder's writes on a thread of their own, in dispatch order: the device side captures each
    record (`RealRecorder.capture`) and goes on while this thread hashes and writes it (SHA-256 and
    file writes release the GIL, so they run on another core).  At most `depth` captured records
    wait; a device side that gets further ahead waits (`waited_s`).  `written`: the records on disk;
    a failed write is raised on the device side's next call."""

    def __init__(self, recorder: RealRecorder, depth: int):
        import queue
        import threading

        self.recorder, self.written, self.error = recorder, 0, None
        self.waited_s = 0.0             # the device side blocked on a full queue
        self.busy_s = 0.0               # this thread's time writing (wall)
        self.cpu_s = 0.0                # ... and its CPU time in it (the rest: waits for the GIL or a core)
        self.q = queue.Queue(maxsize=depth)
        self.cv = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="record-writer", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        import time

        while (c := self.q.get()) is not None:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                self.recorder.write(c)
            except BaseException as e:          # noqa: BLE001 - raised again on the device side
                with self.cv:
                    self.error = e
                    self.cv.notify_all()
                return
            self.busy_s += time.perf_counter() - t0
            self.cpu_s += time.thread_time() - c0
            with self.cv:
                self.written += 1
                self.cv.notify_all()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def put(self, capture: dict) -> None:
        import time

        import queue

        self._raise()
        t0 = time.perf_counter()
        while True:
            try:
                self.q.put(capture, timeout=0.5)
                break
            except queue.Full:
                self._raise()               # the thread stopped on an error: the queue drains no more
        self.waited_s += time.perf_counter() - t0

    def wait(self, n: int) -> None:
        """Until `n` records are on disk."""
        with self.cv:
            self.cv.wait_for(lambda: self.written >= n or self.error is not None)
        self._raise()

    def close(self) -> None:
        """The queued records written, the thread ended; a failed write raised."""
        if self.thread.is_alive() and self.error is None:
            self.q.put(None)
        self.thread.join()
        self._raise()


# ---- reading ----------------------------------------------------------------------------------------
def read_config(run_dir) -> dict:
    path = Path(run_dir) / "records" / "config.json"
    if not path.exists():
        raise AbiError("run_dir", str(run_dir), "a real-golden run directory with records/config.json",
                       where="hw.real records")
    what = "the arguments that rebuild the run, as lockstep wrote them (start afresh with --fresh)"
    d = read_json(path, "--run-dir", what)
    if set(d) != set(BUILD_KEYS):
        raise AbiError("keys", sorted(d), f"exactly {sorted(BUILD_KEYS)}: {what}", where=f"--run-dir {path}")
    f = d["fault"]
    if f is not None and (not isinstance(f, dict) or set(f) != set(FAULT_KEYS)):
        raise AbiError("fault", f, f"null or an object with exactly the keys {list(FAULT_KEYS)}: {what}",
                       where=f"--run-dir {path}")
    return d


def per_run(cache: dict, run_dir, build, *extra):
    """build(config) for the run in `run_dir`, held in `cache` (a per-process cache) under the run's
    path and `extra`, and built again when the run there has another config than the one it was built
    from: a process that lives on (a notebook, a worker) may check a run rewritten at the same path
    (--fresh) with other arguments.  One entry per path and `extra`."""
    b = read_config(run_dir)
    key, text = (str(Path(run_dir).resolve()), *extra), json.dumps(b, sort_keys=True)
    hit = cache.get(key)
    if hit is None or hit[0] != text:
        hit = cache[key] = (text, build(b))
    return hit[1]


def checked_get(store: RecordStore, h: str, where: str) -> np.ndarray:
    """A blob, re-hashed: bytes that no longer match their address are a tampered or corrupt record."""
    a = store.get(h)
    if content_hash(a) != h:
        raise AbiError("record", where, f"a blob whose bytes match its content hash {h}", where="hw.real replay")
    return a


def apply_deltas(store: RecordStore, arrays: dict, deltas: dict, *, verify: bool = False, where: str = "") -> dict:
    """Copy-on-write: the keys a record changed get new arrays, every other key keeps its object."""
    get = (lambda h, k: checked_get(store, h, f"{where} {k}")) if verify else (lambda h, k: store.get(h))
    out = dict(arrays)
    for k, d in deltas.items():
        a = np.array(arrays[k])
        a.reshape(-1, a.shape[-1])[get(d["rows"], k)] = get(d["values"], k)
        out[k] = a
    return out


def check_inputs(store: RecordStore, rec: Record, rd) -> None:
    """The regenerated dispatch is the recorded one: same program, same argument names and bytes."""
    where = f"dispatch {rd.index}"
    if rec.program != rd.dispatch.program or set(rec.inputs) != set(rd.dispatch.args):
        raise AbiError("records", f"{where}: {rec.program}", f"the dispatch the scheduler issues now "
                       f"({rd.dispatch.program})", where="hw.real records")
    bad = [k for k, h in rec.inputs.items() if content_hash(np.asarray(rd.dispatch.args[k])) != h]
    if bad:
        raise AbiError("records", f"{where} input {bad[0]}", "the bytes the scheduler's dispatch stages now "
                       "(the run's workload or code changed: start afresh with --fresh)", where="hw.real records")


def share_equal(dev: dict, gold: dict) -> dict:
    """The golden's arrays that equal the device's become the device's objects (a live run with
    carry="device" shares them, and the lockstep skips pools neither side wrote by identity)."""
    out = dict(gold)
    for k, a in gold.items():
        b = dev.get(k)
        if b is not None and a is not b and a.dtype == b.dtype and a.shape == b.shape \
                and np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)):
            out[k] = b
    return out
