"""Monitoring probes: the engine and the scheduler call these hooks; nothing reads them back.

The recorder keeps raw rows (plain tuples and lists, cheap to append) that `metrics` turns into
pandas frames and `risk` scans for the situations upstream reported failing or unsafe.
"""
from __future__ import annotations

from array import array
from time import perf_counter, process_time

import numpy as np

from .scheduler import SchedulerProbe


class Recorder(SchedulerProbe):
    def __init__(self, env, scheduler=None, *, partitions: int, k: int):
        self.env = env
        self.sched = scheduler
        self.partitions, self.k = partitions, k
        self.req: dict[str, dict] = {}
        self.itl = array("d")
        self.wall: list[float] = []           # host wall clock per step (speed measurement only)
        self.cpu: list[float] = []            # process CPU time per step (speed on a loaded machine)
        self.steps: list[tuple] = []          # (step, t, n_prefill, n_decode, tokens, waiting, running, live per partition)
        self.dispatches: list[tuple] = []     # (step, kind, start, seconds, meta, parts)
        self.pages: list[tuple] = []          # (t, partition, family, used)
        self.accept_hist = np.zeros(self.k + 2 if k else 2, dtype=np.int64)
        self.fallbacks = 0
        self.events: list[tuple] = []         # (t, kind, request, detail)
        self.prefix = {"queries": 0, "hits": 0, "query_tokens": 0, "hit_tokens": 0, "fallbacks": 0}
        self._page_every = 1
        self.client_queue: dict[str, float] = {}   # request -> client-side wait under --max-concurrency (s)
        self.host_lanes: list[tuple] = []          # (lane, step, start, end): schedule / prepare / reclaim

    # ---- scheduler probe -----------------------------------------------------------------------
    def arrived(self, req):
        self.req[req.request_id] = {"arrival": req.arrival, "prompt_len": req.prompt_len, "first": None,
                                    "last": None, "chunks": 0, "stream": []}

    def admitted(self, req, hit_tokens, fallback):
        d = self.req.get(req.request_id)
        if d is not None and d.get("admitted") is None:
            d["admitted"] = self.env.now
            p = self.prefix                      # recorded once per request, as upstream
            p["queries"] += 1
            p["query_tokens"] += req.prompt_len
            p["hits"] += hit_tokens > 0
            p["hit_tokens"] += hit_tokens
            p["fallbacks"] += fallback
            d["cached"] = hit_tokens

    def preempted(self, req, by):
        self.events.append((self.env.now, "preempt", req.request_id,
                            {"outputs": len(req.outputs), "by": by.request_id, "partition": req.partition}))

    def finished(self, req):
        d = self.req.setdefault(req.request_id, {"arrival": req.arrival, "prompt_len": req.prompt_len,
                                                 "first": None, "last": None, "chunks": 0, "stream": []})
        d["end"] = self.env.now

    def stop_in_chunk(self, req, index, n_new):
        self.events.append((self.env.now, "stop_in_chunk", req.request_id, {"at_output": index, "chunk": n_new}))

    # ---- engine hooks --------------------------------------------------------------------------
    def scheduled(self, cmd, sched):
        n_pre = len(cmd.prefill.items)
        live = tuple(sched.kv.load)
        self.steps.append((cmd.step_id, self.env.now, n_pre, len(cmd.decode.items), cmd.num_tokens,
                           len(sched.waiting), len(sched.running), live))
        self.wall.append(perf_counter())
        self.cpu.append(process_time())
        if cmd.step_id % self._page_every == 0:
            kv = sched.kv
            t = self.env.now
            for p in range(kv.partitions):
                for f, fam in enumerate(kv.families):
                    self.pages.append((t, p, fam.name, fam.blocks_per_partition - len(kv.free[f][p])))

    def dispatch(self, cmd, d, start):
        self.dispatches.append((cmd.step_id, d.kind, start, d.seconds, d.meta, d.parts))

    def applied(self, cmd, res, touched):
        now = self.env.now
        itl = self.itl
        for req, n in touched:
            if n == 0:
                continue
            d = self.req[req.request_id]
            d["stream"].append((now, n, cmd.step_id))   # per streamed chunk: vLLM's itls, the trace's flows
            if d["first"] is None:
                d["first"] = now
            else:
                itl.append(now - d["last"])
            d["last"] = now
            d["chunks"] += 1
        if res.accepted:
            drafts = res.drafts
            verified = [c for rid, c in res.accepted.items() if drafts.get(rid)]
            self.fallbacks += len(res.accepted) - len(verified)
            if verified:                          # one histogram update per step
                self.accept_hist += np.bincount(verified, minlength=len(self.accept_hist))

    def host(self, lane: str, step: int, start: float, end: float):
        self.host_lanes.append((lane, step, start, end))

    def worker_error(self, cmd, error):
        self.events.append((self.env.now, "worker_error", None, {"step": cmd.step_id, "error": error}))

    def livelock(self, info):
        self.events.append((self.env.now, "livelock", None, dict(info)))

    def stall(self, req):
        self.events.append((self.env.now, "stall", req.request_id, {"reason": req.finish_detail}))
