"""Backends: PyptoBackend positional binding (fake runner), TorchBackend device handling."""
import importlib.util
import sys

import ml_dtypes
import numpy as np
import pytest

from hw.backend import TorchBackend, check_device
from hw.model.spec import Geometry
from hw.model.weights import synthetic_weights
from hw.pypto import NP_DTYPE, PyptoBackend
from twin.abi import PROGRAMS, TINY, bind, deployment
from twin.abi.batches import Dispatch
from twin.abi.errors import AbiError
from twin.abi.programs import INPUT, OUTPUT, STATE, WEIGHT

EXT = dict(P=64, Q=4, B=4, T_MAIN=32)


class FakeRunner:
    """Checks what a compiled PyPTO program would receive: names, order, shapes and dtypes."""

    def __init__(self, dep, slots=1, **ext):
        self.dep, self.slots, self.ext, self.calls = dep, slots, ext, []

    def run(self, compiled_as, args, names):
        prog = next(p for p in PROGRAMS.values() if p.compiled_as == compiled_as)
        assert names == prog.names, "argument names or order differ from the ABI"
        want = bind(prog, self.dep, self.slots, **self.ext)
        assert len(args) == len(want)
        for a, b in zip(args, want):
            assert tuple(np.shape(a)) == b.shape, b.name
            assert np.asarray(a).dtype == NP_DTYPE[b.dtype], b.name
        for a, b in zip(args, want):              # the "device" writes outputs and state in place
            if b.arg.role in (OUTPUT, STATE) and np.asarray(a).flags.writeable and np.asarray(a).size:
                a.reshape(-1)[0] = np.asarray(1, a.dtype)
        self.calls.append(compiled_as)


def zeros_for(prog, dep, roles, slots=1, lazy=False, by_name=False, **ext):
    out = {}
    for b in bind(prog, dep, slots, **ext):
        if b.arg.role in roles:
            dt = NP_DTYPE[b.dtype]
            # lazy: zero-stride views, no memory, so FLASH-sized buffers can be checked on a laptop
            out[b.arg.buffer_id if b.arg.role in (STATE, WEIGHT) and not by_name else b.name] = (
                np.broadcast_to(np.zeros((), dt), b.shape) if lazy else np.zeros(b.shape, dt))
    return out


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_pypto_binds_every_program_positionally(program):
    dep = deployment("tiny", ep=4, tp=4)
    runner = FakeRunner(dep, **EXT)
    weights = zeros_for(program, dep, (WEIGHT,), **EXT)
    state = zeros_for(program, dep, (STATE,), **EXT)
    before = {k: v.copy() for k, v in state.items()}
    d = Dispatch(program, zeros_for(program, dep, (INPUT,), **EXT), {"extents": EXT})
    r = PyptoBackend(dep, runner, weights=weights).run(d, state)
    assert runner.calls == [PROGRAMS[program].compiled_as]
    outs = [a.name for a in PROGRAMS[program].args if a.role == OUTPUT]
    assert sorted(r.outputs) == sorted(outs)
    for k, v in state.items():                     # the caller's state is never written
        assert np.array_equal(v, before[k])
    for k, v in r.state.items():
        if v.size:
            assert v.reshape(-1)[0] == 1           # the device's writes come back as the new state


def test_pypto_flash_shapes_bind_without_memory():
    dep = deployment("flash", ep=16, tp=4)
    prog = "l3_decode_fwd_dspark"
    runner = FakeRunner(dep)
    weights = zeros_for(prog, dep, (WEIGHT,), lazy=True)
    # state passed by name in the dispatch: bound as given (the backend copies only state it owns)
    args = PyptoBackend(dep, runner, weights=weights).positional(
        Dispatch(prog, zeros_for(prog, dep, (INPUT, STATE), lazy=True, by_name=True)), {})
    assert len(args) == len(PROGRAMS[prog].args)
    emb = args[PROGRAMS[prog].index["embed_weight"]]
    assert emb.shape == (16, 129280, 4096) and emb.dtype == ml_dtypes.bfloat16


def test_pypto_errors_name_the_argument():
    dep = deployment("tiny", ep=4, tp=4)
    prog = "l3_distributed_markov_sample"
    b = PyptoBackend(dep, FakeRunner(dep, **EXT), weights=zeros_for(prog, dep, (WEIGHT,), **EXT))
    inputs = zeros_for(prog, dep, (INPUT,), **EXT)
    name = next(iter(inputs))
    bad = dict(inputs, **{name: np.zeros((1, 2, 3), inputs[name].dtype)})
    with pytest.raises(AbiError, match=rf"{name}=\[1, 2, 3\].*shape"):
        b.run(Dispatch(prog, bad, {"extents": EXT}), {})
    bad = dict(inputs, **{name: inputs[name].astype(np.float64)})
    with pytest.raises(AbiError, match=rf"{name}='float64'.*dtype"):
        b.run(Dispatch(prog, bad, {"extents": EXT}), {})
    with pytest.raises(AbiError, match=rf"argument='{name}'"):
        b.run(Dispatch(prog, {k: v for k, v in inputs.items() if k != name}, {"extents": EXT}), {})
    with pytest.raises(AbiError, match="argument='bogus'"):
        b.run(Dispatch(prog, dict(inputs, bogus=np.zeros(1)), {"extents": EXT}), {})


def test_pypto_from_runtime_without_a_runtime_says_what_is_missing():
    with pytest.raises(AbiError, match="PyPTO runtime"):
        PyptoBackend.from_runtime(deployment("tiny", ep=4, tp=4))


def test_torch_backend_devices():
    for ok in ("cpu", "cuda:1", "npu:7"):
        assert check_device(ok, available=False) == ok
    for bad in ("tpu", "cpu:x", "", None):
        with pytest.raises(AbiError, match="device"):
            check_device(bad)
    assert check_device("cpu") == "cpu"
    if importlib.util.find_spec("torch_npu") is None:     # a named device whose runtime is missing
        with pytest.raises(AbiError, match="npu:7.*torch_npu is not installed"):
            check_device("npu:7")
    geo = Geometry(TINY)
    w = synthetic_weights(TINY)
    TorchBackend(geo, w, "cpu")
    assert "torch_npu" not in sys.modules          # only an "npu" backend imports it
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(AbiError, match="cuda"):
            TorchBackend(geo, w, "cuda")


def test_reference_step_is_for_small_presets_only():
    from twin.abi import FLASH

    with pytest.raises(AbiError, match="preset='flash'"):
        Geometry(FLASH)
