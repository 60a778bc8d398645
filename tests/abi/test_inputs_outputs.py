"""twin.abi.inputs reads values exactly as given (never cast, rounded or wrapped) and names where a
bad one is; twin.abi.outputs writes a report file whole or not at all."""
import os
import stat

import numpy as np
import pytest

from twin.abi import ConfigError
from twin.abi.inputs import integer, located, number, read_json, read_jsonl, token_ids
from twin.abi.outputs import atomic_path, output_dir, write_text


@pytest.mark.parametrize("bad,pos", [([1, -5, 3], 1), ([1, 2.7], 1), ([2.0], 0), ([True], 0), ([2**40], 0),
                                     ([99], 0), ([1, "7"], 1), ([None], 0)])
def test_token_ids_refuse_what_a_cast_would_change(bad, pos):
    with pytest.raises(ConfigError, match=rf"where: prompt\[{pos}\]=.*in \[0, 99\)"):
        token_ids(bad, "prompt", 99, "where")


def test_token_ids_keep_every_id_in_range():
    ids = token_ids([0, 98, 5], "prompt", 99)
    assert ids.dtype == np.int32 and ids.tolist() == [0, 98, 5]
    assert token_ids([], "prompt", 99).shape == (0,)
    with pytest.raises(ConfigError, match="a list of integer token ids"):
        token_ids("5 6", "prompt", 99)


def test_integer_and_number_take_only_their_kind():
    assert integer(3, "n", lo=0) == 3
    for bad in (3.0, True, "3", -1):
        with pytest.raises(ConfigError, match="an integer >= 0"):
            integer(bad, "n", lo=0)
    assert number(2, "x", lo=0, lo_open=True) == 2.0
    for bad in (float("nan"), float("inf"), False, "1", 0):
        with pytest.raises(ConfigError, match="x="):
            number(bad, "x", lo=0, lo_open=True)
    assert number(float("inf"), "x", finite=False) == float("inf")
    with pytest.raises(ConfigError, match="a number"):
        number(float("nan"), "x", finite=False)


def test_read_json_names_the_file_and_what_it_should_hold(tmp_path):
    f = tmp_path / "f.json"
    with pytest.raises(ConfigError, match=r"--x='.*f\.json'.*an existing file holding a thing \(no such file\)"):
        read_json(f, "--x", "a thing")
    f.write_text("  \n")
    with pytest.raises(ConfigError, match=r"a thing \(the file is empty\)"):
        read_json(f, "--x", "a thing")
    f.write_text('{"a": 1,\n\n  "b": }')
    with pytest.raises(ConfigError, match=r"f\.json:3'.*not JSON: Expecting value at column 8"):
        read_json(f, "--x", "a thing")
    f.write_text("[1]")
    with pytest.raises(ConfigError, match="found a JSON array, not a JSON object"):
        read_json(f, "--x", "a thing")
    assert read_json(f, "--x", "a thing", kind=(dict, list)) == [1]
    with pytest.raises(ConfigError, match="this is a directory"):
        read_json(tmp_path, "--x", "a thing")


def test_read_jsonl_numbers_lines_as_the_file_does(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"a": 1}\n\n{"b": 2}\n')
    assert list(read_jsonl(f, "--t", "x")) == [(1, f"--t {f}:1", {"a": 1}), (3, f"--t {f}:3", {"b": 2})]
    f.write_text('{"a": 1}\n\n"s"\n')
    with pytest.raises(ConfigError, match=r"t\.jsonl:3: line='s'.*not a JSON string"):
        list(read_jsonl(f, "--t", "x"))
    with pytest.raises(ConfigError, match=r"^a: b=1 is invalid"):
        with located("a"):
            integer(1, "b", lo=2)


def test_atomic_write_leaves_the_old_file_or_the_whole_new_one(tmp_path):
    f = tmp_path / "summary.json"
    write_text(f, "old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(f) as tmp:
            tmp.write_text("half of the ne")
            raise KeyboardInterrupt
    assert f.read_text() == "old" and os.listdir(tmp_path) == ["summary.json"]
    write_text(f, "new")
    assert f.read_text() == "new" and os.listdir(tmp_path) == ["summary.json"]
    plain = tmp_path / "plain"
    plain.write_text("x")
    assert stat.S_IMODE(f.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)   # not mkstemp's 0600
    with atomic_path(tmp_path / "plot.png") as tmp:
        assert tmp.suffix == ".png" and tmp.parent == tmp_path      # writers pick the format by suffix
        tmp.write_bytes(b"png")


def test_output_dir_is_made_or_refused_before_a_run(tmp_path):
    assert output_dir(tmp_path / "a" / "b", "--out").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"--out=.*a file of that name exists"):
        output_dir(tmp_path / "file", "--out")
    with pytest.raises(ConfigError, match=r"--out=.*a parent is a file"):
        output_dir(tmp_path / "file" / "sub", "--out")
    if os.geteuid() != 0:                # root writes anywhere: the read-only case needs a user
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(ConfigError, match="Permission denied"):
            output_dir(ro / "sub", "--out")
