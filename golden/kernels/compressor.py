"""K7 / K8 / K9: the overlapping ratio-4 compressor, the ratio-128 compressor and the indexer
compressor, with their paged state pools; one formulation serves prefill and decode.

Every token projects kv and score rows (score += ape[pos mod ratio]) and writes [kv | score] to its
state slot.  A boundary token p ((p+1) mod ratio == 0) pools a window of rows by a per-channel
softmax over the scores:
  ratio 4 (overlap): the FRONT halves of positions p-7..p-4 and the BACK halves of p-3..p;
  ratio 128:         positions p-127..p.
A row comes from this call's fresh projections when its position is at or after the request's
first position in the call, otherwise from the old state through the request's state table
(ring slot: table[(pos // page) mod width] * page + pos mod page).  Negative positions and
unmapped pages are excluded (score -inf, kv 0).

Two named contracts say which boundaries a call pools and in which order state and pooling go:
  EAGER_PUBLISH  serving's contract (the default): every boundary of the call is pooled and
                 published, from the call's own projections; state is committed after pooling,
                 so pooling never reads a row this call writes.
  DEVICE_KERNEL  pypto-lib's decode kernels (decode_compressor_ratio4 / _ratio128 /
                 decode_indexer_compressor): state rows are written first, then each request pools
                 only the first boundary of its call, every window row read back from the state
                 (a row this call wrote is read as written, also where a short ring aliases it).
They agree on a call with at most one boundary per request whose window rows do not alias.
"""
from __future__ import annotations

from .rmsnorm import rmsnorm_f
from .rope import compressed_rows, rope_tail_bf16

EXCLUDE, ZERO = "exclude", "zero"     # how a missing (unmapped) state row enters the softmax
EAGER_PUBLISH, DEVICE_KERNEL = "eager-publish", "device-kernel"
CONTRACTS = (EAGER_PUBLISH, DEVICE_KERNEL)


def _contract_plan(contract, positions, req, first_pos, sel, is_b, state, state_slot_mapping, kvp, scp, ratio, nm):
    """-> (state to pool from, first positions that count as fresh, is_b, committed state or None):
    the order and the boundaries the contract prescribes (module docstring)."""
    xp = nm.xp
    if contract == EAGER_PUBLISH:
        return state, first_pos, is_b, None
    if contract != DEVICE_KERNEL:
        from twin.abi.errors import AbiError
        raise AbiError("contract", contract, f"one of {CONTRACTS}", where="compressor")
    written = nm.set_rows(state, state_slot_mapping, xp.concatenate([kvp, scp], -1))
    first_b = (positions[sel] - first_pos[req[sel]]) < ratio          # the request's first boundary
    never_fresh = xp.full(first_pos.shape, xp.iinfo(xp.int64).max)     # every row from the state
    return written, never_fresh, is_b & first_b, written


def compress_project(x, wkv, wgate, ape, positions, *, ratio, nm, proj=None):
    """kv and score projections [T, OUT] (f32, not rounded); ape indexed by position mod ratio.
    proj: the (x @ wkv.T, x @ wgate.T) products when the caller already has them (the JAX path's
    one fused projection GEMM)."""
    if proj is None:
        xf = nm.asf(x)
        proj = nm.mm(xf, nm.asf(wkv).T), nm.mm(xf, nm.asf(wgate).T)
    kvp, scp = proj[0], proj[1] + nm.asf(ape)[positions % ratio]
    return nm.r32(kvp), nm.r32(scp)             # f32 rows: the same bits as the state pool holds


def window_len(ratio: int) -> int:
    return 2 * ratio if ratio == 4 else ratio


def pool_rows(kvp, scp, sel, positions, req, first_pos, state, state_table, *, ratio, nm, missing=EXCLUDE):
    """Pooled [len(sel), d] for the tokens `sel` (each treated as a window end)."""
    xp = nm.xp
    T, OUT = kvp.shape
    overlap = ratio == 4
    d = OUT // 2 if overlap else OUT
    rw = window_len(ratio)
    p = positions[sel]
    r = req[sel]
    qpos = p[:, None] - (rw - 1) + xp.arange(rw)[None, :]
    fresh = qpos >= first_pos[r][:, None]
    fidx = xp.clip(sel[:, None] - (p[:, None] - qpos), 0, T - 1)
    page, width = state.shape[1], state_table.shape[1]
    lp = xp.where(qpos >= 0, qpos, 0) // page
    ent = state_table[r[:, None], lp % width]
    from_state = (qpos >= 0) & ~fresh & (ent >= 0)
    st = nm.get_rows(state, xp.where(from_state, ent * page + qpos % page, -1))
    st = nm.asf(st)
    kv = xp.where(fresh[..., None], kvp[fidx], st[..., :OUT])
    sc = xp.where(fresh[..., None], scp[fidx], st[..., OUT:])
    if overlap:
        kv = xp.concatenate([kv[:, :ratio, :d], kv[:, ratio:, d:]], axis=1)
        sc = xp.concatenate([sc[:, :ratio, :d], sc[:, ratio:, d:]], axis=1)
    valid = (qpos >= 0) & (fresh | (ent >= 0))
    if missing == ZERO:     # pypto prefill ratio-128 golden: a missing row scores 0, kv 0 (§7 #15)
        zero = (qpos >= 0) & ~fresh & (ent < 0)
        sc = xp.where(zero[..., None], 0.0, sc)
        valid = valid | zero
    kv = xp.where(valid[..., None], kv, 0.0)
    sc = xp.where(valid[..., None], sc, -xp.inf)
    m = xp.max(sc, axis=1, keepdims=True)
    # exp only of valid scores (exp(-inf) is ~4x slower in NumPy's SIMD exp); the rest is 0
    e = xp.where(valid[..., None], xp.exp(xp.where(valid[..., None], sc - m, 0.0)), 0.0)
    return xp.sum(e * kv, axis=1) / xp.sum(e, axis=1)


def boundary_selection(positions, ratio, nm):
    """(sel, is_boundary[sel]): NumPy pools only boundary tokens; JAX pools all, masked later."""
    xp = nm.xp
    mask = (positions + 1) % ratio == 0
    if nm.is_numpy:
        sel = xp.nonzero(mask)[0]
        return sel, mask[sel]
    return xp.arange(positions.shape[0]), mask


def compressor(x, positions, req, first_pos, compress_state, state_block_table, state_slot_mapping,
               cmp_kv, cmp_slot_mapping, wkv, wgate, ape, norm_w, cmp_cos, cmp_sin, *, ratio, cfg, nm,
               missing=EXCLUDE, selection=None, proj=None, pool_branch=None, contract=EAGER_PUBLISH):
    """Main KV compressor (ratio 4 = CSA, ratio 128 = HCA).

    x [T, D] attn-normed; positions/req [T]; first_pos [B]; cmp_cos/sin [T, R] rows of the compress
    profile at the window start p - ratio + 1.  Returns (cmp_kv, compress_state, (sel, rows)) where
    rows [len(sel), HD] are the compressed rows (bf16 values) of the selected tokens.  selection and
    proj as in `indexer_compressor`; pool_branch(rows, compress_state, shape) runs
    rows(compress_state), the pooling, whose result has `shape` (the JAX path skips it at run time in
    a call without a real boundary).  contract: EAGER_PUBLISH or DEVICE_KERNEL (module docstring);
    under DEVICE_KERNEL the rows of boundaries it does not pool are still returned, not written."""
    kvp, scp = compress_project(x, wkv, wgate, ape, positions, ratio=ratio, nm=nm, proj=proj)
    sel, is_b = selection if selection is not None else boundary_selection(positions, ratio, nm)
    read, fresh_from, is_b, committed = _contract_plan(contract, positions, req, first_pos, sel, is_b, compress_state,
                                                       state_slot_mapping, kvp, scp, ratio, nm)

    def rows(state):
        pooled = pool_rows(kvp, scp, sel, positions, req, fresh_from, state, state_block_table, ratio=ratio, nm=nm,
                           missing=missing)
        return compressed_rows(pooled, norm_w, cmp_cos[sel], cmp_sin[sel], cfg=cfg, nm=nm)
    y = (rows(read) if pool_branch is None else
         pool_branch(rows, read, (sel.shape[0], cmp_kv.shape[-1])))
    slots = nm.xp.where(is_b, cmp_slot_mapping[sel], -1)
    cmp_kv = nm.set_rows(cmp_kv, slots, nm.store_bf16(y))
    if committed is None:
        committed = nm.set_rows(compress_state, state_slot_mapping, nm.xp.concatenate([kvp, scp], -1))
    return cmp_kv, committed, (sel, y)


def indexer_compressor(x, positions, req, first_pos, inner_state, state_block_table, state_slot_mapping,
                       idx_kv_cache, idx_kv_scale, idx_slot_mapping, inner_wkv, inner_wgate, inner_ape,
                       inner_norm_w, hadamard, cmp_cos, cmp_sin, *, cfg, nm, selection=None, proj=None,
                       contract=EAGER_PUBLISH):
    """K9: ratio-4 overlapping pooling at IHD, rms + RoPE + Hadamard, then quant-on-write: int8
    rows + f32 scale (device), the FP4-rounded values (official), raw float64 (exact).  `selection`
    = (sel, is_boundary) chosen by the caller (the JAX path passes a static-length host list);
    proj as in `compress_project`; contract as in `compressor`.  Returns (idx_kv_cache,
    idx_kv_scale, inner_state, (sel, rows as stored, dequantized; the rotated rows before
    quantization, f32 values: the kernel's `kv` output))."""
    xp = nm.xp
    kvp, scp = compress_project(x, inner_wkv, inner_wgate, inner_ape, positions, ratio=4, nm=nm, proj=proj)
    sel, is_b = selection if selection is not None else boundary_selection(positions, 4, nm)
    read, fresh_from, is_b, committed = _contract_plan(contract, positions, req, first_pos, sel, is_b, inner_state,
                                                       state_slot_mapping, kvp, scp, 4, nm)
    pooled = pool_rows(kvp, scp, sel, positions, req, fresh_from, read, state_block_table, ratio=4, nm=nm)
    y = rope_tail_bf16(rmsnorm_f(pooled, inner_norm_w, nm, cfg.rms_norm_eps), cmp_cos[sel], cmp_sin[sel], nm)
    pre = nm.r32(nm.mm(y, nm.rotation(hadamard)))
    y = nm.bf16(pre)
    if nm.mode == "device":
        y_q, dq = nm.q8(y)
    else:
        y_q, dq = nm.fp4(y), xp.ones(y.shape[:-1] + (1,), nm.f)
    slots = xp.where(is_b, idx_slot_mapping[sel], -1)
    idx_kv_cache = nm.set_rows(idx_kv_cache, slots, y_q)
    idx_kv_scale = nm.set_rows(idx_kv_scale, slots, dq)
    if committed is None:
        committed = nm.set_rows(inner_state, state_slot_mapping, xp.concatenate([kvp, scp], -1))
    return idx_kv_cache, idx_kv_scale, committed, (sel, y_q * dq, pre)
