"""A run directory recorded by the NumPy reference step is refused in one line, never misread: by the
CLI (exit status 2) and by the API (AbiError), whether the run finished (its run.json) or was killed
(only its records)."""
import json

import pytest

from hw.records import RecordStore
from hw.report import ReportWriter
from hw.run_format import check_run_dir, reference_marker
from twin.abi.errors import AbiError
from twin.cli import main

REF_WEIGHTS = "04ed74e3ce2a4eca17355c0e"        # the reference step's 12-byte blake2b weights digest


def reference_run(d, *, finished: bool):
    """The files the reference step wrote: report lines, a manifest of records, run.json once done."""
    (d / "records" / "packs").mkdir(parents=True)
    entry = {"findings": [], "first_divergence": None, "index": 0, "program": "l3_prefill_fwd", "resyncs": [],
             "rows": 128, "verdict": "pass"}
    (d / "report.jsonl").write_text(json.dumps(entry) + "\n")
    rec = {"golden_state_delta": {}, "index": 0, "inputs": {}, "meta": {"index": 0, "items": []}, "outputs": {},
           "program": "l3_prefill_fwd", "state_delta": {}, "weights": REF_WEIGHTS}
    (d / "records" / "manifest.jsonl").write_text(json.dumps(rec) + "\n")
    if finished:
        (d / "run.json").write_text(json.dumps({"wall_s_this_session": 0.77, "config": {
            "preset": "tiny", "seed": 0, "mode": "strict", "device": "torch:cpu", "golden": "golden:numpy",
            "weights": REF_WEIGHTS}}, indent=2) + "\n")
    return d


@pytest.mark.parametrize("finished", [True, False])
def test_the_cli_refuses_a_reference_run_directory_in_one_line(tmp_path, capsys, finished):
    d = reference_run(tmp_path / "run", finished=finished)
    before = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
    for argv in (["lockstep", "--steps", "4", "--run-dir", str(d)], ["lockstep", "--replay", "--run-dir", str(d)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert f"--run-dir='{d}'" in err and "recorded by the NumPy reference step" in err and "--fresh" in err
        assert ("golden='golden:numpy'" if finished else f"weights='{REF_WEIGHTS}'") in err
    assert {p: p.read_bytes() for p in d.rglob("*") if p.is_file()} == before      # nothing rewritten


def test_fresh_discards_a_reference_run_and_starts_over(tmp_path, capsys):
    d = reference_run(tmp_path / "run", finished=True)
    assert main(["lockstep", "--steps", "2", "--run-dir", str(d), "--fresh"]) == 0
    assert "PASS: 2 dispatches" in capsys.readouterr().out
    assert reference_marker(d) is None and json.loads((d / "run.json").read_text())["config"]["golden"] == "real"


def test_the_api_refuses_it_wherever_it_reads_the_directory(tmp_path):
    from twin.functional.parity import build_lockstep, replay_records

    d = reference_run(tmp_path / "run", finished=False)
    with pytest.raises(AbiError, match="recorded by the NumPy reference step"):
        ReportWriter(d).entries()
    with pytest.raises(AbiError, match="recorded by the NumPy reference step"):
        RecordStore(d / "records").records()
    with pytest.raises(AbiError, match="recorded by the NumPy reference step"):
        build_lockstep(run_dir=d, max_new=8).run(2)                    # a resume, with records
    with pytest.raises(AbiError, match="recorded by the NumPy reference step"):
        build_lockstep(run_dir=d, max_new=8, record=False).run(2)      # a resume, without
    with pytest.raises(AbiError):
        replay_records(d)


@pytest.mark.parametrize("weights,refused", [(REF_WEIGHTS, True), ("synthetic:tiny:seed0:k7", False),
                                             (REF_WEIGHTS[:-1], False), (REF_WEIGHTS.upper(), False)])
def test_the_records_mark_is_the_reference_digest_exactly(tmp_path, weights, refused):
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "manifest.jsonl").write_text(json.dumps({"index": 0, "weights": weights}) + "\n")
    assert (reference_marker(tmp_path) is not None) == refused
    for golden, marked in (("golden:numpy", True), ("real", refused)):
        (tmp_path / "run.json").write_text(json.dumps({"config": {"golden": golden}}))
        if marked:
            with pytest.raises(AbiError, match="--run-dir"):
                check_run_dir(tmp_path)
        else:
            check_run_dir(tmp_path)


def test_unreadable_files_are_left_to_their_readers(tmp_path):
    (tmp_path / "run.json").write_text("{not json")
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "manifest.jsonl").write_bytes(b"\xff\xfe")
    assert reference_marker(tmp_path) is None
    assert reference_marker(tmp_path / "absent") is None
