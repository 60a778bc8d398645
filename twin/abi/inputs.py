"""Reading a user's input files and values: every refusal names the flag, the file (and line), the
value and what is allowed, so a bad file is a one-line answer instead of a traceback.

Nothing here converts a value it was not given exactly: a token id of 2.7 or -5 is refused, never
rounded or wrapped; a JSON number of the wrong kind is refused, never cast.
"""
from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import AbiError, ConfigError

_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
               type(None): "null"}


def json_type(value) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def read_text(path, flag: str, what: str) -> str:
    """The file's text; `what` says what the file should hold (it ends every refusal)."""
    p = Path(path)
    try:
        return p.read_text()
    except FileNotFoundError:
        raise ConfigError(flag, str(path), f"an existing file holding {what} (no such file)") from None
    except IsADirectoryError:
        raise ConfigError(flag, str(path), f"a file holding {what} (this is a directory)") from None
    except UnicodeDecodeError:
        raise ConfigError(flag, str(path), f"a UTF-8 text file holding {what}") from None
    except OSError as e:
        raise ConfigError(flag, str(path), f"a readable file holding {what} ({e.strerror})") from None


def read_json(path, flag: str, what: str, kind: type | tuple = dict):
    """One JSON document of type `kind` (dict, list, or a tuple of them)."""
    text = read_text(path, flag, what)
    if not text.strip():
        raise ConfigError(flag, str(path), f"{what} (the file is empty)")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(flag, f"{path}:{e.lineno}", f"{what} (not JSON: {e.msg} at column {e.colno})") from None
    if not isinstance(value, kind):
        want = " or ".join(_JSON_TYPES[k] for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ConfigError(flag, str(path), f"{what} (found a JSON {json_type(value)}, not a JSON {want})")
    return value


def read_jsonl(path, flag: str, what: str) -> Iterator[tuple[int, str, dict]]:
    """(line number, where, object) per non-blank line; `where` is 'FLAG PATH:LINE', for the refusals
    of that line."""
    text = read_text(path, flag, what)
    n = 0
    for ln, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{flag} {path}:{ln}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError("line", line[:60], f"one JSON object per line holding {what} ({e.msg} at column "
                              f"{e.colno})", where=where) from None
        if not isinstance(value, dict):
            raise ConfigError("line", value, f"a JSON object holding {what}, not a JSON {json_type(value)}",
                              where=where)
        n += 1
        yield ln, where, value
    if not n:
        raise ConfigError(flag, str(path), f"at least one line of {what} (the file has none)")


@contextmanager
def located(where: str):
    """Refusals raised inside (by rules that know a value but not its file) are prefixed with `where`."""
    try:
        yield
    except AbiError as e:
        raise ConfigError(e.name, e.value, e.allowed, where=f"{where} {e.where}".strip()) from None


def known_keys(d: dict, allowed, name: str, where: str = "") -> None:
    """A key nobody reads would be silently dropped: refuse it."""
    bad = sorted(set(d) - set(allowed))
    if bad:
        raise ConfigError(name, bad[0], f"one of {sorted(allowed)}", where=where)


def integer(value, name: str, where: str = "", *, lo: int | None = None, hi: int | None = None) -> int:
    """An exact integer (a JSON integer, not 2.0, not true) in [lo, hi]."""
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if not ok or (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ConfigError(name, value, _range("an integer", lo, hi), where=where)
    return int(value)


def number(value, name: str, where: str = "", *, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, unit: str = "", finite: bool = True) -> float:
    """A number (integer or decimal; finite unless `finite=False`, never NaN) in [lo, hi] ((lo, hi]
    when lo_open)."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    ok = ok and not math.isnan(value) and (math.isfinite(value) or not finite)
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value <= hi
    if not ok:
        lo_s = None if lo is None else (f"> {lo:g}" if lo_open else f">= {lo:g}")
        allowed = ("a finite number" if finite else "a number") + (f" {lo_s}" if lo_s else "") + (f" and <= {hi:g}" if hi is not None else "")
        raise ConfigError(name, value, allowed + (f" {unit}" if unit else ""), where=where)
    return float(value)


def token_ids(value, name: str, vocab: int, where: str = "") -> np.ndarray:
    """A list of integer token ids in [0, vocab), as int32; the position of a bad one is named."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(name, value, "a list of integer token ids", where=where)
    for j, t in enumerate(value):
        if not (isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) and 0 <= t < vocab):
            raise ConfigError(f"{name}[{j}]", t, f"an integer token id in [0, {vocab}) (the vocabulary)", where=where)
    return np.asarray(value, dtype=np.int32).reshape(len(value))


def _range(kind: str, lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"{kind} in [{lo}, {hi}]"
    if lo is not None:
        return f"{kind} >= {lo}"
    if hi is not None:
        return f"{kind} <= {hi}"
    return kind
