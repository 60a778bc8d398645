"""golden: the DeepSeek-V4-Flash DSpark target model as NumPy / JAX reference kernels.

Contract: /work/shared/reference/kernel-math.md (K1-K19, §3, §5).  Imports only `twin.abi`.

Numerics (`golden.numerics`)
    Numerics("device" | "exact" | "official", xp=numpy)  - mode + array namespace, passed as `nm=`.
    device: bf16 storage, W8A8 per-row INT8 (amax floor 1e-4, 127, half-even), f32 rounding points,
    in-kernel sums carried in float64 and rounded once (batch- and padding-invariant bits);
    exact: float64, no rounding; official: FP8 e4m3 / FP4 e2m1 block round trips with ue8m0 scales,
    following the checkpoint's weight dtype (numerics(mode, cfg=cfg) / Numerics.for_config(cfg):
    FP8 linear inputs only for FP8 weights, FP32 activations for an FP32 checkpoint).
    Numerics.rotation(hadamard): the indexer's rotation (exact +-1/sqrt(d) outside device mode).

Ties (`golden.ties`): the tie rules for top-k selections
    equivalent_rows(scores, a, b) / adopt_equivalent(scores, mine, theirs) -> (selection, rows)
    index_gaps(scores, mine, theirs, xp=np) / index_near_ties(..., tol=INDEX_TIE_TOL): the
        indexer's near tie (the lockstep against a device, the JAX path against NumPy)

Kernels (`golden.kernels.<family>`; ABI argument names; functions, state in and out)
    embedding.lookup_embedding       rmsnorm.rms_norm
    hyper_connections.hc_pre / hc_post / hc_head / sinkhorn
    rope.rope_rows / rope_rotate / rope_tail / inv_freq (the formula is twin.abi.rope's) (swa and YaRN compress profiles)
    qkv_proj_rope.qkv_proj_rope      -> q, kv, qr (int8 values), qr_scale
    compressor.compressor (ratio 4 overlapping / ratio 128) and .indexer_compressor (INT8 + scale)
    indexer.lightning_indexer        -> score, topk_idxs (offset 0, -1 padded)
    sparse_attention.sparse_attention (+ hca_rows, csa_rows visibility helpers)
    o_proj.o_proj / o_proj_partial / pack_groups
    moe.gate / swiglu_expert / shared_expert / routed_expert / moe_experts (grouped dispatch)
    lm_head.lm_head / greedy_sample (first maximum) / sampled_ids_pad

Paged caches (`golden.paged`)
    Span(request, start, input_ids, blocks_by_family, commit=None)
    lower(cfg, spans, form="prefill"|"decode") -> StepMeta (slot mappings, tables, window indices,
        the ABI's -1 conventions, serving-contract.md §6.1)
    alloc_caches(cfg, pages, nm) -> [per-layer {pool name: array}], ABI layout and dtypes
    assign_blocks(cfg, n_requests, max_len, rng=...) -> distinct (optionally permuted) block ids

Compositions (`golden.compose`)
    forward(ckpt, meta, caches, cfg=, nm=, taps=) -> ForwardOut(logits, sampled, caches, x_hc, taps)
    prefill_fwd(ckpt, caches, spans, ...)   packed, chunked, against each request's resident prefix
    decode_fwd(ckpt, caches, spans, ...)    S rows per request, logits for every row
    layer_step / attention_sublayer / moe_sublayer / moe_router / final_head   the per-layer pieces
        (ratio= overrides the layer's attention kind: DSpark draft layers are SWA with ids 40..42)
    Taps(stages=None): (layer, stage) -> array; stages attn_in, x_mixed, x_norm, q, kv, cmp_kv,
        idx_topk, attn, attn_out, attn_x_hc, ffn_x_mixed, moe_indices, moe_weights, ffn_out, x_hc;
        ("head", hidden | x_norm | logits)
    target_hidden(taps, model, cfg=, nm=, tap="hc_head_of_outputs" | "mean_of_inputs") -> [T, 3D]
    Session(ckpt, cfg, nm, n_requests, max_len, seed=None).run({request: ids}, form)  (driver)

Weights (`golden.checkpoint`)
    SyntheticCheckpoint(cfg, seed)  .model() .layer(l) .expert(l, e)  (lazy, seeded per tensor)
    SafetensorsCheckpoint(dir, cfg) same protocol over a real checkpoint directory (official names,
        W8A8: int8 `.weight` + f32 `.weight_scale`); save_checkpoint(ckpt, dir); real_names(cfg)
Real checkpoints (`golden.release`)
    RealCheckpoint(dir, cfg)        the official release (FP8 e4m3 + ue8m0 `.scale` blocks, FP4 e2m1
        experts) or the W8A8 serving layout, tensor by tensor; .drafter(): the `mtp.*` drafter
        (DSpark serving names; the V4.1 Markov-head names too); save_drafter(dckpt, dir) (W8A8,
        beside save_checkpoint's target); release_names(cfg); ue8m0,
        dequant_fp8, dequant_fp4, fp4_e2m1

JAX (`golden.jax_path`, `golden.jax_numerics`)
    JaxGolden(ckpt, cfg, mode, compiler_options=None, verify_bf16=False, device=None,
        layers=None).forward(meta, caches, donate=False, taps=None, extents=None,
        resync_from=None)  - the whole step in one jit (key: form,
        candidate-count buckets, layout); device mode accumulates in FP32 (Fp32Numerics: BF16
        operands where both factors are BF16 values, kernel-math's rounding points, exact INT8
        GEMMs; verify_bf16 checks the operands and sets `bf16_operands_ok`), exact mode in float64;
        equal to NumPy within kernel-math's FP32 tolerances (tie-aware); pools come back as JAX
        arrays (to_numpy(tree) converts), donate=True updates them in place; taps from
        JAX_TAP_STAGES; resync_from=NumPy's taps (RESYNC_STAGES) adopts its routing and its
        indexer selections at near ties (`jg.resyncs`); .layer_step(x_hc, layer, meta, pools):
        one held layer (layers=); .sublayer("attn" | "moe", x_hc, layer, meta, pools): one of its
        sub-layers with every stage tapped (the site checker's); .resident(pools): a layer's pools
        on the device
    golden.jax_resync: agreement(out, ref, resyncs) (kernel-math §2 per logit row);
        jax_admissible(cfg, program, mode, max_len=) -> (bool, why): where a checker may use JAX

Process setup (`golden.heap`, `golden.blas`)
    heap.retain_heap() -> glibc settings used (None elsewhere): freed temporaries stay in the heap
        for the next step's reuse; blas.blas_threads(n) / single_threaded_blas(): NumPy's OpenBLAS
        threads (golden's many small GEMMs run fastest on one)

Building on it (Golden II): run `forward` with `Taps(stages=["attn_in", "x_hc"])`, take
`target_hidden(...)` for the drafter input, call `layer_step` for draft layers with your own
caches, and `final_head` / `lm_head` + `greedy_sample` for the heads.  Caches are plain per-layer
dicts: pass them in, take the returned ones.
"""
