"""A checker reads the record store while the device side appends to it: the reader's index and
manifest grow with the store (each line parsed once), a line still being written is neither taken
nor cut, and a store recreated at the same path is read afresh.  A rebuilt run keeps its fault's
persistence."""
import json
import os
import shutil

import numpy as np
import pytest

import hw.records as records
from hw.records import Record, RecordStore
from twin.abi.errors import AbiError


def _append(store: RecordStore, i: int, value) -> str:
    rec = Record(i, "l3_decode_fwd", {}, store.put_all({"a": np.asarray(value)}), {}, {}, {}, "w")
    store.append(rec)
    return rec.inputs["a"]


def test_a_reader_sees_the_store_grow_and_parses_each_line_once(tmp_path, monkeypatch):
    writer, reader = RecordStore(tmp_path), RecordStore(tmp_path)        # two processes' views
    h0 = _append(writer, 0, np.arange(3))
    assert np.array_equal(reader.get(h0), np.arange(3)) and [r.index for r in reader.records()] == [0]
    parsed = []
    real = json.loads
    monkeypatch.setattr(records.json, "loads", lambda s, *a, **k: parsed.append(s) or real(s, *a, **k))
    for _ in range(20):
        reader.get(h0)
        reader.records()
    assert parsed == []                                  # nothing appended: nothing parsed again
    h1 = _append(writer, 1, np.arange(5.0))
    # grown after the reader read it: the new blob and record are found, one index and one manifest line read
    assert np.array_equal(reader.get(h1), np.arange(5.0)) and [r.index for r in reader.records()] == [0, 1]
    assert len(parsed) == 2


def test_a_line_being_written_is_neither_taken_nor_cut(tmp_path):
    writer, reader = RecordStore(tmp_path), RecordStore(tmp_path)
    h0 = _append(writer, 0, np.arange(3))
    h1 = writer.put(np.arange(7))
    writer.flush_pack("00000001")
    full = writer.index_path.read_bytes()
    cut = full.rfind(b"\n", 0, len(full) - 1) + 1
    line = full[cut:]
    writer.index_path.write_bytes(full[:cut] + line[:10])         # the writer is mid-line
    reader2 = RecordStore(tmp_path)
    assert np.array_equal(reader2.get(h0), np.arange(3))
    with pytest.raises(AbiError, match="a hash indexed in"):
        reader2.get(h1)
    assert writer.index_path.read_bytes() == full[:cut] + line[:10]          # a reader never cuts
    with open(writer.index_path, "ab") as fh:
        fh.write(line[10:])                                                   # the line completed
    assert np.array_equal(reader2.get(h1), np.arange(7)) and np.array_equal(reader.get(h1), np.arange(7))


def test_a_store_recreated_at_the_same_path_is_read_afresh(tmp_path):
    root = tmp_path / "records"
    old = _append(RecordStore(root), 0, np.arange(4))
    reader = RecordStore(root)
    assert np.array_equal(reader.get(old), np.arange(4)) and len(reader.records()) == 1
    shutil.rmtree(root)                                   # --fresh: the run directory starts again
    w = RecordStore(root)
    new = _append(w, 0, np.full(4, 9))
    _append(w, 1, np.full(2, 5))
    assert np.array_equal(reader.get(new), np.full(4, 9)) and [r.index for r in reader.records()] == [0, 1]
    with pytest.raises(AbiError, match="a hash indexed in"):
        reader.get(old)                                    # the old run's blob is gone with its index


def test_a_rebuilt_run_keeps_a_persistent_fault_persistent(tmp_path):
    """records/config.json names the fault's persistence: the run rebuilt from it (a replay's or an API
    user's) fails on the same dispatches as the live run, not only where the fault first fired."""
    pytest.importorskip("torch")
    from hw.real.faults import RealFault
    from hw.real.records import FAULT_KEYS, read_config
    from twin.functional.parity import build_lockstep, rebuild

    def verdicts(run):
        run.run(6)                      # writes the summary and run.json too
        return [e["verdict"] for e in run.entries]

    live = build_lockstep(max_new=8, mode="continuous", run_dir=tmp_path,
                          fault=RealFault("weight", at=1, layer=0, seed=1, persistent=True))
    got = verdicts(live)
    assert got.count("fail") >= 2 and got[:3] == ["pass"] * 3       # first fires at 3 (a prefill), again at 5
    b = read_config(tmp_path)
    spec = {"kind": "weight", "at": 1, "layer": 0, "seed": 1, "persistent": True}
    assert b["fault"] == spec and set(spec) == set(FAULT_KEYS)
    for name in ("summary.json", "run.json"):
        assert json.loads((tmp_path / name).read_text())["config"]["fault"] == spec, name   # persistence too
    again = rebuild(b, record=False, run_dir=None)
    assert again.checker.fault.persistent and verdicts(again) == got


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors in /proc")
def test_a_reader_keeps_a_bounded_number_of_packs_open(tmp_path, monkeypatch):
    """Packs are memory-mapped and each map holds a file descriptor: a long run's reader keeps only the
    most recently read ones mapped (the others are mapped again when read)."""
    monkeypatch.setattr(records, "MAPPED_PACKS", 4)
    w = RecordStore(tmp_path)
    hashes = [_append(w, i, np.full(3, i)) for i in range(12)]
    reader = RecordStore(tmp_path)
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(2):
        for i, h in enumerate(hashes):
            assert np.array_equal(reader.get(h), np.full(3, i))
    assert len(reader._maps) == 4 and len(os.listdir("/proc/self/fd")) <= fds + 4
