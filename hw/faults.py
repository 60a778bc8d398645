"""A fault-injecting backend: wraps a device backend and breaks one dispatch in one of the ways
real kernels and lowering break (serving-contract.md's known failures), so the lockstep can be
shown to catch every kind and to localize it.

Each fault knows the site (layer, stage) where a correct localization must point.  A fault is
armed at dispatch index `at` and fires on the first dispatch from there on where it can apply
(a dropped compressed-boundary write needs a boundary, an uncommitted publication needs a request
that rejected a draft); `fired` then holds the dispatch index, the site and what was done.

Kinds:
  bitflip              flip the exponent MSB of one logits element (an output)
  stale_draft_kv       one drafter context row keeps its old value (a skipped ctx-KV write)
  wrong_slot           one raw-KV row lands one slot past its mapping
  dropped_boundary     one CSA compressed-boundary row is never written
  off_by_one_position  one row's position is off by one inside the kernel (RoPE)
  flipped_route        one token's expert route is replaced by another expert
  uncommitted_publish  one uncommitted (rejected) verify row is published to the drafter context
  ring_alias           one compressor-state write uses half the ring modulus and aliases a live row
  nan_output           a NaN appears in the target-hidden output
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from twin.abi.batches import Dispatch
from twin.abi.errors import AbiError

from .backend import StepResult
from .model.spec import (CSA_STATE_PAGE, CSA_STATE_PAGES, LEASE_BLOCKS, PROGRAM_FUSED, PROGRAM_SEED,
                         ROWS_PER_VERIFY, Geometry, draft_layer, target_layer)

KINDS = ("bitflip", "stale_draft_kv", "wrong_slot", "dropped_boundary", "off_by_one_position", "flipped_route",
         "uncommitted_publish", "ring_alias", "nan_output")


def split_fault(spec: str) -> tuple[str, int, int]:
    """'KIND', 'KIND@AT' or 'KIND@AT:LAYER' -> (kind, at, layer): AT a dispatch index, LAYER a layer
    index (both integers >= 0, 0 when left out); the fault kinds of each golden check KIND."""
    kind, _, rest = spec.partition("@")
    at, _, layer = rest.partition(":")
    try:
        at, layer = int(at or 0), int(layer or 0)
    except ValueError:
        at = layer = -1
    if at < 0 or layer < 0:
        raise AbiError("--inject", spec, "KIND[@AT[:LAYER]] with integers AT >= 0 and LAYER >= 0", where="lockstep")
    return kind, at, layer


@dataclass
class Fault:
    kind: str
    at: int = 0
    layer: int = 0            # which layer of the family the fault hits (taken modulo the family size)
    seed: int = 0
    fired: dict | None = field(default=None)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise AbiError("fault", self.kind, f"one of {KINDS}", where="FaultBackend")
        if self.at < 0:
            raise AbiError("at", self.at, ">= 0 (a dispatch index)", where="FaultBackend")


def _flat(a):
    return a.reshape(-1, a.shape[-1])


class FaultBackend:
    def __init__(self, inner, geo: Geometry, fault: Fault):
        self.inner, self.geo, self.fault = inner, geo, fault
        self.name = f"{inner.name}+fault:{fault.kind}"

    def run(self, d: Dispatch, state) -> StepResult:
        f = self.fault
        if f.fired is not None or int(d.meta.get("index", 0)) < f.at:
            return self.inner.run(d, state)
        plan = getattr(self, "_" + f.kind)(d, state, np.random.default_rng(f.seed))
        if plan is None:
            return self.inner.run(d, state)
        site, args, hooks, post = plan
        dd = Dispatch(d.program, args, d.meta) if args is not None else d
        r = self.inner.run(dd, state, hooks=hooks) if hooks else self.inner.run(dd, state)
        detail = post(r) if post else {}
        if detail is None:           # the hook found nothing to break after all
            return self.inner.run(d, state)
        f.fired = {"dispatch": int(d.meta.get("index", 0)), "program": d.program, "kind": f.kind,
                   "layer": site[0], "stage": site[1], **(detail or {})}
        return r

    # ---- helpers ----------------------------------------------------------------------------------
    def _targets(self, d):
        return d.program != PROGRAM_SEED

    def _csa_layer(self):
        layers = self.geo.cfg.csa_layers
        i = self.fault.layer % len(layers)
        return i, layers[i]

    # ---- the kinds: each returns (site, args or None, hooks or None, post(result) -> detail) or None --------
    def _bitflip(self, d, state, rng):
        if not self._targets(d) or len(d.args["logit_row_indices"]) == 0:
            return None

        def post(r):
            lg = r.outputs["logits"]
            small = np.argwhere(np.abs(lg) < 2.0)        # exponent MSB clear: the flip makes it huge
            row, col = small[rng.integers(len(small))]
            v = lg.view(np.uint32)
            v[row, col] ^= np.uint32(1 << 30)
            return {"row": int(row), "col": int(col)}
        return ("head", "logits"), None, None, post

    def _stale_draft_kv(self, d, state, rng):
        if d.program not in (PROGRAM_SEED, PROGRAM_FUSED):
            return None
        dl = self.fault.layer % self.geo.cfg.dspark_num_layers
        a = d.args

        def post(r):
            if d.program == PROGRAM_SEED:
                i = int(rng.integers(len(a["ctx_positions"])))
                p, q = int(a["ctx_positions"][i]), int(a["ctx_req"][i])
            else:                       # a committed verify row published this step
                acc = r.outputs["accepted_counts"]
                q = int(rng.integers(len(acc)))
                p = int(a["position_ids"][q * ROWS_PER_VERIFY + int(rng.integers(acc[q]))])
            slot = a["lease_block_table"][q, (p // 32) % LEASE_BLOCKS] * 32 + p % 32
            row = dl * self.geo.region_rows("draft_kv") + int(slot)
            _flat(r.state["draft_kv"])[row] = _flat(state["draft_kv"])[row]
            return {"row": row, "position": p}
        return (draft_layer(dl), "ctx_kv"), None, None, post

    def _wrong_slot(self, d, state, rng):
        if not self._targets(d):
            return None
        l = self.fault.layer % self.geo.cfg.num_hidden_layers
        sm = d.args["swa_slot_mapping"]
        mapped = set(sm[sm >= 0].tolist())
        cands = [t for t in range(len(sm)) if sm[t] >= 0 and sm[t] + 1 not in mapped
                 and (sm[t] + 1) % self.geo.region_rows("kv_cache")]
        if not cands:
            return None
        t = cands[int(rng.integers(len(cands)))]
        base = l * self.geo.region_rows("kv_cache")
        s = base + int(sm[t])

        def post(r):
            pool, before = _flat(r.state["kv_cache"]), _flat(state["kv_cache"])
            pool[s + 1] = pool[s]
            pool[s] = before[s]
            return {"row": int(t), "slot": int(sm[t]), "written_to": int(sm[t]) + 1}
        return (target_layer(l), "kv_write"), None, None, post

    def _dropped_boundary(self, d, state, rng):
        if not self._targets(d):
            return None
        ci, l = self._csa_layer()
        csm = d.args["csa_cmp_slot_mapping"]
        rows = np.flatnonzero(csm >= 0)
        if not len(rows):
            return None
        t = int(rows[rng.integers(len(rows))])
        s = ci * self.geo.region_rows("csa_cmp_kv") + int(csm[t])

        def post(r):
            _flat(r.state["csa_cmp_kv"])[s] = _flat(state["csa_cmp_kv"])[s]
            return {"row": t, "position": int(d.args["position_ids"][t])}
        return (target_layer(l), "compress"), None, None, post

    def _off_by_one_position(self, d, state, rng):
        if not self._targets(d):
            return None
        a = d.args
        pos, req = a["position_ids"], a["row_req"]
        first = np.r_[True, req[1:] != req[:-1]]
        # a row that is neither a request's first row (it anchors the verify) nor a compressed boundary
        ok = ~first & ((pos + 1) % 4 != 0) & ((pos + 2) % 4 != 0)
        cands = np.flatnonzero(ok)
        if not len(cands):
            return None
        t = int(cands[rng.integers(len(cands))])
        args = dict(a)
        args["position_ids"] = pos.copy()
        args["position_ids"][t] += 1
        return (target_layer(0), "qkv"), args, None, lambda r: {"row": t, "position": int(pos[t])}

    def _flipped_route(self, d, state, rng):
        if not self._targets(d):
            return None
        m = self.geo.cfg
        routed = [l for l in range(m.num_hidden_layers) if l >= m.num_hash_layers]
        l = routed[self.fault.layer % len(routed)]
        t = int(rng.integers(len(d.args["input_ids"])))
        done = {}

        def hook(route, taps):
            import torch

            route = route.clone()
            w = self.inner.step.w
            # the least likely expert: never a near-tie the golden could re-sync
            score = torch.sqrt(torch.nn.functional.softplus(taps[(target_layer(l), "ffn_norm")][t] @ w["gate_w"][l].T))
            score = score + w["gate_bias"][l]
            score[route[t].long()] = float("inf")
            new = int(score.argmin())
            done.update(row=t, old=int(route[t, -1]), new=new)
            route[t, -1] = new
            return route
        return (target_layer(l), "route"), None, {(target_layer(l), "route"): hook}, lambda r: dict(done)

    def _uncommitted_publish(self, d, state, rng):
        if d.program != PROGRAM_FUSED:
            return None
        done = {}

        def hook(pub, taps):
            q = (pub < ROWS_PER_VERIFY).nonzero().flatten()
            if not len(q):
                return pub
            q = int(q[0])
            pub = pub.clone()
            pub[q] += 1
            done.update(request=q, published=int(pub[q]))
            return pub
        return ("head", "publish"), None, {("head", "publish"): hook}, lambda r: dict(done) if done else None

    def _ring_alias(self, d, state, rng):
        if not self._targets(d):
            return None
        ci, l = self._csa_layer()
        a = d.args
        ssm, pos, req = a["csa_state_slot_mapping"], a["position_ids"], a["row_req"]
        table = a["csa_state_block_table"]
        half = CSA_STATE_PAGES // 2
        alias = np.array([table[req[t], (pos[t] // CSA_STATE_PAGE) % half] * CSA_STATE_PAGE + pos[t] % CSA_STATE_PAGE
                          for t in range(len(pos))])
        cands = np.flatnonzero((ssm >= 0) & (alias != ssm))
        if not len(cands):
            return None
        t = int(cands[rng.integers(len(cands))])
        base = ci * self.geo.region_rows("csa_compress_state")
        s, s_alias = base + int(ssm[t]), base + int(alias[t])

        def post(r):
            st, before = _flat(r.state["csa_compress_state"]), _flat(state["csa_compress_state"])
            st[s_alias] = st[s]
            st[s] = before[s]
            return {"row": t, "position": int(pos[t]), "slot": int(ssm[t]), "aliased_slot": int(alias[t])}
        return (target_layer(l), "compress_state"), None, None, post

    def _nan_output(self, d, state, rng):
        if not self._targets(d):
            return None
        m = self.geo.cfg

        def post(r):
            h = r.outputs["dspark_target_hidden"]
            t = int(rng.integers(h.shape[0]))
            h[t, int(rng.integers(h.shape[1]))] = np.nan
            return {"row": t}
        return (target_layer(m.dspark_target_layer_ids[0]), "moe_out"), None, None, post
