"""Paged pools as the kernels address them: a flat row index `slot = page * rows_per_page + row`,
-1 meaning "no read / no write" (kernel-math.md §3.3)."""
from __future__ import annotations

import torch


def flat(pool):
    """[pages, rows_per_page, *row] -> [pages * rows_per_page, *row] (a view)."""
    return pool.reshape(pool.shape[0] * pool.shape[1], *pool.shape[2:])


def get_rows(pool_flat, slots):
    """Rows at `slots` (zeros where the slot is -1), in FP32."""
    ok = slots >= 0
    out = pool_flat[torch.where(ok, slots, 0)].to(torch.float32)
    return torch.where(ok.reshape(ok.shape + (1,) * (out.dim() - ok.dim())), out, torch.zeros((), dtype=out.dtype))


def set_rows(pool_flat, slots, values):
    """Write `values` at the slots >= 0, in place, cast to the pool's storage dtype."""
    ok = slots >= 0
    if bool(ok.any()):
        pool_flat[slots[ok]] = values[ok].to(pool_flat.dtype)


def ring_slot(table_row, pos, page: int):
    """The state rings' read address: table[(pos // page) mod width] * page + pos mod page; -1 for
    pos < 0 or an unmapped entry.  table_row [n, width], pos [n, k]."""
    width = table_row.shape[-1]
    p = torch.clamp(pos, min=0)
    ent = torch.gather(table_row, -1, (p // page) % width).to(torch.int64)
    return torch.where((pos >= 0) & (ent >= 0), ent * page + p % page, torch.full_like(ent, -1))


def table_slot(table_row, row, rows_per_page: int):
    """A compressed row's storage slot through an absolute table: -1 beyond the depth or unmapped.
    table_row [n, width], row [n, k]."""
    width = table_row.shape[-1]
    pg = torch.clamp(row, min=0) // rows_per_page
    ent = torch.gather(table_row, -1, torch.clamp(pg, max=width - 1)).to(torch.int64)
    ok = (row >= 0) & (pg < width) & (ent >= 0)
    return torch.where(ok, ent * rows_per_page + torch.clamp(row, min=0) % rows_per_page, torch.full_like(ent, -1))
