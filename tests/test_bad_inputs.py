"""Every bad input of every command (the corpus in bad_inputs.py) exits with status 2 and one line
on stderr naming the argument or file (and line), the value and what is allowed, never a
traceback; a bug is an internal error (status 70) instead; the real entry point behaves the same."""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bad_inputs import CASES, FILE_FLAGS, FILE_KINDS, FILES, NEEDS_ABSENT
from twin.cli import EXIT_INTERNAL, EXIT_USAGE, build_parser, main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad-inputs")
    for name, text in FILES.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    return d


@pytest.fixture
def threads():
    """lockstep limits torch and OpenBLAS to one thread for its run: give the suite its own back."""
    from hw.threads import limit_cpu_threads, restore

    prev = limit_cpu_threads(1)
    yield
    restore(prev)


def absent(runtime: str) -> bool:
    if runtime == "cuda":
        import torch
        return not torch.cuda.is_available()
    return importlib.util.find_spec(runtime) is None


def expand(x, d: Path):
    return [expand(v, d) for v in x] if isinstance(x, (list, tuple)) else x.replace("{d}", str(d))


def check_line(rc: int, out: str, err: str, named, allowed: str) -> None:
    assert rc == EXIT_USAGE, (rc, err)
    assert "Traceback" not in err + out
    assert err.endswith("\n") and err.count("\n") == 1, err           # exactly one line
    assert err.startswith("dspark-twin") and " error: " in err, err
    for s in named:
        assert s in err, (s, err)
    assert allowed in err, (allowed, err)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_naming_it(case, scratch, threads, capsys):
    id_, argv, _flag, named, allowed = case
    if id_ in NEEDS_ABSENT and not absent(NEEDS_ABSENT[id_]):
        pytest.skip(f"{NEEDS_ABSENT[id_]} is installed here")
    try:
        rc = main(expand(argv, scratch))
    except SystemExit as e:                  # argparse refuses before a command runs
        rc = e.code
    out, err = capsys.readouterr()
    check_line(rc, out, err, expand(named, scratch), expand(allowed, scratch))
    # a refused run writes no report (simulate's --out is {d}/out in every case that gives one)
    assert not (scratch / "out" / "summary.json").exists(), id_


def test_a_refused_out_is_not_created(scratch, threads, capsys):
    rc = main(["simulate", "--requests", "2", "--no-plots", "--out", "/proc/dspark-out"])
    capsys.readouterr()
    assert rc == 2 and not Path("/proc/dspark-out").exists()


def test_the_corpus_covers_every_command_flag_and_input_file():
    """Every value-taking option of every command has a row, and every input file each kind."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    have = {}
    for id_, argv, flag, *_ in CASES:
        have.setdefault(id_.split()[0], set()).add(flag)
    missing = []
    for cmd, p in sub.choices.items():
        for a in p._actions:
            if a.nargs == 0 or isinstance(a, argparse._HelpAction):
                continue                                     # a switch takes no value to get wrong
            names = set(a.option_strings) or {a.dest}
            if not names & have.get(cmd, set()):
                missing.append(f"{cmd} {'/'.join(sorted(names))}")
    assert not missing, f"no bad-input row for: {missing}"
    ids = {c[0] for c in CASES}
    lacking = [f"{cmd} {flag} {kind}" for cmd, flag in sorted(FILE_FLAGS) for kind in FILE_KINDS
               if f"{cmd} {flag} {kind}" not in ids]
    assert not lacking, lacking
    assert len(CASES) >= 40 and len(ids) == len(CASES)


def entry_point() -> list:
    exe = shutil.which("dspark-twin")
    return [exe] if exe else [sys.executable, "-m", "twin.cli"]


@pytest.mark.parametrize("case_id", ["simulate --trace negative token id", "simulate --rate word",
                                     "lockstep --policy not JSON", "capacity --hbm-gib inf"])
def test_the_real_entry_point_says_the_same(case_id, scratch):
    _, argv, _, named, allowed = next(c for c in CASES if c[0] == case_id)
    r = subprocess.run(entry_point() + expand(argv, scratch), capture_output=True, text=True, timeout=300,
                       cwd=scratch, env={**os.environ, "PYTHONPATH": str(ROOT)})
    check_line(r.returncode, r.stdout, r.stderr, expand(named, scratch), expand(allowed, scratch))


def test_a_bug_is_an_internal_error_not_bad_input(monkeypatch, capsys):
    """An unexpected exception: status 70 and one line saying where, --debug adds the traceback."""
    from twin.commands import capacity

    def broken(dep, **kw):
        return {}["no such key"]
    monkeypatch.setattr(capacity, "hbm_account", broken)
    assert main(["capacity"]) == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("dspark-twin capacity: internal error: KeyError: 'no such key' at tests/test_bad_inputs.py:")
    assert "rerun with --debug for the traceback" in err
    assert main(["capacity", "--debug"]) == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in broken" in err
    assert err.splitlines()[-1].startswith("dspark-twin capacity: internal error: KeyError")


def test_an_invalid_dispatch_of_the_twins_own_making_is_internal(monkeypatch, capsys):
    """No command takes a dispatch as input: one that breaks the ABI is the twin's bug (70), not yours (2)."""
    from twin.abi.lowering import DispatchError
    from twin.commands import capacity

    def lowers_badly(dep, **kw):
        raise DispatchError("l3_prefill_fwd", "x_hc", "shape", (3, 4), "(16, 8192, 4, 4096)")
    monkeypatch.setattr(capacity, "hbm_account", lowers_badly)
    assert main(["capacity"]) == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("dspark-twin capacity: internal error: DispatchError: l3_prefill_fwd [shape]: "
                          "x_hc=(3, 4) is invalid")
