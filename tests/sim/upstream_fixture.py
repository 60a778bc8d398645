"""Drive the twin's scheduler through one of upstream's recorded scheduler runs.

A fixture folder (`tests/sim/data/upstream-scheduler/<run>/`, a copy of the project's shared
`fixtures/upstream-scheduler/`, so a fresh clone runs it) holds
upstream's settings, workload and decisions (see its README).  `replay` builds the twin's
scheduler and block manager with the same settings, feeds the same workload, answers every step
with the same fake runner and runs the same async depth-2 loop, recording what `config.json`
says upstream recorded: per dispatched step the scheduled items and the used pages per family and
partition after schedule and after apply, and the admissions and preemptions in order.
"""
from __future__ import annotations

import gzip
import json
from collections import deque
from pathlib import Path

from twin.sim.decisions import DecisionLog
from twin.sim.kvcache import FamilySpec, KvCacheManager
from twin.abi.batches import Request, Sampling
from twin.sim.scheduler import Scheduler, SchedulerConfig, SchedulerProbe

FIXTURES = Path(__file__).resolve().parent / "data" / "upstream-scheduler"
RUNS = ("seed20-n200", "burst-seed21-n120", "slots2-seed22-n150")


def _lines(path: Path):
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def load(run: str) -> dict:
    d = FIXTURES / run
    if not d.is_dir():
        raise FileNotFoundError(f"upstream scheduler fixture {d} is missing (tests/sim/data holds the three runs)")
    return {"config": json.loads((d / "config.json").read_text()), "workload": _lines(d / "workload.jsonl.gz"),
            "decisions": _lines(d / "decisions.jsonl.gz"), "events": _lines(d / "events.jsonl.gz")}


class _Events(SchedulerProbe):
    def __init__(self):
        self.log: list = []
        self.step = 0

    def admitted(self, req, hit_tokens, fallback):
        self.log.append((self.step, "admit", req.request_id, hit_tokens, req.partition, fallback))

    def preempted(self, req, by):
        self.log.append((self.step, "preempt", req.request_id, by.request_id))


def build(cfg: dict) -> Scheduler:
    fams = tuple(FamilySpec(n, f["page_tokens"], f["sliding_window"], f["max_blocks_per_seq"],
                            f["blocks_per_partition"]) for n, f in cfg["families"].items())
    kv = KvCacheManager(fams, cfg["partitions"], prefix_caching=cfg["enable_prefix_cache"])
    scfg = SchedulerConfig(cfg["max_num_scheduled_tokens"], cfg["max_num_running_reqs"],
                           min(cfg["max_prefill_tokens_per_request"], cfg["long_prefill_token_threshold"]),
                           cfg["max_seq_len"], cfg["num_speculative_tokens"], cfg["enable_prefix_cache"],
                           cfg["speculative_prefix_cache_replay_tokens"], async_depth=cfg["batch_queue_depth"])
    return Scheduler(scfg, kv, probe=_Events())


def fake_tokens(cmd, cfg: dict) -> dict[str, list[int]]:
    """config.json's fake runner: a terminal prefill chunk returns one token, a decode three when
    `start + num_new - 1 + K < max_seq_len`, else one; every token is 7 and there is no EOS."""
    k, L, tok = cfg["num_speculative_tokens"], cfg["max_seq_len"], cfg["fake_runner"]["token_value"]
    out = {}
    for s in cmd.scheduled:
        if s.prefill:
            if s.samples:
                out[s.req.request_id] = [tok]
        else:
            out[s.req.request_id] = [tok] * (3 if s.start + s.num_new - 1 + k < L else 1)
    return out


def _used(kv: KvCacheManager) -> dict[str, list[int]]:
    per = [kv.used_pages(p) for p in range(kv.partitions)]
    return {n: [u[n] for u in per] for n in kv.names}


def replay(fx: dict, max_steps: int | None = None, log: bool = False):
    """The twin's decisions on the fixture's workload, in the fixture's record format (and, with
    `log`, the run's decision log)."""
    cfg = fx["config"]
    s = build(cfg)
    dlog = DecisionLog(s) if log else None
    for w in fx["workload"]:
        s.add_request(Request(w["id"], w["prompt"], Sampling(w["max_new_tokens"], None, True), w["arrival"]))
    depth = cfg["batch_queue_depth"]
    inflight: deque = deque()
    steps: list[dict] = []
    rec = {}
    while True:
        dispatched = False
        if len(inflight) < depth and s.has_work:
            s.probe.step = len(steps) + 1
            cmd = s.schedule()
            if cmd.scheduled:
                s.advance_after_schedule(cmd)
                rec[cmd.step_id] = d = {
                    "step": len(steps) + 1,
                    "items": [[x.req.request_id, "P" if x.prefill else "D", x.start, x.num_new, x.req.partition]
                              for x in cmd.scheduled],
                    "used_after_sched": _used(s.kv)}
                steps.append(d)
                inflight.append(cmd)
                dispatched = True
        if inflight and (len(inflight) == depth or not dispatched):
            cmd = inflight.popleft()
            s.check_stop(s.update_from_output(cmd, fake_tokens(cmd, cfg)))
            rec[cmd.step_id]["used_after_apply"] = _used(s.kv)
        if not inflight and not dispatched:
            if not s.has_work:
                break
            raise AssertionError(f"stalled after {len(steps)} steps: work left, nothing schedulable")
        if max_steps is not None and len(steps) >= max_steps and not inflight:
            break
    if log:
        return steps, s.probe.log, dlog.done()
    return steps, s.probe.log


def upstream_events(fx: dict) -> list:
    """The fixture's admissions and preemptions in `replay`'s event format."""
    out = []
    for phase, step, kind, rid, d in fx["events"]:
        if kind == "admit":
            out.append((step, "admit", rid, d["hit"], d["part"], d["fallback"]))
        elif kind == "preempt":
            out.append((step, "preempt", rid, d["by"]))
    return out
