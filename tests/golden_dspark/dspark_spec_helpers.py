"""Shared by the speculation tests: a K=0 oracle draft policy, stale-row poisoning and a readable-row
comparison of two runs' caches."""
import numpy as np

from golden.dspark.oracle_drafts import continuation_drafts

from golden.dspark.ring import ring_slots
from golden.paged import families

SENTINEL = 3.0e4       # finite (bf16-representable): masked reads contribute 0 * x = 0, real reads explode


def oracle_policy(reference: dict, patterns: dict, vocab: int, log: dict | None = None):
    """Drafts = the K=0 continuation after the current anchor, wrong from index patterns[rid][step]
    on (7 = all right).  reference: request id -> prompt + K=0 tokens.  `log` collects the Markov
    drafts the drafter produced: request id -> (drafter anchor, drafts)."""
    steps: dict = {}

    def policy(seq, drafts):
        rid = seq.req.request_id
        if log is not None:
            log[rid] = (seq.draft_anchor, np.asarray(drafts).copy())
        if rid not in patterns:
            return drafts
        i = steps.get(rid, 0)
        steps[rid] = i + 1
        pat = patterns[rid]
        j = pat[i % len(pat)]
        return continuation_drafts(reference[rid], seq.anchor, j, vocab)

    return policy


def _flat(pool):
    a = np.asarray(pool)
    return a.reshape(a.shape[0] * a.shape[1], -1)


def ring_slot(ids, pos, page):
    ids = np.asarray(ids)
    pos = np.asarray(pos)
    return ids[(pos // page) % ids.size] * page + pos % page


def abs_row_slot(ids, row, rows_per_page):
    ids = np.asarray(ids)
    row = np.asarray(row)
    return ids[row // rows_per_page] * rows_per_page + row % rows_per_page


def poison_unwritten_rows(g, run):
    """Before the run: every raw-KV row and every drafter ring row holds the sentinel (the filler
    ring stays zero: padding rows read it), so a read of a never-written row shows too."""
    from twin.abi import constants as C
    for layer in range(g.cfg.num_hidden_layers):
        run.caches[layer]["kv_cache"] = np.full_like(np.asarray(run.caches[layer]["kv_cache"]), SENTINEL)
    for i, pool in enumerate(run.pools or []):
        p = np.array(pool)
        p[:, :C.DRAFTER_FILLER_BLOCK_BASE] = SENTINEL
        run.pools[i] = p


def poison_stale_rows(g, run, seqs):
    """After a step every position >= the new anchor is stale (or unwritten): overwrite them with a
    sentinel in the raw KV pools and in the drafter rings.  Any later read before a rewrite shows."""
    cfg = g.cfg
    for s in seqs:
        pos = np.arange(s.anchor, min(s.anchor + 8, g.max_model_len))
        slots = ring_slot(run.blocks[s.index]["ori"], pos, 32)
        for layer in range(cfg.num_hidden_layers):      # in place: each step's pools are fresh arrays
            p = run.caches[layer]["kv_cache"]
            p.reshape(-1, p.shape[-1])[slots] = SENTINEL
        if run.pools is not None and s.lease is not None:
            pool = run.pools[s.group]
            for l in range(cfg.dspark_num_layers):
                pool[l].reshape(-1, pool.shape[-1])[ring_slots(s.lease, pos, l)] = SENTINEL


def readable_rows(cfg, blocks, A):
    """pool name -> flat slots the next step (anchor A) may read without rewriting them first."""
    fam = families(cfg)
    out = {}
    p = np.arange(max(0, A - cfg.sliding_window), A)
    out["kv_cache"] = ring_slot(blocks["ori"], p, 32)
    for name, f, ratio in (("csa_cmp_kv", "cmp_c4", 4), ("idx_kv_cache", "idx", 4), ("idx_kv_scale", "idx", 4),
                           ("hca_cmp_kv", "cmp_c128", 128)):
        out[name] = abs_row_slot(blocks[f], np.arange(A // ratio), fam[f].rows_per_page)
    p = np.arange(max(0, A - 8), A)
    out["csa_compress_state"] = ring_slot(blocks["csa_state"], p, 2)
    out["csa_inner_compress_state"] = ring_slot(blocks["csa_inner_state"], p, 2)
    out["hca_compress_state"] = ring_slot(blocks["hca_state"], np.arange(A - A % 128, A), 8)
    return out


def compare_readable(cfg, run_a, run_b, seq_a, seq_b, *, exact: bool):
    """Every row of seq_a's caches that a step at its anchor A may read equals run_b's, where run_b
    is a from-scratch K=0 run that went at least as far (rows < A are final once A is reached)."""
    assert seq_a.anchor <= seq_b.anchor and run_a.blocks[seq_a.index] == run_b.blocks[seq_b.index]
    rows = readable_rows(cfg, run_a.blocks[seq_a.index], seq_a.anchor)
    n = 0
    for layer in range(cfg.num_hidden_layers):
        for name, slots in rows.items():
            if name not in run_a.caches[layer] or slots.size == 0:
                continue
            a = _flat(run_a.caches[layer][name])[slots].astype(np.float64)
            b = _flat(run_b.caches[layer][name])[slots].astype(np.float64)
            assert np.abs(a).max() < SENTINEL / 2, (name, layer)
            if exact:
                np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=f"{name} layer {layer}")
            else:       # batch shape may move an f32 sum across a bf16 rounding boundary: one ulp
                np.testing.assert_allclose(a, b, rtol=2.0 ** -7, atol=1e-6, err_msg=f"{name} layer {layer}")
            n += a.size
    return n


def compare_drafter_context(g, run, seq, hidden_log):
    """The drafter ring rows a query at seq's last drafter anchor reads (a-127 .. a) equal a recompute
    from the K=0 run's target hidden: context KV = K23(K22(main_hidden)) at each position."""
    from golden.dspark.drafter import context_kv, dspark_proj
    a = seq.draft_anchor
    pos = np.arange(max(0, a - 127), a + 1)
    mh = np.stack([hidden_log[int(p)] for p in pos])
    dm = g.dckpt.model()
    main_x = dspark_proj(mh, dm["main_proj_weight"], dm["main_norm_weight"], cfg=g.cfg, nm=g.nm)
    pool = np.asarray(run.pools[seq.group])
    for l in range(g.cfg.dspark_num_layers):
        lw = g.dckpt.layer(l)
        want = np.asarray(context_kv(main_x, lw["wkv"], lw["gamma_ckv"], pos, cfg=g.cfg, nm=g.nm), np.float64)
        got = pool[l].reshape(-1, pool.shape[-1])[ring_slots(seq.lease, pos, l)].astype(np.float64)
        if g.nm.exact:
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"draft layer {l}")
        else:
            np.testing.assert_array_equal(got, want, err_msg=f"draft layer {l}")
    return pos.size


def recompute_drafts(g, seq, hidden_log):
    """The drafts a clean drafter produces at seq's drafter anchor: a fresh ring holding only the
    context a-127..a (recomputed from the K=0 run's target hidden) and the query block."""
    from golden.dspark.drafter import DraftRow, drafter_forward
    from golden.dspark.markov import dspark_markov
    from golden.dspark.ring import new_pools
    a = seq.draft_anchor
    pos = tuple(range(max(0, a - 127), a + 1))
    mh = np.stack([hidden_log[p] for p in pos])
    head, _ = drafter_forward(new_pools(g.cfg, 1, g.nm)[0], mh, [DraftRow(seq.lease, a, seq.current, pos)],
                              g.dckpt, g.ckpt.model(), cfg=g.cfg, nm=g.nm, variant=g.drafter)
    dm = g.dckpt.model()
    d, _ = dspark_markov(head, dm["final_norm_weight"], g.ckpt.model()["lm_head_weight"], [1], [seq.current],
                         [seq.current], dm["markov_w1"], dm["markov_w2"], dm["confidence_head_weight"], cfg=g.cfg,
                         nm=g.nm)
    return np.asarray(d[0])


def drafter_read_checker(hidden_logs: dict, log: dict):
    """on_step hook: every redraft of this step must equal a clean recompute (a drafter that read a
    stale or poisoned ring row would not), then poison the new stale rows."""
    checked = {"n": 0}

    def on_step(g, run, seqs):
        for s in seqs:
            rid = s.req.request_id
            if rid in log and log[rid][0] == s.draft_anchor and s.draft_anchor is not None:
                np.testing.assert_array_equal(log.pop(rid)[1], recompute_drafts(g, s, hidden_logs[rid]))
                checked["n"] += 1
        poison_stale_rows(g, run, seqs)

    on_step.checked = checked
    return on_step
