"""The K=7 device state and the linear-chain acceptance (kernel-math.md K27, serving-contract.md §7.5).

Per TP group and lease slot: `state_tokens [G, 64, 8]` int64 = [current token, draft_1..draft_7]
(the noise token where no draft is pending) and `state_meta [G, 64, 6]` int32 = [valid,
generation, anchor_position, committed_count, draft_count, position_limit].  anchor_position is
the position of the current token, which the next verify step feeds (it is not cached yet).

Every function is pure: the state goes in, a new state comes out.  Requests address their slot by
(group, lease, generation); a slot that is not valid or whose generation differs raises, so a
stale row of an earlier incarnation can never be verified as a live request.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from twin.abi import constants as C
from twin.abi.errors import AbiError

W = C.DECODE_SEQ                       # 8 verify rows: the current token and 7 drafts
K = C.DSPARK_QUERY_WIDTH               # 7 drafts
VALID, GENERATION, ANCHOR, COMMITTED, DRAFTS, LIMIT = range(len(C.STATE_META_FIELDS))


@dataclass(frozen=True)
class DeviceState:
    tokens: np.ndarray                 # [G, 64, 8] int64
    meta: np.ndarray                   # [G, 64, 6] int32
    noise_token: int

    @property
    def groups(self) -> int:
        return self.tokens.shape[0]


@dataclass(frozen=True)
class SlotRef:
    """Which slot a request owns: (TP group, lease, generation)."""

    group: int
    lease: int
    generation: int


def new_state(groups: int, noise_token: int) -> DeviceState:
    if groups < 1:
        raise AbiError("groups", groups, ">= 1 TP group", where="dspark device state")
    toks = np.full((groups, C.DRAFTER_LEASES_PER_GROUP, W), noise_token, np.int64)
    meta = np.zeros((groups, C.DRAFTER_LEASES_PER_GROUP, len(C.STATE_META_FIELDS)), np.int32)
    return DeviceState(toks, meta, int(noise_token))


def _check_ref(st: DeviceState, ref: SlotRef, where: str, *, live: bool = True):
    if not 0 <= ref.group < st.groups:
        raise AbiError("group", ref.group, f"0..{st.groups - 1}", where=where)
    if not 0 <= ref.lease < C.DRAFTER_LEASES_PER_GROUP:
        raise AbiError("lease", ref.lease, f"0..{C.DRAFTER_LEASES_PER_GROUP - 1}", where=where)
    if live:
        m = st.meta[ref.group, ref.lease]
        if m[VALID] != 1:
            raise AbiError("lease", ref.lease, "a valid (seeded, not released) slot", where=where)
        if m[GENERATION] != ref.generation:
            raise AbiError("generation", ref.generation, f"the slot's current generation {int(m[GENERATION])}",
                           where=where)


def seed(st: DeviceState, ref: SlotRef, first_token: int, drafts, *, prompt_len: int, position_limit: int
         ) -> DeviceState:
    """`_initialize_dspark_device_state`: token row [first token, 7 drafts] and meta
    [1, generation, prompt_len, prompt_len, 7|0, limit].  Seeding drafts only when the seed's query
    block fits: anchor + 7 < limit with anchor = prompt_len - 1; otherwise `drafts` is empty and
    the slot starts with draft_count 0 (noise tokens), so its first verify falls back."""
    where = "dspark seed"
    _check_ref(st, ref, where, live=False)
    if not 0 < prompt_len < position_limit:
        raise AbiError("prompt_len", prompt_len, f"1..{position_limit - 1} (the first token needs a position)",
                       where=where)
    drafts = np.asarray(drafts, np.int64).reshape(-1)
    fits = prompt_len - 1 + K < position_limit
    if drafts.size and (not fits or drafts.shape != (K,)):
        raise AbiError("drafts", drafts.tolist(), f"{K} draft ids when prompt_len - 1 + 7 < {position_limit}, "
                       "else none", where=where)
    toks, meta = st.tokens.copy(), st.meta.copy()
    toks[ref.group, ref.lease] = np.concatenate([[first_token], drafts if drafts.size else np.full(K, st.noise_token)])
    meta[ref.group, ref.lease] = (1, ref.generation, prompt_len, prompt_len, K if drafts.size else 0, position_limit)
    return replace(st, tokens=toks, meta=meta)


def release(st: DeviceState, ref: SlotRef) -> DeviceState:
    """Completion, abort or preemption: the slot is no longer valid (idempotent)."""
    _check_ref(st, ref, "dspark release", live=False)
    meta = st.meta.copy()
    meta[ref.group, ref.lease, VALID] = 0
    return replace(st, meta=meta)


@dataclass(frozen=True)
class Prepared:
    """The verify rows of each request: ids and positions of all 8 offsets, how many are live."""

    refs: tuple[SlotRef, ...]
    tokens: np.ndarray                 # [n, 8] int64
    positions: np.ndarray              # [n, 8] int32: min(anchor + o, limit - 1)
    active_width: np.ndarray           # [n]: draft_count + 1, or 1 when the window does not fit
    anchor: np.ndarray                 # [n]
    draft_count: np.ndarray            # [n] effective drafts (0 on fallback)
    limit: np.ndarray                  # [n]

    @property
    def kv_seq_lens(self) -> np.ndarray:
        return self.anchor + self.active_width

    @property
    def live(self) -> np.ndarray:
        """[n, 8]: the rows that publish KV and get a logit row (eager publication)."""
        return np.arange(W)[None, :] < self.active_width[:, None]

    @property
    def fallback(self) -> np.ndarray:
        return self.draft_count == 0


def prepare(st: DeviceState, refs) -> Prepared:
    refs = tuple(refs)
    seen = set()
    for r in refs:
        _check_ref(st, r, "dspark prepare")
        if (r.group, r.lease) in seen:
            raise AbiError("lease", r.lease, "each slot at most once per step",
                           where=f"dspark prepare, group {r.group}")
        seen.add((r.group, r.lease))
    g = np.array([r.group for r in refs], np.int64)
    s = np.array([r.lease for r in refs], np.int64)
    meta = st.meta[g, s].astype(np.int64).reshape(len(refs), -1)
    anchor, dc, lim = meta[:, ANCHOR], meta[:, DRAFTS], meta[:, LIMIT]
    if np.any(anchor >= lim):
        i = int(np.argmax(anchor >= lim))
        raise AbiError("anchor_position", int(anchor[i]), f"< position_limit {int(lim[i])}",
                       where=f"dspark prepare, lease {refs[i].lease}")
    fits = anchor + dc < lim
    active = np.where(fits, dc + 1, 1)
    pos = np.minimum(anchor[:, None] + np.arange(W)[None, :], lim[:, None] - 1).astype(np.int32)
    return Prepared(refs, st.tokens[g, s].reshape(len(refs), W), pos, active, anchor, np.where(fits, dc, 0), lim)


@dataclass(frozen=True)
class Accepted:
    """What one verify step committed, and what the drafter runs next."""

    counts: np.ndarray                 # [n] accepted tokens, 1..8
    token_ids: np.ndarray              # [n, 8]: sampled[0..count-1], -1 after
    next_token: np.ndarray             # [n]: the bonus / correction token = the new current token
    old_anchor: np.ndarray             # [n]: positions old_anchor + o, o < count, were committed
    drafter_anchor: np.ndarray         # [n]: old_anchor + count - 1
    redraft: np.ndarray                # [n] bool: (old_anchor + count) + 7 < limit
    matched: np.ndarray                # [n]: count - 1
    proposed: np.ndarray               # [n]: drafts verified (7, or 0 on fallback)


def accept(st: DeviceState, prep: Prepared, sampled) -> tuple[Accepted, DeviceState]:
    """Linear chain: matched = longest prefix j < eff with draft_j == sampled[j]; count = matched + 1.

    sampled [n, 8] is the target's greedy prediction after each verify row (inactive rows ignored)."""
    sampled = np.asarray(sampled, np.int64)
    n = len(prep.refs)
    if sampled.shape != (n, W):
        raise AbiError("sampled", sampled.shape, f"[{n}, {W}] (one prediction per verify row)", where="dspark accept")
    live = prep.live
    if np.any(sampled[live] < 0):
        raise AbiError("sampled", int(sampled[live].min()), "a token id >= 0 on every live row", where="dspark accept")
    drafts = prep.tokens[:, 1:]
    hit = (drafts == sampled[:, :K]) & (np.arange(K)[None, :] < prep.draft_count[:, None])
    matched = np.where(hit.all(axis=1), K, np.argmin(hit, axis=1))
    if np.any(matched >= prep.active_width):     # a full match leaves no bonus row: impossible by construction
        raise AbiError("matched", int(matched.max()), "< active_width (a bonus token must remain)",
                       where="dspark accept")
    count = matched + 1
    ids = np.where(np.arange(W)[None, :] < count[:, None], sampled, -1)
    nxt = sampled[np.arange(n), matched]
    toks, meta = st.tokens.copy(), st.meta.copy()
    for i, r in enumerate(prep.refs):
        toks[r.group, r.lease] = st.noise_token
        toks[r.group, r.lease, 0] = nxt[i]
        meta[r.group, r.lease, ANCHOR] += count[i]
        meta[r.group, r.lease, COMMITTED] += count[i]
        meta[r.group, r.lease, DRAFTS] = 0
    new_anchor = prep.anchor + count
    acc = Accepted(count, ids, nxt, prep.anchor.copy(), prep.anchor + count - 1, new_anchor + K < prep.limit,
                   matched, prep.draft_count.copy())
    return acc, replace(st, tokens=toks, meta=meta)


def commit_drafts(st: DeviceState, refs, drafts) -> DeviceState:
    """After the Markov chain: drafts are committed only where anchor + 7 < limit (else plain decode)."""
    refs = tuple(refs)
    drafts = np.asarray(drafts, np.int64).reshape(len(refs), -1)
    if drafts.shape[1] != K:
        raise AbiError("drafts", drafts.shape, f"[{len(refs)}, {K}]", where="dspark commit")
    toks, meta = st.tokens.copy(), st.meta.copy()
    for i, r in enumerate(refs):
        _check_ref(st, r, "dspark commit")
        m = meta[r.group, r.lease]
        if m[ANCHOR] + K < m[LIMIT]:
            toks[r.group, r.lease, 1:] = drafts[i]
            m[DRAFTS] = K
    return replace(st, tokens=toks, meta=meta)
