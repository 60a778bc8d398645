"""Per-dispatch latency from the ABI's bytes and FLOPs and the device's limits.

Roofline per stage, per rank, summed over stages (a dispatch is a chain of dependent layers):

- dense weights: every non-routed weight argument of the program, read once per dispatch
  (`twin.abi.programs.bind` gives each argument's per-rank bytes); FLOPs = 2 x elements x rows;
- MoE: per layer, the slowest EP rank: max(distinct local experts x expert bytes / HBM,
  routed token pairs x expert FLOPs / INT8 peak); routing from a policy or a recorded trace;
  the hash-routed first layers route by token id, i.e. uniformly at random;
- attention: KV bytes per family read by each request's queries (SWA window on every layer, the
  top-k compressed rows on CSA layers plus the indexer scan, every compressed row on HCA layers),
  taken on the busiest rank;
- collectives: the TP4 gather of the group's token rows and the EP dispatch/combine all-to-all
  per layer, from link bandwidth and latency.

Device limits are data (`twin/sim/data/devices.json`), and a measured profile rescales them.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path

import numpy as np

from twin.abi import constants as C
from twin.abi.caches import cache_families
from twin.abi.errors import ConfigError
from twin.abi.inputs import integer, known_keys, number, read_json
from twin.abi.programs import WEIGHT, bind

GATHERED = ("embed", "rope", "tid2eid")        # looked up by row, not streamed


@dataclass(frozen=True)
class DeviceLimits:
    name: str
    hbm_bytes: int
    hbm_bw: float
    bf16_flops: float
    int8_flops: float
    link_bw: float
    link_latency: float
    hbm_efficiency: float
    compute_efficiency: float
    link_efficiency: float
    dispatch_overhead: float
    host_schedule_per_request: float
    host_prepare_per_request: float
    host_reclaim: float
    lifecycle: float

    @classmethod
    def load(cls, name: str = "ascend-a3-die", path: str | Path | None = None, **overrides) -> "DeviceLimits":
        table = read_json(path, "device table", "device limits: {name: {limit: value}}") if path else \
            json.loads(resources.files("twin.sim").joinpath("data/devices.json").read_text())
        table = {k: v for k, v in table.items() if not k.startswith("_")}
        if name not in table:
            raise ConfigError("device", name, f"one of {sorted(table)}")
        known = {f.name for f in fields(cls)} - {"name"}
        bad = set(overrides) - known
        if bad:
            raise ConfigError("device override", sorted(bad)[0], f"one of {sorted(known)}")
        d = {**table[name], **overrides}
        for k in known:
            if k not in d:
                raise ConfigError(f"device {name}", k, "present in the device table")
            if not d[k] > 0:
                raise ConfigError(k, d[k], "> 0")
        return cls(name=name, **{k: d[k] for k in known})

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Calibration:
    """Multipliers fitted from a measured profile, per dispatch kind."""

    prefill: float = 1.0
    decode: float = 1.0
    seed: float = 1.0

    @classmethod
    def from_profile(cls, path: str | Path, model: "CostModel", flag: str = "--profile") -> "Calibration":
        """A profile file: {"points": [{"kind": "decode", "seconds": s, "requests_per_group": [..],
        "context": c} | {"kind": "prefill", "seconds": s, "tokens_per_group": [[...], ...], "start": c}
        | {"kind": "seed", "seconds": s, "rows": n}]}, one list entry per TP group.  Each kind's
        multiplier is the median of measured / predicted."""
        data = read_json(path, flag, PROFILE_FORMAT)
        known_keys(data, ("points",), "key", where=f"{flag} {path}")
        points = data.get("points")
        if not isinstance(points, list) or not points:
            raise ConfigError("points", points, f"a non-empty list: {PROFILE_FORMAT}", where=f"{flag} {path}")
        G = model.G
        ratios: dict[str, list[float]] = {"prefill": [], "decode": [], "seed": []}
        for i, p in enumerate(points):
            at = f"{flag} {path} points[{i}]"
            if not isinstance(p, dict) or p.get("kind") not in PROFILE_KEYS:
                raise ConfigError("kind", p.get("kind") if isinstance(p, dict) else p,
                                  f"an object whose 'kind' is one of {sorted(PROFILE_KEYS)}", where=at)
            kind = p["kind"]
            known_keys(p, PROFILE_KEYS[kind], "key", where=at)
            seconds = number(p.get("seconds"), "seconds", at, lo=0.0, lo_open=True, unit="(measured device time)")
            if kind == "decode":
                per_group = _per_group(p.get("requests_per_group"), "requests_per_group", at, G, lambda v, n, w:
                                       integer(v, n, w, lo=0, hi=C.DECODE_BATCH))
                ctx_len = integer(p.get("context", 1024), "context", at, lo=1)
                ctx = [[ctx_len] * n for n in per_group]
                pred = model.decode(ctx, [[j % 4 for j in range(n)] for n in per_group])[0]
            elif kind == "prefill":
                def chunks(v, n, w):
                    if not isinstance(v, list):
                        raise ConfigError(n, v, "a list of chunk token counts", where=w)
                    return [integer(x, f"{n}[{j}]", w, lo=1) for j, x in enumerate(v)]
                groups = _per_group(p.get("tokens_per_group"), "tokens_per_group", at, G, chunks)
                start = integer(p.get("start", 0), "start", at, lo=0)
                pred = model.prefill([[(n, start) for n in g] for g in groups])[0]
            else:
                pred = model.seed(integer(p.get("rows", 128), "rows", at, lo=1))[0]
            ratios[kind].append(seconds / pred)
        return cls(**{k: float(np.median(v)) if v else 1.0 for k, v in ratios.items()})


PROFILE_FORMAT = "a measured profile: {\"points\": [{\"kind\": decode|prefill|seed, \"seconds\", ...}]} (docs/calibration.md)"
PROFILE_KEYS = {"decode": ("kind", "seconds", "requests_per_group", "context"),
                "prefill": ("kind", "seconds", "tokens_per_group", "start"),
                "seed": ("kind", "seconds", "rows")}


def _per_group(value, name: str, where: str, groups: int, item) -> list:
    """One entry per TP group (the deployment's partitions), each read by `item`."""
    if not isinstance(value, list) or len(value) != groups:
        raise ConfigError(name, value, f"a list of {groups} entries, one per TP group", where=where)
    return [item(v, f"{name}[{g}]", where) for g, v in enumerate(value)]


ROUTING_POLICIES = ("balanced", "random", "skewed", "trace")


@dataclass(frozen=True)
class Routing:
    policy: str = "random"
    skew: float = 1.0                 # skewed: Zipf exponent over experts (randomly placed on ranks)
    trace: tuple = ()                 # trace: per layer, per expert token counts (a recorded histogram)

    def __post_init__(self):
        if self.policy not in ROUTING_POLICIES:
            raise ConfigError("routing", self.policy, f"one of {ROUTING_POLICIES}")
        number(self.skew, "routing skew", lo=0.0, unit="(a Zipf exponent)")
        if self.policy == "trace" and not self.trace:
            raise ConfigError("routing trace", "empty", "per-layer expert histograms (a JSON list of lists)")

    @classmethod
    def from_trace_file(cls, path: str | Path, flag: str = "--routing-trace") -> "Routing":
        what = TRACE_FORMAT
        data = read_json(path, flag, what, kind=(dict, list))
        if isinstance(data, dict):
            known_keys(data, ("layers",), "key", where=f"{flag} {path}")
            data = data.get("layers")
        if not isinstance(data, list) or not data:
            raise ConfigError("layers", data, what, where=f"{flag} {path}")
        rows = []
        for i, row in enumerate(data):
            if not isinstance(row, list):
                raise ConfigError(f"layers[{i}]", row, "a list of expert token counts", where=f"{flag} {path}")
            rows.append(tuple(number(x, f"layers[{i}][{j}]", f"{flag} {path}", lo=0.0, unit="(a token count)")
                              for j, x in enumerate(row)))
        return cls("trace", trace=tuple(rows))


TRACE_FORMAT = "per-layer expert histograms: {\"layers\": [[tokens per expert, ...] per target layer]}"


def check_trace(trace: tuple, m) -> None:
    """A routing trace holds one histogram per target layer over every routed expert, each with some
    tokens (the hash-routed layers' rows are not used: those route uniformly)."""
    E, n = m.n_routed_experts, m.num_hidden_layers
    if len(trace) != n:
        raise ConfigError("routing trace layers", len(trace), f"{n} (one histogram per layer of {m.name})")
    for i, row in enumerate(trace):
        if len(row) != E or not sum(row) > 0:
            raise ConfigError(f"routing trace layer {i}", f"{len(row)} counts summing to {sum(row):g}",
                              f"{E} non-negative expert counts, not all zero")


class CostModel:
    """Latency of the three dispatch kinds of a deployment: prefill, decode (fused K=7 or split
    K=0) and the bootstrap drafter seed."""

    def __init__(self, dep, slots: int, device: DeviceLimits | None = None, routing: Routing | None = None,
                 calibration: Calibration | None = None, seed: int = 0, fixed_tile: bool = True):
        self.dep, self.slots = dep, slots
        self.device = device or DeviceLimits.load()
        self.routing = routing or Routing()
        self.cal = calibration or Calibration()
        self.fixed_tile = fixed_tile
        self._rng = np.random.default_rng(seed)
        m, topo = dep.model, dep.topology
        if self.routing.policy == "trace":
            check_trace(self.routing.trace, m)
        self.m, self.R, self.tp, self.G = m, topo.ranks, topo.tp, topo.partitions
        self.n_local = topo.experts_per_rank(m)
        self.decode_program = "l3_decode_fwd_dspark" if dep.k else "l3_decode_fwd"
        self.w = {p: self._weights(p) for p in ("l3_prefill_fwd", self.decode_program)}
        if dep.k:
            self.w["seed"] = self._weights("l3_dspark_draft_step_device_state")
        fam = {f.name: f for f in cache_families(m)}
        self.tok_bytes = {n: f.page_bytes / f.page_tokens for n, f in fam.items()}   # all layers of the family
        self.tok_bytes_all = sum(self.tok_bytes.values())                             # one token, every family
        self.row_bytes = {n: f.row_bytes for n, f in fam.items()}
        self.expert_flops = 2 * 3 * m.hidden_size * m.moe_intermediate_size
        # the preset derives layer lists on every access; attention asks per dispatch
        self._layer_counts = (m.num_hidden_layers, len(m.csa_layers), len(m.hca_layers))
        self._moe_cache: dict[tuple, float] = {}
        self._decode_static: dict[tuple, dict] = {}     # decode_arrays: the parts set by the batch shape
        self._prefill_static: dict[tuple, tuple] = {}   # prefill_arrays: the same, by (rows per rank, requests)
        self._prefill_row: dict[tuple, tuple] = {}      # one prefill row's (bytes, flops) by (tokens, start)
        self._seed: dict[int, tuple] = {}                # seed: (uncalibrated seconds, parts) by rows
        self.moe_bucket = 64                             # token rows per routing draw
        self._row_time: np.ndarray | None = None
        d = self.device
        self.bw = d.hbm_bw * d.hbm_efficiency
        self.f16 = d.bf16_flops * d.compute_efficiency
        self.f8 = d.int8_flops * d.compute_efficiency
        self.link = d.link_bw * d.link_efficiency

    # ---- static weight facts ------------------------------------------------------------------
    def _weights(self, program: str) -> dict:
        drafter_only = program == "l3_dspark_draft_step_device_state"
        dense_bytes = i8 = bf = lm = 0
        expert_bytes = {}
        layers = {}
        for b in bind(program, self.dep, self.slots):
            a = b.arg
            if a.role != WEIGHT or any(g in a.name for g in GATHERED):
                continue
            if "routed_w" in a.name:
                key = "draft" if drafter_only or a.name.startswith("draft_") else "target"
                n_layers = self.m.dspark_num_layers if key == "draft" else self.m.num_hidden_layers
                layers[key] = n_layers
                expert_bytes[key] = expert_bytes.get(key, 0) + b.nbytes_per_rank / (n_layers * self.n_local)
                continue
            dense_bytes += b.nbytes_per_rank
            n = math.prod(b.shape[1:])
            if "lm_head" in a.name:
                lm += n
            elif len(b.shape) >= 3:
                if a.dtype == "i8":
                    i8 += n
                else:
                    bf += n
        return {"dense_bytes": dense_bytes, "i8": i8, "bf": bf, "lm": lm, "expert_bytes": expert_bytes,
                "moe_layers": layers}

    # ---- routing --------------------------------------------------------------------------------
    def _probs(self, layer: int) -> np.ndarray:
        E = self.m.n_routed_experts
        pol = self.routing.policy
        if layer < self.m.num_hash_layers or pol in ("random", "balanced"):
            return np.full(E, 1.0 / E)
        if pol == "skewed":
            p = 1.0 / np.arange(1, E + 1) ** self.routing.skew
            p = np.random.default_rng(layer).permutation(p)
            return p / p.sum()
        row = np.asarray(self.routing.trace[layer], dtype=float)
        return row / row.sum()

    def moe_time(self, tokens: int, key: str = "target", program: str | None = None) -> float:
        """Sum over MoE layers of the slowest EP rank, for `tokens` rows each picking top-k experts."""
        w = self.w[program or self.decode_program]
        n_layers = w["moe_layers"].get(key, 0)
        if not n_layers or tokens <= 0:
            return 0.0
        g = self.moe_bucket
        bucket = -(-tokens // g) * g
        ck = (key, bucket, program)
        if ck not in self._moe_cache:
            ebytes = w["expert_bytes"][key]
            pairs = bucket * self.m.num_experts_per_tok
            E, R = self.m.n_routed_experts, self.R
            # balanced routing draws only the hash-routed layers; the others split the pairs evenly
            drawn = min(n_layers, self.m.num_hash_layers) if self.routing.policy == "balanced" else n_layers
            per = np.full((n_layers, E), pairs / E)
            if drawn:       # one call draws layer after layer: the stream of one draw per layer
                per[:drawn] = self._rng.multinomial(pairs, np.array([self._probs(i) for i in range(drawn)]))
            by_rank = per.reshape(n_layers, R, E // R)
            distinct = (by_rank > 0).sum(axis=2)
            t = np.maximum(distinct * ebytes / self.bw, by_rank.sum(axis=2) * self.expert_flops / self.f8)
            total = 0.0
            for slowest in t.max(axis=1).tolist():    # summed in layer order
                total += slowest
            self._moe_cache[ck] = total
        return self._moe_cache[ck]

    # ---- pieces -----------------------------------------------------------------------------------
    def _dense(self, w: dict, rows: int, logit_rows: int) -> float:
        flops_t = 2 * rows * (w["i8"] / self.f8 + w["bf"] / self.f16) + 2 * logit_rows * w["lm"] / self.f16
        return max(w["dense_bytes"] / self.bw, flops_t)

    def _attn(self, q_rows: int, ctx: float) -> tuple[float, float]:
        """(bytes, flops) for `q_rows` query rows of one request at context `ctx`."""
        m = self.m
        nl, nc, nh = self._layer_counts
        win = np.minimum(ctx, C.SLIDING_WINDOW + q_rows)
        topk = np.minimum(ctx / 4, m.index_topk)
        r = self.row_bytes
        kv_bytes = (nl * win * r["ori"] + nc * (topk * r["cmp_c4"] + ctx / 4 * r["idx"])
                    + nh * ctx / 128 * r["cmp_c128"])
        hd = 2 * 2 * m.num_attention_heads * m.head_dim
        flops = q_rows * (hd * (nl * win + nc * topk + nh * ctx / 128)
                          + nc * 2 * m.index_n_heads * m.index_head_dim * ctx / 4)
        return kv_bytes, flops

    def _comm(self, rows_per_rank: int, n_layers: int) -> float:
        m = self.m
        gather = (self.tp - 1) * rows_per_rank * m.hidden_size * 2
        a2a = rows_per_rank * m.num_experts_per_tok * m.hidden_size * (1 + 2)    # INT8 dispatch, BF16 combine
        return n_layers * ((gather + a2a) / self.link + 3 * self.device.link_latency)

    # ---- dispatches -------------------------------------------------------------------------------
    def prefill(self, groups: list[list[tuple[int, int]]]) -> tuple[float, dict]:
        """One packed prefill dispatch: per group, (chunk tokens, start position) per request
        (`prefill_arrays` over the flattened rows)."""
        tokens = [n for grp in groups for n, _ in grp]
        start = [st for grp in groups for _, st in grp]                 # int or float positions, as given
        group = [g for g, grp in enumerate(groups) for _ in grp]
        if len(tokens) <= self.PREFILL_ROWS_IN_PYTHON:
            return self._prefill_from_rows(tokens, start, group)
        return self.prefill_arrays(np.array(tokens, dtype=np.int64), np.array(start), np.array(group, dtype=np.int64))

    def decode(self, contexts: list[list[float]], owners: list[list[int]]) -> tuple[float, dict]:
        """One decode step: per group, each request's context and owner rank (lease % 4 at K=7)
        (`decode_arrays` over the flattened rows)."""
        group = np.array([g for g, c in enumerate(contexts) for _ in c], dtype=np.int64)
        ctx = np.array([x for c in contexts for x in c])
        owner = np.array([o for os_ in owners for o in os_], dtype=np.int64)
        return self.decode_arrays(ctx, group, owner)

    def _decode_parts(self, w: dict, q: int, active: int, rows_rank: int) -> dict:
        """A decode step's parts set by its shape alone (attention 0.0, in its place: the sum's
        order is the parts' order)."""
        tile = self.R * C.LOCAL_ROWS if self.fixed_tile else active * q
        parts = {"dense": self._dense(w, rows_rank, active * q // max(1, self.R)), "attention": 0.0,
                 "moe": self.moe_time(tile, "target"), "comm": self._comm(rows_rank, self.m.num_hidden_layers),
                 "overhead": self.device.dispatch_overhead}
        if self.dep.k:      # the fused program also redrafts: 3 drafter layers over 7 query rows
            qrows = C.LOCAL_REQUESTS * self.dep.k if self.fixed_tile else rows_rank
            parts["drafter_moe"] = self.moe_time(self.R * qrows, "draft")
            parts["drafter_comm"] = self._comm(qrows, self.m.dspark_num_layers)
        return parts

    # ---- struct-of-arrays forms: the formulas (the list forms above flatten into these) ----------
    def decode_arrays(self, ctx: np.ndarray, group: np.ndarray, owner: np.ndarray) -> tuple[float, dict]:
        """One decode step for requests given as arrays (context, TP group, owner rank): one
        bincount over (group, owner)."""
        q = 1 + self.dep.k
        active = len(ctx)
        cell = group * self.tp + owner
        if self.fixed_tile:
            rows_rank = C.LOCAL_ROWS
        else:
            rows_rank = int(np.bincount(cell, minlength=self.G * self.tp).max()) * q if active else 0
        w = self.w[self.decode_program]
        parts = self._decode_static.get((active, rows_rank))
        if parts is None:
            parts = self._decode_static[(active, rows_rank)] = self._decode_parts(w, q, active, rows_rank)
        parts = dict(parts)
        if active:
            if ctx.dtype.kind in "iu" and ctx.max() < len(self._decode_row_time()):
                per = self._row_time[ctx]          # the same values, looked up by context length
            else:
                per = self._decode_row_seconds(ctx.astype(float))
            parts["attention"] = float(np.bincount(cell, weights=per).max())
        return self.cal.decode * sum(parts.values()), parts

    def _decode_row_seconds(self, ctx: np.ndarray) -> np.ndarray:
        """One decode request's attention time (its KV reads and written rows, or its FLOPs) at
        each context in `ctx` (float)."""
        q = 1 + self.dep.k
        kb, fl = self._attn(q, ctx)
        return (kb + q * self.tok_bytes_all) / self.bw + fl / self.f16

    def _decode_row_time(self) -> np.ndarray:
        """`_decode_row_seconds` at each context 0..max_model_len + 8 (a table built once: the
        formula is elementwise in the context)."""
        if self._row_time is None:
            self._row_time = self._decode_row_seconds(
                np.arange(self.dep.limits.max_model_len + C.DECODE_SEQ + 1, dtype=float))
        return self._row_time

    def prefill_arrays(self, tokens: np.ndarray, start: np.ndarray, group: np.ndarray) -> tuple[float, dict]:
        """One packed prefill dispatch given as arrays (chunk tokens, start, TP group)."""
        n_req = len(tokens)
        if n_req <= self.PREFILL_ROWS_IN_PYTHON:
            return self._prefill_from_rows(tokens.tolist(), start.tolist(), group.tolist())
        per_group = np.bincount(group, weights=tokens, minlength=self.G)
        return self._prefill_total(int(per_group.max()), n_req, self._prefill_attention(tokens, start, group))

    def _prefill_from_rows(self, tokens: list, start: list, group: list) -> tuple[float, dict]:
        per_group, attn = self._prefill_rows(tokens, start, group)
        return self._prefill_total(int(max(per_group)) if tokens else 0, len(tokens), attn)

    def _prefill_total(self, P: int, n_req: int, attn: float) -> tuple[float, dict]:
        """The dispatch's time from its busiest group's tokens `P`, its request count and its
        attention time."""
        w = self.w["l3_prefill_fwd"]
        P = -(-P // self.tp) * self.tp
        L = P // self.tp
        # dense, MoE and comm depend only on the shape (MoE routing is drawn on a bucket's first
        # use, which a shape's first use still is: the draw order is unchanged)
        static = self._prefill_static.get((L, n_req))
        if static is None:
            static = self._prefill_static[(L, n_req)] = (
                self._dense(w, L, n_req), self.moe_time(self.R * L, "target", "l3_prefill_fwd"),
                self._comm(L, self.m.num_hidden_layers))
        dense, moe, comm = static
        parts = {"dense": dense, "attention": attn, "moe": moe, "comm": comm, "overhead": self.device.dispatch_overhead}
        return self.cal.prefill * sum(parts.values()), parts

    # a packed prefill of a few requests is priced faster in Python (per-row values memoised by
    # (tokens, start)) than by ~15 numpy calls; both paths give the same bits (bincount adds its
    # weights in input order, as the loop does)
    PREFILL_ROWS_IN_PYTHON = 128

    def _prefill_attention(self, tokens: np.ndarray, start: np.ndarray, group: np.ndarray) -> float:
        if not len(tokens):
            return 0.0
        n = tokens.astype(float)
        kb, fl = self._attn(n, start + n / 2)
        b = np.bincount(group, weights=kb + n * self.tok_bytes_all, minlength=self.G)
        f = np.bincount(group, weights=fl, minlength=self.G)
        return float(np.maximum(b / self.bw, f / self.tp / self.f16).max())

    def _prefill_rows(self, tokens: list, start: list, group: list) -> tuple[list, float]:
        """(tokens per group, attention time) of `_prefill_attention`'s arithmetic, row by row."""
        G = self.G
        per, b, f = [0] * G, [0.0] * G, [0.0] * G
        rows = self._prefill_row
        for t, s, g in zip(tokens, start, group):
            per[g] += t
            row = rows.get((t, s))
            if row is None:
                if len(rows) >= 1 << 16:        # bounded at long contexts (recomputed, same values)
                    rows.clear()
                n = float(t)
                kb, fl = self._attn(n, s + n / 2)
                row = rows[(t, s)] = (float(kb + n * self.tok_bytes_all), float(fl))
            b[g] += row[0]
            f[g] += row[1]
        if not tokens:
            return per, 0.0
        return per, max(max(x / self.bw, y / self.tp / self.f16) for x, y in zip(b, f))

    def seed(self, rows: int) -> tuple[float, dict]:
        """One bootstrap drafter wave (a seed row per group, its tail context of `rows` rows): set
        by `rows` alone, so priced once per value (MoE routing drawn at its first use, as before)."""
        got = self._seed.get(rows)
        if got is None:
            w = self.w["seed"]
            parts = {"dense": self._dense(w, rows, self.tp), "moe": self.moe_time(self.R * rows, "draft", "seed"),
                     "comm": self._comm(rows, self.m.dspark_num_layers), "overhead": self.device.dispatch_overhead}
            got = self._seed[rows] = (sum(parts.values()), parts)
        return self.cal.seed * got[0], dict(got[1])

    def with_calibration(self, cal: Calibration) -> "CostModel":
        out = CostModel.__new__(CostModel)
        out.__dict__.update(self.__dict__)
        out.cal = cal
        return out
