"""Dispatch records: inputs, outputs and touched state, content-addressed, with a manifest.

Layout of a record store:

    blobs/ab/abcdef....npy     one array per content hash (dtype, shape and bytes hashed), written once
    manifest.jsonl            one line per dispatch: index, program, meta, and name -> hash maps for
                              inputs, device outputs, state before, device state after, golden
                              state after, plus the weights fingerprint

A line is appended only after all its blobs are on disk, so a killed writer leaves at most an
orphan blob, never a line that points at nothing.  Identical tensors (pools that a dispatch did
not change, repeated tables) are stored once.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from twin.abi.errors import AbiError


def content_hash(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.view(np.uint8).reshape(-1) if a.size else b"")
    return h.hexdigest()


@dataclass
class Record:
    index: int
    program: str
    meta: dict
    inputs: dict
    outputs: dict
    state_before: dict
    state_after: dict
    golden_state_after: dict
    weights: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class RecordStore:
    def __init__(self, root):
        self.root = Path(root)
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        self.manifest = self.root / "manifest.jsonl"

    def put(self, a) -> str:
        a = np.asarray(a)
        h = content_hash(a)
        p = self.root / "blobs" / h[:2] / f"{h}.npy"
        if not p.exists():
            p.parent.mkdir(exist_ok=True)
            tmp = p.with_suffix(f".tmp{os.getpid()}")
            with open(tmp, "wb") as fh:
                np.save(fh, a, allow_pickle=False)
            os.replace(tmp, p)
        return h

    def get(self, h: str) -> np.ndarray:
        p = self.root / "blobs" / h[:2] / f"{h}.npy"
        if not p.exists():
            raise AbiError("blob", h, f"a hash stored under {self.root / 'blobs'}", where="record store")
        return np.load(p, allow_pickle=False)

    def put_all(self, arrays: dict) -> dict:
        return {k: self.put(v) for k, v in arrays.items()}

    def get_all(self, hashes: dict) -> dict:
        return {k: self.get(h) for k, h in hashes.items()}

    def append(self, rec: Record) -> None:
        with open(self.manifest, "a") as fh:
            fh.write(json.dumps(rec.to_dict(), sort_keys=True, default=_json_default) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def records(self) -> list[Record]:
        """Complete manifest lines in order (a torn last line from a killed writer is ignored)."""
        if not self.manifest.exists():
            return []
        out = []
        for line in self.manifest.read_text().splitlines():
            try:
                out.append(Record(**json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                break
        return out

    def truncate(self, n: int) -> None:
        """Keep the first n manifest lines (resume drops records its report never confirmed)."""
        recs = self.records()[:n]
        tmp = self.manifest.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r.to_dict(), sort_keys=True, default=_json_default) + "\n" for r in recs))
        os.replace(tmp, self.manifest)


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(type(o).__name__)
