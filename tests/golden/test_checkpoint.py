"""Synthetic checkpoints (real names, W8A8 layout, lazy per (layer, expert)) and the safetensors
loader, tested on a small checkpoint directory written here."""
import os

import ml_dtypes
import numpy as np
import pytest

from golden.checkpoint import (SafetensorsCheckpoint, SyntheticCheckpoint, real_names, save_checkpoint,
                               write_safetensors)
from golden.compose import Session
from twin.abi.errors import AbiError
from twin.abi.presets import FLASH, SMALL, TINY
from twin.abi.programs import WEIGHT, eval_dim, get_program, symbols
from twin.abi.topology import deployment


def test_lazy_and_deterministic_per_layer_and_expert():
    a, b = SyntheticCheckpoint(SMALL, seed=3), SyntheticCheckpoint(SMALL, seed=3)
    e7 = b.expert(5, 7)                                  # generation order does not matter
    assert np.array_equal(a.expert(5, 7)["routed_w2"], e7["routed_w2"])
    assert np.array_equal(np.asarray(a.layer(4)["wkv"], np.float32), np.asarray(b.layer(4)["wkv"], np.float32))
    assert not np.array_equal(a.expert(5, 7)["routed_w2"], a.expert(5, 8)["routed_w2"])
    assert not np.array_equal(a.layer(2)["wq_b"], SyntheticCheckpoint(SMALL, seed=4).layer(2)["wq_b"])
    w = a.layer(2)
    assert w["wq_b"].dtype == np.int8 and w["wq_b_scale"].dtype == np.float32 and w["wkv"].dtype == ml_dtypes.bfloat16
    assert np.all(w["gate_bias"] == 0) or 2 >= SMALL.num_hash_layers
    assert "tid2eid" in a.layer(0) and "tid2eid" not in a.layer(2)
    tid = a.layer(1)["tid2eid"]
    assert tid.shape == (SMALL.vocab_size, SMALL.num_experts_per_tok)
    assert all(len(set(r)) == SMALL.num_experts_per_tok for r in tid[:50])
    with pytest.raises(AbiError, match="layer=11"):
        a.layer(11)
    with pytest.raises(AbiError, match="expert=32"):
        a.expert(0, 32)


def _per_layer_shape(arg, syms, n_kind):
    dims = [eval_dim(d, syms) for d in arg.dims[1:]]
    first = dims[0] // n_kind
    if "LOCAL_O_GROUPS" in arg.dims[1]:
        first *= syms["TP"]                              # golden holds all groups; ranks hold TP shards
    if "N_LOCAL" in arg.dims[1]:
        first //= syms["N_LOCAL"]                        # per expert
    shape = [first] + dims[1:]
    return tuple(shape[1:] if shape[0] == 1 and len(shape) > 1 else shape)


@pytest.mark.parametrize("cfg,layers", [(FLASH, (3, 4)), (SMALL, (0,))])
def test_tensor_shapes_follow_the_abi(cfg, layers, flash_ckpt, small_ckpt):
    """Every per-layer weight of l3_prefill_fwd has the ABI's shape (FLASH: one layer generated alone)."""
    ck = flash_ckpt if cfg is FLASH else small_ckpt
    syms = symbols(deployment(cfg, max_model_len=4096))
    prog = get_program("l3_prefill_fwd")
    seen = set()
    for layer in layers:
        w = {**ck.layer(layer), **ck.expert(layer, 0)}
        for arg in prog.args:
            if arg.role != WEIGHT or arg.name not in w:
                continue
            head = arg.dims[1]
            n = syms["NC"] if head.startswith("NC") else syms["NH"] if head.startswith("NH") else syms["NL"]
            if not head.startswith(("NL", "NC", "NH")):
                continue
            assert tuple(np.shape(w[arg.name])) == _per_layer_shape(arg, syms, n), arg.name
            seen.add(arg.name)
    assert len(seen) >= (35 if cfg is FLASH else 20)
    if cfg is FLASH:
        return                                           # the 1 GiB embedding and head: shapes checked on SMALL
    model = ck.model()
    for name in ("embed_weight", "hc_head_fn", "hc_head_base", "final_norm_w"):
        assert model[name].shape == tuple(eval_dim(d, syms) for d in get_program("l3_decode_fwd").arg(name).dims[1:])
    assert model["lm_head_weight"].shape == (cfg.vocab_size, cfg.hidden_size)     # TP shards concatenated


def test_real_names():
    names = real_names(TINY)
    for n in ("embed.weight", "head.weight", "norm.weight", "hc_head_fn", "layers.0.ffn.gate.tid2eid",
              "layers.2.attn.indexer.wq_b.weight", "layers.2.attn.indexer.wq_b.weight_scale",
              "layers.2.attn.indexer.compressor.ape", "layers.3.attn.compressor.norm.weight",
              "layers.4.ffn.experts.15.w2.weight_scale", "layers.6.ffn.shared_experts.w1.weight",
              "layers.1.attn.attn_sink", "layers.5.hc_ffn_fn", "layers.5.ffn.gate.bias"):
        assert n in names, n
    assert "layers.0.ffn.gate.bias" not in names and "layers.3.attn.indexer.wq_b.weight" not in names


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tiny_ckpt):
    path = str(tmp_path_factory.mktemp("tiny_ckpt"))
    save_checkpoint(tiny_ckpt, path)
    return path


def test_written_files_are_real_safetensors(tiny_dir, tiny_ckpt):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    files = sorted(f for f in os.listdir(tiny_dir) if f.endswith(".safetensors"))
    seen = {}
    for f in files:
        with safe_open(os.path.join(tiny_dir, f), framework="pt") as fh:
            for k in fh.keys():
                seen[k] = fh.get_tensor(k)
    assert set(seen) == set(real_names(TINY))
    wq_b = seen["layers.2.attn.wq_b.weight"]
    assert wq_b.dtype == torch.int8 and tuple(wq_b.shape) == (TINY.num_attention_heads * TINY.head_dim, TINY.q_lora_rank)
    assert tuple(seen["layers.2.attn.wq_b.weight_scale"].shape) == (TINY.num_attention_heads * TINY.head_dim, 1)
    assert seen["embed.weight"].dtype == torch.bfloat16
    emb = seen["embed.weight"].view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    assert np.array_equal(emb, tiny_ckpt.model()["embed_weight"])


def test_loader_roundtrip_from_a_torch_written_directory(tmp_path, tiny_dir, tiny_ckpt):
    """A directory written by the safetensors library itself (torch tensors) loads to the same
    weights and the same logits."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file
    src = SafetensorsCheckpoint(tiny_dir, TINY)
    out = {}
    for name in src.names():
        x = src.raw(name)
        out[name] = (torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16) if x.dtype == ml_dtypes.bfloat16
                     else torch.from_numpy(x.copy()))
    save_file(out, str(tmp_path / "model.safetensors"))
    ld = SafetensorsCheckpoint(str(tmp_path), TINY)
    for layer in (0, 2, 3):
        a, b = ld.layer(layer), tiny_ckpt.layer(layer)
        assert set(a) == set(b)
        for k in a:
            assert np.array_equal(np.asarray(a[k], np.float64), np.asarray(b[k], np.float64)), k
    e = ld.expert(4, 9)
    assert np.array_equal(e["routed_w1"], tiny_ckpt.expert(4, 9)["routed_w1"])
    ids = np.random.default_rng(0).integers(0, TINY.vocab_size, 40)
    got = Session(ld, TINY, "device", 1, 48).run({0: ids}).logits
    want = Session(tiny_ckpt, TINY, "device", 1, 48).run({0: ids}).logits
    assert np.array_equal(got, want)


def test_loader_names_bad_directories_and_tensors(tmp_path):
    with pytest.raises(AbiError, match="checkpoint_dir"):
        SafetensorsCheckpoint(str(tmp_path), TINY)
    write_safetensors(str(tmp_path / "a.safetensors"), {"embed.weight": np.zeros((4, 4), np.float32)})
    ck = SafetensorsCheckpoint(str(tmp_path), TINY)
    with pytest.raises(AbiError, match="tensor='head.weight'"):
        ck.raw("head.weight")
    with pytest.raises(AbiError, match="embed.weight"):
        ck.model()
