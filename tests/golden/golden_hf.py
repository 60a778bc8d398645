"""The transformers `deepseek_v4` model built from a golden checkpoint (test-side only: golden itself
never imports torch).  Weights are dequantized (int8 * scale) and mapped one to one."""
import numpy as np

ABI_TO_HF_LAYER = {   # ABI name -> (HF parameter, transform of the dequantized ABI tensor)
    "attn_norm_w": ("input_layernorm.weight", None), "norm_w": ("post_attention_layernorm.weight", None),
    "hc_attn_fn": ("attn_hc.fn", None), "hc_attn_base": ("attn_hc.base", None), "hc_attn_scale": ("attn_hc.scale", None),
    "hc_ffn_fn": ("ffn_hc.fn", None), "hc_ffn_base": ("ffn_hc.base", None), "hc_ffn_scale": ("ffn_hc.scale", None),
    "wq_a": ("self_attn.q_a_proj.weight", "T"), "gamma_cq": ("self_attn.q_a_norm.weight", None),
    "wq_b": ("self_attn.q_b_proj.weight", "T"), "wkv": ("self_attn.kv_proj.weight", "T"),
    "gamma_ckv": ("self_attn.kv_norm.weight", None), "attn_sink": ("self_attn.sinks", None),
    "wo_a": ("self_attn.o_a_proj.weight", "groups"), "wo_b": ("self_attn.o_b_proj.weight", "wo_b"),
    "csa_cmp_wkv": ("self_attn.compressor.kv_proj.weight", None),
    "csa_cmp_wgate": ("self_attn.compressor.gate_proj.weight", None),
    "csa_cmp_ape": ("self_attn.compressor.position_bias", None),
    "csa_cmp_norm_w": ("self_attn.compressor.kv_norm.weight", None),
    "csa_inner_wkv": ("self_attn.compressor.indexer.kv_proj.weight", None),
    "csa_inner_wgate": ("self_attn.compressor.indexer.gate_proj.weight", None),
    "csa_inner_ape": ("self_attn.compressor.indexer.position_bias", None),
    "csa_inner_norm_w": ("self_attn.compressor.indexer.kv_norm.weight", None),
    "csa_idx_wq_b": ("self_attn.compressor.indexer.q_b_proj.weight", "T"),
    "csa_weights_proj": ("self_attn.compressor.indexer.scorer.weights_proj.weight", "T"),
    "hca_cmp_wkv": ("self_attn.compressor.kv_proj.weight", None),
    "hca_cmp_wgate": ("self_attn.compressor.gate_proj.weight", None),
    "hca_cmp_ape": ("self_attn.compressor.position_bias", None),
    "hca_cmp_norm_w": ("self_attn.compressor.kv_norm.weight", None),
    "gate_w": ("mlp.gate.weight", None), "gate_bias": ("mlp.gate.e_score_correction_bias", None),
    "shared_w1": ("mlp.shared_experts.gate_proj.weight", None), "shared_w3": ("mlp.shared_experts.up_proj.weight", None),
    "shared_w2": ("mlp.shared_experts.down_proj.weight", None),
}


def dequant(d, name):
    x = np.asarray(d[name], np.float64)
    if d[name].dtype == np.int8:
        s = np.asarray(d[name + "_scale"], np.float64)
        if name == "wo_b":                       # [G, D, OL], one scale per output row d
            return x * s[None, :, None]
        if name in ("wq_b", "csa_idx_wq_b"):     # ABI [in, out]: scale per column
            return x * s[None, :]
        return x * s.reshape(s.shape + (1,) * (x.ndim - s.ndim))
    return x


def hf_config(cfg):
    from transformers import DeepseekV4Config
    return DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
        q_lora_rank=cfg.q_lora_rank, num_experts_per_tok=cfg.num_experts_per_tok, n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts, routed_scaling_factor=cfg.routed_scaling_factor,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
        compress_rope_theta=cfg.compress_rope_theta, compress_ratios=list(cfg.target_ratios),
        num_hash_layers=cfg.num_hash_layers, qk_rope_head_dim=cfg.qk_rope_head_dim, hc_mult=cfg.hc_mult,
        hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, swiglu_limit=cfg.swiglu_limit,
        sliding_window=cfg.sliding_window, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
        rope_parameters={"rope_type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.beta_fast,
                         "beta_slow": cfg.beta_slow,
                         "original_max_position_embeddings": cfg.original_max_position_embeddings},
    )


def hf_model(ckpt, cfg):
    import torch
    from transformers import DeepseekV4ForCausalLM
    torch.manual_seed(0)
    conf = hf_config(cfg)
    conf._experts_implementation = "eager"        # grouped_mm has no float64 kernel
    conf._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(conf).to(torch.float64).eval()
    sd = {}
    m = ckpt.model()
    sd["model.embed_tokens.weight"] = np.asarray(m["embed_weight"], np.float64)
    sd["model.norm.weight"] = np.asarray(m["final_norm_w"], np.float64)
    sd["model.hc_head.hc_fn"] = m["hc_head_fn"]
    sd["model.hc_head.hc_base"] = m["hc_head_base"]
    sd["model.hc_head.hc_scale"] = m["hc_head_scale"]
    sd["lm_head.weight"] = np.asarray(m["lm_head_weight"], np.float64)
    for layer in range(cfg.num_hidden_layers):
        w, p = ckpt.layer(layer), f"model.layers.{layer}."
        for abi, (hf, how) in ABI_TO_HF_LAYER.items():
            if abi not in w or (abi == "gate_bias" and layer < cfg.num_hash_layers):
                continue
            x = dequant(w, abi)
            if how == "T":
                x = x.T
            elif how == "groups":
                x = x.reshape(-1, x.shape[-1])
            elif how == "wo_b":
                x = x.transpose(1, 0, 2).reshape(x.shape[1], -1)
            sd[p + hf] = x
        if layer < cfg.num_hash_layers:
            sd[p + "mlp.gate.tid2eid"] = np.asarray(w["tid2eid"], np.int64)
        ex = [ckpt.expert(layer, e) for e in range(cfg.n_routed_experts)]
        sd[p + "mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([dequant(e, "routed_w1"), dequant(e, "routed_w3")]) for e in ex])
        sd[p + "mlp.experts.down_proj"] = np.stack([dequant(e, "routed_w2") for e in ex])
    own = model.state_dict()
    missing = [k for k in own if k not in sd and not k.endswith("inv_freq")]
    unknown = [k for k in sd if k not in own]
    assert not missing and not unknown, (missing[:5], unknown[:5])
    for k, v in sd.items():
        t = torch.from_numpy(np.ascontiguousarray(v))
        own[k].copy_(t.to(own[k].dtype).reshape(own[k].shape))
    return model


# ---- tie-aware comparison over prefill + greedy decode ------------------------------------------
def golden_greedy(ckpt, cfg, mode, prompt, steps):
    """golden: prefill (every prompt row's logits), then `steps` greedy decode steps.  -> (tokens
    fed after the prompt, logits [len(prompt) + steps, V], per call the indexer's (score, topk) of
    every CSA layer in layer order)."""
    from golden.compose import Session, forward
    from golden.kernels.indexer import lightning_indexer
    from golden.paged import DECODE, Span, lower
    s = Session(ckpt, cfg, mode, 1, len(prompt) + steps + 1)
    calls = []

    def indexer(*a, **k):
        score, topk = lightning_indexer(*a, **k)
        calls[-1].append((np.asarray(score, np.float64), np.asarray(topk)))
        return score, topk

    def call(start, ids, form, logits=None):
        calls.append([])
        out = forward(ckpt, lower(cfg, [Span(0, start, tuple(ids), s.blocks[0])], form=form, logits=logits),
                      s.caches, cfg=cfg, nm=s.nm, indexer=indexer)
        s.caches = out.caches
        return out

    out = call(0, prompt, "prefill", logits="all")
    logits, tokens = [np.asarray(out.logits)], [int(out.sampled[-1])]
    for i in range(steps):
        out = call(len(prompt) + i, [tokens[-1]], DECODE)
        logits.append(np.asarray(out.logits))
        tokens.append(int(out.sampled[0]))
    return tokens, np.concatenate(logits), calls


def hf_with_golden_ties(model, cfg, prompt, tokens, calls, *, qat=None):
    """transformers fed the prompt and golden's tokens, with the one tie rule (golden.ties): where
    its indexer selection differs from golden's only among exactly tied scores (golden's), golden's
    selection is applied; any other difference is kept (it shows in the logits) and counted.
    qat(model): installs extra hooks and returns their handles.  -> (logits, {"adopted": rows with
    golden's tie order applied, "diverged": rows that differ in a score, "short": rows with fewer
    positive scores than index_topk among the k it selects})."""
    import torch
    from golden.ties import adopt_equivalent
    stats = {"adopted": 0, "diverged": 0, "short": 0}
    state = {"call": 0}
    handles = list(qat(model)) if qat else []
    for n, layer in enumerate(cfg.csa_layers):
        def hook(mod, args, out, n=n):
            score, g = calls[state["call"]][n]
            hf = out[0].numpy()                       # [S, k_hf], -1 = not visible
            k = hf.shape[1]
            if np.any(g[:, k:] >= 0):
                raise AssertionError("golden selected more rows than transformers' top-k width")
            mine = np.full(g.shape, -1, np.int64)
            mine[:, :k] = hf
            chosen, rows = adopt_equivalent(score, mine, g)
            stats["adopted"] += len(rows)
            stats["diverged"] += int((np.sort(chosen, -1) != np.sort(g, -1)).any(-1).sum())
            vis = (g >= 0).sum(-1)
            pos = (score > 0).sum(-1)
            stats["short"] += int(((vis == cfg.index_topk) & (pos < cfg.index_topk)).sum())
            return torch.from_numpy(chosen[:, :k]).to(out.dtype)[None]
        handles.append(model.model.layers[layer].self_attn.compressor.indexer.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model(torch.tensor(np.asarray(prompt)[None]), use_cache=True)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            logits = [out.logits[0].numpy()]
            for t in tokens[:-1]:
                state["call"] += 1
                out = model(torch.tensor([[t]]), cache=cache, use_cache=True)
                cache = out.cache if hasattr(out, "cache") else out.past_key_values
                logits.append(out.logits[0].numpy())
    finally:
        for h in handles:
            h.remove()
    return np.concatenate(logits), stats


def cosine_rows(a, b):
    return np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


# ---- the official reference's quantization-aware-training round trips, added to transformers -----
def _round_trip(x, block, fmt, fmt_max):
    """Blocks of the last axis: power-of-two (ue8m0) scale from the block's amax, cast to fmt and
    back (the official act_quant / fp4_act_quant simulation), on a float64 torch tensor."""
    import math

    import torch
    a = x.detach().numpy()
    block = math.gcd(block, a.shape[-1])            # small presets: golden's fit_block convention
    b = a.reshape(a.shape[:-1] + (a.shape[-1] // block, block))
    s = np.exp2(np.ceil(np.log2(np.maximum(np.abs(b).max(-1, keepdims=True), 1e-4) / fmt_max)))
    q = np.clip(b / s, -fmt_max, fmt_max).astype(fmt).astype(np.float64) * s
    return torch.from_numpy(q.reshape(a.shape)).to(x.dtype)


def _sylvester(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def official_qat(cfg):
    """-> qat(model) for hf_with_golden_ties: forward hooks that add the official reference's
    always-on round trips: FP8 e4m3 in blocks of 64 on the non-RoPE dims of the window KV and of
    the CSA / HCA compressors' rows, FP4 e2m1 in blocks of 32 on the Hadamard-rotated indexer
    query and keys (the rotation itself cannot change a score: it is orthonormal)."""
    import ml_dtypes
    import torch
    R = cfg.qk_rope_head_dim
    fp8, fp4 = ml_dtypes.float8_e4m3fn, ml_dtypes.float4_e2m1fn
    H = torch.from_numpy(_sylvester(cfg.index_head_dim))

    def nope_fp8(mod, args, out):
        return torch.cat([_round_trip(out[..., :-R], 64, fp8, 448.0), out[..., -R:]], -1)

    def scorer_fp4(mod, args):
        q, k, h = args
        return _round_trip(q.double() @ H, 32, fp4, 6.0), _round_trip(k.double() @ H, 32, fp4, 6.0), h

    def install(model):
        handles = []
        for layer in range(cfg.num_hidden_layers):
            attn = model.model.layers[layer].self_attn
            handles.append(attn.kv_norm.register_forward_hook(nope_fp8))
            if attn.compressor is not None:
                handles.append(attn.compressor.kv_norm.register_forward_hook(nope_fp8))
            if cfg.target_ratios[layer] == 4:
                handles.append(attn.compressor.indexer.scorer.register_forward_pre_hook(scorer_fp4))
        return handles
    return install
