"""Every invalid preset, topology, limit and environment value is rejected with a message naming it."""
import pytest

from twin.abi import FLASH, SMALL, TINY, ConfigError, Deployment, ServingLimits, Topology, deployment, get_preset
from twin.abi.presets import flash_compress_ratios
from twin.abi.ringheap import parse_ring_heap, resolve_profiles


def test_flash_mirrors_checkpoint_config():
    f = FLASH
    assert (f.hidden_size, f.num_attention_heads, f.head_dim, f.qk_rope_head_dim, f.nope_head_dim) == (4096, 64, 512, 64, 448)
    assert (f.q_lora_rank, f.o_lora_rank, f.o_groups, f.sliding_window) == (1024, 1024, 8, 128)
    assert (f.vocab_size, f.moe_intermediate_size, f.n_routed_experts, f.num_experts_per_tok) == (129280, 2048, 256, 6)
    assert (f.num_hidden_layers, f.num_hash_layers, len(f.compress_ratios)) == (43, 3, 44)
    assert (len(f.csa_layers), len(f.hca_layers), f.swa_layers) == (21, 20, (0, 1))
    assert f.compress_ratios[:4] == (0, 0, 4, 128) and f.compress_ratios[-2:] == (4, 0)
    assert (f.index_n_heads, f.index_head_dim, f.index_topk, f.hc_mult, f.mix_hc, f.hc_dim) == (64, 128, 512, 4, 24, 16384)
    assert (f.dspark_num_layers, f.dspark_num_drafts, f.dspark_markov_rank) == (3, 7, 256)
    assert f.dspark_target_layer_ids == (40, 41, 42) and f.dspark_noise_token_id == 128799
    assert f.max_position_embeddings == 1_048_576 and f.grammar_segments == 160
    assert abs(f.softmax_scale - 0.04419417) < 1e-8 and abs(f.index_scale - 0.01104854) < 1e-8


@pytest.mark.parametrize("p", [TINY, SMALL])
def test_small_presets_keep_the_structure(p):
    assert p.small and p.hc_mult == 4 and len(p.swa_layers) == 2
    assert len(p.csa_layers) == len(p.hca_layers) + 1 >= 2 and p.num_hash_layers >= 1
    assert p.target_ratios == flash_compress_ratios(p.num_hidden_layers, 0)
    assert p.dspark_target_layer_ids == tuple(range(p.num_hidden_layers - 3, p.num_hidden_layers))
    assert p.hidden_size * p.num_hidden_layers < 4096  # small enough for a CPU forward


@pytest.mark.parametrize("field,value,match", [
    ("hidden_size", 2048, "hidden_size=2048.*Flash shape"),
    ("num_attention_heads", 32, "num_attention_heads"),
    ("hc_mult", 2, "hc_mult"),
    ("sliding_window", 64, "sliding_window"),
    ("dspark_num_drafts", 5, "dspark_num_drafts"),
    ("dspark_target_layer_ids", (39, 40, 41), "dspark_target_layer_ids"),
    ("dspark_noise_token_id", 200000, "dspark_noise_token_id"),
    ("dspark_markov_rank", 0, "dspark_markov_rank"),
    ("o_groups", 6, "o_groups"),
    ("compress_ratios", (0,) * 44, "compress_ratios"),
    ("scoring_func", "softmax", "scoring_func"),
    ("num_experts_per_tok", 300, "num_experts_per_tok"),
    ("qk_rope_head_dim", 600, "head_dim"),
    ("vocab_size", 129281, "vocab_size"),
])
def test_invalid_preset_fields(field, value, match):
    with pytest.raises(ConfigError, match=match):
        FLASH.replace(**{field: value})


def test_unknown_preset():
    with pytest.raises(ConfigError, match="preset='huge'"):
        get_preset("huge")


@pytest.mark.parametrize("kw,match", [
    (dict(tp=2), "tp=2"),
    (dict(tp=8), "tp=8"),
    (dict(ep=4), "ep=4.*small presets only"),
    (dict(ep=32), "ep=32"),
    (dict(ep=12), "ep=12"),
    (dict(tp=1, ep=1), "tp=1"),
    (dict(devices=range(15)), "devices"),
    (dict(devices=[0] * 16), "distinct"),
])
def test_invalid_topology_for_flash(kw, match):
    with pytest.raises(ConfigError, match=match):
        deployment("flash", **kw)


def test_dp_must_equal_ep_over_4():
    with pytest.raises(ConfigError, match="dp=2"):
        Deployment(FLASH, Topology(tp=4, ep=16, dp=2))
    assert Deployment(FLASH, Topology(tp=4, ep=8, dp=2)).partitions == 2


def test_small_presets_allow_reduced_topologies():
    assert deployment("tiny", ep=1, tp=1).partitions == 1
    assert deployment("tiny", ep=4).partitions == 1
    with pytest.raises(ConfigError, match="n_routed_experts"):
        Deployment(TINY.replace(n_routed_experts=12), Topology(tp=4, ep=8))


@pytest.mark.parametrize("kw,match", [
    (dict(block_size=128), "block_size=128"),
    (dict(max_num_seqs=257), "max_num_seqs=257.*64 decode requests per TP group"),
    (dict(max_num_seqs=0), "max_num_seqs=0"),
    (dict(max_model_len=1_048_577), "max_model_len=1048577"),
    (dict(max_model_len=0), "max_model_len=0"),
    (dict(num_speculative_tokens=3), "num_speculative_tokens=3"),
    (dict(temperature=0.7), "temperature=0.7.*greedy"),
    (dict(max_num_batched_tokens=4), "max_num_batched_tokens=4"),
    (dict(long_prefill_token_threshold=0), "long_prefill_token_threshold=0"),
    (dict(npu_memory_utilization=1.5), "npu_memory_utilization=1.5"),
    (dict(npu_memory_utilization=0), "npu_memory_utilization=0"),
])
def test_invalid_limits(kw, match):
    with pytest.raises(ConfigError, match=match):
        deployment("flash", **kw)


def test_limits_scale_with_partitions_and_position_embeddings():
    assert deployment("flash", ep=8, max_num_seqs=128).limits.max_num_seqs == 128
    with pytest.raises(ConfigError, match="max_num_seqs=129"):
        deployment("flash", ep=8, max_num_seqs=129)
    with pytest.raises(ConfigError, match="max_position_embeddings=16384"):
        deployment("tiny", max_model_len=16385)
    # K=0 lets a decode request cost 1 token
    assert deployment("flash", num_speculative_tokens=0, max_num_batched_tokens=1).k == 0


def test_derived_runtime_fields():
    lim = ServingLimits(max_num_batched_tokens=8192, long_prefill_token_threshold=128)
    assert lim.max_prefill_tokens_per_request == 128
    assert ServingLimits(max_num_batched_tokens=4096, long_prefill_token_threshold=8192).max_prefill_tokens_per_request == 4096
    assert ServingLimits(max_num_batched_tokens=100000, long_prefill_token_threshold=100000).max_prefill_tokens_per_request == 8192
    assert ServingLimits(enable_chunked_prefill=False, max_num_batched_tokens=8192,
                         long_prefill_token_threshold=128).max_prefill_tokens_per_request == 8192
    assert ServingLimits(num_speculative_tokens=7).speculative_prefix_cache_replay_tokens == 128
    assert ServingLimits(num_speculative_tokens=0).speculative_prefix_cache_replay_tokens == 0
    d = deployment("flash", max_num_seqs=8)
    assert (d.prefill_batch, d.prefill_requests_per_partition) == (8, 8)
    d = deployment("flash", max_num_seqs=200)
    assert (d.prefill_batch, d.prefill_requests_per_partition) == (200, 64)


GIB = 1 << 30


def test_ring_heap_grammar():
    assert parse_ring_heap("4294967296", variable="X") == (4 * GIB,) * 4
    assert parse_ring_heap(" 1073741824,1073741824,1073741824,4294967296 ", variable="X") == (GIB, GIB, GIB, 4 * GIB)
    assert parse_ring_heap("0,1024,0,2048", variable="X") == (None, 1024, None, 2048)


@pytest.mark.parametrize("text,match", [
    ("1,2", "one byte count .* or 4 comma-separated"),
    ("1000", "power of two >= 1024; 1000"),
    ("512", "512 is not"),
    ("3221225472", "3221225472 is not"),
    ("-1024", "negative"),
    ("abc", "'abc' is not an integer"),
    ("1024,,1024,1024", "comma-separated"),
])
def test_ring_heap_errors_name_variable_and_value(text, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse_ring_heap(text, variable="PYPTO_DSPARK_DECODE_RING_HEAP")
    assert "PYPTO_DSPARK_DECODE_RING_HEAP" in str(e.value)


def test_ring_heap_profiles_from_env_and_cli():
    p = resolve_profiles({"PYPTO_DSPARK_DRAFTER_RING_HEAP": "2147483648"}, ring_heap="0,0,0,1073741824")
    assert p["drafter"].resolved() == (2 * GIB,) * 4 and p["drafter"].source == "PYPTO_DSPARK_DRAFTER_RING_HEAP"
    # 0 leaves a depth unset: the runtime's compile-time heap (PTO2_HEAP_SIZE, 256 MiB), not the profile's
    assert p["prefill"].resolved() == (GIB // 4, GIB // 4, GIB // 4, GIB)
    assert p["decode"].resolved() == (GIB, GIB, GIB, 4 * GIB) and p["markov"].total == 4 * GIB
    with pytest.raises(ConfigError, match="--ring-heap"):
        resolve_profiles({}, ring_heap="7")
