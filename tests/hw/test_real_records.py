"""Records of the real-golden lockstep on a parity run: a recorded run replays offline (its
scheduler re-driven with the recorded device outputs) to the same report entries, tampered records
are flagged, and a killed run (SIGKILL) resumes to a byte-identical report with no dispatch lost
or repeated."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from hw.records import Record, RecordStore  # noqa: E402
from twin.functional.parity import build_lockstep  # noqa: E402
from twin.functional.parity import replay_records as replay  # noqa: E402
from killed_run import ROOT, env, kill_after  # noqa: E402
from twin.abi.errors import AbiError  # noqa: E402

N = 14                     # prefill, seed and fused K=7 dispatches


def _run(run_dir, **kw):
    # the CLI's budget for --steps N (twin/commands/lockstep.py), so the CLI run below is the same run
    return build_lockstep(max_new=max(8, N), run_dir=run_dir, **kw)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    d = tmp_path_factory.mktemp("real-rec")
    s = _run(d).run(N)
    assert s["verdict"] == "PASS" and s["dispatches"] == N
    return d


def _lines(d: Path) -> list[str]:
    return (d / "report.jsonl").read_text().splitlines()


def _same_run(a: Path, b: Path) -> None:
    assert (a / "report.jsonl").read_bytes() == (b / "report.jsonl").read_bytes()
    assert (a / "summary.md").read_text() == (b / "summary.md").read_text()
    recs = [json.loads(x)["index"] for x in (b / "records" / "manifest.jsonl").read_text().splitlines()]
    assert recs == list(range(N))                       # none lost, none repeated


def test_records_hold_inputs_outputs_and_state_deltas(recorded):
    store = RecordStore(recorded / "records")
    recs = store.records()
    assert [r.index for r in recs] == list(range(N))
    assert {r.meta["real"]["kind"] for r in recs} == {"prefill", "seed", "decode"}
    dec = recs[-1]
    assert "group_state_slot_ids" in dec.inputs and "input_ids" in recs[0].inputs
    assert "accepted_ids" in dec.outputs and "tap:head/logits" in dec.outputs
    assert any(k.endswith("/kv_cache") for k in dec.state_delta) and "dspark/tokens" in dec.state_delta
    # a delta is the rows the dispatch changed, not the pool: far fewer rows than the pool holds
    k = next(k for k in dec.state_delta if k.endswith("/kv_cache"))
    rows = store.get(dec.state_delta[k]["rows"])
    shape = store.index[json.loads((recorded / "records" / "initial.json").read_text())[k]][3]
    assert 0 < rows.size < 0.25 * np.prod(shape[:-1])


def test_replay_gives_the_recorded_entries(recorded, capsys):
    from twin.cli import main

    assert main(["lockstep", "--replay", "--run-dir", str(recorded)]) == 0      # all of it, in order
    assert f"{N} identical to the report" in " ".join(capsys.readouterr().out.split())
    entries = replay(recorded)
    assert [json.dumps(e, sort_keys=True) for e in entries] == _lines(recorded)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_replay_flags_tampered_bytes(recorded, tmp_path):
    d = _copy(recorded, tmp_path / "run")
    store = RecordStore(d / "records")
    h = store.records()[6].outputs["accepted_ids"]
    pack, off, *_ = store.index[h]
    with open(d / "records" / "packs" / pack, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 1]))
    with pytest.raises(AbiError, match="dispatch 6 output accepted_ids"):
        replay(d)


def test_replay_flags_a_consistently_rewritten_record(recorded, tmp_path):
    """A record rewritten with valid hashes (a different device result) fails its dispatch's check."""
    d = _copy(recorded, tmp_path / "run")
    store = RecordStore(d / "records")
    recs = store.records()
    i = next(r.index for r in recs[5:] if r.meta["real"]["kind"] == "decode")
    rec = recs[i]
    key = next(k for k in rec.state_delta if k.endswith("/kv_cache"))
    vals = np.array(store.get(rec.state_delta[key]["values"]))
    vals[0] = (vals[0].astype(np.float32) + 0.5).astype(vals.dtype)
    delta = {"rows": rec.state_delta[key]["rows"], "values": store.put(vals)}
    store.flush_pack("tampered")
    recs[i] = Record(**{**rec.to_dict(), "state_delta": {**rec.state_delta, key: delta}})
    (d / "records" / "manifest.jsonl").write_text("".join(json.dumps(r.to_dict(), sort_keys=True) + "\n"
                                                          for r in recs))
    entries = replay(d)[:i + 1]
    assert [e["verdict"] for e in entries] == ["pass"] * i + ["fail"]
    fd = entries[i]["first_divergence"]
    assert (fd["layer"], fd["stage"]) == (key.split("/")[0], "kv")
    from twin.cli import main

    assert main(["lockstep", "--replay", "--run-dir", str(d)]) == 1


def test_crash_between_record_and_report_line_resumes_identically(recorded, tmp_path):
    lr = _run(tmp_path)
    lr.crash_after = 7                   # dies after dispatch 7's record, before its report line
    with pytest.raises(KeyboardInterrupt):
        lr.run(N)
    assert len(_lines(tmp_path)) == 7
    assert len((tmp_path / "records" / "manifest.jsonl").read_text().splitlines()) == 8
    _run(tmp_path).run(N)                # what a fresh process does
    _same_run(recorded, tmp_path)


def test_resume_refuses_another_configuration_or_no_records(recorded, tmp_path):
    d = _copy(recorded, tmp_path / "run")
    with pytest.raises(AbiError, match="differs in \\[.*'seed'\\]"):
        _run(d, seed=1).run(N)
    with pytest.raises(AbiError, match="run_dir"):
        _run(d, record=False).run(N)


def test_sigkilled_cli_run_resumes_identically(recorded, tmp_path):
    cmd = [sys.executable, "-m", "twin.cli", "lockstep", "--steps", str(N), "--run-dir", str(tmp_path)]
    done = kill_after(cmd, tmp_path / "report.jsonl", 5, wait_s=120)
    assert 5 <= done < N
    out = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "resuming" in out.stdout and "PASS" in out.stdout
    _same_run(recorded, tmp_path)


def test_a_failing_continuous_run_replays_and_resumes_identically(tmp_path):
    """After a fault the golden adopts the device's whole run (continuous mode): replay and resume
    reproduce that too, including the failing dispatch's localization from its recorded taps."""
    from hw.real.faults import RealFault

    def run(d, crash=None):
        lr = build_lockstep(max_new=10, run_dir=d, mode="continuous", fault=RealFault("kv_row", at=5, layer=3))
        lr.crash_after = crash
        return lr.run(10)

    s = run(tmp_path / "a")
    assert s["failed_dispatches"] == 1 and s["first_divergence"]["dispatch"] == 5
    assert [json.dumps(e, sort_keys=True) for e in replay(tmp_path / "a")] == _lines(tmp_path / "a")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b", crash=7)
    run(tmp_path / "b")
    for name in ("report.jsonl", "summary.md", "summary.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
