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
the torch device's.  Only the K=0 programs (`l3_prefill_fwd`, `l3_decode_fwd`) run here: the fused K=7
step is not in the torch device, and `build_lockstep` refuses `k=7` with this backend.
"""
from __future__ import annotations

from typing import Mapping

import ml_dtypes
import numpy as np

from golden.dispatch import commit_prefill, placement_order
from golden.dspark.step import advance
from twin.abi.errors import AbiError
from twin.abi.programs import STATE, bind

from ..golden_args import pool_layers, stage_pools, stage_weights, unstage_rows
from .step import DeviceResult
from .side import install_state, side_state

PROGRAMS = {"prefill": "l3_prefill_fwd", "decode": "l3_decode_fwd"}


def _extents(d) -> dict:
    if d.program != "l3_prefill_fwd":
        return {}
    from hw.torchdev.prefill import extents
    return extents(d)


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
    checkpoint's weights staged per program."""

    def __init__(self, side, ctx, device: str, ckpt):
        from hw.torchdev import TorchBackend

        self.side, self.ctx, self.dep, self.slots = side, ctx, ctx.deployment, ctx.slots
        if self.dep.k:
            raise AbiError("k", self.dep.k, "0 with the torch device (the fused K=7 program l3_decode_fwd_dspark "
                           "is not in it yet)", where="lockstep")
        self.torch = TorchBackend(self.dep, self.slots, device,
                                  weights=lambda program: stage_weights(program, self.dep, self.slots, ckpt))
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
        if PROGRAMS.get(kind) != dispatch.program:
            raise AbiError("program", dispatch.program, f"one of {sorted(PROGRAMS.values())} (the torch device's "
                           "K=0 programs)", where=self.name)
        sv = side.served
        if kind == "prefill":
            dispatch = self._embedded(dispatch, items)
            items = placement_order(dispatch, items)
        seqs = [sv.bind(it.request_id, it.partition, it.lease, it.generation, it.block_ids) for it in items]
        ext = _extents(dispatch)
        pools = stage_pools(dispatch.program, self.dep, self.slots, self.ctx, sv.run.caches, **ext)
        res = self.torch.run(dispatch, pools)
        caches = self._unstage(dispatch.program, res.state, sv.run.caches)
        tok, logit = self._rows(dispatch, items)
        taps = {}
        for site, v in res.taps.items():
            rows = logit if site == ("head", "logits") else tok
            taps[site] = np.stack([v[r, i] for r, i in rows])
        sampled = np.array([int(res.outputs["sampled_ids"][r, i, 0]) for r, i in logit], np.int64)
        before = side_state(side)
        sv.run.caches = caches
        if kind == "prefill":
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
        return DeviceResult(out, {k: v for k, v in after.items() if before.get(k) is not v}, taps, [sampled], [],
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

    def _rows(self, d, items):
        """(token rows, logit rows) of the dispatch in golden's order, each (rank, row in the rank)."""
        meta, tp = d.meta, self.ctx.tp
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
            if b.arg.role != STATE or b.name not in touched:
                continue
            nb, gname = ctx.num_blocks[b.arg.pool], b.arg.buffer_id
            for l in pool_layers(cfg, b.arg):
                new = np.array(caches[l][gname], copy=True)
                for g in range(self.dep.partitions):
                    rows = unstage_rows(program, self.dep, self.slots, ctx, b.name, touched[b.name], l, g * ctx.tp)
                    new[g * nb:(g + 1) * nb] = _to_golden(rows, b.dtype, new[g * nb:(g + 1) * nb])
                out[l][gname] = new
        return out

