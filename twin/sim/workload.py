"""Workloads: arrival processes, length distributions, shared-prefix groups, JSONL traces.

A `WorkloadSpec` is data (it round-trips through JSON; the bundled default lives in
`twin/sim/data/default_workload.json`); `generate` turns it into requests with prompt token ids,
deterministically from its seed.  Traces replay one JSON object per line.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path

import numpy as np

from twin.abi.batches import Request, Sampling
from twin.abi.errors import ConfigError
from twin.abi.inputs import integer, known_keys, number, read_jsonl, token_ids

ARRIVALS = ("poisson", "gamma", "burst")
LENGTH_KINDS = ("fixed", "uniform", "lognormal", "normal")


@dataclass(frozen=True)
class LengthDist:
    kind: str = "fixed"
    mean: float = 256
    spread: float = 0.0          # uniform: half-width; lognormal: sigma; normal: std
    min: int = 1
    max: int = 1 << 20

    def __post_init__(self):
        if self.kind not in LENGTH_KINDS:
            raise ConfigError("length kind", self.kind, f"one of {LENGTH_KINDS}")
        integer(self.min, "length min", lo=1)
        integer(self.max, "length max", lo=1)
        if not self.min <= self.max:
            raise ConfigError("length min/max", (self.min, self.max), "1 <= min <= max")
        # the mean inside [min, max]: outside it every sample would be clipped to a bound
        number(self.mean, "length mean", lo=self.min, hi=self.max, unit="(between min and max, tokens)")
        number(self.spread, "length spread", lo=0.0)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "fixed":
            x = np.full(n, self.mean)
        elif self.kind == "uniform":
            x = rng.uniform(self.mean - self.spread, self.mean + self.spread + 1, n)
        elif self.kind == "lognormal":
            s = self.spread or 0.5
            x = rng.lognormal(np.log(self.mean) - s * s / 2, s, n)
        else:
            x = rng.normal(self.mean, self.spread, n)
        return np.clip(np.floor(x), self.min, self.max).astype(np.int64)


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 512
    arrival: str = "poisson"
    rate: float = 32.0                   # requests per second (inf: all at t=0)
    gamma_cv: float = 2.0                # gamma arrivals: coefficient of variation (burstiness)
    prompt: LengthDist = field(default_factory=lambda: LengthDist("lognormal", 512, 0.6, 16, 4096))
    output: LengthDist = field(default_factory=lambda: LengthDist("lognormal", 256, 0.6, 8, 2048))
    prefix_groups: int = 0               # shared-prefix groups (0: none)
    prefix_len: int = 0                  # tokens shared by a group
    prefix_fraction: float = 0.0         # fraction of requests that belong to a group
    eos_fraction: float = 0.0            # requests that emit EOS before their length limit
    stop_fraction: float = 0.0           # requests that emit a stop sequence
    stop_sequence: tuple[int, ...] = (7, 8)
    eos_token_id: int = 1
    vocab: int = 129280
    seed: int = 0

    def __post_init__(self):
        if self.arrival not in ARRIVALS:
            raise ConfigError("arrival", self.arrival, f"one of {ARRIVALS}")
        integer(self.num_requests, "num_requests", lo=1)
        if isinstance(self.rate, bool) or not isinstance(self.rate, (int, float)) or not self.rate > 0:
            raise ConfigError("rate", self.rate, "> 0 requests per second (inf for all at once)")
        number(self.gamma_cv, "gamma_cv", lo=0.0, lo_open=True)
        for name in ("prefix_groups", "prefix_len", "seed"):
            integer(getattr(self, name), name, lo=0)
        integer(self.vocab, "vocab", lo=3)
        integer(self.eos_token_id, "eos_token_id", lo=0, hi=self.vocab - 1)
        token_ids(list(self.stop_sequence), "stop_sequence", self.vocab)
        if not isinstance(self.prompt, LengthDist) or not isinstance(self.output, LengthDist):
            raise ConfigError("prompt/output", (self.prompt, self.output), "length distributions")
        for name in ("prefix_fraction", "eos_fraction", "stop_fraction"):
            number(getattr(self, name), name, lo=0.0, hi=1.0)
        if self.prefix_fraction and (self.prefix_groups < 1 or self.prefix_len < 1):
            raise ConfigError("prefix_groups/prefix_len", (self.prefix_groups, self.prefix_len),
                              ">= 1 each when prefix_fraction > 0")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop_sequence"] = list(self.stop_sequence)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "WorkloadSpec":
        if not isinstance(d, dict):
            raise ConfigError("workload", d, "a JSON object of workload keys (docs/simulation.md)")
        known_keys(d, [f.name for f in fields(cls)], "workload key")
        d = dict(d)
        for k in ("prompt", "output"):
            if k not in d:
                continue
            v = d[k]
            if not isinstance(v, dict):
                raise ConfigError(k, v, "a length distribution {kind, mean, spread, min, max}")
            known_keys(v, [f.name for f in fields(LengthDist)], f"{k} key")
            try:
                d[k] = LengthDist(**v)
            except ConfigError as e:       # name the distribution: prompt.mean, output.min, ...
                raise ConfigError(f"{k}.{e.name.removeprefix('length ')}", e.value, e.allowed) from None
        if "stop_sequence" in d:
            if not isinstance(d["stop_sequence"], (list, tuple)):
                raise ConfigError("stop_sequence", d["stop_sequence"], "a list of token ids")
            d["stop_sequence"] = tuple(d["stop_sequence"])
        return cls(**d)

    def replace(self, **kw) -> "WorkloadSpec":
        return WorkloadSpec.from_dict({**asdict(self), **kw})


def arrivals(spec: WorkloadSpec, rng: np.random.Generator) -> np.ndarray:
    n = spec.num_requests
    if spec.arrival == "burst" or np.isinf(spec.rate):
        return np.zeros(n)
    if spec.arrival == "poisson":
        gaps = rng.exponential(1.0 / spec.rate, n)
    else:                                  # gamma with mean 1/rate and the given CV
        shape = 1.0 / spec.gamma_cv ** 2
        gaps = rng.gamma(shape, 1.0 / (spec.rate * shape), n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def generate(spec: WorkloadSpec) -> list[Request]:
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    t = arrivals(spec, rng)
    plen = spec.prompt.sample(n, rng)
    olen = spec.output.sample(n, rng)
    prefixes = [rng.integers(2, spec.vocab, spec.prefix_len, dtype=np.int32) for _ in range(spec.prefix_groups)]
    in_group = rng.random(n) < spec.prefix_fraction
    group = rng.integers(0, max(1, spec.prefix_groups), n)
    eos = rng.random(n) < spec.eos_fraction
    stop = rng.random(n) < spec.stop_fraction
    reqs = []
    for i in range(n):
        body = rng.integers(2, spec.vocab, int(plen[i]), dtype=np.int32)
        tag = ""
        if in_group[i] and prefixes:
            pre = prefixes[group[i]]
            body = np.concatenate([pre, body])[: max(int(plen[i]), len(pre) + 1)]
            tag = f"prefix{group[i]}"
        script: dict[int, int] = {}
        m = int(olen[i])
        if eos[i] and m > 1:
            script[int(rng.integers(0, m))] = spec.eos_token_id
        stops: tuple = ()
        if stop[i] and m > len(spec.stop_sequence):
            at = int(rng.integers(0, m - len(spec.stop_sequence)))
            for j, tok in enumerate(spec.stop_sequence):
                script[at + j] = tok
            stops = (tuple(spec.stop_sequence),)
        reqs.append(Request(f"r{i}", body, Sampling(m, spec.eos_token_id, False, stops), float(t[i]),
                            script, tag))
    return reqs


# ---- traces --------------------------------------------------------------------------------
TRACE_KEYS = ("id", "arrival", "prompt", "prompt_len", "max_new_tokens", "output_len", "prefix_group", "prefix_len",
              "eos_at", "stop", "script", "ignore_eos")


def load_jsonl(path: str | Path, *, vocab: int = 129280, seed: int = 0, eos_token_id: int = 1,
               flag: str = "--trace") -> list[Request]:
    """One request per line: {"id", "arrival", "prompt" (token ids) or "prompt_len",
    "max_new_tokens" (or "output_len"), optional "prefix_group" + "prefix_len", "eos_at",
    "stop" (list of token-id lists), "script" ({output index: token}), "ignore_eos"}.  Every value
    is checked as given: a token id outside [0, vocab), a negative length or an unknown key is
    refused naming the line, the request and the position."""
    rng = np.random.default_rng(seed)
    prefixes: dict[str, np.ndarray] = {}
    reqs, seen = [], {}
    for ln, where, d in read_jsonl(path, flag, "one request (docs/simulation.md#workloads)"):
        known_keys(d, TRACE_KEYS, "key", where)
        rid = d.get("id", f"t{ln}")
        if isinstance(rid, bool) or not isinstance(rid, (str, int)):
            raise ConfigError("id", rid, "a string or an integer", where=where)
        rid = str(rid)
        if rid in seen:
            raise ConfigError("id", rid, f"an id not already used (line {seen[rid]} has it)", where=where)
        seen[rid] = ln
        at = f"{where} (request {rid!r})"
        if "prompt" in d:
            prompt = token_ids(d["prompt"], "prompt", vocab, at)
        elif "prompt_len" in d:
            prompt = rng.integers(2, vocab, integer(d["prompt_len"], "prompt_len", at, lo=0), dtype=np.int32)
        else:
            raise ConfigError("keys", sorted(d), "a 'prompt' (token ids) or a 'prompt_len'", where=at)
        if "prefix_group" in d:
            g = d["prefix_group"]
            if isinstance(g, bool) or not isinstance(g, (str, int)):
                raise ConfigError("prefix_group", g, "a string or an integer", where=at)
            g = str(g)
            plen = integer(d.get("prefix_len", 0), "prefix_len", at, lo=0)
            if g not in prefixes:
                prefixes[g] = rng.integers(2, vocab, plen, dtype=np.int32)
            elif plen != len(prefixes[g]):
                raise ConfigError("prefix_len", plen, f"{len(prefixes[g])}, the length group {g!r} began with",
                                  where=at)
            prompt = np.concatenate([prefixes[g], prompt])
        elif "prefix_len" in d:
            raise ConfigError("prefix_len", d["prefix_len"], "only with a 'prefix_group'", where=at)
        if "max_new_tokens" in d and "output_len" in d:
            raise ConfigError("keys", ["max_new_tokens", "output_len"], "one of them (they mean the same)", where=at)
        key = "max_new_tokens" if "max_new_tokens" in d else "output_len"
        if key not in d:
            raise ConfigError("keys", sorted(d), "a 'max_new_tokens' (or 'output_len')", where=at)
        m = integer(d[key], key, at, lo=0)
        script = d.get("script", {})
        if not isinstance(script, dict):
            raise ConfigError("script", script, "an object {output index: token id}", where=at)
        out_script = {}
        for k, v in script.items():
            if not (isinstance(k, str) and k.isdigit()):
                raise ConfigError("script key", k, "an output index: a non-negative integer", where=at)
            out_script[int(k)] = int(token_ids([v], f"script[{k}]", vocab, at)[0])
        if "eos_at" in d:
            out_script[integer(d["eos_at"], "eos_at", at, lo=0)] = eos_token_id
        stop = d.get("stop", [])
        if not isinstance(stop, list):
            raise ConfigError("stop", stop, "a list of token-id lists", where=at)
        stops = []
        for i, seq in enumerate(stop):
            ids = token_ids(seq, f"stop[{i}]", vocab, at)
            if not len(ids):
                raise ConfigError(f"stop[{i}]", seq, "a non-empty list of token ids", where=at)
            stops.append(tuple(int(x) for x in ids))
        ignore_eos = d.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise ConfigError("ignore_eos", ignore_eos, "true or false", where=at)
        arrival = number(d.get("arrival", 0.0), "arrival", at, lo=0.0, unit="(seconds)")
        reqs.append(Request(rid, prompt, Sampling(m, eos_token_id, ignore_eos, tuple(stops)), arrival, out_script,
                            str(d.get("prefix_group", ""))))
    return reqs


def save_jsonl(reqs: list[Request], path: str | Path) -> None:
    with open(path, "w") as fh:
        for r in reqs:
            d = {"id": r.request_id, "arrival": r.arrival, "prompt": r.prompt.tolist(),
                 "max_new_tokens": r.sampling.max_new_tokens}
            if r.script:
                d["script"] = {str(k): v for k, v in r.script.items()}
            if r.sampling.stop:
                d["stop"] = [list(s) for s in r.sampling.stop]
            fh.write(json.dumps(d) + "\n")


def default_spec() -> WorkloadSpec:
    """The bundled default workload (twin/sim/data/default_workload.json)."""
    text = resources.files("twin.sim").joinpath("data/default_workload.json").read_text()
    return WorkloadSpec.from_dict(json.loads(text))


def documented_run(seed: int = 0) -> tuple[WorkloadSpec, dict]:
    """Upstream's documented run (serving-contract §10.1): 32 requests, ragged 33-512-token
    prompts, 128-token chunked prefill, K=7, 8 requests per group; returns the workload and the
    serving limits it used (max_num_seqs 32 = 8 per group at EP16)."""
    spec = WorkloadSpec(num_requests=32, arrival="burst", prompt=LengthDist("uniform", 272.5, 239.5, 33, 512),
                        output=LengthDist("fixed", 64, 0, 1, 64), seed=seed)
    return spec, dict(max_model_len=1024, long_prefill_token_threshold=128, max_num_seqs=32,
                      max_num_batched_tokens=8192, num_speculative_tokens=7)
