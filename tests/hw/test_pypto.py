"""PyptoBackend on PyPTO's calling convention, against a fake runtime with pypto.runtime's API that
enforces the runtime's own checks (tests/hw/fake_pypto.py): compiled programs from `compile(*tensors)`
and their compiled_meta.json, ChipWorker.run with a per-call RunConfig carrying the ring heaps, and
execute_compiled in the params order; every mismatch is refused, naming the argument, before the
runtime sees anything."""
import json

import ml_dtypes
import numpy as np
import pytest

import fake_pypto
from fake_pypto import CompiledProgram, jit
from hw.pypto import NP_DTYPE, RING_ENV, PyptoBackend, _dynamic_axes, load_compiled, ring_heap
from twin.abi import PROGRAMS, bind, deployment
from twin.abi.batches import Dispatch, DispatchResult
from twin.abi.errors import AbiError, ConfigError
from twin.abi.programs import INPUT, OUTPUT, SCRATCH, STATE, WEIGHT
from twin.abi.ringheap import DEFAULT_PROFILES

EXT = dict(P=64, Q=4, B=4, T_MAIN=32)
DIRECTION = {INPUT: "In", WEIGHT: "In", STATE: "InOut", OUTPUT: "Out", SCRATCH: "Out"}


@pytest.fixture(autouse=True)
def _no_calls():
    fake_pypto.CALLS.clear()


@pytest.fixture(scope="module")
def dep():
    return deployment("tiny", ep=4, tp=4)


def torch_zeros(b):
    import torch

    from hw.pypto import _to_torch

    return _to_torch(np.zeros(b.shape, NP_DTYPE[b.dtype])) if b.shape else torch.zeros(())


def compile_program(program, dep, out_dir, *, platform="a2a3sim", mutate=None, **ext):
    """What `kernel.compile(*tensors)` makes of a pypto-lib program with the ABI's argument list: the
    per-dispatch axes dynamic, the rest fixed by the sample tensors."""
    bound = list(bind(program, dep, 1, **(ext or EXT)))
    params = [(b.name, DIRECTION[b.arg.role], _dynamic_axes(b.arg)) for b in bound]
    if mutate:
        params, bound = mutate(params, bound)
    return jit(params).compile(*(torch_zeros(b) for b in bound), out_dir=out_dir, platform=platform)


def arrays(program, dep, roles, **ext):
    return {(b.arg.buffer_id if b.arg.role in (STATE, WEIGHT) else b.name): np.zeros(b.shape, NP_DTYPE[b.dtype])
            for b in bind(program, dep, 1, **(ext or EXT)) if b.arg.role in roles}


def backend_for(program, dep, tmp_path, *, work_dir_only=False, **kw):
    compiled = compile_program(program, dep, tmp_path / program)
    src = compiled.output_dir if work_dir_only else compiled
    return PyptoBackend(dep, {program: load_compiled(program, src, dep)}, fake_pypto,
                        weights=arrays(program, dep, (WEIGHT,)), **kw)


def dispatch(program, dep, **ext):
    return Dispatch(program, arrays(program, dep, (INPUT,), **ext), {"extents": ext or EXT})


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_every_program_runs_positionally_on_a_chip_worker(program, dep, tmp_path):
    be = backend_for(program, dep, tmp_path)
    state = arrays(program, dep, (STATE,))
    before = {k: v.copy() for k, v in state.items()}
    r = be.run(dispatch(program, dep), state)
    assert isinstance(r, DispatchResult)
    (call,) = fake_pypto.CALLS
    prog = PROGRAMS[program]
    assert call["path"] == "ChipWorker.run" and call["names"] == list(prog.names)
    # the RunConfig of the call carries the program's ring-heap profile, one entry per scope depth
    assert call["ring_heap"] == list(DEFAULT_PROFILES[prog.ring_heap])
    assert sorted(r.outputs) == sorted(a.name for a in prog.args if a.role == OUTPUT)
    assert sorted(r.state) == sorted(a.buffer_id for a in prog.args if a.role == STATE)
    # the device wrote position + 1 into each written tensor: each result is the tensor of its own position
    for i, a in enumerate(prog.args):
        got = r.outputs.get(a.name) if a.role == OUTPUT else r.state.get(a.buffer_id) if a.role == STATE else None
        if got is not None and got.size:
            assert got.dtype == NP_DTYPE[a.dtype] and float(got.reshape(-1)[0]) == i + 1, a.name
    for k, v in state.items():                     # the caller's state is never written
        assert np.array_equal(v, before[k])


def test_execute_compiled_takes_the_params_order_and_the_ring_heap_from_the_environment(dep, tmp_path, monkeypatch):
    program = "l3_decode_fwd"
    be = backend_for(program, dep, tmp_path, work_dir_only=True)
    assert be.worker is None                       # no compiled object: nothing to register on a worker
    state = arrays(program, dep, (STATE,))
    monkeypatch.delenv(RING_ENV, raising=False)
    with pytest.raises(AbiError, match=rf"{RING_ENV}=None.*1073741824,1073741824,1073741824,4294967296"):
        be.run(dispatch(program, dep), state)
    monkeypatch.setenv(RING_ENV, "4294967296")     # the drafter's profile, not the decode one
    with pytest.raises(AbiError, match=RING_ENV):
        be.run(dispatch(program, dep), state)
    assert fake_pypto.CALLS == []
    monkeypatch.setenv(RING_ENV, ",".join(str(v) for v in DEFAULT_PROFILES["decode"]))
    r = be.run(dispatch(program, dep), state)
    (call,) = fake_pypto.CALLS
    params = json.loads((tmp_path / program / "compiled_meta.json").read_text())["params"]
    assert call["path"] == "execute_compiled" and call["names"] == [p["name"] for p in params]
    # each output is the tensor of its own position in the params order
    for name in ("logits", "sampled_ids"):
        assert float(r.outputs[name].reshape(-1)[0]) == PROGRAMS[program].index[name] + 1


def test_ring_heaps_follow_their_overrides(dep, tmp_path, monkeypatch):
    program = "l3_decode_fwd"
    monkeypatch.setenv("PYPTO_DSPARK_DECODE_RING_HEAP", "0,0,0,8589934592")
    assert ring_heap(PROGRAMS[program]) == [0, 0, 0, 8589934592]
    be = backend_for(program, dep, tmp_path)
    be.run(dispatch(program, dep), arrays(program, dep, (STATE,)))
    assert fake_pypto.CALLS[-1]["ring_heap"] == [0, 0, 0, 8589934592]
    monkeypatch.setenv("PYPTO_DSPARK_DECODE_RING_HEAP", "3000")         # not a power of two
    with pytest.raises(ConfigError, match="PYPTO_DSPARK_DECODE_RING_HEAP"):
        be.run(dispatch(program, dep), arrays(program, dep, (STATE,)))


def test_the_fake_runtime_makes_the_real_checks(tmp_path):
    import torch

    with pytest.raises(ValueError, match="Invalid platform"):
        fake_pypto.RunConfig(platform="npu")
    with pytest.raises(ValueError, match="4 entries"):
        fake_pypto.RunConfig(ring_heap=[1024, 1024])
    with pytest.raises(ValueError, match="power of 2"):
        fake_pypto.RunConfig(ring_heap=[3000, 0, 0, 0])
    k = jit([("a", "In", set()), ("out", "Out", set())])
    c = k.compile(torch.zeros(4, 8), torch.zeros(4, 8), out_dir=tmp_path / "k")
    w = fake_pypto.ChipWorker(config=fake_pypto.RunConfig(platform="a2a3sim"))
    with pytest.raises(TypeError, match="expects 2 .in-place. arguments, got 1"):
        w.run(c, torch.zeros(4, 8))
    with pytest.raises(ValueError, match="not contiguous"):
        w.run(c, torch.zeros(8, 4).t(), torch.zeros(4, 8))
    with pytest.raises(TypeError, match="dtype"):
        w.run(c, torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="does not match"):
        fake_pypto.ChipWorker(config=fake_pypto.RunConfig(platform="a2a3")).run(c, torch.zeros(4, 8), torch.zeros(4, 8))
    out = torch.zeros(4, 8)
    w.run(CompiledProgram.from_dir(tmp_path / "k"), torch.ones(4, 8), out)
    assert out[0, 0] == 2 and out.sum() == 2                  # written in place, at its own position


def test_dispatch_errors_name_the_argument_before_the_runtime_runs(dep, tmp_path):
    prog = "l3_decode_fwd"
    be = backend_for(prog, dep, tmp_path)
    d = dispatch(prog, dep)
    args, state = dict(d.args), arrays(prog, dep, (STATE,))
    name = "input_ids" if "input_ids" in args else next(iter(args))
    cases = [
        (dict(args, **{name: np.zeros((1, 2, 3), args[name].dtype)}), rf"{name}=\[1, 2, 3\].*shape"),
        (dict(args, **{name: args[name].astype(np.float64)}), rf"{name}='float64'.*dtype"),
        ({k: v for k, v in args.items() if k != name}, rf"argument='{name}'"),
        (dict(args, bogus=np.zeros(1)), "argument='bogus'"),
    ]
    table = next(a for a in PROGRAMS[prog].args if a.dims[-1] == "CMP_DEPTH" and a.role == INPUT)
    t = args[table.name]
    cases.append((dict(args, **{table.name: np.zeros(t.shape[:-1] + (t.shape[-1] + 1,), t.dtype)}),
                  rf"{table.name}=.*frozen depth CMP_DEPTH"))
    for bad, match in cases:
        with pytest.raises(AbiError, match=match):
            be.run(Dispatch(prog, bad, d.meta), state)
    with pytest.raises(AbiError, match="program='l3_prefill_fwd'.*compiled"):
        be.run(dispatch("l3_prefill_fwd", dep), {})
    assert fake_pypto.CALLS == []


def test_a_dynamic_axis_takes_each_dispatch_extent_and_a_fixed_one_is_checked(dep, tmp_path):
    prog = "l3_prefill_fwd"
    be = backend_for(prog, dep, tmp_path)
    for p in (64, 128):
        be.run(dispatch(prog, dep, **dict(EXT, P=p)), arrays(prog, dep, (STATE,), **dict(EXT, P=p)))
    assert [c["args"][0].shape[1] for c in fake_pypto.CALLS] == [64, 128]
    # compiled from samples without declaring P dynamic: a dispatch of another P is refused by name
    fixed = compile_program(prog, dep, tmp_path / "fixed",
                            mutate=lambda ps, bs: ([(n, d, set()) for n, d, _ in ps], bs))
    be = PyptoBackend(dep, {prog: load_compiled(prog, fixed, dep)}, fake_pypto,
                      weights=arrays(prog, dep, (WEIGHT,)))
    with pytest.raises(AbiError, match=r"x_hc=\[.*compiled program's shape"):
        be.run(dispatch(prog, dep, **dict(EXT, P=128)), arrays(prog, dep, (STATE,), **dict(EXT, P=128)))
    assert len(fake_pypto.CALLS) == 2


def swap(i, j):
    def m(ps, bs):
        ps, bs = list(ps), list(bs)
        ps[i], ps[j], bs[i], bs[j] = ps[j], ps[i], bs[j], bs[i]
        return ps, bs
    return m


def test_a_compiled_program_that_differs_from_the_abi_is_refused_at_load(dep, tmp_path):
    prog = "l3_decode_fwd"
    P = PROGRAMS[prog]
    logits = P.index["logits"]
    first_out = next(i for i, a in enumerate(P.args) if a.role == OUTPUT)
    table = next(i for i, a in enumerate(P.args) if a.dims[-1] == "CMP_DEPTH")

    def drop_last(ps, bs):
        return ps[:-1], bs[:-1]

    def rename(ps, bs):
        ps = list(ps)
        ps[3] = ("renamed", *ps[3][1:])
        return ps, bs

    def as_input(ps, bs):
        ps = list(ps)
        ps[first_out] = (ps[first_out][0], "In", ps[first_out][2])
        return ps, bs

    class _B:                      # a bound argument with one more table column
        def __init__(self, b):
            self.arg, self.name, self.dtype, self.shape = b.arg, b.name, b.dtype, b.shape[:-1] + (b.shape[-1] + 1,)

    def deeper(ps, bs):
        bs = list(bs)
        bs[table] = _B(bs[table])
        return ps, bs

    def wider(ps, bs):             # a fixed (non-dynamic) extent that is not the ABI's
        bs = list(bs)
        i = next(i for i, b in enumerate(bs) if b.arg.role == WEIGHT and not _dynamic_axes(b.arg))

        class W:
            arg, name, dtype, shape = bs[i].arg, bs[i].name, bs[i].dtype, bs[i].shape[:-1] + (bs[i].shape[-1] * 2,)
        bs[i] = W
        return ps, bs

    def f32_ids(ps, bs):
        bs = list(bs)
        i = next(i for i, b in enumerate(bs) if b.dtype == "i32")

        class F:
            arg, name, dtype, shape = bs[i].arg, bs[i].name, "f32", bs[i].shape
        bs[i] = F
        return ps, bs

    cases = [(drop_last, rf"parameters={len(P.args) - 1}.*{len(P.args)}"),
             (swap(0, 1), rf"parameter 0='{P.args[1].name}'.*'{P.args[0].name}'"),
             (rename, r"parameter 3='renamed'"),
             (as_input, rf"{P.args[first_out].name}='In'.*Out or InOut"),
             (deeper, rf"{P.args[table].name}=.*frozen depth CMP_DEPTH"),
             (wider, r"shape \["),
             (f32_ids, "='fp32'.*dtype int32")]
    for i, (mutate, match) in enumerate(cases):
        c = compile_program(prog, dep, tmp_path / f"c{i}", mutate=mutate)
        with pytest.raises(AbiError, match=match):
            load_compiled(prog, c, dep)
    assert logits >= 0 and fake_pypto.CALLS == []


def test_platforms_and_compiled_meta_are_checked(dep, tmp_path):
    prog = "l3_distributed_markov_sample"
    c = compile_program(prog, dep, tmp_path / "m", platform="a2a3")
    pp = load_compiled(prog, c, dep)
    with pytest.raises(AbiError, match="platform='a2a3'.*'a2a3sim'"):
        PyptoBackend(dep, {prog: pp}, fake_pypto, platform="a2a3sim")
    with pytest.raises(AbiError, match="platform='npu'"):
        PyptoBackend(dep, {prog: pp}, fake_pypto, platform="npu")
    with pytest.raises(AbiError, match="program='l3_decode_fwd'"):
        PyptoBackend(dep, {"l3_decode_fwd": pp}, fake_pypto, platform="a2a3")
    meta = tmp_path / "m" / "compiled_meta.json"
    m = json.loads(meta.read_text())
    for broken, match in ((dict(m, schema=2), "schema 2"), (dict(m, params={}), "'params' is not a list"),
                          (dict(m, params=[{"name": "x"}]), r"params\[0\]")):
        meta.write_text(json.dumps(broken))
        with pytest.raises(AbiError, match=match):
            load_compiled(prog, tmp_path / "m", dep)
    meta.write_text("{oops")
    with pytest.raises(AbiError, match="not JSON"):
        load_compiled(prog, tmp_path / "m", dep)
    with pytest.raises(AbiError, match="cannot be read"):
        load_compiled(prog, tmp_path / "absent", dep)


def test_flash_shapes_bind_without_memory(tmp_path):
    dep = deployment("flash", ep=16, tp=4)
    prog = "l3_decode_fwd_dspark"
    weights = {b.arg.buffer_id: np.broadcast_to(np.zeros((), NP_DTYPE[b.dtype]), b.shape)
               for b in bind(prog, dep) if b.arg.role == WEIGHT}
    given = {b.name: np.broadcast_to(np.zeros((), NP_DTYPE[b.dtype]), b.shape)
             for b in bind(prog, dep) if b.arg.role in (INPUT, STATE)}
    be = PyptoBackend(dep, {}, fake_pypto, weights=weights)
    args = be.positional(Dispatch(prog, given), {})
    assert len(args) == len(PROGRAMS[prog].args)
    emb = args[PROGRAMS[prog].index["embed_weight"]]
    assert emb.shape == (16, 129280, 4096) and emb.dtype == ml_dtypes.bfloat16


def test_from_runtime_without_pypto_says_what_is_missing(dep):
    with pytest.raises(AbiError, match="PyPTO runtime.*docs/lockstep.md"):
        PyptoBackend.from_runtime(dep, {})
