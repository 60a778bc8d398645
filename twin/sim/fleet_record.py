"""The fleet fidelity's recorder: per-step rows and array updates, turned at the end into the
same raw rows as `probes.Recorder` so `metrics` and `risk` read either fidelity unchanged."""
from __future__ import annotations

from time import perf_counter, process_time

import numpy as np


class FleetRecorder:
    def __init__(self, *, partitions: int, k: int, families: tuple[str, ...]):
        self.partitions, self.k, self.families = partitions, k, families
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.steps: list[tuple] = []
        self.dispatches: list[tuple] = []
        self._free: list[tuple[float, np.ndarray]] = []
        self._itl: list[np.ndarray] = []
        self._stream: list[tuple] = []         # (time, step, sampled rows, their output counts after)
        self._accepted: list[tuple[np.ndarray, np.ndarray]] = []
        self.accept_hist = np.zeros(k + 2 if k else 2, dtype=np.int64)
        self.fallbacks = 0
        self.events: list[tuple] = []
        self.prefix = {"queries": 0, "hits": 0, "query_tokens": 0, "hit_tokens": 0, "fallbacks": 0}
        self.req: dict[str, dict] = {}
        self.pages: list[tuple] = []
        self.itl = np.zeros(0)
        self.client_queue: dict[str, float] = {}   # the fleet engine has no closed loop: always empty
        self.host_lanes: list[tuple] = []          # the fleet engine charges host time inside its steps
        self.sim = None

    # ---- hooks (the fleet engine calls them) -------------------------------------------------------
    def arrived(self, i: int) -> None:
        pass                                   # arrival times are the requests' own

    def admitted(self, i: int, hit: int, fallback: bool, now: float) -> None:
        sim = self.sim
        if sim.admitted[i] != sim.admitted[i]:           # NaN: the first admission
            sim.admitted[i] = now
            p = self.prefix
            p["queries"] += 1
            p["query_tokens"] += sim._plen[i]
            p["hits"] += hit > 0
            p["hit_tokens"] += hit
            p["fallbacks"] += fallback

    def preempted(self, v: int, by: int, outputs: int, partition: int, now: float) -> None:
        rid = self.sim.rid
        self.events.append((now, "preempt", rid[v], {"outputs": outputs, "by": rid[by], "partition": partition}))

    def stop_in_chunk(self, i: int, index: int, n_new: int, now: float) -> None:
        self.events.append((now, "stop_in_chunk", self.sim.rid[i], {"at_output": index, "chunk": n_new}))

    def stall(self, i: int, reason: str, now: float) -> None:
        self.events.append((now, "stall", self.sim.rid[i], {"reason": reason}))

    def worker_error(self, step: int, error: str, now: float) -> None:
        self.events.append((now, "worker_error", None, {"step": step, "error": error}))

    def scheduled(self, cmd, sim) -> None:
        n_pre = cmd.n_prefill
        self.steps.append((cmd.step_id, sim.now, n_pre, len(cmd.idx) - n_pre, cmd.tokens,
                           len(sim.waiting), len(sim.running), tuple(sim.kv.load.tolist())))
        self.wall.append(perf_counter())
        self.cpu.append(process_time())
        self._free.append((sim.now, sim.kv.free.copy()))

    def dispatch(self, step: int, kind: str, start: float, secs: float, meta: dict, parts: dict) -> None:
        self.dispatches.append((step, kind, start, secs, meta, parts))

    def applied(self, itl: np.ndarray, cmd) -> None:
        """A step applied: its sampled rows' inter-token gaps (NaN for a request's first token,
        dropped once, at finalize; first / last / chunks are the engine's arrays) and the decode
        rows' acceptance."""
        self._itl.append(itl)
        sim = self.sim
        # the sampled rows are the ones whose stream time is now (apply_rows sets it), in row order
        rows = cmd.idx[sim.last[cmd.idx] == sim.now]
        if len(rows) != len(itl):
            raise AssertionError(f"step {cmd.step_id}: {len(rows)} rows stamped now, {len(itl)} gaps")
        self._stream.append((sim.now, cmd.step_id, rows, sim.n_out[rows].copy()))
        if cmd.accepted is not None:               # the decode rows' (accepted counts, drafted)
            self._accepted.append(cmd.accepted)    # counted once, at finalize (a bincount a step cost ~1%)

    # ---- the raw rows `metrics` reads ---------------------------------------------------------------
    def finalize(self, sim) -> None:
        if self._accepted:
            counts = np.concatenate([c for c, _ in self._accepted])
            fits = np.concatenate([f for _, f in self._accepted])
            nf = int(np.count_nonzero(fits)) if self.k else 0
            if nf:
                self.accept_hist += np.bincount(counts[fits], minlength=len(self.accept_hist))
            self.fallbacks += len(fits) - nf
            self._accepted = []
        self.itl = np.concatenate(self._itl) if self._itl else np.zeros(0)
        self.itl = self.itl[~np.isnan(self.itl)]
        if self._free:
            # one row per (step, partition, family), built from flat lists rather than nested loops
            G, F = self.partitions, len(self.families)
            used = sim.kv.cap[None, None, :] - np.stack([f for _, f in self._free])
            times = np.repeat([t for t, _ in self._free], G * F).tolist()
            parts = np.tile(np.repeat(np.arange(G), F), len(self._free)).tolist()
            self.pages.extend(zip(times, parts, list(self.families) * (G * len(self._free)), used.ravel().tolist()))
        self._free = []
        streams = self._streams()
        cols = [[None if x != x else x for x in a.tolist()] for a in (sim.first, sim.last, sim.admitted, sim.end)]
        for i, (rid, arr, pl, ch, ca, fi, la, ad, en) in enumerate(zip(
                sim.rid, sim.arrival.tolist(), sim.plen.tolist(), sim.chunks.tolist(), sim.cached.tolist(), *cols)):
            self.req[rid] = {"arrival": arr, "prompt_len": pl, "first": fi, "last": la, "chunks": ch,
                             "admitted": ad, "cached": ca, "end": en, "stream": streams.get(i, [])}

    def _streams(self) -> dict[int, list[tuple[float, int, int]]]:
        """Per request, its streamed chunks as (time, tokens, step): the output count's steps
        between successive chunks (the exact recorder's `stream` rows)."""
        if not self._stream:
            return {}
        t = np.concatenate([np.full(len(r), now) for now, _, r, _ in self._stream])
        st = np.concatenate([np.full(len(r), s, dtype=np.int64) for _, s, r, _ in self._stream])
        rows = np.concatenate([r for _, _, r, _ in self._stream])
        outs = np.concatenate([o for *_, o in self._stream]).astype(np.int64)
        order = np.argsort(rows, kind="stable")          # per request, in time order
        t, st, rows, outs = t[order], st[order], rows[order], outs[order]
        new = np.diff(outs, prepend=0)
        first = np.ones(len(rows), bool)
        first[1:] = rows[1:] != rows[:-1]
        new[first] = outs[first]
        self._stream = []
        out: dict[int, list] = {}
        for i, ti, ni, si in zip(rows.tolist(), t.tolist(), new.tolist(), st.tolist()):
            out.setdefault(i, []).append((ti, ni, si))
        return out
