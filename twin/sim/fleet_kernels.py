"""The fleet fidelity's per-step array work as compiled loops (numba, `cache=True`).

A saturated step touches ~250 running requests x 7 families; as numpy calls that is a few hundred
small-array operations per step, each ~1 us of dispatch.  Here each piece is one plain loop over
the running slots in request order, so the step costs what its arithmetic costs.  It is integer
logic (page and token counts) but for the inter-token gaps (one subtraction each, as before), so
a kernel returns exactly what the numpy formulation it replaced returned.
tests/sim/test_fleet_kernels.py checks `family_table`, `grow_rows`, `phase1` / `_search`,
`prefill_rows` and `decode_rows` against those forms; the others (`apply_rows`, `commit_rows` after
an overflow, `end_rows`, `release_pages`, `place`, `settle`) are held by the fleet digests
(bit-identical to the numpy step they replaced) and by tests/sim/test_fleet.py's invariants.

Python keeps the per-event work: admissions with prefix lookup, prefix releases, publication, and
the preemptions this module only *chooses* (`phase1` returns the victims in order; `FleetSchedule`
preempts them, then `commit` writes the growth), because those touch Python objects.

Only the fleet fidelity imports this module (numba is not loaded by `twin.sim` or the exact
fidelity).  Compiled code is cached on disk (`cache=True`: ~7 s of compiling once, ~0.3 s to load
in a new process); where no cache directory is writable the kernels compile in memory instead.
"""
from __future__ import annotations

import warnings

import numpy as np
from numba import njit as _numba_njit

from .fleet_command import EOS, FINISHED, LENGTH

_warned = False          # the no-cache warning is given once per process


def njit(fn=None, *, cache: bool = True, **kw):
    """numba's njit with its on-disk cache where a cache directory is writable (next to this file,
    NUMBA_CACHE_DIR or the user's cache); where none is, numba refuses `cache=True` at decoration,
    so the kernels compile in memory on their first call instead (one warning)."""
    def deco(f):
        try:
            return _numba_njit(cache=cache, **kw)(f)
        except RuntimeError as e:
            global _warned
            if not _warned:
                warnings.warn(f"fleet kernels compile without numba's cache (~7 s per process): {e}", RuntimeWarning,
                              stacklevel=3)
                _warned = True
            return _numba_njit(**kw)(f)
    return deco if fn is None else deco(fn)


def family_table(pt, maxb, rolling) -> np.ndarray:
    """The growth kernels' `fam` rows from per-family page tokens, max blocks per sequence and
    which families are rolling rings: page tokens, ring size (maxb for a ring; an append-only
    family is a ring that never fills, 2^40), maxb, and log2 of the page tokens (-1 when not a
    power of two)."""
    ring = np.where(rolling, maxb, 1 << 40)
    shift = [int(p).bit_length() - 1 if p & (p - 1) == 0 else -1 for p in np.asarray(pt).tolist()]
    return np.stack([pt, ring, maxb, np.array(shift, dtype=np.int64)]).astype(np.int64)


@njit(inline="always")
def _grow_row(tok, Lr, Sr, pinned, fam, need, own, taken, wrap, L2, S2):
    """One table row growing to `tok` tokens, per family (the growth formula: docs/simulation.md,
    "Fidelity"; an append-only family is a ring that never fills, its ring size huge).  `fam`
    rows: page tokens, ring size, max blocks per sequence, log2 of the page tokens (-1 when not a
    power of two: a shift instead of an integer division, the step's costliest instruction)."""
    for f in range(fam.shape[1]):
        pt, ring, maxb, sh = fam[0, f], fam[1, f], fam[2, f], fam[3, f]
        tgt = (tok + pt - 1) >> sh if sh >= 0 else (tok + pt - 1) // pt
        size = min(tgt, ring)
        o = max(size - Sr[f], 0)
        w = min(max(tgt - max(Lr[f], ring), 0), maxb)
        own[f] = o
        wrap[f] = w
        taken[f] = o + w
        need[f] = o + w if pinned else o            # a ring rewrite under an in-flight step detaches
        L2[f] = max(Lr[f], tgt)
        S2[f] = max(Sr[f], size)


@njit
def grow_rows(tokens, L, S, pinned, fam):
    """Rows growing to `tokens` (n) from logical pages `L` and filled ring slots `S` (n x F):
    (need, own, taken, wrapped, L', S') stacked, 6 x n x F."""
    n, F = L.shape
    g = np.empty((6, n, F), np.int64)
    for j in range(n):
        _grow_row(tokens[j], L[j], S[j], pinned[j], fam, g[0, j], g[1, j], g[2, j], g[3, j], g[4, j], g[5, j])
    return g


@njit
def phase1(run, state, n_out, slot, part, rank, kv4, free, takes, fam, limits):
    """Phase 1 over the running requests in order: the rows scheduled under the global token budget
    (a K=7 row costs 8; chunked prefill), their tables grown, and where a partition cannot hold its
    rows the overflow search (the first row in order that does not fit is dropped; the latest
    arrival among the other running requests, same partition first, is chosen as a victim, its
    pages count as free, and the row is retried once).

    `state` = (computed, plen, ph, pins, tpif, next_drop) by request, `kv4` the slots' (logical,
    ring, own, pinned) pages, `limits` = (max_seq, budget, chunk, k, columns to leave for
    admissions).  Returns (ints, flags,
    growth, victims, stats): ints rows (request, num_new, spec, start, -) and flags rows (prefill,
    samples, keep) over the budget's rows; growth (need, own, taken, wrapped, L', S') per row;
    victims (victim, by) in the order chosen.  Without a victim or a dropped row `commit_rows` runs
    here and `stats` is its result; otherwise `stats[0]` is -1: the caller preempts the victims and
    calls `commit_rows`.
    """
    max_seq, budget, chunk, k = limits[0], limits[1], limits[2], limits[3]
    computed, plen, ph, pins, tpif, next_drop = state
    m = len(run)
    G, F = free.shape
    ints = np.empty((5, m + limits[4]), np.int64)       # with room for phase 2's admissions
    flags = np.empty((3, m + limits[4]), np.bool_)
    n = 0
    left = budget
    for r in range(m):
        i = run[r]
        if tpif[i]:
            continue
        c = computed[i]
        pl = plen[i]
        pre = c < pl
        room = max_seq - c
        nn = min(min(pl + n_out[i] + ph[i] - c, budget), room)
        if pre:
            nn = min(nn, chunk)
        if nn <= 0:
            continue
        if left <= 0:
            break
        # the sequential budget walk (a row that fits in full keeps its chunk and drafts)
        nn = min(nn, left)
        s = 0 if pre else max(0, min(k, room - nn))
        if nn + s > left:
            continue
        ints[0, n], ints[1, n], ints[2, n], ints[3, n] = i, nn, s, c
        flags[0, n] = pre
        flags[2, n] = True
        left -= nn + s
        n += 1
    L, S, own, pinned = kv4[0], kv4[1], kv4[2], kv4[3]
    g = np.empty((6, n, F), np.int64)
    sums = np.zeros((G, F), np.int64)
    for j in range(n):
        i = ints[0, j]
        s_ = slot[i]
        _grow_row(ints[3, j] + ints[1, j] + ints[2, j], L[s_], S[s_], pins[i] > 0, fam,
                  g[0, j], g[1, j], g[2, j], g[3, j], g[4, j], g[5, j])
        p = part[i]
        for f in range(F):
            sums[p, f] += g[0, j, f]
    over = np.zeros(G, np.bool_)
    anyover = False
    for p in range(G):
        for f in range(F):
            if sums[p, f] > free[p, f]:
                over[p] = True
                anyover = True
    victims = np.empty((m, 2), np.int64)
    if not anyover:
        return ints, flags, g, victims[:0], commit_rows(ints, flags, g, slot, part, kv4, free, takes, state, k)
    nv = _search(run, ints[0, :n], part, rank, slot, own, pinned, free, g[0], flags[2, :n], over, victims)
    stats = np.zeros(6, np.int64)
    stats[0] = -1
    return ints, flags, g, victims[:nv], stats


@njit
def _search(run, act, part, rank, slot, own, pinned, free, need, keep, over, victims):
    """The overflow search in row order (only partitions whose rows together overflow can; in one,
    the cumulative need of the kept rows before a row plus its own need must fit the free pages,
    which a victim's release raises).  Fills `keep` and `victims`; returns the victim count."""
    n = len(act)
    G, F = free.shape
    cum = np.zeros((G, F), np.int64)
    freef = free.copy()
    alive = np.ones(len(run), np.bool_)
    nv = 0
    for j in range(n):
        if not keep[j]:
            continue                                   # a victim chosen at an earlier row
        i = act[j]
        p = part[i]
        if not over[p]:
            continue
        some = False
        fits = True
        for f in range(F):
            x = need[j, f]
            if x:
                some = True
            if cum[p, f] + x > freef[p, f]:
                fits = False
        if not some:
            continue
        if fits:
            for f in range(F):
                cum[p, f] += need[j, f]
            continue
        keep[j] = False
        # the latest arrival among the other running requests, same partition first
        best, best_same = -1, -1
        for q in range(len(run)):
            x = run[q]
            if not alive[q] or x == i:
                continue
            if best < 0 or rank[x] > rank[run[best]]:
                best = q
            if part[x] == p and (best_same < 0 or rank[x] > rank[run[best_same]]):
                best_same = q
        q = best_same if best_same >= 0 else best
        if q < 0:
            continue
        alive[q] = False
        v = run[q]
        victims[nv, 0] = v
        victims[nv, 1] = i
        nv += 1
        pv = part[v]
        for jv in range(n):
            if act[jv] == v:
                if keep[jv] and jv < j and over[pv]:
                    for f in range(F):
                        cum[pv, f] -= need[jv, f]      # its growth, counted above, is undone
                keep[jv] = False
                break
        sv = slot[v]
        for f in range(F):
            freef[pv, f] += own[sv, f] + pinned[sv, f]
        fits = True
        for f in range(F):
            if cum[p, f] + need[j, f] > freef[p, f]:
                fits = False
        if fits:
            keep[j] = True
            for f in range(F):
                cum[p, f] += need[j, f]
    return nv


@njit
def commit_rows(ints, flags, growth, slot, part, kv4, free, takes, state, k):
    """Phase 1's end: the kept rows' growth written (`commit`), the rows compacted in place to the
    kept ones, and `advance_after_schedule` on them (pinned by the step; computed to the chunk end
    plus drafts; placeholders for the sampled token and drafts; a sampling prefill row is the
    terminal prefill in flight); ints' last row lists the kept rows whose tokens pass a held
    rolling tail's drop point.  Returns (rows kept, budget used, prefill rows, pages detached,
    pages rotated, rows due a tail drop).
    """
    computed, plen, ph, pins, tpif, next_drop = state
    act, nn, spec, c, due = ints[0], ints[1], ints[2], ints[3], ints[4]
    pre, samples, keep = flags[0], flags[1], flags[2]
    nb = growth.shape[1]                               # the budget's rows (the rest: admissions' room)
    det, rot = commit(act[:nb], keep[:nb], slot, part, kv4, free, takes, growth)
    n = used = n_pre = nd = 0
    for j in range(nb):
        if not keep[j]:
            continue
        i = act[j]
        e = c[j] + nn[j]
        t = e + spec[j]
        smp = e >= plen[i] or not pre[j]
        act[n], nn[n], spec[n], c[n], pre[n], samples[n] = i, nn[j], spec[j], c[j], pre[j], smp
        used += nn[j] + spec[j]
        if pre[j]:
            n_pre += 1
            if smp and k:
                tpif[i] = True
        pins[i] += 1
        computed[i] = t
        ph[i] += smp + spec[j]
        if t > next_drop[i]:
            due[nd] = n
            nd += 1
        n += 1
    stats = np.empty(6, np.int64)
    stats[0], stats[1], stats[2], stats[3], stats[4], stats[5] = n, used, n_pre, det, rot, nd
    return stats


@njit
def commit(act, keep, slot, part, kv4, free, takes, growth):
    """Write the kept rows' growth: tables, own and pinned pages, free pages and pages taken.
    Returns (detached, rotated) page totals."""
    L, S, own, pinned = kv4[0], kv4[1], kv4[2], kv4[3]
    F = L.shape[1]
    det_t = 0
    wrap_t = 0
    for j in range(len(act)):
        if not keep[j]:
            continue
        i = act[j]
        s = slot[i]
        p = part[i]
        for f in range(F):
            L[s, f] = growth[4, j, f]
            S[s, f] = growth[5, j, f]
            own[s, f] += growth[1, j, f]
            d = growth[0, j, f] - growth[1, j, f]
            pinned[s, f] += d
            det_t += d
            wrap_t += growth[3, j, f]
            free[p, f] -= growth[0, j, f]
            takes[p, f] += growth[2, j, f]
    return det_t, wrap_t - det_t


@njit
def apply_rows(idx, cver, samples, counts, spec, ver, n_out, ph, computed, tpif, pins, discarded, dropped, chunks,
               first, last, fin, eos_at, stop_end, now, flags, spart, pinned, free):
    """A step's result on its rows (`update_from_output`'s array half): stale rows (a finish or
    preemption since) discarded, pins released, each sampled row's accepted tokens retained up to
    its EOS / length end (`fin`), the rest of the draft position undone, and its stream times.

    `flags` = (check first tokens, check stop strings, release the pinned pages).  Returns
    (inter-token gaps of the sampled rows, in row order; (request, finish code) of the rows that
    end by EOS / length; (request, stop end, output length, retained) of the rows whose output
    reached a planted stop string's end).  The ends come as two rows (requests, codes)."""
    n = len(idx)
    if flags[2]:
        # at depth <= 2 every pinned page is this step's (a stale row's went back with its release)
        G, F = free.shape
        for s in range(len(spart)):
            p = spart[s]
            for f in range(F):
                free[p, f] += pinned[s, f]
                pinned[s, f] = 0
    itl = np.empty(n, np.float64)
    ends = np.empty((2, n), np.int64)                  # rows: each a contiguous array for `end_rows`
    stops = np.empty((n, 4), np.int64)
    ni = ne = ns = 0
    for j in range(n):
        i = idx[j]
        if ver[i] != cver[j]:
            discarded[i] += counts[j]
            continue
        pins[i] -= 1
        if not samples[j]:
            continue
        tpif[i] = False
        cnt = counts[j]
        before = n_out[i]
        r = min(cnt, fin[i] - before)
        Lx = before + r
        n_out[i] = Lx
        itl[ni] = now - last[i]
        ni += 1
        if flags[0] and first[i] != first[i]:
            first[i] = now
        last[i] = now
        chunks[i] += 1
        if Lx >= fin[i]:
            ends[0, ne] = i
            ends[1, ne] = EOS if fin[i] == eos_at[i] + 1 else LENGTH
            dropped[i] += cnt - r
            ne += 1
            continue
        sp = spec[j] + 1
        ph[i] -= sp
        computed[i] += r - sp
        if flags[1]:
            se = stop_end[i]
            if se > before and se <= Lx:
                stops[ns, 0], stops[ns, 1], stops[ns, 2], stops[ns, 3] = i, se, Lx, r
                ns += 1
    return itl[:ni], ends[:, :ne], stops[:ns]


@njit
def decode_rows(idx, pre, start, num_new, part, lease, committed, limits):
    """A step's decode rows before their acceptance draw, as (ints, fits, per): ints rows (row,
    request, TP group, owner rank, committed context) in row order, the owner rank being the
    lease's (K=0: the ordinal within the group, mod TP); whether drafts fit (the anchor, the
    chunk's last position, + K and the committed context + the verify rows stay inside max_seq);
    per: the requests per group, then the decode tile check: (0, -, -) when the tile holds,
    (1, group, count) when a group's batch exceeds `decode_batch`, (2, group, -) when an owner
    rank holds more than `local` leased requests.

    `limits` = (max_seq, k, groups, tp, decode_batch, local, verify rows)."""
    max_seq, k, G, tp, batch, local, dseq = limits[0], limits[1], limits[2], limits[3], limits[4], limits[5], limits[6]
    n = len(idx)
    m = 0
    for j in range(n):
        if not pre[j]:
            m += 1
    ints = np.empty((5, m), np.int64)
    fits = np.empty(m, np.bool_)
    per = np.zeros(G + 3, np.int64)
    own = np.zeros(G * tp, np.int64)
    q = 0
    for j in range(n):
        if pre[j]:
            continue
        i = idx[j]
        g = part[i]
        c = committed[i]
        ints[0, q], ints[1, q], ints[2, q], ints[4, q] = j, i, g, c
        if k:
            ls = lease[i]
            ints[3, q] = ls % tp
            if ls >= 0:
                own[g * tp + ls % tp] += 1
            fits[q] = (start[j] + num_new[j] < max_seq - k + 1) and (c <= max_seq - dseq)
        else:
            ints[3, q] = per[g] % tp
            fits[q] = False
        per[g] += 1
        q += 1
    if m:
        for g in range(G):
            if per[g] > batch:
                per[G], per[G + 1], per[G + 2] = 1, g, per[g]
                break
        if per[G] == 0 and k:
            for c in range(G * tp):
                if own[c] > local:
                    per[G], per[G + 1] = 2, c // tp
                    break
    return ints, fits, per


@njit
def place(i, s, need, row, free, takes, load, nxt, kv4, occ, spart, slot, part):
    """Admit request `i` with no prefix hit into page-row slot `s`: the least-loaded partition whose
    pools hold `need` (ties round-robin from `nxt[0]`) takes its first rows `row` (logical pages,
    ring slots, own pages, pinned pages per family).  Returns the partition, or -1 when none holds
    it (nothing changes then)."""
    G, F = free.shape
    best = -1
    for q in range(G):
        p = (nxt[0] + q) % G
        ok = True
        for f in range(F):
            if free[p, f] < need[f]:
                ok = False
                break
        if ok and (best < 0 or load[p] < load[best]):
            best = p
    if best < 0:
        return best
    nxt[0] = (best + 1) % G
    part[i] = best
    load[best] += 1
    for f in range(F):
        free[best, f] -= need[f]
        takes[best, f] += need[f]
    for r in range(4):
        for f in range(F):
            kv4[r, s, f] = row[r, f]
    slot[i] = s
    occ[s] = i
    spart[s] = best
    return best


@njit
def release_pages(ids, part, slot, pins, kv4, free, load):
    """Requests leaving their partition: their own and pinned pages back to the free pools, their
    slot rows zeroed.  Returns the slots freed, in order (a request without a partition has none)."""
    F = free.shape[1]
    own, pinned = kv4[2], kv4[3]
    freed = np.empty(len(ids), np.int64)
    nf = 0
    for i in ids:
        p = part[i]
        if p < 0:
            continue
        s = slot[i]
        for f in range(F):
            free[p, f] += own[s, f] + pinned[s, f]
        for r in range(4):
            for f in range(F):
                kv4[r, s, f] = 0
        slot[i] = -1
        part[i] = -1
        pins[i] = 0
        load[p] -= 1
        freed[nf] = s
        nf += 1
    return freed[:nf]


@njit
def end_rows(ids, codes, now, status, ver, finish, ph, tpif, end, part, slot, pins, kv4, free, load, running, mark):
    """Requests that finish (`codes`: their finish codes) after their prefix references went back:
    status, version, finish code and time, their pages (`release_pages`), and the running set
    without them.  Returns (slots freed, the running set)."""
    for j in range(len(ids)):
        i = ids[j]
        status[i] = FINISHED
        ver[i] += 1
        finish[i] = codes[j]
        ph[i] = 0
        tpif[i] = False
        end[i] = now
        mark[i] = True
    freed = release_pages(ids, part, slot, pins, kv4, free, load)
    out = np.empty(len(running), np.int64)
    n = 0
    for i in running:
        if not mark[i]:
            out[n] = i
            n += 1
    for i in ids:
        mark[i] = False
    return freed, out[:n]


@njit
def prefill_rows(idx, pre, samples, num_new, part, plen, limits):
    """A step's prefill rows: (row, TP group, chunk tokens) in row order; the terminal ones (they
    sample; in row order); requests and tokens per group; the longest prompt of each seeding wave
    (a group's n-th terminal prefill joins wave n); and (whether everything fits one packed
    dispatch, the largest chunk, its first row).  `limits` = (groups, requests per dispatch,
    requests per group, tokens per group)."""
    G, max_batch, per_cap, tok_cap = limits[0], limits[1], limits[2], limits[3]
    n = len(idx)
    info = np.empty((3, n), np.int64)
    term = np.empty(n, np.int64)
    per = np.zeros((2, G), np.int64)
    seen = np.zeros(G, np.int64)
    waves = np.zeros(n, np.int64)
    m = nt = nw = 0
    big, big_row = -1, -1
    for j in range(n):
        if not pre[j]:
            continue
        i = idx[j]
        g = part[i]
        t = num_new[j]
        info[0, m], info[1, m], info[2, m] = j, g, t
        m += 1
        per[0, g] += 1
        per[1, g] += t
        if t > big:
            big, big_row = t, j
        if samples[j]:
            term[nt] = j
            nt += 1
            w = seen[g]
            seen[g] += 1
            waves[w] = max(waves[w], plen[i])
            nw = max(nw, w + 1)
    fits = m <= max_batch
    for g in range(G):
        if per[0, g] > per_cap or per[1, g] > tok_cap:
            fits = False
    chk = np.empty(3, np.int64)
    chk[0], chk[1], chk[2] = fits, big, big_row
    return info[:, :m], term[:nt], per, waves[:nw], chk


@njit
def settle(idx, out, term, dec, counts, committed, plen, com):
    """A priced step's accepted tokens per row (`out`): 1 for a terminal prefill row (its committed
    context becomes the prompt), the drawn count for a decode row (its committed context grows by
    it).  Returns the step's total."""
    for j in term:
        out[j] = 1
        committed[idx[j]] = plen[idx[j]]
    for q in range(len(dec)):
        j = dec[q]
        out[j] = counts[q]
        committed[idx[j]] = com[q] + counts[q]
    total = 0
    for j in range(len(out)):
        total += out[j]
    return total
