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
