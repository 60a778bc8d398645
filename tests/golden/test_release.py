"""Real checkpoints (golden.release): the release formats decoded against formulations written here,
and small checkpoints in both layouts (target and drafter) written with the safetensors library by
the tests, loaded back and run."""
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")
import ml_dtypes  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from golden.checkpoint import (SyntheticCheckpoint, _expert_specs, _layer_specs, _model_specs,  # noqa: E402
                               save_checkpoint, to_real)
from golden.dspark import step as S  # noqa: E402
from golden.dspark.weights import (DrafterCheckpoint, draft_expert_specs, draft_layer_specs,  # noqa: E402
                                  draft_model_specs)
from golden.release import (RealCheckpoint, dequant_fp4, dequant_fp8, fp4_e2m1, release_names,  # noqa: E402
                            save_drafter, ue8m0)
from twin.abi.errors import AbiError  # noqa: E402
from twin.abi.presets import TINY  # noqa: E402


# ---- the formats, decoded independently ----------------------------------------------------------
def e4m3_by_bits(b):
    """FP8 e4m3fn from its bits: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
    subnormal (m / 8 * 2^-6); 0x7F / 0xFF are NaN (no infinities)."""
    b = np.asarray(b, np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 0x7
    v = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    return np.where((b & 0x7F) == 0x7F, np.nan, sign * v)


def test_ue8m0_is_a_power_of_two_per_byte():
    e = np.arange(255, dtype=np.uint8)
    np.testing.assert_array_equal(ue8m0(e), [2.0 ** (int(k) - 127) for k in e])
    assert ue8m0(np.array([127], np.uint8))[0] == 1.0
    with pytest.raises(AbiError, match="scale"):
        ue8m0(np.array([255], np.uint8))


def test_fp4_e2m1_codes_and_nibble_order():
    codes = np.arange(16)
    want = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    # ml_dtypes' own e2m1 decoding of the 16 codes agrees with the table
    np.testing.assert_array_equal(codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32), want)
    packed = np.array([[0x21, 0xF8]], np.uint8)        # low nibble first: (1, 2) then (8, 15)
    np.testing.assert_array_equal(fp4_e2m1(packed), [[0.5, 1.0, -0.0, -6.0]])
    # torch's packed e2m1 x2 type holds the same bytes the release stores
    t = torch.from_numpy(packed).view(torch.float4_e2m1fn_x2)
    assert t.view(torch.uint8).numpy().tolist() == packed.tolist()


def test_fp8_block_dequant_against_the_bits():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 256, (70, 45)).astype(np.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x10                     # no NaNs
    scale = rng.integers(120, 135, (-(-70 // 32), -(-45 // 32))).astype(np.uint8)
    got = dequant_fp8(bits.view(ml_dtypes.float8_e4m3fn), scale, 32)
    r, c = np.meshgrid(np.arange(70), np.arange(45), indexing="ij")
    want = e4m3_by_bits(bits) * 2.0 ** (scale[r // 32, c // 32].astype(np.int64) - 127)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(AbiError, match="scale"):
        dequant_fp8(bits, scale[:, :1], 32)


def test_fp4_dequant_scales_each_32_inputs():
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, (3, 48)).astype(np.uint8)        # [3, 96] values
    scale = rng.integers(110, 140, (3, 3)).astype(np.uint8)
    got = dequant_fp4(packed, scale)
    codes = np.stack([packed & 15, packed >> 4], -1).reshape(3, 96)
    vals = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    want = vals * 2.0 ** (np.repeat(scale, 32, axis=1).astype(np.int64) - 127)
    np.testing.assert_array_equal(got, want)


# ---- writers: the release layout from golden weights (safetensors' own encoder) ---------------------
def _e8m0_for(amax, fmt_max):
    """The smallest power-of-two scale that brings amax within the format: its e8m0 byte."""
    e = np.ceil(np.log2(np.maximum(amax, 1e-30) / fmt_max)).astype(np.int64)
    return np.clip(e + 127, 0, 254).astype(np.uint8)


def encode_fp8(w, block):
    out, n = w.shape
    pad = np.zeros((-(-out // block) * block, -(-n // block) * block))
    pad[:out, :n] = np.abs(w)
    amax = pad.reshape(pad.shape[0] // block, block, pad.shape[1] // block, block).max(axis=(1, 3))
    e = _e8m0_for(amax, 448.0)
    s = np.repeat(np.repeat(2.0 ** (e.astype(np.int64) - 127), block, 0), block, 1)[:out, :n]
    q = (w / s).astype(ml_dtypes.float8_e4m3fn)
    return torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn), \
        torch.from_numpy(e).view(torch.float8_e8m0fnu)


def encode_fp4(w, store="F4"):
    """store "F4": safetensors' e2m1 x2 type (element shape); "I8": the packed bytes [out, in / 2]."""
    out, n = w.shape
    e = _e8m0_for(np.abs(w).reshape(out, n // 32, 32).max(-1), 6.0)
    s = np.repeat(2.0 ** (e.astype(np.int64) - 127), 32, 1)
    codes = (w / s).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    w = torch.from_numpy(packed)
    w = w.view(torch.float4_e2m1fn_x2) if store == "F4" else w.view(torch.int8)
    return w, torch.from_numpy(e).view(torch.float8_e8m0fnu)


FP8_BF16 = ("wq_a", "wkv", "main_proj_weight")          # BF16 in golden, FP8 in the release


def release_tensors(sources, block, fp4="F4"):
    """{official name: torch tensor}: INT8 entries and a few BF16 matrices as FP8 + `.scale`,
    routed experts as FP4 + `.scale`, everything else as BF16 / F32 values."""
    t = {}
    for src, specs, expert in sources:
        for abi, (real, _, dtype) in specs.items():
            x = to_real(abi, np.asarray(src[abi]))           # official [out, in]
            if dtype == "i8":                                 # INT8 x one scale per output row
                x = x.astype(np.float64) * np.asarray(src[abi + "_scale"], np.float64).reshape(-1, 1)
            if dtype == "i8" or abi in FP8_BF16:
                w, s = encode_fp4(x, fp4) if expert else encode_fp8(x.reshape(x.shape[0], -1), block)
                t[real], t[real[:-len("weight")] + "scale"] = w, s
            elif dtype == "bf16":
                t[real] = torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16)
            elif dtype == "f32":
                t[real] = torch.from_numpy(np.asarray(x, np.float32))
            else:
                t[real] = torch.from_numpy(np.asarray(x))
    return t


def write_release(path, ck, dk, *, block=32, fp4="F4"):
    cfg = ck.cfg
    sources = [(ck.model(), _model_specs(cfg), False), (dk.model(), draft_model_specs(cfg), False)]
    for l in range(cfg.num_hidden_layers):
        sources.append((ck.layer(l), _layer_specs(cfg, l), False))
        sources += [(ck.expert(l, e), _expert_specs(cfg, l, e), True) for e in range(cfg.n_routed_experts)]
    for l in range(cfg.dspark_num_layers):
        sources.append((dk.layer(l), draft_layer_specs(cfg, l), False))
        sources += [(dk.expert(l, e), draft_expert_specs(cfg, l, e), True) for e in range(cfg.n_routed_experts)]
    t = release_tensors(sources, block, fp4)
    half = sorted(t)[: len(t) // 2]
    save_file({k: t[k].contiguous() for k in half}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: t[k].contiguous() for k in t if k not in half}, str(path / "model-00002-of-00002.safetensors"))
    return t


CK, DK = SyntheticCheckpoint(TINY, 11), DrafterCheckpoint(TINY, 11)


@pytest.fixture(scope="module", params=["F4", "I8"])
def release_dir(tmp_path_factory, request):
    """A TINY release: FP8 blocks of 32 (V4.1's edge), FP4 experts stored either way."""
    p = tmp_path_factory.mktemp("release")
    write_release(p, CK, DK, fp4=request.param)
    return p


def test_every_release_name_is_mapped_and_stored(release_dir):
    ck = RealCheckpoint(str(release_dir), TINY)
    names = set(ck.names())
    want = release_names(TINY)
    assert set(want) <= names
    # every FP8 / FP4 weight carries its scale and nothing else is left over
    scales = {n for n in names if n.endswith(".scale")}
    assert {n[:-len("scale")] + "weight" for n in scales} <= set(want)
    assert names - set(want) == scales
    fp4 = ck.stored_dtype("mtp.1.ffn.experts.3.w2.weight")
    assert fp4 in ("F4", "I8")
    assert {ck.stored_dtype(n) for n in names} == {"F8_E4M3", "F8_E8M0", fp4, "BF16", "F32", "I32"}
    assert "mtp.0.main_proj.weight" in names and "mtp.2.markov_head.markov_w1.weight" in names


def test_release_weights_load_within_their_format_error(release_dir):
    """FP8 carries 3 mantissa bits (relative error <= 2^-4 of a block's scale), FP4 e2m1 1 bit; the
    loader's W8 requantization adds half a step of amax / 127 per row."""
    ck = RealCheckpoint(str(release_dir), TINY)
    dk = ck.drafter()
    src = CK.layer(2)["wq_b"].astype(np.float64) * CK.layer(2)["wq_b_scale"][None, :]
    got = ck.layer(2)["wq_b"].astype(np.float64) * ck.layer(2)["wq_b_scale"][None, :]
    amax = np.abs(src).max()
    assert np.max(np.abs(got - src)) <= amax * (2.0 ** -3 + 1 / 254)
    assert ck.layer(2)["wq_b"].dtype == np.int8
    e_src = DK.expert(1, 3)["routed_w2"].astype(np.float64) * DK.expert(1, 3)["routed_w2_scale"][:, None]
    e_got = dk.expert(1, 3)["routed_w2"].astype(np.float64) * dk.expert(1, 3)["routed_w2_scale"][:, None]
    # e2m1's widest gap is 2 (between 4 and 6) of a scale that puts the block amax in (3, 6]
    row_amax = np.abs(e_src).max(axis=1, keepdims=True)
    assert np.all(np.abs(e_got - e_src) <= row_amax * (2 / 6 + 1 / 254))
    assert np.array_equal(np.asarray(dk.model()["final_norm_weight"], np.float32),
                          np.asarray(DK.model()["final_norm_weight"], np.float32))
    assert dk.model()["confidence_head_weight"].dtype == np.float32
    assert "hc_head_fn" in dk.model()


def test_release_checkpoint_runs_the_fused_step(release_dir):
    ck = RealCheckpoint(str(release_dir), TINY)
    prompt = tuple(int(t) for t in np.random.default_rng(2).integers(0, TINY.vocab_size, 30))
    g = S.Golden(TINY, ck, ck.drafter(), max_model_len=64)
    run = S.generate(g, [S.Prompt("r", prompt, 12)], k=7)
    ref = S.generate(S.Golden(TINY, ck, None, max_model_len=64), [S.Prompt("r", prompt, 12)], k=0)
    assert S.outputs(run) == S.outputs(ref) and len(S.outputs(run)["r"]) == 12


def test_w8a8_serving_checkpoint_loads_bit_for_bit(tmp_path):
    """Target (save_checkpoint) and drafter (mtp.* names, own experts) in the W8A8 layout: every tensor
    comes back as written, and the run equals the synthetic weights' run token for token."""
    save_checkpoint(CK, str(tmp_path))
    save_drafter(DK, str(tmp_path))
    ck = RealCheckpoint(str(tmp_path), TINY)
    dk = ck.drafter()
    for got, want in ((dk.layer(2), DK.layer(2)), (dk.expert(0, 5), DK.expert(0, 5)), (dk.model(), DK.model()),
                      (ck.layer(3), CK.layer(3))):
        for k in want:
            if want[k] is not None:
                assert np.array_equal(np.asarray(got[k], np.float64), np.asarray(want[k], np.float64)), k
    assert "mtp.0.ffn.experts.5.w1.weight" in ck.names() and "mtp.2.confidence_head.proj.weight" in ck.names()
    prompt = tuple(int(t) for t in np.random.default_rng(3).integers(0, TINY.vocab_size, 25))
    runs = [S.generate(S.Golden(TINY, c, d, max_model_len=64), [S.Prompt("r", prompt, 10)], k=7)
            for c, d in ((ck, dk), (CK, DK))]
    assert S.outputs(runs[0]) == S.outputs(runs[1])
    assert runs[0].counters.summary() == runs[1].counters.summary()


# ---- the real release's tensor list --------------------------------------------------------------
def _fixture():
    import json
    import os
    with open(os.path.join(os.path.dirname(__file__), "data", "v4_flash_release_tensors.json")) as f:
        return json.load(f)


# stored dtype -> the golden dtypes it can become (FP8 / FP4 dequantized, then rounded or W8-quantized)
TAKES = {"FP8": {"bf16", "i8"}, "FP4": {"i8"}, "BF16": {"bf16", "f32"}, "F32": {"f32"}, "I64": {"i32"}}


def _release_entries(fx, cfg):
    out = list(map(tuple, fx["model"]))
    for l in (0, 2, 3, 4, cfg.num_hidden_layers - 1):
        kind = {0: [], 4: fx["layer_ratio4"], 128: fx["layer_ratio128"]}[cfg.compress_ratios[l]]
        gate = fx["layer_hash"] if l < cfg.num_hash_layers else fx["layer_scored"]
        out += [(f"layers.{l}.{n}", d, s) for n, d, s in fx["layer_common"] + gate + kind]
    for st in range(cfg.dspark_num_layers):
        out += [(f"mtp.{st}.{n}", d, s) for n, d, s in fx["layer_common"] + fx["layer_scored"]]
    for prefix in ("layers.3", "layers.42", "mtp.1"):
        for e in (0, 255):
            out += [(f"{prefix}.ffn.experts.{e}.{n}", d, s) for n, d, s in fx["expert"]]
    return out


def test_the_loader_maps_every_tensor_of_the_real_release():
    """Every tensor the FLASH release holds (fixture: sources named in it) is one golden reads, with
    the official shape golden's orientation rule gives and a stored dtype it decodes."""
    from golden.release import fp8_block, real_shape
    from twin.abi.presets import FLASH
    fx = _fixture()
    names = release_names(FLASH)
    entries = _release_entries(fx, FLASH)
    assert len(entries) > 200
    for name, dtype, shape in entries:
        assert name in names, name
        abi, want_dtype, abi_shape = names[name]
        official = real_shape(abi, abi_shape)
        stored = [shape[0], 2 * shape[1]] if dtype == "FP4" else shape
        assert list(official) == stored, (name, official, shape)
        assert want_dtype in TAKES[dtype], (name, dtype, want_dtype)
        if dtype == "FP8":
            scale = [-(-n // fx["fp8_block"]) for n in shape]
            assert fp8_block(shape, scale) == fx["fp8_block"]
    # and nothing golden reads is missing from the release's layer plan (hash / scored, each kind)
    listed = {n for n, _, _ in entries}
    for name in names:
        head = name.split(".")
        if head[0] == "layers" and int(head[1]) in (0, 2, 3, 4, 42) and "experts." not in name:
            assert name in listed, name
        if head[0] == "mtp" and "experts." not in name:
            assert name in listed, name


def test_real_shape_is_to_reals_orientation():
    """The shape rule the fixture test uses is the orientation rule the writer and loader use."""
    from golden.release import real_shape
    specs = {**_model_specs(TINY), **_layer_specs(TINY, 2), **_layer_specs(TINY, 3), **_expert_specs(TINY, 3, 1)}
    ck = {**CK.model(), **CK.layer(2), **CK.layer(3), **CK.expert(3, 1)}
    for abi, (_, shape, _) in specs.items():
        assert real_shape(abi, shape) == to_real(abi, np.asarray(ck[abi])).shape, abi
