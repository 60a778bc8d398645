"""Workloads from the data serving engineers already have: ShareGPT conversations, vLLM's random
and prefix-repetition datasets, Mooncake traces and the Azure LLM inference trace.

Each adapter returns requests (prompt token ids, output length, arrival) the simulator runs as it
runs a generated workload.  Datasets without timestamps (ShareGPT, random, prefix repetition)
get their arrivals from the workload's arrival process (`--request-rate`, `--burstiness`);
traces keep their own.  A bad file raises `ConfigError` naming the file and line.

- ShareGPT (`[{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}, ...]}]`):
  the first turn is the prompt, the second the reference completion, as vLLM's ShareGPT dataset;
  entries with fewer than two turns, or a prompt or completion under 4 tokens, are skipped as
  vLLM skips them.  Lengths and token ids come from a local tokenizer directory
  (`tokenizer.json`) when given, else from `CHARS_PER_TOKEN` characters per token with ids that
  hash each character group, so equal text prefixes give equal token prefixes.
- random (vLLM `--dataset-name random`): input and output lengths uniform over
  [floor(L (1 - r)), ceil(L (1 + r))] (output at least 1), an optional random prefix shared by every
  request, then tokens (offset + index + position) mod vocab.
- prefix repetition (vLLM `--dataset-name prefix_repetition`): `num_prefixes` random prefixes,
  each shared by num_prompts // num_prefixes requests with their own random suffix, shuffled.
- Mooncake (one JSON object per line: `timestamp` in ms, `input_length`, `output_length`,
  `hash_ids`): hash id h is a 512-token block whose tokens depend only on h, so two requests that
  name the same ids share those prefix blocks and the prefix cache sees them; a prompt longer
  than its blocks is completed with tokens of its own.
- Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`): arrivals relative
  to the first row's timestamp.
"""
from __future__ import annotations

import csv
import json
import math
import zlib
from datetime import datetime
from pathlib import Path

import numpy as np

from twin.abi.batches import Request, Sampling
from twin.abi.errors import ConfigError


CHARS_PER_TOKEN = 4.0            # English text under a BPE vocabulary: about 4 characters a token
SHAREGPT_MIN_LEN = 4             # vLLM's is_valid_sequence minimum, prompt and completion
MOONCAKE_BLOCK = 512             # tokens per Mooncake hash id
DATASETS = ("sharegpt", "random", "prefix_repetition", "mooncake", "azure")
FIRST_ID = 2                     # token ids 0 and 1 are left to padding and EOS


def _bad(path, line: int | None, value, allowed: str) -> ConfigError:
    where = f"{path}:{line}" if line is not None else str(path)
    return ConfigError(where, value if not isinstance(value, str) else value[:80], allowed)


def _request(i: int, prompt: np.ndarray, out_len: int, arrival: float, eos: int, tag: str = "") -> Request:
    return Request(f"d{i}", prompt, Sampling(int(out_len), eos, False, ()), float(arrival), {}, tag)


# ---- ShareGPT -----------------------------------------------------------------------------------
class CharTokens:
    """Lengths and ids without a tokenizer: one token per CHARS_PER_TOKEN characters, each id a
    hash of its characters (stable across runs and machines)."""

    def __init__(self, vocab: int, chars_per_token: float = CHARS_PER_TOKEN):
        if not chars_per_token > 0:
            raise ConfigError("chars_per_token", chars_per_token, "> 0")
        self.vocab, self.cpt = vocab, chars_per_token

    def encode(self, text: str) -> np.ndarray:
        n = max(1, math.ceil(len(text) / self.cpt)) if text else 0
        edges = [round(j * self.cpt) for j in range(n + 1)]
        span = self.vocab - FIRST_ID
        return np.array([FIRST_ID + zlib.crc32(text[a:b].encode()) % span for a, b in zip(edges, edges[1:])],
                        dtype=np.int32)


class DirTokenizer:
    """A local tokenizer directory's `tokenizer.json` (the `tokenizers` package; no hub access)."""

    def __init__(self, path: str | Path):
        f = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
        if not f.is_file():
            raise ConfigError("--tokenizer", str(path), "a directory holding tokenizer.json (or the file itself)")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("--tokenizer", str(path), "the 'tokenizers' package installed") from None
        try:
            self.tok = Tokenizer.from_file(str(f))
        except Exception as e:         # the library's parse error, whatever its type
            raise ConfigError(str(f), "", f"a tokenizers JSON file ({type(e).__name__})") from None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)


def sharegpt(path: str | Path, *, num_prompts: int | None = None, tokenizer=None, output_len: int | None = None,
             vocab: int = 129280, eos: int = 1) -> list[Request]:
    """ShareGPT JSON in file order; `output_len` fixes every output length (vLLM's
    --sharegpt-output-len), else the reference completion's length."""
    tok = tokenizer or CharTokens(vocab)
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise _bad(path, None, "", "an existing ShareGPT JSON file") from None
    except json.JSONDecodeError as e:
        raise _bad(path, e.lineno, e.msg, "a ShareGPT JSON list") from None
    except UnicodeDecodeError:
        raise _bad(path, None, "", "UTF-8 JSON text") from None
    if not isinstance(data, list):
        raise _bad(path, 1, type(data).__name__, "a JSON list of conversations")
    reqs = []
    for k, entry in enumerate(data):
        conv = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(conv, list) or not all(isinstance(t, dict) and isinstance(t.get("value"), str)
                                                 for t in conv[:2]):
            raise _bad(path, None, f"entry {k}", "{'conversations': [{'from': ..., 'value': text}, ...]}")
        if len(conv) < 2:
            continue
        prompt = tok.encode(conv[0]["value"])
        n_out = output_len if output_len is not None else len(tok.encode(conv[1]["value"]))
        if len(prompt) < SHAREGPT_MIN_LEN or n_out < SHAREGPT_MIN_LEN:
            continue
        reqs.append(_request(len(reqs), prompt, n_out, 0.0, eos, "sharegpt"))
        if num_prompts is not None and len(reqs) == num_prompts:
            break
    if not reqs:
        raise _bad(path, None, f"{len(data)} entries", "at least one conversation with two turns of >= 4 tokens")
    return reqs


# ---- vLLM's synthetic datasets -----------------------------------------------------------------
def random_dataset(num_prompts: int, *, input_len: int = 1024, output_len: int = 128, range_ratio: float = 0.0,
                   prefix_len: int = 0, seed: int = 0, vocab: int = 129280, eos: int = 1) -> list[Request]:
    if not 0.0 <= range_ratio < 1.0:
        raise ConfigError("--random-range-ratio", range_ratio, "in [0, 1)")
    for name, v, lo in (("--num-prompts", num_prompts, 1), ("--random-input-len", input_len, 0),
                        ("--random-output-len", output_len, 1), ("--random-prefix-len", prefix_len, 0)):
        if v < lo:
            raise ConfigError(name, v, f">= {lo}")
    if prefix_len + math.floor(input_len * (1 - range_ratio)) < 1:
        raise ConfigError("--random-input-len", input_len, "prefix + the shortest sampled input >= 1 token")
    rng = np.random.default_rng(seed)
    ilen = rng.integers(math.floor(input_len * (1 - range_ratio)), math.ceil(input_len * (1 + range_ratio)) + 1,
                        num_prompts)
    olo = max(1, math.floor(output_len * (1 - range_ratio)))
    olen = rng.integers(olo, max(olo, math.ceil(output_len * (1 + range_ratio))) + 1, num_prompts)
    offsets = rng.integers(0, vocab, num_prompts)
    span = vocab - FIRST_ID
    prefix = rng.integers(FIRST_ID, vocab, prefix_len).astype(np.int32)
    reqs = []
    for i in range(num_prompts):
        inner = (FIRST_ID + (offsets[i] + i + np.arange(ilen[i])) % span).astype(np.int32)
        reqs.append(_request(i, np.concatenate([prefix, inner]), olen[i], 0.0, eos, "random"))
    return reqs


def prefix_repetition(num_prompts: int, *, prefix_len: int = 256, suffix_len: int = 256, num_prefixes: int = 10,
                      output_len: int = 128, seed: int = 0, vocab: int = 129280, eos: int = 1) -> list[Request]:
    """num_prompts // num_prefixes requests per prefix (vLLM's count: the remainder is not drawn)."""
    if num_prefixes < 1 or num_prompts < num_prefixes:
        raise ConfigError("--prefix-repetition-num-prefixes", num_prefixes, f"1..num_prompts ({num_prompts})")
    for name, v, lo in (("--prefix-repetition-prefix-len", prefix_len, 0),
                        ("--prefix-repetition-suffix-len", suffix_len, 0),
                        ("--prefix-repetition-output-len", output_len, 1)):
        if v < lo:
            raise ConfigError(name, v, f">= {lo}")
    if prefix_len + suffix_len < 1:
        raise ConfigError("--prefix-repetition-prefix-len", prefix_len, "prefix + suffix >= 1 token")
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(num_prefixes):
        pre = rng.integers(FIRST_ID, vocab, prefix_len).astype(np.int32)
        for _ in range(num_prompts // num_prefixes):
            rows.append((np.concatenate([pre, rng.integers(FIRST_ID, vocab, suffix_len).astype(np.int32)]), g))
    order = rng.permutation(len(rows))
    return [_request(i, rows[j][0], output_len, 0.0, eos, f"prefix{rows[j][1]}") for i, j in enumerate(order)]


# ---- traces ------------------------------------------------------------------------------------
def _block(h: int, seed: int, vocab: int) -> np.ndarray:
    return np.random.default_rng([seed, h]).integers(FIRST_ID, vocab, MOONCAKE_BLOCK).astype(np.int32)


def mooncake(path: str | Path, *, num_prompts: int | None = None, seed: int = 0, vocab: int = 129280,
             eos: int = 1) -> list[Request]:
    blocks: dict[int, np.ndarray] = {}
    rows = []
    for ln, line in _lines(path):
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise _bad(path, ln, line, f"a JSON object per line ({e.msg})") from None
        if not isinstance(d, dict):
            raise _bad(path, ln, line, "a JSON object per line")
        try:
            t, n_in, n_out = float(d["timestamp"]), d["input_length"], d["output_length"]
            ids = d.get("hash_ids", [])
        except KeyError as e:
            raise _bad(path, ln, line, f"keys timestamp, input_length, output_length (missing {e})") from None
        except (TypeError, ValueError):
            raise _bad(path, ln, line, "a numeric timestamp (ms)") from None
        if not (isinstance(n_in, int) and n_in >= 1 and isinstance(n_out, int) and n_out >= 1) or math.isnan(t):
            raise _bad(path, ln, line, "integer input_length >= 1, output_length >= 1 and a timestamp")
        if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
            raise _bad(path, ln, ids, "hash_ids: a list of integers")
        if len(ids) > math.ceil(n_in / MOONCAKE_BLOCK):
            raise _bad(path, ln, f"{len(ids)} hash_ids", f"at most ceil(input_length / {MOONCAKE_BLOCK}) blocks")
        parts = [blocks.setdefault(h, _block(h, seed, vocab)) for h in ids]
        prompt = np.concatenate(parts)[:n_in] if parts else np.zeros(0, np.int32)
        if len(prompt) < n_in:           # the rest of the prompt is this request's own
            own = np.random.default_rng([seed, 1 << 40, ln]).integers(FIRST_ID, vocab, n_in - len(prompt))
            prompt = np.concatenate([prompt, own.astype(np.int32)])
        rows.append((t / 1000.0, prompt, n_out))
        if num_prompts is not None and len(rows) == num_prompts:
            break
    return _timed(path, rows, eos, "mooncake")


def azure(path: str | Path, *, num_prompts: int | None = None, seed: int = 0, vocab: int = 129280,
          eos: int = 1) -> list[Request]:
    rng = np.random.default_rng(seed)
    rows = []
    try:
        fh = open(path, newline="")
    except FileNotFoundError:
        raise _bad(path, None, "", "an existing Azure trace CSV") from None
    with fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        want = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        if header is None or [h.strip() for h in header[:3]] != want:
            raise _bad(path, 1, ",".join(header or []), ",".join(want) + " as the header")
        for row in reader:
            ln = reader.line_num
            if not row or not "".join(row).strip():
                continue
            try:
                t = datetime.fromisoformat(row[0].strip()).timestamp()
                n_in, n_out = int(row[1]), int(row[2])
            except (ValueError, IndexError):
                raise _bad(path, ln, ",".join(row), "TIMESTAMP (ISO date and time), ContextTokens, GeneratedTokens "
                                                    "(integers)") from None
            if n_in < 1 or n_out < 1:
                raise _bad(path, ln, ",".join(row), "ContextTokens >= 1 and GeneratedTokens >= 1")
            rows.append((t, rng.integers(FIRST_ID, vocab, n_in).astype(np.int32), n_out))
            if num_prompts is not None and len(rows) == num_prompts:
                break
    return _timed(path, rows, eos, "azure")


def _lines(path):
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise _bad(path, None, "", "an existing trace file") from None
    except UnicodeDecodeError:
        raise _bad(path, None, "", "UTF-8 text") from None
    for ln, line in enumerate(text.splitlines(), 1):
        if line.strip():
            yield ln, line


def _timed(path, rows, eos: int, tag: str) -> list[Request]:
    if not rows:
        raise _bad(path, None, "no rows", "at least one request")
    t0 = min(t for t, _, _ in rows)
    return [_request(i, p, n, t - t0, eos, tag) for i, (t, p, n) in enumerate(rows)]


def with_arrivals(reqs: list[Request], times: np.ndarray) -> list[Request]:
    """Give an untimed dataset the workload's arrival times."""
    for r, t in zip(reqs, times):
        r.arrival = float(t)
    return reqs
