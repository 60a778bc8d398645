"""Paged caches addressed as the ABI lowers them (serving-contract.md §6.1, kernel-math.md §3.3).

`Span` is one request's contiguous run of tokens in a call (a prefill chunk or a decode row
group) with its block ids by cache family; `lower` turns spans into `StepMeta`: per-token slot
mappings, per-request tables and window indices, with the ABI's -1 conventions:
  ring table      entry i = ids[i mod n]                       (ori and the three state families)
  absolute table  ids at [0, n), -1 after                       (cmp_c128, cmp_c4, idx)
  paged slot      table[(pos // page) mod width] * page + pos mod page   (-1 if the entry is -1)
  compressed slot only at (pos+1) mod ratio == 0 (and column < commit): row = pos // ratio,
                  table[row // rows_per_page] * rows_per_page + row mod rows_per_page
  SWA window      128 columns of ori slots for positions max(0, p-127)..p, -1 beyond; len.
`alloc_caches` gives the per-layer pools in the ABI layout ([pages, rows_per_page, ...]).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from twin.abi.lowering.primitives import absolute_table, ring_table  # the metadata builder's own tables
from twin.abi.caches import FAMILY_NAMES, cache_families
from twin.abi.errors import AbiError

PREFILL, DECODE = "prefill", "decode"
RING_FAMILIES = ("ori", "hca_state", "csa_state", "csa_inner_state")
TABLE_NAMES = {"ori": "ori_block_table", "cmp_c128": "hca_cmp_block_table", "cmp_c4": "csa_cmp_block_table",
               "idx": "idx_block_table", "hca_state": "hca_compress_state_block_table",
               "csa_state": "csa_compress_state_block_table",
               "csa_inner_state": "csa_inner_compress_state_block_table"}


def families(cfg) -> dict:
    return {f.name: f for f in cache_families(cfg)}


@dataclass(frozen=True)
class Span:
    """One request's tokens in a call: positions start .. start+len(input_ids)-1."""

    request: int
    start: int
    input_ids: tuple[int, ...]
    blocks: dict                      # family name -> block ids in table-slot order
    commit: int | None = None         # compressed writes only for columns < commit (verify rows)

    @property
    def n(self) -> int:
        return len(self.input_ids)


@dataclass
class StepMeta:
    """Everything a forward needs besides weights and pools; arrays are NumPy, names the ABI's."""

    form: str
    input_ids: np.ndarray            # [T] int64
    position_ids: np.ndarray         # [T] int32
    req: np.ndarray                  # [T] request row of each token
    first_pos: np.ndarray            # [B] first position of each request in this call
    kv_seq_lens: np.ndarray          # [B] positions covered after the call
    swa_indices: np.ndarray          # [T, W]
    swa_lens: np.ndarray             # [T]
    logit_row_indices: np.ndarray    # [n]
    tables: dict = field(default_factory=dict)     # TABLE_NAMES values -> [B, width]
    slots: dict = field(default_factory=dict)      # ori, hca_cmp, csa_cmp, csa_idx, hca_state, csa_state, csa_inner_state

    @property
    def T(self) -> int:
        return int(self.position_ids.shape[0])

    def arrays(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("form", "tables", "slots")}
        out.update(self.tables)
        out.update({k + "_slot_mapping": v for k, v in self.slots.items()})
        return out


def paged_slot(pos, table, page: int) -> np.ndarray:
    pos = np.asarray(pos)
    ent = table[(pos // page) % table.shape[-1]]
    return np.where(ent >= 0, ent.astype(np.int64) * page + pos % page, -1)


def compressed_slot(pos, table, ratio: int, rows_per_page: int, column=None, commit=None) -> np.ndarray:
    pos = np.asarray(pos)
    row = pos // ratio
    pg = row // rows_per_page
    ent = np.where(pg < table.shape[-1], table[np.minimum(pg, table.shape[-1] - 1)], -1)
    ok = ((pos + 1) % ratio == 0) & (ent >= 0)
    if commit is not None:
        ok &= np.asarray(column) < commit
    return np.where(ok, ent.astype(np.int64) * rows_per_page + row % rows_per_page, -1)


def window_indices(pos, ori_table, page: int, W: int):
    """[T, W] ori slots of positions max(0, p-W+1)..p (oldest first), -1 beyond; lens [T]."""
    pos = np.asarray(pos)
    start = np.maximum(pos - W + 1, 0)
    lens = (pos - start + 1).astype(np.int32)
    q = start[:, None] + np.arange(W)[None, :]
    slots = paged_slot(q, ori_table, page)
    return np.where(np.arange(W)[None, :] < lens[:, None], slots, -1).astype(np.int32), lens


def table_depth(fam, max_positions: int) -> int:
    return math.ceil(max_positions / fam.page_tokens)


def lower(cfg, spans, *, form: str = PREFILL, logits: str | None = None, depths: dict | None = None) -> StepMeta:
    """Spans -> StepMeta.  Tables are `depths[family]` wide (default: the ring ids themselves for
    ring families, ceil(max_position / page_tokens) for the absolute ones, like the kernels'
    frozen depths at this preset's position ceiling)."""
    if form not in (PREFILL, DECODE):
        raise AbiError("form", form, f"'{PREFILL}' or '{DECODE}'", where="lower")
    fams = families(cfg)
    logits = logits or ("last" if form == PREFILL else "all")
    for s in spans:
        missing = set(FAMILY_NAMES) - set(s.blocks)
        if missing:
            raise AbiError("blocks", sorted(missing), "block ids for all 7 cache families", where=f"request {s.request}")
    B = max(s.request for s in spans) + 1
    depths = dict(depths or {})
    for name, fam in fams.items():
        if name not in depths:
            depths[name] = (max(len(s.blocks[name]) for s in spans) if name in RING_FAMILIES
                            else table_depth(fam, cfg.max_position_embeddings))
    tables = {TABLE_NAMES[n]: np.full((B, depths[n]), -1, np.int32) for n in fams}
    first_pos = np.zeros(B, np.int32)
    kv_seq_lens = np.zeros(B, np.int32)
    ids, pos, req, col, commit, rows = [], [], [], [], [], []
    seen = set()
    for s in spans:
        if s.request in seen:
            raise AbiError("spans", s.request, "one span per request per call", where="lower")
        seen.add(s.request)
        for name in fams:
            blk = s.blocks[name]
            if len(set(blk)) != len(blk):
                raise AbiError("blocks", name, "no physical block repeated within a request", where=f"request {s.request}")
            fn = ring_table if name in RING_FAMILIES else absolute_table
            tables[TABLE_NAMES[name]][s.request] = fn(blk, depths[name])
        if s.start < 0 or s.start + s.n > cfg.max_position_embeddings:
            raise AbiError("start", s.start, f"0 <= start and start + n <= {cfg.max_position_embeddings}",
                           where=f"request {s.request}")
        first_pos[s.request] = s.start
        kv_seq_lens[s.request] = s.start + (s.n if s.commit is None else s.commit)
        base = len(pos)
        ids += list(s.input_ids)
        pos += list(range(s.start, s.start + s.n))
        req += [s.request] * s.n
        col += list(range(s.n))
        commit += [s.commit if s.commit is not None else s.n] * s.n
        rows += [base + s.n - 1] if logits == "last" else list(range(base, base + s.n))
    pos, req, col, commit = (np.asarray(a, np.int64) for a in (pos, req, col, commit))
    tb = {n: tables[TABLE_NAMES[n]][req] for n in fams}        # per-token table rows

    def per_token(fn):
        return np.array([fn(i) for i in range(len(pos))], np.int64).reshape(len(pos))

    f = fams
    slots = {
        "ori": per_token(lambda i: paged_slot(pos[i], tb["ori"][i], f["ori"].page_tokens)),
        "hca_state": per_token(lambda i: paged_slot(pos[i], tb["hca_state"][i], f["hca_state"].page_tokens)),
        "csa_state": per_token(lambda i: paged_slot(pos[i], tb["csa_state"][i], f["csa_state"].page_tokens)),
        "csa_inner_state": per_token(lambda i: paged_slot(pos[i], tb["csa_inner_state"][i],
                                                          f["csa_inner_state"].page_tokens)),
        "hca_cmp": per_token(lambda i: compressed_slot(pos[i], tb["cmp_c128"][i], 128, f["cmp_c128"].rows_per_page,
                                                       col[i], commit[i])),
        "csa_cmp": per_token(lambda i: compressed_slot(pos[i], tb["cmp_c4"][i], 4, f["cmp_c4"].rows_per_page,
                                                       col[i], commit[i])),
        "csa_idx": per_token(lambda i: compressed_slot(pos[i], tb["idx"][i], 4, f["idx"].rows_per_page,
                                                       col[i], commit[i])),
    }
    W = cfg.sliding_window
    swa = [window_indices(pos[i:i + 1], tb["ori"][i], f["ori"].page_tokens, W) for i in range(len(pos))]
    swa_indices = np.concatenate([a for a, _ in swa]) if swa else np.zeros((0, W), np.int32)
    swa_lens = np.concatenate([b for _, b in swa]) if swa else np.zeros(0, np.int32)
    return StepMeta(form=form, input_ids=np.asarray(ids, np.int64), position_ids=pos.astype(np.int32),
                    req=req.astype(np.int32), first_pos=first_pos, kv_seq_lens=kv_seq_lens,
                    swa_indices=swa_indices, swa_lens=swa_lens,
                    logit_row_indices=np.asarray(rows, np.int32), tables=tables, slots=slots)


# ---- pools ------------------------------------------------------------------------------------
POOLS = {  # pool name -> (family, row shape builder, device dtype)
    "kv_cache": ("ori", lambda c: (1, c.head_dim), "bf16"),
    "hca_cmp_kv": ("cmp_c128", lambda c: (1, c.head_dim), "bf16"),
    "csa_cmp_kv": ("cmp_c4", lambda c: (1, c.head_dim), "bf16"),
    "idx_kv_cache": ("idx", lambda c: (1, c.index_head_dim), "i8"),
    "idx_kv_scale": ("idx", lambda c: (1, 1), "f32"),
    "hca_compress_state": ("hca_state", lambda c: (2 * c.head_dim,), "f32"),
    "csa_compress_state": ("csa_state", lambda c: (4 * c.head_dim,), "f32"),
    "csa_inner_compress_state": ("csa_inner_state", lambda c: (4 * c.index_head_dim,), "f32"),
}


def layer_pools(cfg, layer: int) -> tuple[str, ...]:
    kind = cfg.layer_kind(layer)
    extra = {"swa": (), "hca": ("hca_cmp_kv", "hca_compress_state"),
             "csa": ("csa_cmp_kv", "idx_kv_cache", "idx_kv_scale", "csa_compress_state", "csa_inner_compress_state")}
    return ("kv_cache",) + extra[kind]


def alloc_caches(cfg, pages: dict, nm, layers=None) -> list[dict]:
    """Zeroed per-layer pools: [pages[family], rows_per_page, *row] in the mode's storage dtypes."""
    import ml_dtypes
    fams = families(cfg)
    missing = set(FAMILY_NAMES) - set(pages)
    if missing:
        raise AbiError("pages", sorted(missing), "a page count for all 7 cache families", where="alloc_caches")
    dt = {"bf16": ml_dtypes.bfloat16, "i8": np.int8, "f32": np.float32}
    out = []
    for layer in (range(cfg.num_hidden_layers) if layers is None else layers):
        d = {}
        for name in layer_pools(cfg, layer):
            fam, shape, dtype = POOLS[name]
            dtype = (np.float64 if nm.exact else np.float32 if nm.mode == "official" and dtype == "i8" else
                     nm.store_dtype if dtype == "bf16" else dt[dtype])
            d[name] = nm.xp.asarray(np.zeros((pages[fam], fams[fam].rows_per_page) + shape(cfg), dtype))
        out.append(d)
    return out


def blocks_needed(cfg, max_len: int, chunk: int | None = None) -> dict:
    """Pages per request for a sequence of max_len tokens: rings as the serving formula sizes them
    (window + one in-flight chunk, default max_len), full-history families ceil(max_len / 128)."""
    return {f.name: f.max_blocks_per_seq(max_len, chunk or max_len) for f in cache_families(cfg)}


def assign_blocks(cfg, n_requests: int, max_len: int, *, rng=None, spare: int = 0, chunk: int | None = None):
    """Distinct block ids per request and family; `rng` permutes the physical ids.
    Returns (blocks per request, pages per family)."""
    need = blocks_needed(cfg, max_len, chunk)
    pages = {n: k * n_requests + spare for n, k in need.items()}
    out = [dict() for _ in range(n_requests)]
    for name, k in need.items():
        ids = np.arange(pages[name])
        if rng is not None:
            ids = rng.permutation(ids)
        for r in range(n_requests):
            out[r][name] = [int(i) for i in ids[r * k:(r + 1) * k]]
    return out, pages
