"""Dispatch records: inputs, outputs and touched state, content-addressed, with a manifest.

Layout of a record store:

    packs/00000012.<digest>.bin  the raw bytes of the blobs first stored by dispatch 12, one array per
                              content hash (dtype, shape and bytes hashed); a blob is stored once;
                              the digest names the pack's contents, so a name never changes its bytes
    index.jsonl               hash -> (pack, byte offset, dtype, shape)
    initial.json              the pools before the first dispatch (hashes)
    manifest.jsonl            one line per dispatch: index, program, meta, name -> hash maps for its
                              inputs and device outputs, the touched state as row deltas (rows the
                              device changed and their values; the same for the golden), and the
                              weights fingerprint; any dispatch's state before and after is the
                              initial pools with the deltas applied in order

A line is appended only after its pack is on disk and indexed, so a killed writer leaves at most
an orphan pack, never a line that points at nothing.  One process writes a store; any number read
it while it grows (a checker beside the device side): a reader parses only the lines appended since
its last read and maps the packs.  Identical tensors (pools that a dispatch did
not change, repeated tables) are stored once.
"""
from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from twin.abi.errors import AbiError
from twin.abi.inputs import read_json

from .run_format import check_run_dir


MAPPED_PACKS = 128         # packs a reader keeps mapped at once


def content_hash(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a)
    h = hashlib.sha256()            # hardware-accelerated on current CPUs: the fastest strong hash here
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.view(np.uint8).reshape(-1) if a.size else b"")
    return h.hexdigest()[:32]


@dataclass
class Record:
    index: int
    program: str
    meta: dict
    inputs: dict
    outputs: dict
    state_delta: dict            # pool -> {"rows", "values"}: the rows the device changed, as written
    golden_state_delta: dict     # the same for the golden (after any re-sync)
    weights: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class RecordStore:
    """Blobs are content-addressed; the new blobs of one record are written together as one pack
    (`packs/<n>.bin`, like git's packfiles) and `index.jsonl` maps each hash to its pack, so a
    dispatch costs one file however many tensors it has."""

    def __init__(self, root):
        self.root = Path(root)
        (self.root / "packs").mkdir(parents=True, exist_ok=True)
        self.manifest = self.root / "manifest.jsonl"
        self.index_path = self.root / "index.jsonl"
        self._index: dict[str, tuple] = {}
        self._index_at = _Tail()
        self._records: list[Record] = []
        self._records_at = _Tail()
        self._pending: dict[str, list] = {}            # hash -> [offset, dtype, shape] in the open pack
        self._pack = None                                # the open pack (a temporary file until flushed)
        self._pack_tmp, self._pack_off = None, 0
        self.generation = 0             # counts the files found replaced: what a reader cached of them is void
        self._maps: dict[str, mmap.mmap] = {}           # pack -> its bytes, mapped (packs are written once)
        self._maps_generation = 0

    @property
    def index(self) -> dict[str, tuple]:
        """hash -> (pack, offset, dtype, shape).  Read once and then incrementally: a checker reads the
        store while the device side appends to it, so each access parses only the lines appended since
        (one stat when nothing was), and a file replaced or shortened is read afresh."""
        fresh, lines = self._index_at.read(self.index_path, json.loads)
        if fresh:
            self._index = {}
            self.generation += 1
        for e in lines:
            if (self.root / "packs" / e["pack"]).exists():
                self._index.update({h: (e["pack"], *loc) for h, loc in e["blobs"].items()})
        return self._index

    def put(self, a) -> str:
        """Store an array's bytes as they are now; returns their hash.  Always hashed from content: an
        array can change in place between two puts, and a memo by object identity would then answer
        with a stale hash (pools are stored as row deltas, so a memo would save ~0.1% of a run).  A new
        blob's bytes go to the open pack at once, so what happens to `a` afterwards does not matter and
        nothing is copied.  The writer reads the index file once per pack (the first new blob's put):
        it is the store's one writer, so what it appended since is in its own index already."""
        a = np.asarray(a)
        h = content_hash(a)
        if h in self._pending or h in self._index:
            return h
        if self._pack is None:
            if h in self.index:
                return h
            fd, tmp = tempfile.mkstemp(prefix="pending.", suffix=".tmp", dir=self.root / "packs")
            self._pack, self._pack_tmp, self._pack_off = open(fd, "wb"), tmp, 0
        a = np.ascontiguousarray(a)
        if a.size:
            self._pack.write(a.view(np.uint8).reshape(-1).data)
        self._pending[h] = [self._pack_off, _dtype_name(a.dtype), list(a.shape)]
        self._pack_off += a.nbytes
        return h

    def flush_pack(self, name: str) -> None:
        """The pending blobs' pack, complete, as `<name>.<digest>.bin`, then their index line (a killed
        writer leaves at most an unindexed pack).  The digest is of the pack's index entries (each blob's
        hash, offset, dtype and shape), so a pack name always means the same bytes: a dispatch redone
        on resume with other new blobs writes another pack, and the index lines of the first still
        point at theirs."""
        if not self._pending:
            return
        digest = hashlib.sha256(json.dumps(self._pending, sort_keys=True).encode()).hexdigest()[:16]
        pack = f"{name}.{digest}.bin"
        self._pack.close()
        os.replace(self._pack_tmp, self.root / "packs" / pack)
        self._pack = None
        self._maps.pop(pack, None)
        entries, self._pending = self._pending, {}
        index = self.index
        # a line torn by a killed writer goes first, so this one starts a line of its own (only the
        # writer cuts: a reader stops before a line still being written)
        self._index_at.cut_torn(self.index_path)
        line = (json.dumps({"pack": pack, "blobs": entries}) + "\n").encode()
        with open(self.index_path, "ab") as fh:
            fh.write(line)
            fh.flush()
        index.update({h: (pack, *e) for h, e in entries.items()})
        self._index_at.wrote(self.index_path, len(line))

    def get(self, h: str) -> np.ndarray:
        if h in self._pending:
            off, dtype, shape = self._pending[h]
            self._pack.flush()
            return np.fromfile(self._pack_tmp, dtype=_dtype(dtype), count=int(np.prod(shape, dtype=np.int64)),
                               offset=off).reshape(shape)
        loc = self.index.get(h)
        if loc is None:
            raise AbiError("blob", h, f"a hash indexed in {self.index_path}", where="record store")
        pack, off, dtype, shape = loc
        dt = _dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64))
        if not n:
            return np.zeros(shape, dt)
        if self._maps_generation != self.generation:
            self._maps, self._maps_generation = {}, self.generation
        m = self._maps.pop(pack, None)
        if m is None:
            with open(self.root / "packs" / pack, "rb") as fh:
                m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            if len(self._maps) >= MAPPED_PACKS:
                # each map holds a file descriptor: the least recently read goes (its arrays keep it alive)
                del self._maps[next(iter(self._maps))]
        self._maps[pack] = m                         # most recently read last
        # a read-only view of the pack: only the pages a check touches are read
        return np.frombuffer(m, dtype=dt, count=n, offset=off).reshape(shape)

    def put_delta(self, before: np.ndarray, after: np.ndarray) -> dict:
        """The rows of a pool (viewed as [rows, last axis]) that differ bit-wise, and their new values."""
        rows = changed_rows(before, after)
        return {"rows": self.put(rows), "values": self.put(after.reshape(-1, after.shape[-1])[rows])}

    def apply_delta(self, pool: np.ndarray, delta: dict) -> None:
        """In place: pool rows <- the delta's values."""
        pool.reshape(-1, pool.shape[-1])[self.get(delta["rows"])] = self.get(delta["values"])

    def put_initial(self, state: dict) -> None:
        path = self.root / "initial.json"
        if not path.exists():
            hashes = self.put_all(state)
            self.flush_pack("initial")
            path.write_text(json.dumps(hashes, sort_keys=True) + "\n")

    def initial_hashes(self) -> dict:
        """The content hash of each pool before dispatch 0."""
        return read_json(self.root / "initial.json", "--run-dir", "the hash of each pool before dispatch 0, as "
                                                                   "lockstep wrote it (start afresh with --fresh)")

    def initial(self) -> dict:
        return {k: np.array(v) for k, v in self.get_all(self.initial_hashes()).items()}

    def states(self, records=None, *, with_before: bool = True):
        """Yield (record, device state before, device state after, golden state after), rebuilding
        both sides' pools from the initial state and the deltas."""
        dev, gold = self.initial(), self.initial()
        for rec in self.records() if records is None else records:
            before = {k: dev[k].copy() for k in rec.state_delta} if with_before else None
            for k, dlt in rec.state_delta.items():
                self.apply_delta(dev[k], dlt)
            for k, dlt in rec.golden_state_delta.items():
                self.apply_delta(gold[k], dlt)
            yield rec, before, dev, gold

    def put_all(self, arrays: dict) -> dict:
        return {k: self.put(v) for k, v in arrays.items()}

    def get_all(self, hashes: dict) -> dict:
        return {k: self.get(h) for k, h in hashes.items()}

    def append(self, rec: Record) -> None:
        self.flush_pack(f"{rec.index:08d}")
        with open(self.manifest, "a") as fh:
            fh.write(json.dumps(rec.to_dict(), sort_keys=True, default=_json_default) + "\n")
            fh.flush()      # a killed process loses nothing flushed (fsync would only guard a machine crash)

    def records(self) -> list[Record]:
        """Complete manifest lines in order (a torn last line from a killed writer is ignored); the
        records of a run directory of another format are refused (`hw.run_format`)."""
        check_run_dir(self.root.parent)
        fresh, recs = self._records_at.read(self.manifest, lambda line: Record(**json.loads(line)))
        if fresh:
            self._records = []
            self.generation += 1
        self._records += recs
        return list(self._records)

    def truncate(self, n: int) -> None:
        """Keep the first n manifest lines (resume drops records its report never confirmed)."""
        recs = self.records()[:n]
        tmp = self.manifest.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r.to_dict(), sort_keys=True, default=_json_default) + "\n" for r in recs))
        os.replace(tmp, self.manifest)


def _dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


class _Tail:
    """How far this process has read an append-only JSON-lines file: the file's identity and the
    byte offset after the last line it took.  The files are only appended to, replaced (os.replace)
    or cut back by their one writer, which each read detects."""

    def __init__(self):
        self.key, self.at = None, 0

    def read(self, path: Path, parse) -> tuple[bool, list]:
        """(fresh, values): `parse` of each complete line appended since the last read, stopping before
        the first line it refuses (a line still being written, or torn by a killed writer: read again
        next time); fresh: the file was replaced, shortened or removed, so earlier values are void."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            fresh, self.key, self.at = self.key is not None, None, 0
            return fresh, []
        key = (st.st_dev, st.st_ino)
        if key == self.key and st.st_size == self.at:
            return False, []                        # nothing appended: one stat
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            key = (st.st_dev, st.st_ino)
            fresh = self.key is not None and (key != self.key or st.st_size < self.at)
            if not fresh and self.at:
                fh.seek(self.at - 1)
                fresh = fh.read(1) != b"\n"        # not the file read before (its last line ended there)
            if fresh:
                self.at = 0
            self.key = key
            if st.st_size == self.at:
                return fresh, []
            fh.seek(self.at)
            raw = fh.read()
        out = []
        for line in raw.split(b"\n")[:-1]:        # the part after the last newline is not a line yet
            try:
                out.append(parse(line))
            except (ValueError, TypeError, KeyError):
                break
            self.at += len(line) + 1
        return fresh, out

    def cut_torn(self, path: Path) -> None:
        """The writer, before it appends: drop what follows the last line read (a torn line)."""
        if self.key is not None and os.stat(path).st_size > self.at:
            with open(path, "r+b") as fh:
                fh.truncate(self.at)

    def wrote(self, path: Path, n: int) -> None:
        """The writer appended `n` bytes of lines it holds already (so the next read skips them)."""
        st = os.stat(path)
        if self.key in (None, (st.st_dev, st.st_ino)) and st.st_size == self.at + n:
            self.key, self.at = (st.st_dev, st.st_ino), self.at + n


def changed_rows(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """The rows (the last axis a row) whose bytes differ.  Compared a machine word at a time where a
    row's bytes divide into words: a row differs in a byte exactly when it differs in the word that
    holds it, and the compare's temporary is a word's fraction of the pool."""
    b = np.ascontiguousarray(before).reshape(-1, before.shape[-1])
    a = np.ascontiguousarray(after).reshape(-1, after.shape[-1])
    width = a.shape[1] * a.itemsize
    word = next(w for w in (8, 4, 2, 1) if width % w == 0)
    av = a.view(np.uint8).reshape(a.shape[0], -1).view(f"u{word}")
    bv = b.view(np.uint8).reshape(b.shape[0], -1).view(f"u{word}")
    return np.flatnonzero((av != bv).any(-1)).astype(np.int64)


@functools.cache
def _dtype_name(dt: np.dtype) -> str:
    return dt.name


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, tuple):
        return list(o)
    if isinstance(o, Mapping):          # a step item's block tables (a view, not a dict)
        return dict(o)
    raise TypeError(type(o).__name__)
