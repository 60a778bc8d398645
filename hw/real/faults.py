"""Device-side faults for the real-golden lockstep, each with the site it must be localized to.

Only the device side is broken; the golden runs the staged dispatch.  L is a layer index
(0..num_hidden_layers-1); kinds marked "(any L)" ignore it.

Weight and store faults (fire at dispatch AT exactly; nothing happens if AT cannot host them):
    weight   layer L's o_proj output scales (wo_b_scale) doubled during AT (an exponent bit flip
             in HBM)                                                   -> (L, "attn_out")
    route    layer L's router weights (gate_w) perturbed during AT    -> (L, "moe_indices"/"moe_weights")
    kv_row   after AT, one mapped kv_cache row of layer L is off by 0.5 (a bad store)  -> (L, "kv")
    stray    after AT, a kv_cache row of layer L that AT does not map is overwritten (a wild write)
                                                                      -> (L, "kv"), unmapped rows modified
    token    after AT, the first sampled token is replaced (a bad sampler; any L)  -> ("head", "sample")

Kernel and lowering faults (KERNEL_KINDS; each fires once, at the first dispatch >= AT that can host it,
inside the device's own computation, so everything the device reads afterwards in that dispatch
reads the fault, as on a device):
    bitflip              one bit (the exponent MSB) of one positive logits element flips in the
                         target forward's output; the device samples from it (any L) -> ("head", "logits")
    wrong_slot           layer L's raw-KV store puts one token's row one slot past its mapping; the
                         mapped slot keeps its old row, which that dispatch's attention then reads
                                                                      -> (L, "kv")
    dropped_boundary     at a ratio-4 (CSA) or ratio-128 (HCA) boundary of layer L the compressed row
                         is not written; attention reads the old row  -> (L, "cmp_kv")
    off_by_one_position  the device runs a target dispatch with every position one higher (the anchor
                         it derives positions from is off by one): RoPE, compressor boundaries, slots
                         and windows all follow (any L)               -> (0, "q"/"kv")
    flipped_route        one token's last expert in layer L is replaced by the expert its router
                         scores least (never a near-tie the golden could adopt) -> (L, "moe_indices")
    ring_alias           one request's ring page maps to the physical page of another request of the
                         same cache partition: layer L's kind names the ring (SWA: ori, CSA: csa_state,
                         HCA: hca_state); block tables are shared by all layers, so it shows at the first
                         layer of that kind                           -> (first, "kv") or (first, "cmp_kv")
    stale_draft_kv       in a fused K=7 dispatch, the drafter does not rewrite one committed context
                         row of one request (all draft layers): it keeps the query-block KV the previous
                         drafter call wrote there before the verify rejected it, and the drafter's
                         attention reads that stale row (any L)       -> ("drafter", "ctx_kv")
    uncommitted_publish  in a fused K=7 dispatch, one request publishes the verify row just past its
                         accepted length into the drafter's committed context (its count is one too
                         high: the rejected row's hidden at its position, the drafter anchor one later;
                         any L)                                       -> ("drafter", "ctx_kv")

The drafter is a fused dispatch's last stage and reads only the pools the dispatch started with,
the dispatch's target hidden and its acceptance, so the two drafter faults re-run that stage for the
affected group from exactly those inputs with the faulty rows (golden's own `redraft_calls` and
`draft_rows`, a publication fault as a count one too high in the `Accepted` record); the target
faults hook the device's forward (`TapPar.fault`) and its stores (`TorchNumerics.on_write`).

A fault that fired holds `fired` (what it did), `fired_at` (the dispatch) and `expected`
((layer, stages) a correct localization names).  Note what is NOT a fault on this path: the
eager publication of every verify row into the target pools (serving-contract.md 7.5), and an
uncommitted row written into the drafter ring at its own position, which the same drafter call's
query block overwrites before any read (the publication above moves the anchor, as a wrong count
does).

`twin.functional.parity.run_case(kind, seed=, at=, layer=)` runs one injection on a parity run and
says whether it fired, was detected at the dispatch it fired at (and not before) and localized to
`expected`; `sweep_layers(cfg, kind)` are the layers a sweep injects at
(benchmarks/real_fault_sweep.py measures every kind).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from golden.compose import target_hidden
from golden.dspark import step as S
from golden.dspark.state import commit_drafts
from golden.paged import Span, families, lower
from twin.abi.errors import AbiError
from twin.abi.presets import CSA, HCA

from .side import mapped_rows

KERNEL_KINDS = ("bitflip", "stale_draft_kv", "wrong_slot", "dropped_boundary", "off_by_one_position",
                "flipped_route", "uncommitted_publish", "ring_alias")
REAL_KINDS = ("weight", "route", "kv_row", "stray", "token") + KERNEL_KINDS
EXPECTED_STAGES = {"weight": ("attn_out",), "route": ("moe_indices", "moe_weights"), "kv_row": ("kv",),
                   "stray": ("kv",), "token": ("sample",), "bitflip": ("logits",), "stale_draft_kv": ("ctx_kv",),
                   "wrong_slot": ("kv",), "dropped_boundary": ("cmp_kv",), "off_by_one_position": ("q", "kv"),
                   "flipped_route": ("moe_indices",), "uncommitted_publish": ("ctx_kv",),
                   "ring_alias": ("kv", "cmp_kv")}
LAYERLESS = ("token", "bitflip", "off_by_one_position", "stale_draft_kv", "uncommitted_publish")
DRAFTER_KINDS = ("stale_draft_kv", "uncommitted_publish")
RING_OF_KIND = {"swa": ("ori", "kv"), "csa": ("csa_state", "cmp_kv"), "hca": ("hca_state", "cmp_kv")}


class _FaultyCheckpoint:
    def __init__(self, base, fault):
        self.base, self.fault = base, fault

    def __getattr__(self, name):
        return getattr(self.base, name)

    def layer(self, layer):
        w = self.base.layer(layer)
        f = self.fault
        if not f.armed or layer != f.layer or f.kind not in ("weight", "route"):
            return w
        w = dict(w)
        if f.kind == "weight":
            w["wo_b_scale"] = np.asarray(w["wo_b_scale"]) * np.float32(2.0)
        else:
            rng = np.random.default_rng(f.seed)
            g = np.asarray(w["gate_w"], np.float32)
            w["gate_w"] = (g + rng.standard_normal(g.shape).astype(np.float32) * np.abs(g).max()).astype(g.dtype)
        f._fire(f"{f.kind} at dispatch {f.at}, layer {layer}", str(layer))
        return w


@dataclass
class RealFault:
    kind: str
    at: int = 0
    layer: int = 0
    seed: int = 0
    persistent: bool = False           # fire on every dispatch >= AT that can host it (a broken unit), same choices
    armed: bool = False
    fired: str | None = None
    fired_at: int | None = None
    expected: tuple | None = None      # (layer, stages) of a correct localization, once fired
    _side: object = field(default=None, repr=False)
    _index: int = field(default=-1, repr=False)
    _sites: dict = field(default_factory=dict, repr=False)
    _pools: list = field(default_factory=list, repr=False)
    _now: bool = field(default=False, repr=False)      # fired in the dispatch armed last

    def spec(self) -> dict:
        """What configures the fault, as run.json, summary.json and records/config.json hold it."""
        return {"kind": self.kind, "at": self.at, "layer": self.layer, "seed": self.seed,
                "persistent": self.persistent}

    def __post_init__(self):
        if self.kind not in REAL_KINDS:
            raise AbiError("kind", self.kind, f"one of {REAL_KINDS}", where="hw.real fault")
        if self.at < 0 or self.layer < 0:
            raise AbiError("at/layer", (self.at, self.layer), "non-negative", where="hw.real fault")
        self.rng = np.random.default_rng(self.seed)

    # ---- wiring ------------------------------------------------------------------------------------
    def attach(self, side) -> None:
        cfg = side.g.cfg
        n = cfg.num_hidden_layers
        if self.layer >= n:
            raise AbiError("layer", self.layer, f"0..{n - 1}", where="hw.real fault")
        if self.kind == "dropped_boundary":
            cmp = sorted(cfg.csa_layers + cfg.hca_layers)
            if self.layer not in cmp:
                raise AbiError("layer", self.layer, f"a compressed layer (ratio {CSA} or {HCA}): one of {cmp}",
                               where="hw.real fault dropped_boundary")
        if self.kind in ("wrong_slot", "dropped_boundary"):
            if not hasattr(side.g.nm, "on_write"):
                raise AbiError("device numerics", type(side.g.nm).__name__,
                               "hw.real.TorchNumerics (its store hook)", where=f"hw.real fault {self.kind}")
            side.g.nm.on_write.append(self._on_write)
        self._side = side
        side.g.ckpt = _FaultyCheckpoint(side.g.ckpt, self)
        side.par.fault = self

    def arm(self, index: int) -> None:
        self._index, self._sites, self._now = index, {}, False
        if self.persistent:
            self.armed = index >= self.at
            self.rng = np.random.default_rng(self.seed)      # the same unit breaks the same way each time
        elif self.kind in KERNEL_KINDS:
            self.armed = self.fired is None and index >= self.at
        else:
            self.armed = index == self.at
        if self.armed and self.kind in DRAFTER_KINDS and self._side.run.pools is not None:
            self._pools = list(self._side.run.pools)     # pools are replaced, never mutated: references suffice

    @property
    def _fresh(self) -> bool:
        """Not fired yet: in this dispatch (persistent) or at all (once)."""
        return not self._now if self.persistent else self.fired is None

    def _fire(self, what: str, layer: str, stages=None) -> None:
        self._now = True
        if self.fired is None:
            self.fired, self.fired_at = what, self._index
            self.expected = (layer, tuple(stages or EXPECTED_STAGES[self.kind]))

    def _live(self, kind) -> bool:
        return self.armed and self.kind == kind and self._fresh

    # ---- hooks inside the device's target forward (TapPar.target_forward) -----------------------------
    def on_forward(self, meta, caches):
        """The meta the device runs instead of the staged one; remembers which pool is which."""
        # the pools this forward starts from (each layer writes each pool once, from these very arrays);
        # holding them keeps their ids from being reused by another array while the forward runs
        self._sites = {id(arr): (l, name, arr) for l, pools in enumerate(caches) for name, arr in pools.items()}
        if self._live("off_by_one_position"):
            cfg = self._side.g.cfg
            spans = self._spans(meta, shift=1)
            if max(s.start + s.n for s in spans) <= cfg.max_position_embeddings:
                self._fire(f"off_by_one_position at dispatch {self._index}: {len(spans)} requests at +1", "0")
                return lower(cfg, spans, form=meta.form)
        if self._live("ring_alias"):
            return self._ring_alias(meta)
        return meta

    def _spans(self, meta, shift=0, blocks=None):
        blocks = blocks or self._side.run.blocks
        _, first = np.unique(meta.req, return_index=True)
        out = []
        for b in meta.req[np.sort(first)]:
            rows = np.flatnonzero(meta.req == b)
            out.append(Span(int(b), int(meta.first_pos[b]) + shift, tuple(int(t) for t in meta.input_ids[rows]),
                            blocks[int(b)]))
        return out

    def _ring_alias(self, meta):
        side, cfg = self._side, self._side.g.cfg
        kind = cfg.layer_kind(self.layer)
        fam, stage = RING_OF_KIND[kind]
        first = min(l for l in range(cfg.num_hidden_layers) if cfg.layer_kind(l) == kind)
        seqs = {s.index: s for s in side.run.seqs}          # block-table row -> request
        page = families(cfg)[fam].page_tokens
        blocks_of = side.run.blocks
        pairs = []
        for a in (int(r) for r in np.unique(meta.req)):
            mine = blocks_of[a].get(fam, ())
            j = (int(meta.first_pos[a]) // page) % len(mine) if mine else 0
            # a page of another request of the partition, not one the two share (a prefix hit)
            pairs += [(a, b, j) for b in sorted(seqs) if b != a and seqs[b].group == seqs[a].group
                      and len(blocks_of[b].get(fam, ())) > j and blocks_of[b][fam][j] != mine[j]]
        if not pairs:
            return meta
        a, b, j = pairs[int(self.rng.integers(len(pairs)))]
        mine = list(blocks_of[a][fam])
        other = blocks_of[b][fam][j]
        mine[j] = other
        blocks = list(side.run.blocks)
        blocks[a] = {**blocks[a], fam: mine}
        self._fire(f"ring_alias at dispatch {self._index}: request {a}'s {fam} ring entry {j} -> page {other} "
                   f"of request {b}", str(first), (stage,))
        return lower(cfg, self._spans(meta, blocks=blocks), form=meta.form)

    def moe_hook(self, taps, ckpt, *, cfg):
        if not self._live("flipped_route"):
            return None
        from golden.kernels.moe import moe_experts

        def moe(x_i8, x_scale, idx, wts, expert, shared, *, cfg, nm):
            if taps.layer == self.layer and self._fresh:
                idx = self._flip(np.array(idx), taps[(self.layer, "ffn_x_mixed")], ckpt.layer(self.layer), cfg)
                taps.put(self.layer, "moe_indices", idx)
            return moe_experts(x_i8, x_scale, idx, wts, expert, shared, cfg=cfg, nm=nm)
        return moe

    def _flip(self, idx, x_mixed, lw, cfg):
        t = int(self.rng.integers(idx.shape[0]))
        x = np.asarray(x_mixed, np.float64)[t]
        inv_rms = 1.0 / np.sqrt(np.mean(x * x) + cfg.rms_norm_eps)
        logits = inv_rms * ((x * np.asarray(lw["norm_w"], np.float64)) @ np.asarray(lw["gate_w"], np.float64).T)
        score = np.sqrt(np.maximum(logits, 0) + np.log1p(np.exp(-np.abs(logits))))
        if lw.get("gate_bias") is not None:
            score = score + np.asarray(lw["gate_bias"], np.float64)
        score[idx[t].astype(np.int64)] = np.inf
        old, new = int(idx[t, -1]), int(np.argmin(score))
        idx[t, -1] = new
        self._fire(f"flipped_route at dispatch {self._index}: layer {self.layer} token row {t} expert {old} -> {new}",
                   str(self.layer))
        return idx

    def on_output(self, out, taps):
        self._sites = {}                               # stores after the forward (the drafter's) are not its
        if not self._live("bitflip"):
            return out
        logits = np.array(out.logits)
        v32 = logits.astype(np.float32)
        ok = (v32 > 0) & (v32 < 2) & (np.arange(v32.shape[1])[None, :] != v32.argmax(-1)[:, None])
        rows = np.flatnonzero(ok.any(-1))
        if not rows.size:
            return out
        r = int(rows[self.rng.integers(rows.size)])
        c = int(np.flatnonzero(ok[r])[np.argmin(v32[r][ok[r]])])     # the smallest: far below the row's best
        bits = v32[r:r + 1, c:c + 1].copy().view(np.uint32)
        bits ^= np.uint32(1 << 30)
        logits[r, c] = bits.view(np.float32)[0, 0]
        out.logits = logits
        out.sampled = logits.argmax(-1).astype(np.asarray(out.sampled).dtype)
        taps.put("head", "logits", logits)
        self._fire(f"bitflip at dispatch {self._index}: logits[{r}, {c}] {float(v32[r, c]):.4g} -> "
                   f"{float(logits[r, c]):.4g}", "head")
        return out

    def _on_write(self, pool, slots):
        """TorchNumerics.on_write: the device's stores of layer L's raw KV or compressed rows."""
        if not self.armed or not self._fresh or self.kind not in ("wrong_slot", "dropped_boundary"):
            return slots
        site = self._sites.get(id(pool))
        want = ("kv_cache",) if self.kind == "wrong_slot" else ("csa_cmp_kv", "hca_cmp_kv")
        if site is None or site[2] is not pool or site[0] != self.layer or site[1] not in want:
            return slots
        slots = np.array(slots, np.int64)
        live = np.flatnonzero(slots >= 0)
        if self.kind == "wrong_slot":
            nrows = pool.shape[0] * pool.shape[1]
            taken = set(slots[live].tolist())
            live = np.array([t for t in live if slots[t] + 1 < nrows and slots[t] + 1 not in taken], np.int64)
        if not live.size:
            return slots
        t = int(live[self.rng.integers(live.size)])
        s = int(slots[t])
        slots[t] = s + 1 if self.kind == "wrong_slot" else -1
        what = f"row -> slot {s + 1}" if self.kind == "wrong_slot" else "not written"
        self._fire(f"{self.kind} at dispatch {self._index}: layer {self.layer} {site[1]} slot {s} {what}",
                   str(self.layer))
        return slots

    # ---- after the device's dispatch ------------------------------------------------------------------
    def after(self, side, rd, out: dict, acc=None) -> dict:
        """The device's outputs of dispatch `rd`, faulted; acc: its `Accepted` record (a fused step's)."""
        if not self.armed:
            return out
        self.armed = False
        if self.kind in DRAFTER_KINDS:
            return self._redraft(side, rd, out, acc) if self._fresh else out
        if self.kind == "token":
            name = next(k for k in ("sampled_ids", "accepted_ids") if k in out) if rd.kind != "seed" else None
            if name is None:
                return out
            out = dict(out)
            v = np.array(out[name])
            v.reshape(-1)[0] = (v.reshape(-1)[0] + 1) % side.g.cfg.vocab_size
            out[name] = v
            self._fire(f"token at dispatch {self.at}: {name}[0]", "head")
        elif self.kind in ("kv_row", "stray"):
            pools = dict(side.run.caches[self.layer])
            kv = np.array(pools["kv_cache"])
            flat = kv.reshape(-1, kv.shape[-1])
            mapped = mapped_rows(side.par.calls)["kv_cache"]
            if self.kind == "kv_row" and not mapped.size:
                return out                      # a seed dispatch writes no target row: nothing to corrupt
            if self.kind == "kv_row":
                row = int(mapped[len(mapped) // 2])
                flat[row] = (flat[row].astype(np.float32) + 0.5).astype(flat.dtype)
            else:
                row = int(np.setdiff1d(np.arange(flat.shape[0]), mapped)[-1])
                # persistent: other garbage each time (the same bytes again would change nothing)
                junk = 3.0 + (self._index % 2 if self.persistent else 0)
                flat[row] = np.asarray(np.full(flat.shape[1], junk, np.float32)).astype(flat.dtype)
            pools["kv_cache"] = kv
            side.run.caches[self.layer] = pools
            self._fire(f"{self.kind} at dispatch {self.at}: layer {self.layer} kv_cache row {row}", str(self.layer))
        return out

    def _redraft(self, side, rd, out: dict, acc, edit: str | None = "fault") -> dict:
        """Re-run one group's drafter stage of fused dispatch `rd` from the pools it started with, one
        request's drafter row faulty (see the module docstring); acc: the dispatch's `Accepted` record
        on the device side.  edit=None re-runs it unchanged (the tests check that this reproduces the
        device's own drafter stage bit for bit)."""
        if rd.kind != "decode" or acc is None or not self._pools:
            return out
        g, run = side.g, side.run
        meta, taps, sampled = side.par.calls[-1]
        by_row = {s.index: s for s in run.seqs}
        seqs = [by_row[i] for i in rd.rows]
        rows_of = [np.flatnonzero(meta.req == s.index) for s in seqs]    # each request's verify rows
        width = [r.size for r in rows_of]
        mh = np.asarray(target_hidden(taps, g.ckpt.model(), cfg=g.cfg, nm=g.nm, tap=g.drafter.target_hidden_tap))
        refs, owners = [s.ref for s in seqs], [S.owner_rank(s, g.tp) for s in seqs]
        calls = S.redraft_calls(acc, refs, owners, mh, width)
        edit = self.kind if edit == "fault" else edit
        stale = edit == "stale_draft_kv"
        # a request that finished this dispatch has already given its lease back: its drafter row
        # still ran (and is re-run below), but nothing is committed for it, so it cannot host a fault
        cands = [(j, i) for j, (_, mine, _, _) in enumerate(calls) for i in mine if not seqs[i].released
                 and (stale or (acc.counts[i] < width[i] and acc.old_anchor[i] + acc.counts[i] + S.QW
                                < g.max_model_len))]
        if not cands:
            return out
        at, pick = cands[int(self.rng.integers(len(cands)))]
        grp, mine, rows, hidden = calls[at]
        s, c, old = seqs[pick], int(acc.counts[pick]), int(acc.old_anchor[pick])
        if edit is None:
            pass
        elif stale:
            drop = int(self.rng.integers(c))
            k = mine.index(pick)
            first = sum(len(r.context_positions) for r in rows[:k]) + drop
            rows = list(rows)
            rows[k] = replace(rows[k], context_positions=tuple(p for p in rows[k].context_positions if p != old + drop))
            hidden = np.delete(hidden, first, axis=0)
            what = f"request {s.req.request_id} context row at position {old + drop} not rewritten (stale)"
        else:
            # the count one too high: the rejected verify row's hidden and its sample join the context
            one = np.arange(len(seqs)) == pick
            nxt = np.where(one, int(np.asarray(sampled)[rows_of[pick][c]]), acc.next_token)
            wrong = replace(acc, counts=acc.counts + one, drafter_anchor=acc.drafter_anchor + one, next_token=nxt)
            grp, mine, rows, hidden = S.redraft_calls(wrong, refs, owners, mh, width)[at]
            what = f"request {s.req.request_id} verify row at position {old + c} (beyond {c} accepted) published"
        dr = side.par.draft_routes
        n0, at = len(dr), at * g.cfg.dspark_num_layers
        run.pools[grp] = self._pools[grp]
        drafts, conf = S.draft_rows(g, run, grp, rows, hidden, num_sampled=1)
        # the re-run's drafter routes replace the first run's (the golden adopts drafter ties call by call)
        new = dr[n0:]
        del dr[n0:]
        dr[at:at + len(new)] = new
        live = [j for j, i in enumerate(mine) if not seqs[i].released]
        if live:
            run.state = commit_drafts(run.state, [refs[mine[j]] for j in live], drafts[live])
        for i, cf in zip(mine, conf):
            seqs[i].confidence_logit = cf
        out = dict(out)
        out["drafts"] = np.stack([run.state.tokens[s.group, s.lease] for s in seqs])
        out["state_meta"] = np.stack([run.state.meta[s.group, s.lease] for s in seqs])
        if edit is not None:
            self._fire(f"{self.kind} at dispatch {self._index}: group {grp} {what}", "drafter")
        return out


# ---- measuring detection and localization ------------------------------------------------------------
def sweep_layers(cfg, kind: str) -> tuple[int, ...]:
    """Layers a sweep injects `kind` at: first, middle and last layer; for dropped_boundary the first
    CSA, first HCA and last compressed layer; for ring_alias one layer of each kind (one ring each)."""
    n = cfg.num_hidden_layers
    if kind in LAYERLESS:
        return (0,)
    if kind == "dropped_boundary":
        last = max(cfg.csa_layers + cfg.hca_layers)
        return tuple(dict.fromkeys((min(cfg.csa_layers), min(cfg.hca_layers), last)))
    if kind == "ring_alias":
        return tuple(min(ls) for ls in (cfg.swa_layers, cfg.csa_layers, cfg.hca_layers))
    return tuple(dict.fromkeys((0, n // 2, n - 1)))
