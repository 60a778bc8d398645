"""The fleet fidelity's compiled kernels (twin/sim/fleet_kernels.py) against the numpy / Python
formulations they replaced, over random states; and the kernels' environment: a run with numba's
bounds checks on and an unwritable cache directory, and the exact fidelity without numba."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twin.abi import constants as C
from twin.abi import deployment
from twin.sim import fleet_kernels as fk
from twin.sim.fleet_execute import FleetExecute
from twin.sim.fleet_pool import PagePools
from twin.sim.run import simulate
from twin.sim.worker import split_prefill

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEP = deployment("flash", ep=16, max_model_len=1024, long_prefill_token_threshold=128, max_num_seqs=256,
                 max_num_batched_tokens=8192, num_speculative_tokens=7)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 300), F=st.integers(1, 7), flash=st.booleans())
def test_growth_equals_the_formula_for_any_page_size(seed, n, F, flash):
    """The growth every step runs (`_grow_row`, through `grow_rows`) returns what the growth
    formula written plainly does, for FLASH's families (`PagePools.fam`) and for random ones
    (page sizes that are not powers of two take the division, the others the shift)."""
    rng = np.random.default_rng(seed)
    if flash:
        fam = PagePools.from_deployment(DEP, 3).fam
        pt, maxb, F = fam[0], fam[2], fam.shape[1]
    else:
        pt = rng.integers(1, 300, F)
        maxb = rng.integers(1, 80, F)
        fam = fk.family_table(pt, maxb, rng.random(F) < 0.5)
    ring = fam[1]
    before = rng.integers(0, 5000, n)
    tokens = before + rng.integers(0, 300, n)
    L = -(-before[:, None] // pt)
    S = np.maximum(np.minimum(L, ring) - rng.integers(0, 2, (n, F)) * (L > 0), 0)
    pinned = rng.random(n) < 0.4
    tgt = -(-tokens[:, None] // pt)
    size = np.minimum(tgt, ring)
    own = np.maximum(size - S, 0)
    wrap = np.minimum(np.maximum(tgt - np.maximum(L, ring), 0), maxb)
    want = (own + wrap * pinned[:, None], own, own + wrap, wrap, np.maximum(L, tgt), np.maximum(S, size))
    got = fk.grow_rows(tokens, L, S, pinned, fam)
    for w, g in zip(want, got):
        assert (w == g).all()


def _state(rng, m, N):
    """Random running requests (ids in a random order, some a terminal prefill in flight)."""
    run = rng.permutation(N)[:m].astype(np.int64)
    plen = rng.integers(1, 900, N)
    computed = np.minimum(rng.integers(0, 1000, N), 1023)
    n_out = rng.integers(0, 200, N)
    ph = rng.integers(0, 9, N)
    tpif = rng.random(N) < 0.1
    return run, computed, plen, n_out, ph, tpif


def _budget_rows(run, computed, plen, n_out, ph, tpif, max_seq, budget, chunk, k):
    """Phase 1's rows as the numpy code before the kernel computed them: all rows at once, then
    the sequential walk only from the first row that does not fit in full."""
    act = run[~tpif[run]]
    c, pl = computed[act], plen[act]
    pre = c < pl
    room = max_seq - c
    nn = np.minimum(np.minimum(pl + n_out[act] + ph[act] - c, budget), room)
    nn = np.where(pre, np.minimum(nn, chunk), nn)
    ok = nn > 0
    act, c, pre, nn, room = act[ok], c[ok], pre[ok], nn[ok], room[ok]
    spec = np.where(pre, 0, np.maximum(np.minimum(k, room - nn), 0))
    cost = nn + spec
    if cost.sum() > budget:
        cs = cost.cumsum()
        i = int(cs.searchsorted(budget, side="right"))
        keep = np.zeros(len(act), dtype=bool)
        keep[:i] = True
        left = budget - (int(cs[i - 1]) if i else 0)
        nn = nn.copy()
        for j in range(i, len(act)):
            if left <= 0:
                break
            n = min(int(nn[j]), left)
            s = 0 if pre[j] else max(0, min(k, max_seq - int(c[j]) - n))
            if n <= 0 or n + s > left:
                continue
            nn[j], spec[j], keep[j] = n, s, True
            left -= n + s
        act, c, pre, nn, spec = act[keep], c[keep], pre[keep], nn[keep], spec[keep]
    return act, nn, spec, c, pre


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), m=st.integers(1, 256), budget=st.sampled_from([64, 700, 2048, 8192]),
       chunk=st.sampled_from([16, 128, 512]), k=st.sampled_from([0, 7]))
def test_budget_walk_equals_the_two_stage_scan(seed, m, budget, chunk, k):
    """With pools that hold everything: phase 1's rows, in order, are the numpy formulation's, and
    each is advanced as scheduled (pinned, computed to the chunk end plus drafts)."""
    rng = np.random.default_rng(seed)
    N = m + 20
    run, computed, plen, n_out, ph, tpif = _state(rng, m, N)
    want = _budget_rows(run, computed, plen, n_out, ph, tpif, 1024, budget, chunk, k)
    kv = PagePools.from_deployment(DEP, 3)
    G, F = kv.free.shape
    pins = np.zeros(N, dtype=np.int64)
    state = (computed.copy(), plen, ph.copy(), pins, tpif.copy(), np.full(N, 1 << 40))
    part = rng.integers(0, G, N)
    free = np.full((G, F), 1 << 40)
    limits = np.array([1024, budget, chunk, k, 3])
    ints, flags, _, victims, st_ = fk.phase1(run, state, n_out, np.arange(N), part, np.arange(N),
                                             np.zeros((4, N, F), dtype=np.int64), free, np.zeros((G, F), np.int64),
                                             kv.fam, limits)
    n = int(st_[0])
    assert n == len(want[0]) and not len(victims) and ints.shape[1] == m + 3
    for w, g in zip(want, (ints[0], ints[1], ints[2], ints[3], flags[0])):
        assert (w == g[:n]).all()
    assert int(st_[1]) == int((want[1] + want[2]).sum()) <= budget
    assert int(st_[2]) == int(want[4].sum())
    act, nn, spec, c = want[:4]
    assert (state[3][act] == 1).all() and state[3].sum() == n
    assert (state[0][act] == c + nn + spec).all()


def _search_reference(run, act, part, rank, need, free, freed):
    """The overflow search as the numpy code before the kernel ran it: per partition that runs
    out, the cumulative needs of its rows; the first row in order over any partition's free
    pages is dropped, the latest arrival among the other running requests (same partition
    first) preempted, its pages added, the row retried once."""
    n = len(act)
    keep = np.ones(n, dtype=bool)
    free = free.astype(float)
    pa = part[act]
    sums = np.zeros_like(free)
    np.add.at(sums, pa, need)
    over = (sums > free).any(axis=1).nonzero()[0]
    some = need.any(axis=1)
    groups = {}
    for g in over.tolist():
        rows_g = ((pa == g) & some).nonzero()[0]
        groups[g] = (rows_g, need[rows_g].cumsum(axis=0))

    def first_bad(g, base):
        rows_g, cs_g = groups[g]
        k0 = int(rows_g.searchsorted(base))
        bad = (cs_g[k0:] > free[g]).any(axis=1)
        return int(rows_g[k0 + int(bad.argmax())]) if bad.any() else None

    alive = list(run)
    victims = []
    firsts = {g: first_bad(g, 0) for g in groups}
    while True:
        j = min((f for f in firsts.values() if f is not None), default=None)
        if j is None:
            break
        pj = int(pa[j])
        changed = {pj}
        rows_j, cs_j = groups[pj]
        kj = int(rows_j.searchsorted(j))
        keep[j] = False
        cs_j[kj:] -= need[j]
        r = int(act[j])
        cand = [x for x in alive if x != r]
        same = [x for x in cand if part[x] == part[r]]
        pool = same or cand
        if pool:
            v = max(pool, key=lambda x: rank[x])
            alive.remove(v)
            victims.append((v, r))
            vrow = (act == v).nonzero()[0]
            if len(vrow):
                vr = int(vrow[0])
                if keep[vr] and int(pa[vr]) in groups:
                    rows_v, cs_v = groups[int(pa[vr])]
                    cs_v[int(rows_v.searchsorted(vr)):] -= need[vr]
                    changed.add(int(pa[vr]))
                keep[vr] = False
            if int(part[v]) in groups:
                changed.add(int(part[v]))
            free[part[v]] += freed[v]
            before = cs_j[kj - 1] if kj else 0
            if (before + need[j] <= free[pj]).all():
                keep[j] = True
                cs_j[kj:] += need[j]
        for g in changed:
            firsts[g] = first_bad(g, j + 1)
    return keep, victims


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 10_000), m=st.integers(1, 40), G=st.integers(1, 4), F=st.integers(1, 4),
       tight=st.floats(0.2, 1.2))
def test_overflow_search_equals_the_cumulative_form(seed, m, G, F, tight):
    """Rows dropped, victims chosen in order and rows retried as the per-partition cumulative
    form decided them (running requests outside the step's rows can be victims too)."""
    rng = np.random.default_rng(seed)
    N = m + 5
    run = rng.permutation(N)[:m].astype(np.int64)
    act = run[np.sort(rng.choice(m, rng.integers(1, m + 1), replace=False))]
    part = rng.integers(0, G, N)
    rank = rng.permutation(N)
    need = rng.integers(0, 6, (len(act), F)) * (rng.random((len(act), 1)) < 0.7)
    sums = np.zeros((G, F), dtype=np.int64)
    np.add.at(sums, part[act], need)
    free = np.floor(sums * tight).astype(np.int64) + rng.integers(0, 3, (G, F))
    own = rng.integers(0, 4, (N, F))
    pinned = rng.integers(0, 2, (N, F))
    want_keep, want_victims = _search_reference(run, act, part, rank, need, free, own + pinned)
    keep = np.ones(len(act), dtype=bool)
    over = np.zeros(G, dtype=bool)
    over[(sums > free).any(axis=1)] = True
    victims = np.empty((m, 2), dtype=np.int64)
    nv = fk._search(run, act, part, rank, np.arange(N), own, pinned, free, need, keep, over, victims)
    assert (keep == want_keep).all()
    assert victims[:nv].tolist() == [list(v) for v in want_victims]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 80), big=st.booleans())
def test_prefill_packing_equals_split_prefill(seed, n, big):
    """`prefill_rows` + `_pack` give `split_prefill`'s dispatches (one when all fit, else the
    greedy first fit), with their per-group requests and tokens, and the seeding waves."""
    rng = np.random.default_rng(seed)
    G = DEP.partitions
    idx = rng.permutation(n + 10)[:n].astype(np.int64)
    pre = rng.random(n) < 0.6
    pre[0] = True
    samples = rng.random(n) < 0.5
    num_new = rng.integers(1, C.PREFILL_TOKENS_PER_GROUP // (2 if big else 40), n)
    part = rng.integers(0, G, n + 10)
    plen = rng.integers(1, 600, n + 10)
    limits = np.array([G, DEP.prefill_batch, DEP.prefill_requests_per_partition, C.PREFILL_TOKENS_PER_GROUP])
    info, term, per_g, waves, chk = fk.prefill_rows(idx, pre, samples, num_new, part, plen, limits)
    rows = pre.nonzero()[0]
    assert info[0].tolist() == rows.tolist() and term.tolist() == rows[samples[rows]].tolist()
    sim = SimpleNamespace(rid=[f"r{i}" for i in range(n + 10)], G=G, _prefill_limits=limits)
    cmd = SimpleNamespace(idx=idx, error=None)
    got = FleetExecute._pack(sim, info, per_g, chk, cmd)
    items = [SimpleNamespace(request_id=j, partition=int(part[idx[j]]), num_tokens=int(num_new[j])) for j in rows]
    want = split_prefill(items, DEP.prefill_batch, DEP.prefill_requests_per_partition)
    assert cmd.error is None and len(got) == len(want)
    for (b_rows, b_part, b_tok, meta), w in zip(got, want):
        assert b_rows.tolist() == [it.request_id for it in w.items]
        assert (b_part == part[idx[b_rows]]).all() and (b_tok == num_new[b_rows]).all()
        assert meta["requests_per_group"] == np.bincount(b_part, minlength=G).tolist()
        assert meta["tokens_per_group"] == np.bincount(b_part, weights=b_tok, minlength=G).astype(int).tolist()
    longest = {}
    seen = {}
    for j in term.tolist():
        p = int(part[idx[j]])
        w = seen.get(p, 0)
        seen[p] = w + 1
        longest[w] = max(longest.get(w, 0), int(plen[idx[j]]))
    assert waves.tolist() == [longest[w] for w in range(len(longest))]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 300), k=st.sampled_from([0, 7]))
def test_decode_rows_equal_the_array_form(seed, n, k):
    """Decode rows, owner ranks (the lease's; K=0: the ordinal in the group), draft fit and the
    tile checks as the numpy code computed them."""
    rng = np.random.default_rng(seed)
    G, TP = DEP.partitions, C.TP_SIZE
    N = n + 10
    idx = rng.permutation(N)[:n].astype(np.int64)
    pre = rng.random(n) < 0.1
    start = rng.integers(0, 1024, n)
    num_new = rng.integers(1, 9, n)
    part = rng.integers(0, G, N)
    lease = np.where(rng.random(N) < 0.9, rng.integers(0, 64, N), -1)
    committed = rng.integers(0, 1024, N)
    limits = np.array([1024, k, G, TP, C.DECODE_BATCH, C.LOCAL_REQUESTS, C.DECODE_SEQ])
    ints, fits, per_err = fk.decode_rows(idx, pre, start, num_new, part, lease, committed, limits)
    rows, d_idx, d_part, owner, com = ints
    per, err = per_err[:G], per_err[G:]
    dec = (~pre).nonzero()[0]
    assert rows.tolist() == dec.tolist() and (d_idx == idx[dec]).all() and (d_part == part[idx[dec]]).all()
    assert (com == committed[idx[dec]]).all()
    assert (per == np.bincount(part[idx[dec]], minlength=G)).all()
    if k:
        assert (owner == lease[idx[dec]] % TP).all()
        end = start[dec] + num_new[dec]
        assert (fits == ((end < 1024 - k + 1) & (com <= 1024 - C.DECODE_SEQ))).all()
    else:
        want = np.zeros(len(dec), dtype=np.int64)
        for g in range(G):
            sel = d_part == g
            want[sel] = np.arange(int(sel.sum())) % TP
        assert (owner == want).all() and not fits.any()
    over = per > C.DECODE_BATCH
    if over.any():
        g = int(np.argmax(over))
        assert err.tolist() == [1, g, int(per[g])]
    elif k and len(dec):
        leased = lease[d_idx] >= 0
        own = np.bincount((d_part * TP + owner)[leased], minlength=G * TP)
        bad = own.reshape(G, TP).max(axis=1) > C.LOCAL_REQUESTS
        assert err[0] == (2 if bad.any() else 0)
        if bad.any():
            assert err[1] == int(np.argmax(bad))
    else:
        assert err[0] == 0


RUN = """
import json, sys
sys.path.insert(0, {tests!r})
import dataclasses
import twin
from fleet_workloads import WORKLOADS
from twin.sim.run import simulate
assert twin.__file__.startswith({tree!r}), twin.__file__
res = simulate(dataclasses.replace(WORKLOADS["tight"](), fidelity="fleet"))
print(json.dumps({{k: v for k, v in res.summary.items() if k not in ("wall_s", "sim_s_per_wall_s")}},
                 sort_keys=True, default=str))
"""


@pytest.mark.slow
def test_fleet_runs_without_a_writable_cache_and_with_bounds_checks(tmp_path):
    """No cache directory numba could write (a copy of the package whose __pycache__ is a file, no
    NUMBA_CACHE_DIR or home it can create): the kernels compile in memory, with numba's bounds
    checks on (an index out of range raises instead of reading past an array), and the tight
    workload, preemptions included, ends as it does here (~8 s: one compile)."""
    tree = tmp_path / "tree"
    shutil.copytree(os.path.join(ROOT, "twin"), tree / "twin", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "twin" / "sim" / "__pycache__").write_text("")
    env = {**os.environ, "NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": "/dev/null/numba", "HOME": "/dev/null",
           "XDG_CACHE_HOME": "/dev/null/cache", "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    code = RUN.format(tests=os.path.join(ROOT, "tests", "sim"), tree=str(tree))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "compile without numba's cache" in out.stderr
    sys.path.insert(0, os.path.join(ROOT, "tests", "sim"))
    from fleet_workloads import WORKLOADS

    res = simulate(dataclasses.replace(WORKLOADS["tight"](), fidelity="fleet"))
    here = json.dumps({k: v for k, v in res.summary.items() if k not in ("wall_s", "sim_s_per_wall_s")},
                      sort_keys=True, default=str)
    assert json.loads(out.stdout) == json.loads(here)


def test_exact_fidelity_does_not_load_numba():
    code = ("import sys; import twin.sim; from twin.sim.run import SimConfig, simulate; "
            "from twin.sim.workload import WorkloadSpec, generate; from twin.abi import deployment; "
            "simulate(SimConfig(deployment('flash', ep=16), generate(WorkloadSpec(num_requests=4, seed=1)))); "
            "print('numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "False"
