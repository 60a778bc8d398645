"""capacity and simulate size their pools from different default settings: each says so, and the
slot count capacity quotes for simulate's defaults is the one simulate runs with."""
import json
import re

from twin.cli import main


def test_capacity_explains_and_quotes_simulates_slots(tmp_path, capsys):
    assert main(["capacity"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    m = re.search(r"with this command's HBM settings: (\d+) slots per partition", out)
    assert m and "max-model-len 1024, chunk 2048" in out and "max-model-len 8192, chunk 512" in out
    assert main(["simulate", "--requests", "8", "--out", str(tmp_path), "--no-plots"]) == 0
    sim_out = " ".join(capsys.readouterr().out.split())
    assert "simulate's defaults size the pools for max-model-len 8192, chunk 512" in sim_out
    assert json.loads((tmp_path / "summary.json").read_text())["slots_per_partition"] == int(m.group(1))
    assert main(["capacity", "--json"]) == 0
    own = json.loads(capsys.readouterr().out)["slots_per_partition"]
    assert own != int(m.group(1))          # the two defaults really differ in what they admit


def test_no_note_once_the_sizing_flags_are_given(tmp_path, capsys):
    assert main(["capacity", "--max-model-len", "8192", "--chunk", "512"]) == 0
    assert "note:" not in capsys.readouterr().out
    assert main(["simulate", "--requests", "8", "--max-model-len", "1024", "--chunk", "2048", "--out", str(tmp_path),
                 "--no-plots"]) == 0
    assert "note:" not in capsys.readouterr().out
