"""Content-addressed dispatch records: hashing, packs, deltas, torn writes."""
import json

import ml_dtypes
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hw.records import Record, RecordStore, changed_rows, content_hash


def test_hash_depends_on_bytes_dtype_and_shape():
    a = np.arange(12, dtype=np.int32)
    assert content_hash(a) == content_hash(a.copy())
    assert content_hash(a) != content_hash(a.reshape(3, 4))
    assert content_hash(a) != content_hash(a.astype(np.int64))
    b = a.copy()
    b[5] += 1
    assert content_hash(a) != content_hash(b)


def test_put_get_round_trip_dedup_and_bf16(tmp_path):
    s = RecordStore(tmp_path)
    arrs = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, ml_dtypes.bfloat16),
            "e": np.zeros((0, 5), np.int64), "same": np.arange(6, dtype=np.float32).reshape(2, 3)}
    h = s.put_all(arrs)
    assert h["x"] == h["same"]
    s.flush_pack("p0")
    assert len(list((tmp_path / "packs").iterdir())) == 1
    fresh = RecordStore(tmp_path)              # a new process reads the index back
    for k, v in arrs.items():
        got = fresh.get(h[k])
        assert got.dtype == v.dtype and got.shape == v.shape and np.array_equal(got, v)
    s.put(arrs["x"])
    s.flush_pack("p1")                         # nothing new: no second pack
    assert len(list((tmp_path / "packs").iterdir())) == 1


def test_one_object_with_new_content_gets_a_new_hash_and_blob(tmp_path):
    """A pool updated in place between two puts is the same object with other bytes: the second
    put must hash what it holds now, and each hash keeps the bytes it had when it was put."""
    s = RecordStore(tmp_path)
    pool = np.zeros((4, 8), np.float32)
    first = s.put(pool)
    pool[2] = 1.5                               # in place: same id(), new content
    second = s.put(pool)
    assert second != first and second == content_hash(pool)
    pool[3] = -2.0                              # changed again before the pack is written
    s.flush_pack("p0")
    fresh = RecordStore(tmp_path)
    assert not fresh.get(first).any()
    assert np.array_equal(fresh.get(second)[2], np.full(8, 1.5, np.float32)) and not fresh.get(second)[3].any()


def test_reused_identities_never_answer_an_old_hash(tmp_path):
    """Arrays dropped between puts free their identity for the next one (CPython reuses ids): every
    put still answers the hash of its own bytes."""
    s = RecordStore(tmp_path)
    ids, hashes = set(), set()
    for i in range(64):
        a = np.full(16, i, np.int64)
        ids.add(id(a))
        h = s.put(a)
        assert h == content_hash(a)
        hashes.add(h)
        del a
    assert len(hashes) == 64 and len(ids) < 64        # ids were reused, hashes never were


@settings(max_examples=30)
@given(st.integers(0, 2**31 - 1), st.sets(st.integers(0, 23), max_size=10))
def test_row_deltas_rebuild_the_state(tmp_path_factory, seed, rows):
    rng = np.random.default_rng(seed)
    before = rng.standard_normal((6, 4, 8)).astype(np.float32)
    after = before.copy()
    flat = after.reshape(-1, 8)
    for r in rows:
        flat[r] = rng.standard_normal(8)
    s = RecordStore(tmp_path_factory.mktemp("d"))
    assert set(changed_rows(before, after).tolist()) == set(rows)
    delta = s.put_delta(before, after)
    rebuilt = before.copy()
    s.apply_delta(rebuilt, delta)
    assert np.array_equal(rebuilt, after)


def test_torn_manifest_line_and_unindexed_pack_are_ignored(tmp_path):
    s = RecordStore(tmp_path)
    rec = Record(0, "l3_decode_fwd", {}, s.put_all({"a": np.ones(3)}), {}, {}, {}, "w")
    s.append(rec)
    with open(s.manifest, "a") as fh:
        fh.write('{"index": 1, "prog')                     # killed mid-line
    (tmp_path / "packs" / "00000001.tmp123").write_bytes(b"partial")
    fresh = RecordStore(tmp_path)
    recs = fresh.records()
    assert [r.index for r in recs] == [0]
    assert np.array_equal(fresh.get(recs[0].inputs["a"]), np.ones(3))
    fresh.truncate(1)
    assert fresh.manifest.read_text().count("\n") == 1 and json.loads(fresh.manifest.read_text())["index"] == 0


def test_a_torn_index_line_is_dropped_before_the_next_append(tmp_path):
    s = RecordStore(tmp_path)
    h0 = s.put(np.arange(3))
    s.flush_pack("p0")
    with open(s.index_path, "a") as fh:
        fh.write('{"pack": "p1.bin", "blo')              # killed mid-line
    fresh = RecordStore(tmp_path)
    h1 = fresh.put(np.arange(4))                          # loads the index, drops the torn tail
    fresh.flush_pack("p2")
    again = RecordStore(tmp_path)
    assert np.array_equal(again.get(h0), np.arange(3)) and np.array_equal(again.get(h1), np.arange(4))
