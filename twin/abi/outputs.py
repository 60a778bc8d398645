"""Report files: an output directory checked before a run starts, and files written atomically.

A report file is written to a temporary name beside it and renamed into place, so an interrupted
or killed writer leaves the previous file or the complete new one, never half of one.
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .errors import ConfigError

_UMASK = os.umask(0)
os.umask(_UMASK)


def output_dir(path, flag: str) -> Path:
    """Create `path` (and its parents) and prove it writable, or refuse naming the flag."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".write-check-"):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        if isinstance(e, FileExistsError) or (p.exists() and not p.is_dir()):
            reason = "a file of that name exists"
        elif isinstance(e, NotADirectoryError):
            reason = "a parent is a file"
        raise ConfigError(flag, str(path), f"a directory that can be created and written ({reason})") from None
    return p


@contextmanager
def atomic_path(path):
    """Yield a temporary path beside `path`; on success it replaces `path`, on any failure it goes.
    The temporary name keeps the suffix (writers such as matplotlib pick the format from it)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)     # the mode an ordinary open() would give, not mkstemp's 0600
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_bytes(path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
