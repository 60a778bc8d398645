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

from twin.abi.errors import ConfigError

from .request import Request, Sampling

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
        if not 1 <= self.min <= self.max:
            raise ConfigError("length min/max", (self.min, self.max), "1 <= min <= max")

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
        if self.num_requests < 1:
            raise ConfigError("num_requests", self.num_requests, ">= 1")
        if not self.rate > 0:
            raise ConfigError("rate", self.rate, "> 0 requests per second (inf for all at once)")
        for name in ("prefix_fraction", "eos_fraction", "stop_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(name, getattr(self, name), "in [0, 1]")
        if self.prefix_fraction and (self.prefix_groups < 1 or self.prefix_len < 1):
            raise ConfigError("prefix_groups/prefix_len", (self.prefix_groups, self.prefix_len),
                              ">= 1 each when prefix_fraction > 0")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop_sequence"] = list(self.stop_sequence)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "WorkloadSpec":
        known = {f.name for f in fields(cls)}
        bad = set(d) - known
        if bad:
            raise ConfigError("workload key", sorted(bad)[0], f"one of {sorted(known)}")
        d = dict(d)
        for k in ("prompt", "output"):
            if isinstance(d.get(k), dict):
                d[k] = LengthDist(**d[k])
        if "stop_sequence" in d:
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
def load_jsonl(path: str | Path, *, vocab: int = 129280, seed: int = 0, eos_token_id: int = 1) -> list[Request]:
    """One request per line: {"id", "arrival", "prompt" (token ids) or "prompt_len",
    "max_new_tokens" (or "output_len"), optional "prefix_group" + "prefix_len", "eos_at",
    "stop" (list of token-id lists), "script" ({output index: token})}."""
    rng = np.random.default_rng(seed)
    prefixes: dict[str, np.ndarray] = {}
    reqs = []
    for ln, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{ln}", line[:60], f"a JSON object per line ({e.msg})") from None
        if "prompt" in d:
            prompt = np.asarray(d["prompt"], dtype=np.int32)
        elif "prompt_len" in d:
            prompt = rng.integers(2, vocab, int(d["prompt_len"]), dtype=np.int32)
        else:
            raise ConfigError(f"{path}:{ln}", sorted(d), "a 'prompt' (token ids) or a 'prompt_len'")
        if "prefix_group" in d:
            g = str(d["prefix_group"])
            plen = int(d.get("prefix_len", 0))
            if g not in prefixes:
                prefixes[g] = rng.integers(2, vocab, plen, dtype=np.int32)
            prompt = np.concatenate([prefixes[g], prompt])
        m = d.get("max_new_tokens", d.get("output_len"))
        if m is None:
            raise ConfigError(f"{path}:{ln}", sorted(d), "a 'max_new_tokens' (or 'output_len')")
        script = {int(k): int(v) for k, v in d.get("script", {}).items()}
        if "eos_at" in d:
            script[int(d["eos_at"])] = eos_token_id
        stops = tuple(tuple(int(x) for x in s) for s in d.get("stop", ()))
        reqs.append(Request(str(d.get("id", f"t{ln}")), prompt,
                            Sampling(int(m), eos_token_id, bool(d.get("ignore_eos", False)), stops),
                            float(d.get("arrival", 0.0)), script, str(d.get("prefix_group", ""))))
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
