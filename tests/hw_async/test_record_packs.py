"""The record writer's packs and deltas: a pack's name always means the same bytes (a dispatch redone
on resume never rewrites a pack the index already points into), the writer reads the index file once
per pack, and the word-wide row compare finds exactly the rows whose bytes differ."""
import ml_dtypes
import numpy as np
import pytest

import hw.records as records
from hw.records import Record, RecordStore, changed_rows, content_hash


def _record(store: RecordStore, index: int, arrays: dict) -> Record:
    rec = Record(index, "l3_decode_fwd", {}, store.put_all(arrays), {}, {}, {}, "w")
    store.append(rec)
    return rec


def test_a_dispatch_redone_on_resume_leaves_the_first_packs_bytes_alone(tmp_path):
    a, b, c = (np.full(16, v, np.float32) for v in (1.0, 2.0, 3.0))
    first = _record(RecordStore(tmp_path), 0, {"x": a, "y": b})
    resumed = RecordStore(tmp_path)            # killed before its report line: resume drops the record
    resumed.truncate(0)
    # redone: `a` is indexed already (not written again), `c` is new, so the redo's pack holds `c` alone
    _record(resumed, 0, {"x": a, "y": c})
    fresh = RecordStore(tmp_path)
    for h, want in ((first.inputs["x"], a), (first.inputs["y"], b), (content_hash(c), c)):
        got = fresh.get(h)
        assert content_hash(got) == h and np.array_equal(got, want)
    assert len(list((tmp_path / "packs").glob("00000000.*.bin"))) == 2


def test_the_same_blobs_flushed_again_keep_their_pack_name(tmp_path):
    one, two = RecordStore(tmp_path / "one"), RecordStore(tmp_path / "two")
    for s in (one, two):
        s.put_all({"x": np.arange(5), "y": np.ones((2, 3), ml_dtypes.bfloat16)})
        s.flush_pack("00000003")
    names = [sorted(p.name for p in (s.root / "packs").iterdir()) for s in (one, two)]
    assert names[0] == names[1] and len(names[0]) == 1 and names[0][0].startswith("00000003.")


def test_the_writer_reads_the_index_file_once_per_pack(tmp_path, monkeypatch):
    s = RecordStore(tmp_path)
    old = s.put(np.arange(8))
    s.flush_pack("p0")
    reads = []
    real = records._Tail.read
    monkeypatch.setattr(records._Tail, "read", lambda self, *a: reads.append(1) or real(self, *a))
    for i in range(50):
        s.put(np.full(4, i, np.int64))
        assert s.put(np.arange(8)) == old              # indexed by the earlier pack: not stored again
    assert len(reads) == 1
    s.flush_pack("p1")
    assert (tmp_path / "packs" / next(p for p in s._index.values() if p[0].startswith("p1"))[0]).stat().st_size \
        == 50 * 4 * 8


def _bytewise(before, after):
    b = before.reshape(-1, before.shape[-1])
    a = after.reshape(-1, after.shape[-1])
    return np.flatnonzero((a.view(np.uint8).reshape(len(a), -1) != b.view(np.uint8).reshape(len(b), -1)).any(-1))


@pytest.mark.parametrize("dtype,width", [(np.int8, 3), (ml_dtypes.bfloat16, 3), (np.float32, 3), (np.float32, 4),
                                         (ml_dtypes.float8_e4m3fn, 8), (np.float64, 5), (np.int8, 1)])
def test_the_word_compare_finds_exactly_the_rows_whose_bytes_differ(dtype, width):
    rng = np.random.default_rng(width)
    before = rng.integers(0, 256, (6, 5, width * np.dtype(dtype).itemsize), np.uint8).view(dtype)
    after = before.copy()
    raw = after.view(np.uint8).reshape(30, -1)
    hit = rng.choice(30, 7, replace=False)
    for r in hit:
        raw[r, rng.integers(raw.shape[1])] ^= np.uint8(1 << int(rng.integers(8)))   # one bit of one byte
    got = changed_rows(before, after)
    assert got.dtype == np.int64 and got.tolist() == sorted(hit.tolist()) == _bytewise(before, after).tolist()
    assert changed_rows(before, before.copy()).size == 0
