"""One FLASH-shaped layer runs on this machine: weights generated lazily for just that layer and
the experts its tokens route to; device against exact within the layer tolerance."""
import numpy as np

from golden.compose import device_meta, layer_step, rope_inputs
from golden.numerics import Numerics
from golden.paged import DECODE, Span, alloc_caches, assign_blocks, lower
from twin.abi.presets import FLASH


def test_one_flash_csa_layer_decode_rows(flash_ckpt):
    cfg, layer, S, pos0 = FLASH, 4, 4, 260
    ck = flash_ckpt
    rng = np.random.default_rng(0)
    blocks, pages = assign_blocks(cfg, 1, pos0 + S, chunk=S)
    spans = [Span(0, pos0, tuple(rng.integers(0, cfg.vocab_size, S)), blocks[0])]
    meta = lower(cfg, spans, form=DECODE)
    x_hc = rng.standard_normal((S, cfg.hc_mult, cfg.hidden_size))
    outs = {}
    for mode in ("exact", "device"):
        nm = Numerics(mode)
        pools = alloc_caches(cfg, pages, nm, layers=[layer])[0]
        hist = np.random.default_rng(5)          # the same resident history in both modes
        for name, p in pools.items():
            if name == "idx_kv_cache":
                p[:] = hist.integers(-127, 128, p.shape)
            elif name == "idx_kv_scale":
                p[:] = hist.uniform(0.005, 0.02, p.shape)
            else:
                p[:] = nm.bf16(hist.standard_normal(p.shape)) if "state" not in name else hist.standard_normal(p.shape)
        from golden.compose import Taps
        taps = Taps()
        x, new = layer_step(x_hc, layer, ck, pools, device_meta(meta, nm), rope_inputs(cfg, meta.position_ids, nm),
                            cfg=cfg, nm=nm, form=DECODE, taps=taps)
        outs[mode + "_taps"] = taps
        assert x.shape == x_hc.shape and np.all(np.isfinite(x))
        assert new["csa_cmp_kv"].shape[1:] == (32, 1, cfg.head_dim)
        outs[mode] = x
    # W8A8 + bf16 noise at the FLASH shape: ~1-3 % relative L2 per stage, same routing
    t_dev, t_ex = outs["device_taps"], outs["exact_taps"]
    rl2 = lambda k: np.linalg.norm(np.asarray(t_dev[k], np.float64) - t_ex[k]) / np.linalg.norm(t_ex[k])
    assert rl2((layer, "kv")) < 0.01 and rl2((layer, "attn_out")) < 0.03 and rl2((layer, "x_hc")) < 0.05
    # same experts (their order may swap on a near-tie of the biased scores)
    assert np.array_equal(np.sort(t_dev[(layer, "moe_indices")], -1), np.sort(t_ex[(layer, "moe_indices")], -1))
