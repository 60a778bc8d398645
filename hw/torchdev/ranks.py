"""The deployment's ranks as one process holds them, and every read of another rank's values.

`Ranks(R)` holds all R ranks in this process.  `Ranks.split(R, rank, world)` is process `rank` of
`world` under torch.distributed (its default group, gloo on CPU), holding the contiguous slice
[rank R / world, (rank + 1) R / world); world must divide R.

The programs compute per rank only for `mine` and keep per-rank values as lists of R entries
(None for a rank another process holds).  The one cross-rank primitive is `gather`: every
process's entries, everywhere.  The reductions (the o_proj reduce-scatter, the MoE combine, the
vocabulary shards) are written on top of it as "gather the operands, then do the in-process
arithmetic in rank order", so a split run performs the same operations in the same order on the
same values as the one-process run and is bit-identical to it by construction, for any world.
Every process must make the same sequence of `gather` calls (they are collectives): the calls
depend on the program and the layer, never on a rank's data.
"""
from __future__ import annotations

from typing import Callable

import torch

from twin.abi.errors import AbiError


class Ranks:
    """All R ranks of the deployment in this process (the in-process form)."""

    world = 1
    rank = 0

    def __init__(self, R: int, lo: int = 0, hi: int | None = None):
        self.R, self.lo, self.hi = R, lo, R if hi is None else hi
        self.mine = range(self.lo, self.hi)

    @staticmethod
    def split(R: int, rank: int, world: int) -> "Ranks":
        """Process `rank` of `world` (torch.distributed's default group): a contiguous slice."""
        if world == 1:
            return Ranks(R)
        if world < 1 or R % world:
            raise AbiError("world", world, f"a process count dividing the deployment's {R} ranks "
                           f"({', '.join(str(w) for w in range(1, R + 1) if R % w == 0)})", where="TorchBackend")
        n = R // world
        return DistRanks(R, rank * n, (rank + 1) * n, rank, world)

    def slice_of(self, rank: int) -> range:
        """The ranks process `rank` holds."""
        n = self.R // self.world
        return range(rank * n, (rank + 1) * n)

    # ---- per-rank values --------------------------------------------------------------------------
    def local(self, fn: Callable[[int], object]) -> list:
        """[R] fn(r) for the ranks this process holds, None for the others."""
        return [fn(r) if self.lo <= r < self.hi else None for r in range(self.R)]

    def stack(self, per: list) -> torch.Tensor:
        """[len(mine), ...] this process's entries, in rank order."""
        return torch.stack([per[r] for r in self.mine])

    def of(self, stacked, r: int):
        """Rank r's entry of a stack of this process's ranks."""
        if not self.lo <= r < self.hi:
            raise IndexError(f"rank {r} is not held here (ranks {self.lo}..{self.hi - 1})")
        return stacked[r - self.lo]

    # ---- the cross-rank primitive -----------------------------------------------------------------
    def gather(self, *per: list):
        """Each [R] list completed with the other processes' entries (one collective for all of them)."""
        return per[0] if len(per) == 1 else per

    def share(self, obj) -> list:
        """[world] every process's `obj`, in process order."""
        return [obj]


class DistRanks(Ranks):
    """A contiguous slice of the ranks; the other processes' entries arrive by gloo collectives."""

    def __init__(self, R: int, lo: int, hi: int, rank: int, world: int):
        super().__init__(R, lo, hi)
        self.rank, self.world = rank, world

    def share(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def gather(self, *per: list):
        mine = [[p[r] for r in self.mine] for p in per]
        full = [[None] * self.R for _ in per]
        for proc, vals in enumerate(self.share(mine)):
            for j, r in enumerate(self.slice_of(proc)):
                for k in range(len(per)):
                    full[k][r] = vals[k][j]
        return full[0] if len(per) == 1 else tuple(full)
