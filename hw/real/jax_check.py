"""The site checker's choice of golden: NumPy (the reference), or the JAX path where it is admissible.

`--checker-golden numpy|jax|auto`: numpy (the default) runs every site check on NumPy; jax runs a
target layer's sub-layer on the JAX path (`golden.jax_path.JaxGolden.sublayer`) for every program
that `golden.jax_resync.jax_admissible` admits, and refuses a run holding any other target program;
auto takes JAX where admissible and NumPy elsewhere, saying why.  The head, the drafter site and the
localization of a failing dispatch stay on NumPy.

A JAX check judges the device as the NumPy check does: the same taps compared under the same
policy (`hw.real.site_check`), its rankings decided by the same rules.  The MoE routing is NumPy's:
NumPy's router on the device's input (`golden.compose.moe_router`), the device's near-tie routes
adopted by the lockstep's rule (`TapPar._adopt_routes`), then the JAX sub-layer re-synced to that
routing by the JAX path's own bound (`golden.jax_resync.adopt_routes`); where JAX's routing parts
from NumPy's beyond the bound the sub-layer goes to NumPy.  The indexer's rows are the device's
adopted at the lockstep's near-tie rule (`golden.ties.index_near_ties`) under JAX's scores.  A
sub-layer JAX finds failing is judged again on NumPy, whose findings are reported: JAX only ever
clears a site, and every failure's report line (finding, first divergence) is NumPy's.

The JAX path runs on an accelerator where JAX has one (`jax[cuda]` and a GPU), else on the CPU
(`jax_device`); the report names the backend.
"""
from __future__ import annotations

import numpy as np

from golden.compose import device_meta, moe_router
from golden.ties import INDEX_TIE_TOL
from twin.abi.errors import AbiError

from .side import LayerTaps

GOLDENS = ("numpy", "jax", "auto")
DEFAULT = "numpy"


def jax_device(devices=None):
    """-> (the JAX device the checker runs on, one line naming it and why): the first accelerator
    (GPU or TPU) JAX can use, else the CPU.  devices: jax.devices (a stand-in in tests)."""
    import jax

    from golden.jax_path import device_note

    listing = devices or jax.devices
    try:
        found = list(listing())
    except RuntimeError as e:           # a backend that fails to start (a broken CUDA install)
        found, failed = [], f"jax.devices() failed ({str(e).splitlines()[0]})"
    else:
        failed = None
    for d in found:
        if d.platform != "cpu":
            return d, f"{device_note(d)}: an accelerator backend"
    cpu = jax.devices("cpu")[0]
    why = failed or f"jax.devices() lists {sorted({d.platform for d in found}) or 'nothing'}"
    return cpu, f"{device_note(cpu)}: no accelerator ({why}; jax[cuda] and a GPU run it there)"


def admitted(golden: str, cfg, program: str, mode: str, index_tie_tol: float, max_len: int | None = None):
    """-> (JAX checks `program`'s sites, why)."""
    if golden == "numpy":
        return False, "numpy chosen"
    if index_tie_tol != INDEX_TIE_TOL:
        return False, (f"index tie margin {index_tie_tol}: the JAX indexer re-syncs at golden.ties.INDEX_TIE_TOL "
                       f"({INDEX_TIE_TOL})")
    from golden.jax_resync import jax_admissible

    return jax_admissible(cfg, program, mode, max_len=max_len)


def check_choice(golden: str, cfg, programs, mode: str, *, coverage: bool, max_len: int | None = None) -> dict:
    """The run's choice per target program ({program: {"golden", "why"}}); an explicit jax that
    some program (or a run without coverage) cannot take is refused under `checker_golden`."""
    if golden not in GOLDENS:
        raise AbiError("checker_golden", golden, f"one of {', '.join(GOLDENS)}", where="lockstep")
    if golden != "numpy" and not coverage:
        if golden == "jax":
            raise AbiError("checker_golden", golden, "numpy or auto without --coverage (the JAX path checks a "
                           "sampled run's sites; a full check runs golden's whole step on NumPy)", where="lockstep")
        return {}
    out = {}
    for p in programs:
        ok, why = admitted(golden, cfg, p, mode, INDEX_TIE_TOL, max_len)
        if golden == "jax" and not ok:
            raise AbiError("checker_golden", golden, f"numpy or auto for this run ({why})", where="lockstep")
        out[p] = {"golden": "jax" if ok else "numpy", "why": why}
    return out


def tally(entries) -> dict:
    """Over a run's report entries: the dispatches whose target sites JAX checked and those NumPy
    checked (why, counted), the sites JAX handed to NumPy, and the backends named."""
    out = {"jax_dispatches": 0, "numpy_dispatches": 0, "numpy_why": {}, "sites_to_numpy": 0, "backends": []}
    for e in entries:
        ck = e.get("checker")
        if ck is None:
            continue
        if ck["golden"] == "jax":
            out["jax_dispatches"] += 1
            out["sites_to_numpy"] += len(ck.get("numpy", ()))
            if ck["backend"] not in out["backends"]:
                out["backends"].append(ck["backend"])
        else:
            out["numpy_dispatches"] += 1
            out["numpy_why"][ck["why"]] = out["numpy_why"].get(ck["why"], 0) + 1
    return out


# (preset, seed or checkpoint id, mode, layer, device) -> (checkpoint or None, JaxGolden), kept per
# process; a checkpoint known by its id is held with its golden because an id names an object only
# while it lives (a freed checkpoint's id may be a new one's, which must not find the old weights);
# a seeded one is not held: its seed names its weights
_LAYERS: dict = {}


def layer_golden(cfg, ckpt, mode: str, layer: int, device):
    """The JAX path holding target layer `layer` of `ckpt` on `device`, one per process (its compiled
    sub-layers are shared by the layers of the same structure and reused by every run of the process).
    A seeded synthetic checkpoint is known by its seed (every run regenerates the same weights); any
    other by its identity."""
    from golden.jax_path import JaxGolden

    seed = getattr(ckpt, "seed", None)
    key = (cfg.name, ("seed", seed) if seed is not None else ("id", id(ckpt)), mode, layer, device)
    got = _LAYERS.get(key)
    if got is None:
        got = _LAYERS[key] = (ckpt if seed is None else None, JaxGolden(ckpt, cfg, mode, device=device,
                                                                         layers=(layer,)))
    return got[1]


class JaxSites:
    """A site checker's JAX path: the device it runs on and its per-layer goldens."""

    def __init__(self, sg, devices=None):
        self.sg = sg
        self.device, self.backend = jax_device(devices)

    def sublayer(self, view, layer: int, part: str, par) -> tuple[LayerTaps | None, str | None]:
        """Golden's taps of `part` ("attn" | "moe") of target `layer` on the JAX path, from the
        device's input tap, the pools before and NumPy's routing (see the module docstring), the
        re-syncs added to `par.resyncs` as NumPy's check adds them -> (taps, None); or (None, why)
        where NumPy must judge the sub-layer instead."""
        sg, cfg, meta = self.sg, self.sg.cfg, view.meta
        jg = layer_golden(cfg, sg.ckpt, sg.nm.mode, layer, self.device)
        taps = LayerTaps()
        if part == "attn":
            dev = view.taps.get((layer, "idx_topk")) if cfg.compress_ratios[layer] == 4 else None
            ref = None if dev is None else {(layer, "idx_topk"): dev}
            if dev is not None and np.shape(dev) != (meta.T, cfg.index_topk):
                return None, f"the device's idx_topk has shape {np.shape(dev)}"
            _, pools, got = jg.sublayer("attn", view.taps[(layer, "attn_in")], layer, meta, view.before[layer],
                                        resync_from=ref)
            taps.pools = {k: np.asarray(v) for k, v in pools.items()}
            rows = (jg.resyncs.index_adopted.get(layer, []) if jg.resyncs is not None else [])
            if rows:
                par.resyncs.append({"kind": "index", "site": [layer, "idx_topk"], "row": rows[0],
                                    "golden": f"{len(rows)} near-tie rows", "device": rows[:8]})
        else:
            ref = self._numpy_routing(view, layer, par)
            _, _, got = jg.sublayer("moe", view.taps[(layer, "attn_x_hc")], layer, meta, resync_from=ref)
            refused = jg.resyncs.refused.get(layer, []) if jg.resyncs is not None else []
            if refused:
                return None, f"JAX's routing parts from NumPy's beyond the score bound at {len(refused)} rows"
        for stage, v in got.items():
            taps.put(layer, stage, v)
        return taps, None

    def _numpy_routing(self, view, layer: int, par):
        """NumPy's routing of `layer` on the device's MoE input, the device's near-tie routes adopted
        (the lockstep's rule): the JAX sub-layer's re-sync reference (None: a hash-routed layer)."""
        sg, cfg = self.sg, self.sg.cfg
        if layer < cfg.num_hash_layers:
            return None
        rt = LayerTaps()
        w = sg.ckpt.layer(layer)
        _, _, _, _, _, idx, wts = moe_router(view.taps[(layer, "attn_x_hc")], layer, w,
                                             device_meta(view.meta, sg.nm)["input_ids"], cfg=cfg, nm=sg.nm, taps=rt)
        par._adopt_routes(rt, sg.ckpt, None, idx, wts, cfg=cfg, nm=sg.nm)
        return {(layer, "ffn_x_mixed"): rt[(layer, "ffn_x_mixed")], (layer, "moe_indices"): rt[(layer, "moe_indices")]}
