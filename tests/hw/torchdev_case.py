"""Test cases for the torch device: one preset, a few requests with their own pages, golden run
on the batch and TorchBackend on the lowered dispatch, and the per-site comparison between them.

Sites are golden's (layer, stage) taps in pipeline order; `first_failure` is where a divergence
localizes.  Tolerances are kernel-math.md's per kernel (§4): BF16 activations ratio_allclose(atol
1e-4, rtol 1/128, 0.5 % outliers as pypto's default max_error_ratio), the FP32 residual stream and
router weights allclose(1e-3, 1e-3) (K4, K14), logits allclose(1e-3, 1e-3) (K18), integer ids
exact.  Pools: rows the dispatch writes numerically (K7-K9, K13), every other row bit-identical.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from golden.checkpoint import SyntheticCheckpoint
from golden.compose import Taps, forward
from golden.numerics import numerics
from golden.paged import DECODE, PREFILL, Span, alloc_caches, lower
from golden.staging import PageMap
from hw.compare import compare_pool, compare_tensor
from hw.tolerance import Tolerance
from twin.abi.batches import DecodeBatch, DecodeItem
from twin.abi.lowering import LoweringContext, lower_decode, validate
from twin.abi.programs import bind
from twin.abi.topology import deployment

from torchdev_staging import stage_pools, stage_weights, unstage_rows

BF16_ACT = Tolerance(atol=1e-4, rtol=1 / 128, bad_budget=0.005)
F32_RES = Tolerance(atol=1e-3, rtol=1e-3)
LOGITS = Tolerance(atol=1e-3, rtol=1e-3)
EXACT = Tolerance(exact=True)
STAGES = ("attn_in", "x_mixed", "x_norm", "q", "kv", "idx_topk", "attn", "attn_out", "attn_x_hc", "ffn_x_mixed",
          "moe_indices", "moe_weights", "ffn_out", "x_hc")
TOL = {"attn_in": F32_RES, "attn_x_hc": F32_RES, "x_hc": F32_RES, "moe_weights": F32_RES, "idx_topk": EXACT,
       "moe_indices": EXACT}
POOL_TOL = {"f32": Tolerance(atol=1e-3, rtol=1e-3), "bf16": BF16_ACT, "i8": Tolerance(atol=1.0),
            "i32": EXACT, "i64": EXACT}


@dataclass
class Case:
    dep: object
    slots: int
    ctx: object
    pages: PageMap
    ckpt: object
    nm: object
    caches: list                    # golden pools after the history
    blocks: dict                    # request -> partition-local block ids by family
    requests: list                  # (rid, partition, prompt length)
    tau: list = field(default_factory=list)

    @property
    def cfg(self):
        return self.dep.model


def build(preset: str = "tiny", *, lengths=((0, 200), (1, 255), (1, 131)), max_model_len: int = 512, seed: int = 0):
    """Golden prefills each request's prompt (its own pages, partition by partition) as history."""
    dep = deployment(preset, max_model_len=max_model_len)
    cfg = dep.model
    per_part: dict = {}
    reqs = []
    for i, (p, n) in enumerate(lengths):
        j = per_part.get(p, 0)
        per_part[p] = j + 1
        reqs.append((f"r{i}", p, j, n))
    slots = max(per_part.values())
    ctx = LoweringContext(dep, slots)
    pm = PageMap(ctx)
    nm = numerics("device", cfg=cfg)
    ck = SyntheticCheckpoint(cfg, seed=seed)
    rng = np.random.default_rng(seed)
    blocks = {rid: {f: [j * s.max_blocks_per_seq + k for k in range(s.max_blocks_per_seq)]
                    for f, s in ctx.sizing.items()} for rid, _, j, _ in reqs}
    prompts = {rid: tuple(int(t) for t in rng.integers(2, cfg.vocab_size - 1, n)) for rid, _, _, n in reqs}
    spans = [Span(i, 0, prompts[rid], pm.to_golden(p, blocks[rid])) for i, (rid, p, _, _) in enumerate(reqs)]
    res = forward(ck, lower(cfg, spans, form=PREFILL), alloc_caches(cfg, pm.pool_pages, nm), cfg=cfg, nm=nm)
    case = Case(dep, slots, ctx, pm, ck, nm, res.caches, blocks, [(rid, p, n) for rid, p, _, n in reqs])
    case.tau = [int(t) for t in np.asarray(res.sampled).reshape(len(reqs), -1)[:, 0]]
    return case


def decode_dispatch(case: Case):
    items = tuple(DecodeItem(rid, case.tau[i], n, case.blocks[rid], p) for i, (rid, p, n) in enumerate(case.requests))
    d = lower_decode(DecodeBatch(items, k=0), case.ctx)
    validate(d, case.ctx)
    return d


def golden_decode(case: Case, ckpt=None):
    """Golden's K=0 verify row of every request at its anchor, taps at every stage."""
    spans = [Span(i, n, (case.tau[i],), case.pages.to_golden(p, case.blocks[rid]))
             for i, (rid, p, n) in enumerate(case.requests)]
    taps = Taps()
    out = forward(ckpt or case.ckpt, lower(case.cfg, spans, form=DECODE), case.caches, cfg=case.cfg, nm=case.nm,
                  taps=taps)
    return out, taps


def device_inputs(case: Case, program: str = "l3_decode_fwd"):
    return (stage_weights(program, case.dep, case.slots, case.ckpt),
            stage_pools(program, case.dep, case.slots, case.ctx, case.caches))


def decode_rows(case: Case, d) -> list:
    """(golden row, device rank, device local row, logit entry) of each request's verify row."""
    out = []
    for i, (rid, _, _) in enumerate(case.requests):
        pl = d.meta["placement"][rid]
        out.append((i, pl["rank"], pl["local_row"] * 8, d.meta["requests"][rid]["sampled_slot"][1]))
    return out


def sites(cfg):
    for layer in range(cfg.num_hidden_layers):
        for st in STAGES:
            yield layer, st
    for st in ("hidden", "x_norm", "logits"):
        yield "head", st


def compare_sites(case: Case, d, gtaps, dres) -> list:
    """[(site, Finding)] for every tapped site, the device rows gathered to golden's row order."""
    rows = decode_rows(case, d)
    out = []
    for site in sites(case.cfg):
        if site not in gtaps or site not in dres.taps:
            continue
        g = np.asarray(gtaps[site], np.float64)
        if site == ("head", "logits"):
            dv = np.stack([dres.taps[site][r, e] for _, r, _, e in rows])
            g = g[[i for i, *_ in rows]]
            tol = LOGITS
        else:
            dv = np.stack([dres.taps[site][r, lr] for _, r, lr, _ in rows]).astype(np.float64)
            g = g[[i for i, *_ in rows]]
            tol = TOL.get(site[1], BF16_ACT)
        out.append((site, compare_tensor(f"{site[0]}/{site[1]}", dv, g, tol, ("act", "f32", "none"))))
    return out


def first_failure(findings):
    for site, f in findings:
        if not f.passed:
            return site
    return None


def compare_pools(case: Case, d, before: dict, gout, dres, program: str = "l3_decode_fwd") -> list:
    """[(pool, layer, rank, Finding)]: each rank's replica of its partition's pages against golden's,
    mapped rows = the rows the dispatch's slot mappings name (group-level, every rank of the group)."""
    cfg, ctx = case.cfg, case.ctx
    B = {b.name: b for b in bind(program, case.dep, case.slots)}
    from torchdev_staging import _stack
    slot_args = {"ori": ("swa_slot_mapping",), "csa_state": ("csa_state_slot_mapping",),
                 "csa_inner_state": ("csa_inner_state_slot_mapping",), "hca_state": ("hca_state_slot_mapping",),
                 "cmp_c4": ("csa_cmp_slot_mapping",), "idx": ("csa_idx_slot_mapping",),
                 "cmp_c128": ("hca_cmp_slot_mapping",)}
    out = []
    for name, b in B.items():
        if b.arg.role != "state" or b.arg.pool not in slot_args:
            continue
        fam = b.arg.pool
        nb = ctx.num_blocks[fam]
        after = dres.state.get(name, before[name])
        for l in _stack(cfg, b.arg):
            for r in range(case.dep.ranks):
                g = r // ctx.tp
                gv = np.asarray(gout.caches[l][b.arg.buffer_id])[g * nb:(g + 1) * nb]
                gv = gv.view(np.uint16) if b.dtype == "bf16" else gv
                dv = unstage_rows(program, case.dep, case.slots, ctx, name, after, l, r)
                bv = unstage_rows(program, case.dep, case.slots, ctx, name, before[name], l, r)
                rows = np.concatenate([np.asarray(d.args[s][r]) for s in slot_args[fam]])
                rows = np.unique(rows[(rows >= 0) & (rows < nb * dv.shape[1])])
                widen = (lambda x: (x.astype(np.uint32) << 16).view(np.float32)) if b.dtype == "bf16" else \
                    (lambda x: x)
                row = int(np.prod(dv.shape[2:]))
                f = compare_pool(f"{name}[{l}]@{r}", widen(dv).reshape(-1, row), widen(gv).reshape(-1, row),
                                 widen(bv).reshape(-1, row), rows, POOL_TOL[b.dtype], ("pool", "f32", "none"))
                out.append((name, l, r, f))
    return out
