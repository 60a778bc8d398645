"""The `dspark-twin abi` and `capacity` commands."""
import json

import pytest

from twin.cli import main


def run_json(capsys, *argv):
    rc = main(list(argv))
    return rc, json.loads(capsys.readouterr().out)


def test_abi_lists_programs_with_counts(capsys):
    rc, rows = run_json(capsys, "abi", "--json")
    assert rc == 0
    assert {r["program"]: r["args"] for r in rows} == {
        "l3_prefill_fwd": 102, "l3_decode_fwd": 110, "l3_decode_fwd_dspark": 151,
        "l3_dspark_draft_step_device_state": 71, "l3_dspark_drafter": 59, "l3_distributed_markov_sample": 12}


def test_abi_one_program(capsys):
    rc, d = run_json(capsys, "abi", "l3_distributed_markov_sample", "--preset", "tiny", "--json")
    assert rc == 0 and d["preset"] == "tiny" and len(d["args"]) == 12
    first = d["args"][0]
    assert first["name"] == "head_hidden" and first["shape"] == [16, 16, 7, 64] and first["role"] == "input"
    main(["abi", "l3_prefill_fwd"])
    assert "x_hc" in capsys.readouterr().out


def test_abi_unknown_program_is_a_clear_error(capsys):
    assert main(["abi", "l3_nope"]) == 2
    assert "program='l3_nope'" in capsys.readouterr().err


def test_capacity_reports_fit_and_misfit(capsys):
    rc, d = run_json(capsys, "capacity", "--preset", "flash", "--ep", "16", "--max-model-len", "1024",
                     "--chunk", "8192", "--json")
    assert rc == 0 and d["fits"] and d["blocks_per_request"]["ori"] == 37
    # a 16K request (2.9 GB) is larger than the budget the measured boot leaves: exit 3, and the
    # report's own numbers say why
    rc, d = run_json(capsys, "capacity", "--max-model-len", "16384", "--chunk", "8192", "--json")
    assert rc == 3 and not d["fits"] and d["blocks_per_request"]["ori"] == 261
    assert d["kv_budget_bytes"] < d["bytes_per_slot"] + d["scratch_bytes"]
    rc, d = run_json(capsys, "capacity", "--ep", "8", "--json")
    assert rc == 3 and not d["fits"] and "cannot fit" in d["error"]
    assert main(["capacity"]) == 0
    out = capsys.readouterr().out
    assert "slots per partition" in out and "csa_inner_state" in out


@pytest.mark.parametrize("argv,match", [
    (["capacity", "--ep", "12"], "ep=12"),
    (["capacity", "--temperature", "0.5"], "temperature=0.5"),
    (["capacity", "--hbm-gib", "0"], "--hbm-gib"),
    (["capacity", "--ring-heap", "1000"], "--ring-heap"),
    (["capacity", "-k", "3"], "num_speculative_tokens=3"),
])
def test_capacity_bad_input(capsys, argv, match):
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_simulate_has_its_own_deployment_defaults_and_help(capsys, monkeypatch):
    """simulate's saturating FLASH defaults (and the help that says so) leave the other commands' alone."""
    import argparse

    from twin.cli import build_parser
    from twin.commands._common import add_deployment_args

    monkeypatch.setenv("COLUMNS", "400")            # one help line per flag: no wrap inside a flag's name
    p = build_parser()
    sim, cap = vars(p.parse_args(["simulate"])), vars(p.parse_args(["capacity"]))
    keys = ("max_model_len", "chunk", "max_num_seqs", "max_num_batched_tokens")
    assert [sim[k] for k in keys] == [8192, 512, None, 8192]
    assert [cap[k] for k in keys] == [1024, 2048, 16, 8192]
    assert p.parse_args(["simulate", "--chunk", "64"]).chunk == 64
    with pytest.raises(SystemExit):
        p.parse_args(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(--long-prefill-token-threshold) (default 512 for simulate)" in text
    assert "default: 64 per group, 256 at EP16" in text and "context ceiling (default 8192 for simulate)" in text
    with pytest.raises(ValueError, match="'chunks'.*allowed.*'chunk'"):
        add_deployment_args(argparse.ArgumentParser(), overrides={"chunks": (64, "typo")})
