"""The KV budget flags of `capacity` and `simulate`: what they report, and bad values (exit 2, one
line naming the flag, the value and what is allowed, no traceback)."""
import json
import subprocess
import sys

import pytest

from twin.abi import MEASURED_BOOT, bytes_per_slot, scratch_bytes
from twin.cli import main

BOOT_FLAGS = ["--max-model-len", "1024", "--chunk", "128", "--max-num-seqs", "8"]


def capacity_json(capsys, *argv):
    rc = main(["capacity", *BOOT_FLAGS, *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_default_report_says_where_the_budget_came_from(capsys):
    rc, d = capacity_json(capsys)
    assert rc == 0 and d["budget_source"] == "account" and "37" in d["budget_detail"]
    assert d["slots_per_partition"] == MEASURED_BOOT.measurement.value
    assert {ln["name"] for ln in d["lines"]} >= {"unexplained", "prefill_arena", "driver_baseline"}
    lo, hi = d["unexplained_interval_bytes"]
    assert lo <= d["unexplained_bytes"] <= hi and d["per_rank_bytes"]["unexplained"] == d["unexplained_bytes"]


def test_measured_slots_reports_the_implied_interval_and_1m_prediction(capsys):
    rc, d = capacity_json(capsys, "--measured-slots", "37")
    assert rc == 0 and d["budget_source"] == "measured_slots"
    per, scratch = d["bytes_per_slot"], d["scratch_bytes"]
    assert d["kv_budget_interval_bytes"] == [scratch + 37 * per, scratch + 38 * per - 1]
    one_m = [p for p in d["predictions"] if (p["max_model_len"], p["chunk"]) == (1_048_576, 8192)]
    assert len(one_m) == 1 and one_m[0]["slots_max"] == 0          # a 9.35 GB request in a ~2.8 GB budget


def test_measured_bytes_and_pages_in_the_text_report(capsys):
    assert main(["capacity", *BOOT_FLAGS, "--measured-free-bytes", "10000000000"]) == 0
    out = capsys.readouterr().out
    assert "budget source: measured_free_bytes" in out and "10,000,000,000" in out
    assert main(["capacity", *BOOT_FLAGS, "--total-kv-pages", "90"]) == 0
    out = capsys.readouterr().out
    assert "budget source: total_kv_pages" in out and "slots per partition: 10 " in out


def test_free_and_used_figures_agree(capsys):
    hbm = 64 << 30
    _, free = capacity_json(capsys, "--measured-free-bytes", str(10_000_000_000))
    _, used = capacity_json(capsys, "--measured-used-bytes", str(hbm - 10_000_000_000))
    assert free["kv_budget_bytes"] == used["kv_budget_bytes"] == int(hbm * 0.9) - (hbm - 10_000_000_000)
    assert free["slots_per_partition"] == used["slots_per_partition"] == \
        (free["kv_budget_bytes"] - scratch_bytes(MEASURED_BOOT.deployment)) // bytes_per_slot(MEASURED_BOOT.deployment)


BAD = [
    (["--measured-slots", "0"], "--measured-slots=0 is invalid; allowed: an integer 1..64"),
    (["--measured-slots", "65"], "--measured-slots=65"),
    (["--measured-slots", "3.5"], "--measured-slots='3.5' is invalid; allowed: a decimal integer"),
    (["--measured-slots", "many"], "--measured-slots='many'"),
    (["--measured-free-bytes", "-1"], "--measured-free-bytes=-1 is invalid; allowed: an integer byte count 0.."),
    (["--measured-free-bytes", "1e9"], "--measured-free-bytes='1e9' is invalid; allowed: a decimal integer"),
    (["--measured-used-bytes", str(65 << 30)], "--measured-used-bytes=69793218560"),
    (["--total-kv-pages", "0"], "--total-kv-pages='0' is invalid; allowed: a positive page count"),
    (["--total-kv-pages", "8"], "--total-kv-pages=8 is invalid; allowed: an integer >= ori blocks per request = 9"),
    (["--total-kv-pages", "x"], "--total-kv-pages='x'"),
    (["--measured-slots", "3", "--total-kv-pages", "90"], "not together with --total-kv-pages"),
    (["--measured-free-bytes", "1", "--measured-used-bytes", "1"], "--measured-used-bytes='1' is invalid; "
                                                                   "allowed: not together with --measured-free-bytes"),
]


@pytest.mark.parametrize("argv,match", BAD)
def test_capacity_bad_budget_values(capsys, argv, match):
    assert main(["capacity", *BOOT_FLAGS, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and "\n" not in err and err.startswith("dspark-twin capacity: error: ")


@pytest.mark.parametrize("argv,match", [
    (["--measured-slots", "0"], "--measured-slots=0"),
    (["--total-kv-pages", "5"], "--total-kv-pages=5 is invalid; allowed: an integer >= ori blocks per request"),
    (["--measured-used-bytes", "-3"], "--measured-used-bytes=-3"),
    (["--slots", "4", "--measured-slots", "4"], "--slots=4 is invalid; allowed: not together with a KV budget flag"),
])
def test_simulate_bad_budget_values(tmp_path, argv, match):
    r = subprocess.run([sys.executable, "-m", "twin.cli", "simulate", *BOOT_FLAGS, "--requests", "4", "--no-plots",
                        "--out", str(tmp_path), *argv], capture_output=True, text=True)
    err = r.stderr.strip()
    assert r.returncode == 2 and match in err and "\n" not in err and "Traceback" not in err


def test_simulate_admits_from_a_measured_boot(tmp_path):
    r = subprocess.run([sys.executable, "-m", "twin.cli", "simulate", *BOOT_FLAGS, "--requests", "4", "--rate", "inf",
                        "--measured-slots", "5", "--no-plots", "--json", "--out", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["slots_per_partition"] == 5 and s["kv_budget_source"] == "measured_slots"
