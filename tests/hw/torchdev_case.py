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
from golden.compose import Taps, attention_sublayer, device_meta, final_head, forward, moe_sublayer, rope_inputs
from golden.kernels.indexer import lightning_indexer
from hw.tolerance import Policy
from golden.numerics import numerics
from golden.paged import DECODE, PREFILL, Span, alloc_caches, lower
from golden.staging import PageMap
from hw.compare import compare_pool, compare_tensor
from hw.tolerance import Tolerance
from twin.abi.batches import DecodeBatch, DecodeItem, PrefillBatch, PrefillItem
from twin.abi.lowering import LoweringContext, lower_decode, lower_prefill, validate
from twin.abi.programs import bind
from twin.abi.topology import deployment

from hw.golden_args import pool_layers, stage_pools, stage_weights, unstage_rows

# inputs bit-identical after the re-sync: the kernel's own tolerance (K2, K3, K6)
KERNEL = Tolerance(atol=1e-4, rtol=1 / 128, bad_budget=0.005)
# downstream of a rounding difference inside the layer: K13's layer composition (reldiff 8e-3, 0.8 %)
LAYER = Tolerance(atol=8e-3, rtol=8e-3, bad_budget=0.008)
# the MoE sub-layer, whose INT8 steps turn a one-ulp input difference into a one-LSB step: the full
# forward's hidden comparator (kernel-math §2: rtol 1e-2, atol 5e-2, 2 % outliers)
HIDDEN = Tolerance(atol=5e-2, rtol=1e-2, bad_budget=0.02)
LOGITS = Tolerance(atol=1e-3, rtol=1e-3)
EXACT_SET = Tolerance(exact=True, unordered=True)
STAGES = ("attn_in", "x_mixed", "x_norm", "q", "kv", "idx_topk", "attn", "attn_out", "attn_x_hc", "ffn_x_mixed",
          "moe_indices", "moe_weights", "ffn_out", "x_hc")
TOL = {"attn_in": KERNEL, "x_mixed": KERNEL, "x_norm": KERNEL, "q": KERNEL, "kv": KERNEL, "idx_topk": EXACT_SET,
       "attn": LAYER, "attn_out": LAYER, "attn_x_hc": LAYER, "ffn_x_mixed": HIDDEN, "moe_indices": EXACT_SET,
       "moe_weights": HIDDEN, "ffn_out": HIDDEN, "x_hc": HIDDEN, "hidden": KERNEL, "logits": LOGITS}
# pools, per kernel-math K7-K9 / K13: states 1e-3, KV rows as the kv site, the INT8 index cache +-1 with 1 %
POOL_TOL = {"f32": Tolerance(atol=1e-3, rtol=1e-3, bad_budget=0.01), "bf16": KERNEL,
            "i8": Tolerance(atol=1.0, bad_budget=0.01)}


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
    rng: object = None

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
    spans = [Span(i, 0, prompts[rid], pm.to_golden(p, blocks[rid])) for i, (rid, p, _, n) in enumerate(reqs) if n]
    caches = alloc_caches(cfg, pm.pool_pages, nm)
    case = Case(dep, slots, ctx, pm, ck, nm, caches, blocks, [(rid, p, n) for rid, p, _, n in reqs])
    if spans:
        res = forward(ck, lower(cfg, spans, form=PREFILL), caches, cfg=cfg, nm=nm)
        case.caches = res.caches
        sampled = iter(int(t) for t in np.asarray(res.sampled).reshape(len(spans), -1)[:, 0])
        case.tau = [next(sampled) if n else -1 for *_, n in reqs]
    case.rng = rng
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


def prefill_chunks(case: Case, lengths) -> list:
    """The next chunk of each request: (rid, partition, start, tokens)."""
    return [(rid, p, n, tuple(int(t) for t in case.rng.integers(2, case.cfg.vocab_size - 1, k)))
            for (rid, p, n), k in zip(case.requests, lengths)]


def prefill_dispatch(case: Case, chunks):
    items = tuple(PrefillItem(rid, toks, start, start + len(toks), case.blocks[rid], p) for rid, p, start, toks in chunks)
    emb = np.asarray(case.ckpt.model()["embed_weight"], np.float32)
    d = lower_prefill(PrefillBatch(items), case.ctx, embedding=emb)
    validate(d, case.ctx)
    return d


def golden_prefill(case: Case, chunks, ckpt=None):
    """Golden's packed prefill of the chunks in dispatch order (group, ordinal), against each
    request's resident history; logits for each chunk's last row."""
    spans = [Span(i, start, toks, case.pages.to_golden(p, case.blocks[rid]))
             for i, (rid, p, start, toks) in enumerate(chunks)]
    taps = Taps()
    out = forward(ckpt or case.ckpt, lower(case.cfg, spans, form=PREFILL), case.caches, cfg=case.cfg, nm=case.nm,
                  taps=taps)
    return out, taps


def prefill_rows(case: Case, d, chunks):
    """(token rows: (golden row, rank, band row), logit rows: (golden row, rank, entry))."""
    L, tp = d.meta["L"], case.ctx.tp
    rows, logit = [], []
    base = 0
    for i, (rid, p, start, toks) in enumerate(chunks):
        pl = d.meta["placement"][rid]
        r0 = tp * pl["group"]
        for j in range(len(toks)):
            o = pl["offset"] + j
            rows.append((base + j, r0 + o // L, o % L))
        logit.append((i, r0, pl["ordinal"]))
        base += len(toks)
    return rows, logit


def adopt_near_ties(scores, mine, theirs, tol, adopted, key):
    """One rule for both top-k selections (routing, the indexer): a row where the device selected
    another set takes the device's set iff golden's own scores make it a near tie (the same count
    of valid entries, and golden's selected score sum within `tol` times the row's largest
    selected |score| of the device's); the rows taken are recorded under `key`."""
    s = np.asarray(scores, np.float64)
    out = np.array(mine, copy=True)
    for t in np.flatnonzero((np.sort(out, -1) != np.sort(theirs, -1)).any(-1)):
        a, b = out[t][out[t] >= 0], theirs[t][theirs[t] >= 0]
        if a.size != b.size or (b.size and b.max() >= s.shape[1]):
            continue
        gap = s[t, a].sum() - s[t, b].sum()
        if gap <= tol * max(np.abs(s[t, a]).max(initial=0.0), 1e-30):
            out[t] = theirs[t]
            adopted.setdefault(key, []).append(int(t))
    return out


def golden_resynced(case: Case, meta, dres, tok_rows, logit_rows, ckpt=None, adopted=None):
    """Golden layer by layer from the device's layer inputs (its `attn_in` taps, in golden's row
    order) with golden's own pools: the lockstep's re-sync, so one rounding difference does not
    cascade and a divergence shows at the layer that makes it.  Routing re-syncs too: where the
    device chose other experts, or other compressed rows in the indexer's top-k, and golden's own
    scores make that a near tie (`adopt_near_ties`, the policy's route tie_tol), golden takes the
    device's choice (its own weights for them) and the row goes to `adopted[layer]` (routing) or
    `adopted[("idx", layer)]`.  The head runs on the device's last
    residual stream.  -> (taps, golden's pools after the step, one dict per layer)."""
    cfg, nm = case.cfg, case.nm
    ckpt = ckpt or case.ckpt
    m = device_meta(meta, nm)
    rope = rope_inputs(cfg, meta.position_ids, nm)
    taps = Taps()
    adopted = {} if adopted is None else adopted
    policy = Policy()

    def gathered(site, dtype=None):
        x = np.stack([dres.taps[site][r, lr] for _, r, lr in sorted(tok_rows)])
        return x if dtype is not None else nm.xp.asarray(x.astype(np.float32)).astype(nm.f)

    pools = []
    for layer in range(cfg.num_hidden_layers):
        w = ckpt.layer(layer)
        tol = policy.lookup("route", "i32", depth=layer).tie_tol
        indexer = None
        if cfg.layer_kind(layer) == "csa":
            dev_topk = gathered((layer, "idx_topk"), int)

            def indexer(*args, dev_topk=dev_topk, tol=tol, layer=layer, **kw):
                score, topk = lightning_indexer(*args, **kw)
                topk = adopt_near_ties(score, np.asarray(topk), dev_topk, tol, adopted, ("idx", layer))
                return score, nm.xp.asarray(topk)
        x_hc, new = attention_sublayer(gathered((layer, "attn_in")), layer, w, case.caches[layer], m, rope, cfg=cfg,
                                       nm=nm, form=meta.form, taps=taps, indexer=indexer)
        dev_idx = gathered((layer, "moe_indices"), int)

        def top_k(biased, k, dev_idx=dev_idx, tol=tol, layer=layer):
            b = np.asarray(biased, np.float64)
            idx = np.argsort(-b, axis=-1, kind="stable")[:, :k].astype(np.int32)
            return adopt_near_ties(b, idx, dev_idx, tol, adopted, layer)

        expert = ckpt.experts_of(layer) if hasattr(ckpt, "experts_of") else (lambda e, l=layer: ckpt.expert(l, e))
        moe_sublayer(x_hc, layer, w, expert, m["input_ids"], cfg=cfg, nm=nm, taps=taps, top_k=top_k)
        pools.append(new)
    final_head(gathered((cfg.num_hidden_layers - 1, "x_hc")), ckpt.model(), m["logit_row_indices"], cfg=cfg, nm=nm,
               taps=taps)
    return taps, pools


def sites(cfg):
    for layer in range(cfg.num_hidden_layers):
        for st in STAGES:
            yield layer, st
    for st in ("hidden", "x_norm", "logits"):
        yield "head", st


def compare_sites(case: Case, d, gtaps, dres, rows=None) -> list:
    """[(site, Finding)] for every tapped site, the device rows gathered to golden's row order.
    rows: (token rows, logit rows) as `prefill_rows` gives them; default the decode rows."""
    if rows is None:
        dr = decode_rows(case, d)
        rows = [(i, r, lr) for i, r, lr, _ in dr], [(i, r, e) for i, r, _, e in dr]
    tok, logit = rows
    out = []
    for site in sites(case.cfg):
        if site not in gtaps or site not in dres.taps:
            continue
        g = np.asarray(gtaps[site], np.float64)
        if site == ("head", "logits"):
            dv = np.stack([dres.taps[site][r, e] for _, r, e in logit])
            g = g[[i for i, *_ in logit]]
        else:
            dv = np.stack([dres.taps[site][r, lr] for _, r, lr in tok]).astype(np.float64)
            g = g[[i for i, *_ in tok]]
        tol = TOL[site[1]]
        out.append((site, compare_tensor(f"{site[0]}/{site[1]}", dv, g, tol, ("act", "f32", "none"))))
    return out


def _extents(d) -> dict:
    if d.program != "l3_prefill_fwd":
        return {}
    return {"P": d.meta["P"], "Q": d.meta["Q"]}


def first_failure(findings):
    for site, f in findings:
        if not f.passed:
            return site
    return None


def compare_pools(case: Case, d, before: dict, golden_pools, dres) -> list:
    """[(pool, layer, rank, Finding)]: each rank's replica of its partition's pages against golden's,
    mapped rows = the rows the dispatch's slot mappings name (group-level, every rank of the group)."""
    cfg, ctx = case.cfg, case.ctx
    program = d.program
    B = {b.name: b for b in bind(program, case.dep, case.slots, **_extents(d))}
    slot_args = {"ori": "ori", "csa_state": "csa_state", "csa_inner_state": "csa_inner_state",
                 "hca_state": "hca_state", "cmp_c4": "csa_cmp", "idx": "csa_idx", "cmp_c128": "hca_cmp"}
    suffix = "_slot_mapping_full" if program == "l3_prefill_fwd" else "_slot_mapping"
    slot_args = {f: ((k if k != "ori" or suffix.endswith("full") else "swa") + suffix,) for f, k in slot_args.items()}
    out = []
    for name, b in B.items():
        if b.arg.role != "state" or b.arg.pool not in slot_args:
            continue
        fam = b.arg.pool
        nb = ctx.num_blocks[fam]
        after = dres.state.get(name, before[name])
        for l in pool_layers(cfg, b.arg):
            for r in range(case.dep.ranks):
                g = r // ctx.tp
                gv = np.asarray(golden_pools[l][b.arg.buffer_id])[g * nb:(g + 1) * nb]
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


@dataclass
class Run:
    """One program on the device and the golden metadata of the same batch."""

    case: Case
    dispatch: object
    before: dict                    # the staged pools (the device's inputs, never written)
    dres: object
    rows: tuple                     # (token rows, logit rows)
    spans: list
    form: str

    def meta(self):
        """Golden's lowering of the batch, fresh each time (a seeded lowering bug must apply)."""
        import golden.paged
        return golden.paged.lower(self.case.cfg, self.spans, form=self.form)

    def compare(self, ckpt=None, *, pools: bool = True):
        """-> (site findings, pool findings (empty without `pools`), adopted routing rows by layer)
        against the re-synced golden."""
        adopted: dict = {}
        taps, gpools = golden_resynced(self.case, self.meta(), self.dres, *self.rows, ckpt=ckpt, adopted=adopted)
        return (compare_sites(self.case, self.dispatch, taps, self.dres, self.rows),
                compare_pools(self.case, self.dispatch, self.before, gpools, self.dres) if pools else [], adopted)


def run_decode(case: Case, device: str = "cpu") -> Run:
    from hw.torchdev import TorchBackend
    d = decode_dispatch(case)
    weights, pools = device_inputs(case, d.program)
    before = {k: v.copy() for k, v in pools.items()}
    dres = TorchBackend(case.dep, case.slots, device).run(d, pools, weights)
    dr = decode_rows(case, d)
    rows = ([(i, r, lr) for i, r, lr, _ in dr], [(i, r, e) for i, r, _, e in dr])
    spans = [Span(i, n, (case.tau[i],), case.pages.to_golden(p, case.blocks[rid]))
             for i, (rid, p, n) in enumerate(case.requests)]
    return Run(case, d, before, dres, rows, spans, DECODE)


def run_prefill(case: Case, chunks, device: str = "cpu") -> Run:
    from hw.torchdev import TorchBackend
    d = prefill_dispatch(case, chunks)
    weights, pools = device_inputs(case, d.program)
    before = {k: v.copy() for k, v in pools.items()}
    dres = TorchBackend(case.dep, case.slots, device).run(d, pools, weights)
    spans = [Span(i, start, toks, case.pages.to_golden(p, case.blocks[rid]))
             for i, (rid, p, start, toks) in enumerate(chunks)]
    return Run(case, d, before, dres, prefill_rows(case, d, chunks), spans, PREFILL)
