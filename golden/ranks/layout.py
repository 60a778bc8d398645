"""Which rank holds what: ranks, TP groups, o_proj groups, vocab shards, experts.

The production deployment is 16 ranks = 4 TP groups of 4 (EP16); small presets may also run the
reduced topologies twin.abi.topology allows (one group of 4 ranks, or a single rank).  Rank r is in
group r // tp, holds o_proj groups [(r % tp) * G/tp, ...), the LM-head vocab shard r % tp and the
routed experts [r * N_LOCAL, (r + 1) * N_LOCAL).
"""
from __future__ import annotations

from dataclasses import dataclass

from twin.abi.topology import Topology


@dataclass(frozen=True)
class RankLayout:
    cfg: object
    topology: Topology

    def __post_init__(self):
        self.topology.validate(self.cfg)

    @property
    def ranks(self) -> int:
        return self.topology.ranks

    @property
    def tp(self) -> int:
        return self.topology.tp

    @property
    def groups(self) -> int:
        return self.topology.partitions

    @property
    def n_local_experts(self) -> int:
        return self.topology.experts_per_rank(self.cfg)

    @property
    def o_groups_per_rank(self) -> int:
        return self.cfg.o_groups // self.tp

    @property
    def vocab_per_rank(self) -> int:
        return self.cfg.vocab_size // self.tp

    def group_of(self, rank: int) -> int:
        return rank // self.tp

    def group_ranks(self, g: int) -> range:
        return self.topology.group_ranks(g)

    def o_groups_of(self, rank: int) -> range:
        n = self.o_groups_per_rank
        return range((rank % self.tp) * n, (rank % self.tp + 1) * n)

    def vocab_of(self, rank: int) -> range:
        n = self.vocab_per_rank
        return range((rank % self.tp) * n, (rank % self.tp + 1) * n)

    def expert_rank(self, e):
        return e // self.n_local_experts


def layout_for(cfg, tp: int | None = None, ep: int | None = None) -> RankLayout:
    """The production 16-rank layout when the preset allows it, else the largest reduced one."""
    if tp is not None or ep is not None:
        return RankLayout(cfg, Topology(tp=tp or 4, ep=ep or 16))
    for t, e in ((4, 16), (4, 4), (1, 1)):
        try:
            return RankLayout(cfg, Topology(tp=t, ep=e))
        except ValueError:
            continue
    raise AssertionError("unreachable: (1, 1) is valid for every small preset")
