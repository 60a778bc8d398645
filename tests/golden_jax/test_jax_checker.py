"""The site checker on the JAX path (hw.real.jax_check): a dispatch's sites re-judged from its records
with --checker-golden jax give the NumPy checker's verdicts, per site, on a clean run and on two
persistent device faults (the failing sub-layer judged again on NumPy, so the first divergence is
NumPy's); auto keeps NumPy where jax_admissible refuses, saying why; the backend is chosen as stated;
a checkpoint without a seed keeps its own JAX golden (cached by identity while it lives)."""
from types import SimpleNamespace

import jax
import pytest

from hw.real.coverage import FUSED, PREFILL
from hw.real.faults import RealFault
from hw.real.jax_check import check_choice, jax_device
from twin.abi.errors import AbiError
from twin.abi.presets import TINY
from twin.functional.parity import build_lockstep, check

AT = 3          # a decode dispatch of both requests (the dispatches re-judged share one shape: one compile set)
CASES = {"clean": None, "wrong_slot": ("wrong_slot", 2), "flipped_route": ("flipped_route", 4)}


def _run(d, case, k=0, steps=AT + 1):
    fault = None if case is None else RealFault(case[0], at=AT, layer=case[1], seed=7, persistent=True)
    lr = build_lockstep(preset="tiny", seed=0, k=k, max_new=8, n_requests=2, coverage=1, fault=fault, run_dir=d)
    lr.run(steps)
    return lr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """NumPy-checked sampled runs (every site every dispatch), strict: a fault run stops at AT."""
    return {name: (d, _run(d, case)) for name, case in CASES.items()
            for d in [tmp_path_factory.mktemp(name)]}


def _sites(e):
    return [(e["program"], g, layer, stage) for g, layer, stage, _ in e["sites"]]


@pytest.mark.parametrize("name", list(CASES))
def test_jax_checker_gives_numpys_verdicts(runs, name):
    d, lr = runs[name]
    want = lr.entries[AT]
    got = check(str(d), AT, _sites(want), golden="jax")
    ck = got.pop("checker")
    assert ck["golden"] == "jax" and ck["backend"].startswith("cpu"), ck
    # the same verdict at every site, and a failure localized where NumPy localizes it
    assert got["verdict"] == want["verdict"] == ("pass" if name == "clean" else "fail")
    assert got["sites"] == want["sites"]
    assert got["first_divergence"] == want["first_divergence"]
    assert [(f["name"], f["passed"]) for f in got["findings"]] == [(f["name"], f["passed"]) for f in want["findings"]]
    numpy = ck.get("numpy", [])
    if name == "clean":
        assert not numpy                     # JAX cleared every sub-layer itself
    else:
        fd = want["first_divergence"]
        # the sub-layer JAX found failing went to NumPy, named with why
        assert any(str(layer) == fd["layer"] and "NumPy judges" in why for _, layer, _, why in numpy), (numpy, fd)
        assert len(numpy) < len(want["sites"])      # the rest JAX cleared


def test_auto_keeps_numpy_where_jax_is_not_admissible(tmp_path):
    choice = check_choice("auto", TINY, [PREFILL, FUSED], "device", coverage=True)
    assert choice[PREFILL]["golden"] == "jax"
    assert choice[FUSED]["golden"] == "numpy" and "runs only" in choice[FUSED]["why"]
    with pytest.raises(AbiError, match="checker_golden"):
        check_choice("jax", TINY, [PREFILL, FUSED], "device", coverage=True)
    assert check_choice("auto", TINY, [PREFILL], "official", coverage=True)[PREFILL]["golden"] == "numpy"
    # a fused K=7 dispatch under auto: NumPy checks it, the entry says why, the verdicts are NumPy's
    lr = _run(tmp_path, None, k=7, steps=5)
    e = next(x for x in lr.entries if x["program"] == FUSED)
    got = check(str(tmp_path), e["index"], _sites(e), golden="auto")
    assert got.pop("checker") == {"golden": "numpy", "why": choice[FUSED]["why"]}
    assert got == e


def test_backend_selection():
    cpu = jax.devices("cpu")[0]
    d, note = jax_device()
    assert d.platform == "cpu" and note.startswith("cpu") and "no accelerator" in note
    gpu = SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", id=0)
    d, note = jax_device(lambda: [cpu, gpu])
    assert d is gpu and note == "gpu NVIDIA H200 #0: an accelerator backend"

    def broken():
        raise RuntimeError("Unable to initialize backend 'cuda': no CUDA-capable device\nmore")
    d, note = jax_device(broken)
    assert d == cpu and "Unable to initialize backend 'cuda'" in note and "more" not in note


class _Unseeded:
    """A checkpoint known by its identity only (as a safetensors one): no `seed`."""

    def __init__(self, base):
        self._base = base

    def __getattr__(self, name):
        if name == "seed":
            raise AttributeError(name)
        return getattr(self._base, name)


def test_a_checkpoint_without_a_seed_keeps_its_own_jax_golden():
    import gc
    import weakref

    from golden.checkpoint import SyntheticCheckpoint
    from hw.real.jax_check import layer_golden

    dev, _ = jax_device()
    a = _Unseeded(SyntheticCheckpoint(TINY, seed=11))
    ga = layer_golden(TINY, a, "device", 0, dev)
    assert layer_golden(TINY, a, "device", 0, dev) is ga            # reused for the same checkpoint
    held = weakref.ref(a)
    del a
    gc.collect()
    # still alive while its golden is cached, so no other checkpoint can be given its id
    assert held() is not None
    b = _Unseeded(SyntheticCheckpoint(TINY, seed=12))
    assert layer_golden(TINY, b, "device", 0, dev) is not ga
