"""The fused K=7 step and its drivers (kernel-math.md §5.2-5.4, serving-contract.md §7.3-7.5).

  prefill_and_seed   packed prefill of the prompts, tail capture (last 128 rows), seeding in waves
  fused_step         prepare -> target forward (eager publication of every live verify row) ->
                     accept -> drafter (context KV of the accepted rows, query block) -> Markov -> commit
  generate           whole requests at K=7 (fused steps) or K=0 (one row per request per step)

`Golden` holds configuration and weights; `Run` holds everything a run mutates (target caches, the
device state, the drafter pools, per-request bookkeeping).  The target forward is
`golden.compose.forward`, the drafter `golden.dspark.drafter`; speculation never changes a token,
which the tests check against K=0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from twin.abi.lowering.decode import owner_member

from twin.abi import constants as C
from twin.abi.errors import AbiError
from twin.abi.lowering.drafter import DRAFTER, padded_batch, seeding_waves

from ..compose import Taps, target_hidden
from ..numerics import Numerics, numerics
from ..paged import DECODE, PREFILL, Span, alloc_caches, assign_blocks, lower
from ..ranks.target import cp_owners
from .drafter import DraftRow, drafter_forward
from .markov import dspark_markov
from .parallel import SINGLE
from .ring import new_pools
from .state import SlotRef, accept, commit_drafts, new_state, prepare, release, seed
from .summary import SpeculationCounters
from .variants import DrafterVariant, drafter_variant

QW = C.DSPARK_QUERY_WIDTH
TAIL = C.SLIDING_WINDOW


@dataclass(frozen=True)
class Prompt:
    """A sequence golden generates for on its own (`generate`, `new_run`): its id, tokens and token
    budget.  The scheduler's request, with sampling and run state, is `twin.abi.batches.Request`;
    `golden.dispatch` makes a Prompt of each one it serves."""

    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int


@dataclass
class Golden:
    """Configuration and weights of a functional run."""

    cfg: object
    ckpt: object                       # target checkpoint (golden.checkpoint protocol)
    dckpt: object | None = None        # drafter checkpoint (golden.dspark.weights); None at K=0
    nm: Numerics | str = "device"
    max_model_len: int = 1024          # the position limit of every request
    groups: int = 1                    # TP groups (cache partitions)
    drafter: DrafterVariant | str = "device"   # golden.dspark.variants: "device" (pypto-lib) | "v4.1"
    par: object = SINGLE
    pad_drafter_batch: bool = False    # pad every rank of a drafter call to B in {4, 8, 12, 16} rows

    def __post_init__(self):
        self.nm = numerics(self.nm, cfg=self.cfg)
        self.drafter = drafter_variant(self.drafter)
        if not 1 <= self.max_model_len <= self.cfg.max_position_embeddings:
            raise AbiError("max_model_len", self.max_model_len, f"1..{self.cfg.max_position_embeddings}",
                           where="golden run")
        layout = getattr(self.par, "layout", None)
        if layout is not None and layout.groups != self.groups:
            raise AbiError("groups", self.groups, f"the emulated topology's {layout.groups} TP group(s)",
                           where="golden run")

    @property
    def tp(self) -> int:
        layout = getattr(self.par, "layout", None)
        return C.TP_SIZE if layout is None else layout.tp


@dataclass
class Seq:
    """One request's bookkeeping in a run."""

    req: Prompt
    index: int                         # row in the target's block tables
    group: int
    lease: int | None = None
    generation: int = 0
    anchor: int = 0                    # position of the current (not yet cached) token
    current: int = -1
    generated: list = field(default_factory=list)
    draft_anchor: int | None = None    # anchor of the last drafter call that wrote context
    confidence_logit: np.ndarray | None = None   # of the pending drafts (never read by acceptance)
    released: bool = False
    tail: dict = field(default_factory=dict)       # position -> captured target hidden row

    @property
    def budget(self) -> int:
        return self.req.max_new_tokens

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.budget

    @property
    def partition(self) -> int:
        """The cache partition (= TP group): the name the lowering's seeding waves group by."""
        return self.group

    @property
    def ref(self) -> SlotRef:
        return SlotRef(self.group, self.lease, self.generation)


@dataclass
class Run:
    caches: list
    blocks: list
    seqs: list
    state: object = None               # DeviceState (K=7)
    pools: list = None                 # drafter pools per group (K=7)
    free_leases: list = None
    generations: np.ndarray = None
    counters: SpeculationCounters = field(default_factory=SpeculationCounters)
    steps: int = 0
    hidden_log: dict = None            # request -> {position: main_hidden row} (optional, for checks)


def _check_requests(g: Golden, requests):
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise AbiError("request_id", ids, "unique request ids", where="golden run")
    for r in requests:
        L = len(r.prompt)
        if not 1 <= L < g.max_model_len:
            raise AbiError("prompt", L, f"1..{g.max_model_len - 1} tokens (max_model_len={g.max_model_len})",
                           where=r.request_id)
        if not 1 <= r.max_new_tokens <= g.max_model_len - L:
            raise AbiError("max_new_tokens", r.max_new_tokens,
                           f"1..{g.max_model_len - L} (prompt + output <= max_model_len)", where=r.request_id)
        if min(r.prompt) < 0 or max(r.prompt) >= g.cfg.vocab_size:
            raise AbiError("prompt", [t for t in r.prompt if not 0 <= t < g.cfg.vocab_size][0],
                           f"token ids in [0, {g.cfg.vocab_size})", where=r.request_id)


def new_run(g: Golden, requests, *, k: int, block_seed: int | None = None, log_hidden: bool = False) -> Run:
    if k not in C.SUPPORTED_K:
        raise AbiError("k", k, "0 (target only) or 7 (DSPARK_QUERY_WIDTH)", where="golden run")
    _check_requests(g, requests)
    rng = None if block_seed is None else np.random.default_rng(block_seed)
    blocks, pages = assign_blocks(g.cfg, len(requests), g.max_model_len, rng=rng)
    seqs = [Seq(r, i, i % g.groups) for i, r in enumerate(requests)]
    run = Run(alloc_caches(g.cfg, pages, g.nm), blocks, seqs, hidden_log={} if log_hidden else None)
    if k:
        if g.dckpt is None:
            raise AbiError("dckpt", None, "a drafter checkpoint at K=7", where="golden run")
        run.state = new_state(g.groups, g.cfg.dspark_noise_token_id)
        run.pools = new_pools(g.cfg, g.groups, g.nm)
        run.free_leases = [list(range(C.DRAFTER_LEASES_PER_GROUP)) for _ in range(g.groups)]
        run.generations = np.zeros((g.groups, C.DRAFTER_LEASES_PER_GROUP), np.int64)
    return run


def owner_rank(s: Seq, tp: int = C.TP_SIZE) -> int:
    """Decode row placement: lease % tp in the request's group at K=7, round-robin at K=0."""
    return tp * s.group + owner_member(s.lease is not None, s.lease, s.index, tp)


def forward_spans(g: Golden, run: Run, spans, form):
    """The target forward over `spans` (golden's lowering, form PREFILL or DECODE) on `run`'s caches:
    (sampled token per row, the captured target hidden per row)."""
    taps = Taps(stages={"x_hc", "attn_in"})
    meta = lower(g.cfg, spans, form=form)
    tp = g.tp
    if form == PREFILL:
        owners = cp_owners(meta, {s.index: s.group for s in run.seqs}, tp)
    else:
        by_index = {s.index: owner_rank(s, tp) for s in run.seqs}
        owners = np.array([by_index[int(r)] for r in meta.req], np.int64)
    out = g.par.target_forward(g.ckpt, meta, run.caches, owners, cfg=g.cfg, nm=g.nm, taps=taps)
    run.caches = out.caches
    mh = target_hidden(taps, g.ckpt.model(), cfg=g.cfg, nm=g.nm, tap=g.drafter.target_hidden_tap)
    return np.asarray(out.sampled), np.asarray(mh)


def _log_hidden(run: Run, s: Seq, positions, rows):
    if run.hidden_log is not None:
        log = run.hidden_log.setdefault(s.req.request_id, {})
        for p, h in zip(positions, rows):
            log[int(p)] = h


# ---- prefill, tail capture, seeding ------------------------------------------------------------------
def reserve_lease(run: Run, s: Seq) -> None:
    """At the first prefill chunk: pop the group's last free lease, bump its generation."""
    free = run.free_leases[s.group]
    if not free:
        raise AbiError("leases", 0, f"a free drafter lease (drafter leases exhausted for TP group {s.group})",
                       where=s.req.request_id)
    s.lease = free.pop()
    run.generations[s.group, s.lease] += 1
    s.generation = int(run.generations[s.group, s.lease])


def release_lease(run: Run, s: Seq) -> None:
    """On completion: the slot becomes invalid and the lease goes back on the group's free list."""
    if s.lease is not None and not s.released:
        run.state = release(run.state, s.ref)
        run.free_leases[s.group].append(s.lease)
        s.released = True


def prefill_and_seed(g: Golden, run: Run, *, k: int, chunk: int | None = None) -> None:
    """Prefill every prompt (packed, in chunks of at most `chunk` tokens per request), capture the
    last 128 rows of target hidden per request, sample the first token, and at K=7 seed the drafter."""
    seqs = run.seqs
    done = {s.index: 0 for s in seqs}
    if k:
        for s in seqs:
            reserve_lease(run, s)
    while any(done[s.index] < len(s.req.prompt) for s in seqs):
        spans, parts = [], []
        for s in seqs:
            a = done[s.index]
            if a >= len(s.req.prompt):
                continue
            b = len(s.req.prompt) if chunk is None else min(len(s.req.prompt), a + chunk)
            spans.append(Span(s.index, a, tuple(s.req.prompt[a:b]), run.blocks[s.index]))
            parts.append((s, a, b))
        sampled, mh = forward_spans(g, run, spans, PREFILL)
        row = 0
        for i, (s, a, b) in enumerate(parts):
            pos = np.arange(a, b)
            for p, h in zip(pos, mh[row:row + b - a]):
                s.tail[int(p)] = h
            s.tail = {p: h for p, h in s.tail.items() if p > b - 1 - TAIL}      # rolling, capped at 128
            _log_hidden(run, s, pos, mh[row:row + b - a])
            row += b - a
            done[s.index] = b
            if b == len(s.req.prompt):                                           # terminal chunk samples
                s.anchor, s.current = b, int(sampled[i])
                s.generated.append(s.current)
    if k:
        for wave in seeding_waves(seqs):
            seed_wave(g, run, wave)


def seed_row(g: Golden, s: Seq):
    """A seeding request's drafter call: (its `DraftRow`, the captured hidden of its last 128 prompt
    rows), or None when the seed's query block would not fit (no drafts)."""
    a = len(s.req.prompt) - 1
    want = list(range(max(0, a + 1 - TAIL), a + 1))
    if sorted(s.tail) != want:
        raise AbiError("tail", (min(s.tail), max(s.tail)) if s.tail else None,
                       f"positions [{want[0]}, {a}] (the last 128 prompt rows)", where=s.req.request_id)
    if a + QW >= g.max_model_len:
        return None
    return DraftRow(s.lease, a, s.current, tuple(want), owner_rank=owner_rank(s, g.tp)), \
        np.stack([s.tail[p] for p in want])


def seed_wave(g: Golden, run: Run, wave) -> None:
    """One bootstrap drafter dispatch: at most one request per group."""
    for s in wave:
        call = seed_row(g, s)
        if call is None:
            commit_seed(run, s, None, None, g.max_model_len)
            continue
        drafts, conf = draft_rows(g, run, s.group, [call[0]], call[1], num_sampled=0)
        commit_seed(run, s, drafts[0], conf[0], g.max_model_len)


def commit_seed(run: Run, s: Seq, drafts, confidence, limit: int) -> None:
    """A seeded request's bookkeeping: its slot gets [first token, drafts] (no drafts when the
    seed's query block does not fit: `drafts` None) and the drafter anchor the last prompt position."""
    L = len(s.req.prompt)
    if drafts is not None:
        s.draft_anchor, s.confidence_logit = L - 1, confidence
    run.state = seed(run.state, s.ref, s.current, [] if drafts is None else drafts, prompt_len=L,
                     position_limit=limit)


def pad_rows(rows, group: int, tp: int) -> list:
    """The drafter batch geometry (serving-contract.md §7.2): every rank of the group holds B rows,
    B the smallest of {4, 8, 12, 16} that fits the busiest rank; dense padding rows ride the filler
    ring with token 0 and write nothing."""
    per_rank = {r: 0 for r in range(group * tp, (group + 1) * tp)}
    for r in rows:
        per_rank[r.owner_rank] += 1
    B = padded_batch(DRAFTER, max(per_rank.values()))
    return list(rows) + [DraftRow(None, 0, 0, (), owner_rank=r) for r, n in per_rank.items() for _ in range(B - n)]


def draft_rows(g: Golden, run: Run, group: int, rows, main_hidden, *, num_sampled: int):
    """One drafter call of `group` (its `DraftRow`s, their context hidden rows) then the Markov
    sampler: (drafts, confidence logits) of the real rows; the group's drafter pool is replaced."""
    real = len(rows)
    if g.pad_drafter_batch:
        rows = pad_rows(rows, group, g.tp)
    head, run.pools[group] = drafter_forward(run.pools[group], main_hidden, rows, g.dckpt, g.ckpt.model(),
                                             cfg=g.cfg, nm=g.nm, par=g.par, variant=g.drafter)
    dm = g.dckpt.model()
    tau = np.array([r.anchor_token for r in rows], np.int64)
    ns = np.where(np.arange(len(rows)) < real, num_sampled, 0)
    drafts, conf = dspark_markov(head, dm["final_norm_weight"], g.ckpt.model()["lm_head_weight"],
                                 ns, tau, tau, dm["markov_w1"], dm["markov_w2"],
                                 dm["confidence_head_weight"], cfg=g.cfg, nm=g.nm, par=g.par,
                                 owners=[r.owner_rank for r in rows])
    return np.asarray(drafts)[:real], np.asarray(conf)[:real]


# ---- the fused step ----------------------------------------------------------------------------------
DraftPolicy = Callable[[Seq, np.ndarray], np.ndarray]


def fused_step(g: Golden, run: Run, seqs, *, draft_policy: DraftPolicy | None = None):
    """One K=7 verify step for `seqs` (all in decode).  Returns the `Accepted` record.

    draft_policy(seq, drafts) may replace the Markov drafts before commit (tests drive arbitrary
    acceptance patterns with it); the drafter still runs and writes its caches."""
    refs = [s.ref for s in seqs]
    prep = prepare(run.state, refs)
    spans = [Span(s.index, int(prep.anchor[i]), tuple(int(t) for t in prep.tokens[i, :prep.active_width[i]]),
                  run.blocks[s.index]) for i, s in enumerate(seqs)]
    flat, mh = forward_spans(g, run, spans, DECODE)          # eager publication: every live row writes
    sampled = np.full((len(seqs), C.DECODE_SEQ), -1, np.int64)
    starts = np.concatenate([[0], np.cumsum(prep.active_width)])
    for i in range(len(seqs)):
        sampled[i, :prep.active_width[i]] = flat[starts[i]:starts[i + 1]]
    acc, run.state = accept(run.state, prep, sampled)
    commit_verify(run, seqs, acc)
    for i, s in enumerate(seqs):
        c = int(acc.counts[i])
        _log_hidden(run, s, np.arange(int(acc.old_anchor[i]), int(acc.old_anchor[i]) + c), mh[starts[i]:starts[i] + c])
    for group, mine, rows, hidden in redraft_calls(acc, refs, [owner_rank(s, g.tp) for s in seqs], mh,
                                                   prep.active_width):
        drafts, conf = draft_rows(g, run, group, rows, hidden, num_sampled=1)
        for j, i in enumerate(mine):
            seqs[i].confidence_logit = conf[j]
        if draft_policy is not None:
            drafts = np.stack([np.asarray(draft_policy(seqs[i], drafts[j]), np.int64) for j, i in enumerate(mine)])
        run.state = commit_drafts(run.state, [refs[i] for i in mine], drafts)
    run.steps += 1
    return acc


def redraft_calls(acc, refs, owners, mh, active_width) -> list:
    """A verify step's drafter calls, one per TP group in ascending order: (group, the indices of its
    redrafting requests, their `DraftRow`s, the target hidden of their accepted rows).  acc: the
    step's `Accepted`; refs, owners: each request's slot and owner rank; mh: the step's target hidden,
    the requests' active rows in order (active_width of each, `Prepared.active_width`)."""
    starts = np.concatenate([[0], np.cumsum(active_width)])
    by_group: dict[int, list] = {}
    for i, ref in enumerate(refs):
        if acc.redraft[i]:
            c, old = int(acc.counts[i]), int(acc.old_anchor[i])
            row = DraftRow(ref.lease, int(acc.drafter_anchor[i]), int(acc.next_token[i]), tuple(range(old, old + c)),
                           owner_rank=int(owners[i]))
            by_group.setdefault(ref.group, []).append((i, row, mh[starts[i]:starts[i] + c]))
    return [(group, [i for i, _, _ in items], [r for _, r, _ in items], np.concatenate([h for _, _, h in items]))
            for group, items in sorted(by_group.items())]


def commit_verify(run: Run, seqs, acc) -> None:
    """A verify step's bookkeeping from its `Accepted` record: the speculation counters, each
    request's accepted tokens, its new anchor and current token, and (redrafting) its drafter anchor."""
    run.counters.record([s.req.request_id for s in seqs], acc)
    for i, s in enumerate(seqs):
        c = int(acc.counts[i])
        s.generated.extend(int(t) for t in acc.token_ids[i, :c])
        s.anchor, s.current = int(acc.old_anchor[i]) + c, int(acc.next_token[i])
        if acc.redraft[i]:
            s.draft_anchor = int(acc.drafter_anchor[i])


def plain_step(g: Golden, run: Run, seqs) -> None:
    """K=0: one row per request (the current token at its anchor), one new token each."""
    spans = [Span(s.index, s.anchor, (s.current,), run.blocks[s.index]) for s in seqs]
    flat, mh = forward_spans(g, run, spans, DECODE)
    for i, s in enumerate(seqs):
        _log_hidden(run, s, [s.anchor], mh[i:i + 1])
        advance(s, flat[i])
    run.steps += 1


def advance(s: Seq, token) -> None:
    """K=0 commit: the token sampled at the anchor becomes the current one, one position on."""
    s.anchor, s.current = s.anchor + 1, int(token)
    s.generated.append(s.current)


def generate(g: Golden, requests, *, k: int, chunk: int | None = None, draft_policy: DraftPolicy | None = None,
             block_seed: int | None = None, log_hidden: bool = False, until_anchor: dict | None = None,
             on_step: Callable | None = None, on_start: Callable | None = None) -> Run:
    """Run `requests` to completion.  Outputs are truncated to max_new_tokens (scheduler truncation,
    after the speculation counters).  until_anchor {request_id: anchor} (K=0 only) keeps a request
    running until its anchor reaches the given position instead (for cache comparisons).
    on_step(g, run, seqs) runs after every decode step, on_start(g, run) before the prefill (tests
    poison unwritten and stale rows with them)."""
    run = new_run(g, requests, k=k, block_seed=block_seed, log_hidden=log_hidden)
    if on_start is not None:
        on_start(g, run)
    prefill_and_seed(g, run, k=k, chunk=chunk)

    def live(s):
        if until_anchor is not None and s.req.request_id in until_anchor:
            return s.anchor < until_anchor[s.req.request_id]
        return not s.done

    while True:
        active = [s for s in run.seqs if live(s)]
        if not active:
            break
        if k:
            fused_step(g, run, active, draft_policy=draft_policy)
        else:
            plain_step(g, run, active)
        if on_step is not None:
            on_step(g, run, active)
        if k:
            for s in active:
                if not live(s):
                    release_lease(run, s)
    return run


def outputs(run: Run) -> dict:
    return {s.req.request_id: s.generated[: s.budget] for s in run.seqs}
