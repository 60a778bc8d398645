"""The independent torch device (`hw.torchdev.TorchBackend`) behind the lockstep's device side.

The lockstep keeps both sides' pools in golden's layout (one pool per cache family, every
partition's pages in it, `golden.staging.PageMap`) and judges outputs and taps in golden's row
order.  `TorchBackend` takes and gives the ABI's per-rank arrays.  This adapter converts between
the two around each dispatch: golden-layout pools -> per-rank STATE arguments (`hw.golden_args`),
the device's touched pools -> golden layout again (each partition's pages from its group leader's
replica), its outputs and (layer, stage) taps -> golden's rows (packed prefill: the request's band
rows on its group's ranks; decode: the request's verify row on its owner rank; logits: the
request's logit entry, the full vocabulary).

The adapter also keeps the served requests' bookkeeping (anchor, current token, generated tokens,
the captured hidden tail) from the device's own samples, through golden's own commit rules
(`golden.dispatch.commit_prefill`, `golden.dspark.step.advance`), so what the scheduler commits is
the torch device's.  At K=7 a seeding wave runs `l3_dspark_draft_step_device_state` (its context rows
the device side's captured tail, the host then seeding each slot as golden's `commit_seed` does) and
a decode the fused `l3_decode_fwd_dspark` on the per-rank K=7 state (`state_tokens`, `state_meta`:
the group's slots on each of its ranks) and drafter pools (`draft_kv_caches`: the group's pool on
each of its ranks), its acceptance committed through golden's `commit_verify`.
"""
from __future__ import annotations

from typing import Mapping

import ml_dtypes
import numpy as np

from golden.dispatch import commit_prefill, placement_order
from golden.dspark.state import DRAFTS, Accepted, DeviceState, prepare
from twin.abi import constants as C
from golden.dspark.step import advance, commit_seed, commit_verify
from twin.abi.errors import AbiError
from twin.abi.programs import STATE, bind

from ..golden_args import pool_layers, stage_pools, stage_weights, unstage_rows
from .step import DeviceResult
from .side import install_state, side_state

PROGRAMS = {("prefill", 0): "l3_prefill_fwd", ("decode", 0): "l3_decode_fwd", ("prefill", 7): "l3_prefill_fwd",
            ("seed", 7): "l3_dspark_draft_step_device_state", ("decode", 7): "l3_decode_fwd_dspark"}
K7_POOLS = ("drafter", "device_state")
FUSED = "l3_decode_fwd_dspark"


def _extents(d) -> dict:
    if d.program == "l3_prefill_fwd":
        from hw.torchdev.prefill import extents
    elif d.program == "l3_decode_fwd_dspark":
        from hw.torchdev.decode_dspark import extents
    elif d.program == "l3_dspark_draft_step_device_state":
        from hw.torchdev.bootstrap import extents
    else:
        return {}
    return extents(d)


def _bf16_bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def _to_golden(rows: np.ndarray, abi_dtype: str, like: np.ndarray) -> np.ndarray:
    """ABI rows (BF16 as bit patterns) in golden's pool dtype and page shape."""
    rows = np.asarray(rows)
    if abi_dtype == "bf16":
        rows = rows.view(ml_dtypes.bfloat16)
    return rows.astype(like.dtype).reshape(like.shape)


def _widen(x: np.ndarray) -> np.ndarray:
    """An ABI BF16 output (bit patterns) as float32."""
    x = np.asarray(x)
    return (x.astype(np.uint32) << 16).view(np.float32) if x.dtype == np.uint16 else x


class TorchLockstepDevice:
    """side: the device side (`hw.real.side.Side`): golden-layout pools and request bookkeeping,
    never golden's numbers; the dispatch runs on `TorchBackend(dep, slots, device)` with the
    checkpoint's weights staged per program.  nproc > 1: this process is process 0 of that many
    torch.distributed processes holding rank slices (`hw.launch.torch_device_ranks`)."""

    def __init__(self, side, ctx, device: str, ckpt, dckpt=None, nproc: int = 1):
        from hw.torchdev import Ranks, TorchBackend

        self.side, self.ctx, self.dep, self.slots = side, ctx, ctx.deployment, ctx.slots
        if self.dep.k and dckpt is None:
            raise AbiError("dckpt", None, "the drafter checkpoint at K=7", where="lockstep")
        self.torch = TorchBackend(self.dep, self.slots, device, ranks=Ranks.split(self.dep.ranks, 0, nproc),
                                  weights=lambda program: stage_weights(program, self.dep, self.slots, ckpt, dckpt))
        self.embedding = np.asarray(ckpt.model()["embed_weight"], np.float32)
        self.device = device
        self.name = f"torch:{self.torch.name}"

    # ---- the request lifecycle (the bookkeeping golden's served run keeps per request) -------------
    def admit(self, rid, prompt, max_new_tokens) -> None:
        self.side.served.admit(rid, prompt, max_new_tokens)

    def drop(self, rid) -> None:
        self.side.served.drop(rid)

    # ---- one dispatch ------------------------------------------------------------------------------
    def run(self, dispatch, state: Mapping[str, np.ndarray]) -> DeviceResult:
        side = self.side
        if any(state[k] is not v for k, v in side_state(side).items()):
            install_state(side, dict(state))
        kind, items = dispatch.meta["kind"], list(dispatch.meta["items"])
        want = PROGRAMS.get((kind, self.dep.k))
        if want != dispatch.program:
            raise AbiError("program", dispatch.program, f"{want} for a {kind} dispatch at K={self.dep.k}",
                           where=self.name)
        sv = side.served
        if kind == "prefill":
            dispatch = self._embedded(dispatch, items)
            items = placement_order(dispatch, items)
        if kind == "seed":
            seqs = [sv.seqs[it.request_id] for it in items]
            dispatch = self._with_tails(dispatch, seqs)
        else:
            seqs = [sv.bind(it.request_id, it.partition, it.lease, it.generation, it.block_ids) for it in items]
        ext = _extents(dispatch)
        pools = stage_pools(dispatch.program, self.dep, self.slots, self.ctx, sv.run.caches, **ext)
        pools.update(self._stage_k7(dispatch.program, ext))
        self._prep = prepare(sv.run.state, [s.ref for s in seqs]) if dispatch.program == FUSED else None
        res = self.torch.run(dispatch, pools)
        before = side_state(side)
        self._unstage_k7(res.state)
        if kind == "seed":
            return self._seeded(dispatch, items, seqs, res, before)
        caches = self._unstage(dispatch.program, res.state, sv.run.caches)
        tok, logit = self._rows(dispatch, items)
        taps = {}
        for site, v in res.taps.items():
            rows = logit if site == ("head", "logits") else tok
            taps[site] = np.stack([v[r, i] for r, i in rows])
        sampled = np.array([int(res.outputs["sampled_ids"][r, i, 0]) for r, i in logit], np.int64)
        sv.run.caches = caches
        if dispatch.program == FUSED:
            out = self._verified(dispatch, items, seqs, res)
        elif kind == "prefill":
            mh = np.stack([_widen(res.outputs["dspark_target_hidden"][r, i]) for r, i in tok])
            commit_prefill(seqs, items, sampled, mh)
            out = {"sampled_ids": sampled, "main_hidden": mh}
        else:
            for it, s, t in zip(items, seqs, sampled):
                s.anchor = int(it.anchor)          # the staged position, as golden's split decode runs
                advance(s, t)
            sv.run.steps += 1
            out = {"sampled_ids": sampled}
        after = side_state(side)
        routes = []
        if dispatch.program == FUSED:
            calls: dict = {}
            for it, s, red in zip(items, seqs, out.pop("redraft")):
                if red:
                    pl = dispatch.meta["placement"][it.request_id]
                    calls.setdefault(s.group, []).append((pl["rank"], pl["local_row"]))
            routes = self._draft_routes(res.taps, [calls[g] for g in sorted(calls)])
        return DeviceResult(out, {k: v for k, v in after.items() if before.get(k) is not v}, taps, [sampled], routes,
                            seqs)

    def _embedded(self, d, items):
        """A packed prefill with its `x_hc` embedded (the serving host's step before the device runs;
        the scheduler's executor lowers without activations): the same lowering with the
        checkpoint's embedding, every other argument held equal to the dispatch's."""
        if d.meta.get("x_hc_embedded"):
            return d
        from twin.abi.batches import Dispatch, PrefillBatch
        from twin.abi.lowering import lower_prefill

        e = lower_prefill(PrefillBatch(tuple(items)), self.ctx, embedding=self.embedding)
        for name, v in d.args.items():
            if name != "x_hc" and not np.array_equal(np.asarray(v), np.asarray(e.args[name])):
                raise AbiError(name, "differs", "the scheduler's lowering of the same batch", where=self.name)
        return Dispatch(d.program, {**d.args, "x_hc": e.args["x_hc"]}, {**d.meta, **e.meta, "kind": d.meta["kind"],
                                                                         "items": d.meta["items"]})

    # ---- K=7: the device state and drafter pools, seeding and verify bookkeeping ----------------------
    def _stage_k7(self, program: str, ext: dict) -> dict:
        """The side's K=7 state and drafter pools as the program's per-rank STATE arguments."""
        run, tp, out = self.side.served.run, self.ctx.tp, {}
        for b in bind(program, self.dep, self.slots, **ext):
            if b.arg.role != STATE or b.arg.pool not in K7_POOLS:
                continue
            if b.arg.pool == "device_state":
                src = run.state.tokens if b.name == "state_tokens" else run.state.meta
                out[b.name] = np.stack([src[r // tp] for r in range(b.shape[0])])
            else:
                out[b.name] = np.stack([_bf16_bits(run.pools[r // tp]) for r in range(b.shape[0])])
        return out

    def _unstage_k7(self, touched: dict) -> None:
        """The device's K=7 state and drafter pools back: each group's from its leader rank."""
        run, tp = self.side.served.run, self.ctx.tp
        G = self.dep.partitions
        for name in ("kv_caches", "draft_kv_caches"):
            if name in touched:
                run.pools = [_to_golden(touched[name][g * tp], "bf16", run.pools[g]) for g in range(G)]
        if "state_tokens" in touched or "state_meta" in touched:
            toks = touched.get("state_tokens")
            meta = touched.get("state_meta")
            run.state = DeviceState(run.state.tokens if toks is None else np.stack([toks[g * tp] for g in range(G)]),
                                    run.state.meta if meta is None else np.stack([meta[g * tp] for g in range(G)]),
                                    run.state.noise_token)

    def _with_tails(self, d, seqs):
        """A seeding wave's bootstrap with its context rows: the seed row's captured target hidden at
        each staged context position (the scheduler lowers without activations)."""
        from twin.abi.batches import Dispatch

        tp, by_group = self.ctx.tp, {s.group: s for s in seqs}
        th = np.array(d.args["target_hidden"], copy=True)
        T = th.shape[1]
        for r in range(th.shape[0]):
            s = by_group.get(r // tp)
            if s is None or s.req.request_id not in d.meta["placement"]:
                continue
            pos = np.asarray(d.args["context_group_position_ids"][r])[(r % tp) * T:(r % tp + 1) * T]
            for j, p in enumerate(pos):
                if p >= 0:
                    th[r, j] = _bf16_bits(s.tail[int(p)])
        return Dispatch(d.program, {**d.args, "target_hidden": th}, d.meta)

    def _draft_routes(self, taps, calls) -> list:
        """The drafter's experts in golden's call order: per drafter call (its rows, each (rank, row)),
        per draft layer, the 7 query rows of each row (what the golden re-syncs its near-ties from)."""
        QW = 7
        out = []
        for rows in calls:
            for l in range(self.dep.model.dspark_num_layers):
                t = taps[(f"draft{l}", "moe_indices")]
                out.append(np.concatenate([t[r, b * QW:(b + 1) * QW] for r, b in rows]))
        return out

    def _seeded(self, d, wave, seqs, res, before) -> DeviceResult:
        """Each wave request's slot seeded from the device's drafts (none where the seed's block did
        not fit: it has no dispatch row)."""
        sv = self.side.served
        for s in seqs:
            pl = d.meta["placement"].get(s.req.request_id)
            if pl is None:
                commit_seed(sv.run, s, None, None, sv.g.max_model_len)
                continue
            r, b = pl["rank"], pl["row"]
            commit_seed(sv.run, s, np.asarray(res.outputs["draft_token_ids"][r, b], np.int64),
                        np.asarray(res.outputs["confidence_probs"][r, b]), sv.g.max_model_len)
        st = sv.run.state
        out = {"drafts": np.stack([st.tokens[s.group, s.lease] for s in seqs]),
               "state_meta": np.stack([st.meta[s.group, s.lease] for s in seqs])}
        after = side_state(self.side)
        place = d.meta["placement"]
        calls = [[(place[s.req.request_id]["rank"], place[s.req.request_id]["row"])] for s in seqs
                 if s.req.request_id in place]
        return DeviceResult(out, {k: v for k, v in after.items() if before.get(k) is not v}, {}, [],
                            self._draft_routes(res.taps, calls), seqs)

    def _verified(self, d, items, seqs, res) -> dict:
        """The device's acceptance as golden's `Accepted` record, committed to the requests: its accepted
        tokens and counts, the bonus token (the last accepted one), and a redraft where the device
        committed new drafts (draft_count 7 in its state)."""
        sv, prep = self.side.served, self._prep
        where = [(d.meta["placement"][it.request_id]["rank"], d.meta["placement"][it.request_id]["local_row"])
                 for it in items]
        counts = np.array([int(res.outputs["accepted_counts"][r, b]) for r, b in where], np.int64)
        ids = np.stack([np.asarray(res.outputs["accepted_token_ids"][r, b], np.int64) for r, b in where])
        st = sv.run.state                              # the device's, unstaged
        redraft = np.array([st.meta[s.group, s.lease, DRAFTS] == C.DSPARK_QUERY_WIDTH for s in seqs])
        acc = Accepted(counts, ids, ids[np.arange(len(seqs)), counts - 1], prep.anchor, prep.anchor + counts - 1,
                       redraft, counts - 1, prep.draft_count)
        commit_verify(sv.run, seqs, acc)
        sv.run.steps += 1
        return {"redraft": acc.redraft, "accepted_ids": ids, "accepted_counts": counts,
                "num_draft_tokens": np.asarray(prep.draft_count, np.int64),
                "drafts": np.stack([st.tokens[s.group, s.lease] for s in seqs]),
                "state_meta": np.stack([st.meta[s.group, s.lease] for s in seqs])}

    def _rows(self, d, items):
        """(token rows, logit rows) of the dispatch in golden's order, each (rank, row in the rank)."""
        meta, tp = d.meta, self.ctx.tp
        if d.program == FUSED:
            # each request's live verify rows (golden's prepare: the active width), on its owner rank
            rows = []
            for it, width in zip(items, self._prep.active_width):
                pl = meta["placement"][it.request_id]
                rows += [(pl["rank"], pl["local_row"] * 8 + o) for o in range(int(width))]
            return rows, rows
        if d.program == "l3_decode_fwd":
            tok = [(meta["placement"][it.request_id]["rank"], meta["placement"][it.request_id]["local_row"] * 8)
                   for it in items]
            return tok, [tuple(meta["requests"][it.request_id]["sampled_slot"]) for it in items]
        L = meta["L"]
        tok, logit = [], []
        for it in items:
            pl = meta["placement"][it.request_id]
            r0 = tp * pl["group"]
            tok += [(r0 + o // L, o % L) for o in range(pl["offset"], pl["offset"] + it.end - it.num_computed)]
            logit.append((r0, pl["ordinal"]))
        return tok, logit

    def _unstage(self, program: str, touched: dict, caches: list) -> list:
        """The device's touched per-rank pools back into golden's layout: partition g's pages from its
        group leader's replica (rank g * TP); a pool the device did not touch stays the same array."""
        cfg, ctx = self.dep.model, self.ctx
        out = [dict(p) for p in caches]
        for b in bind(program, self.dep, self.slots):
            if b.arg.role != STATE or b.name not in touched or b.arg.pool in K7_POOLS:
                continue
            nb, gname = ctx.num_blocks[b.arg.pool], b.arg.buffer_id
            for l in pool_layers(cfg, b.arg):
                new = np.array(caches[l][gname], copy=True)
                for g in range(self.dep.partitions):
                    rows = unstage_rows(program, self.dep, self.slots, ctx, b.name, touched[b.name], l, g * ctx.tp)
                    new[g * nb:(g + 1) * nb] = _to_golden(rows, b.dtype, new[g * nb:(g + 1) * nb])
                out[l][gname] = new
        return out

