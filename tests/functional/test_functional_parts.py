"""The functional twin's parts: acceptance export, the oracle, the dispatch cross-check, bad input,
the CLI path and the package's import rules."""
import ast
import json
from pathlib import Path

import numpy as np
import pytest

from golden.paged import PREFILL, Span, lower as golden_lower
from twin.abi import deployment
from twin.abi.batches import PrefillBatch, PrefillItem
from twin.abi.errors import AbiError, ConfigError
from twin.abi.lowering import LoweringContext, lower
from twin.functional import (GoldenExecutor, conditional_rates, first_difference,
                             load_acceptance, sequential_greedy)
from golden.staging import PageMap, check_prefill as staged_check_prefill
from twin.sim import StepPlan

from functional_workload import make_dep

ROOT = Path(__file__).resolve().parents[2]


# ---- acceptance export ---------------------------------------------------------------------------
def test_exported_vector_is_the_cost_models_conditional_form(replay_run, tmp_path):
    summ = replay_run.executor.speculation()
    vec = replay_run.acceptance
    u = summ["acceptance_per_position"]
    assert vec["unconditional"] == u and u[0] > 0
    # a linear chain: P(j accepted) = prod of the conditionals up to j
    np.testing.assert_allclose(np.cumprod(vec["rates"]), u, rtol=1e-12)
    path = tmp_path / "acceptance.json"
    path.write_text(json.dumps(vec))
    model = load_acceptance(path)
    assert summ["fallback_steps"] == 0
    np.testing.assert_allclose(model.expected_length(), summ["mean_accepted_length"], rtol=1e-12)
    # the counts golden measured are the histogram the simulator reports for the same run
    hist = replay_run.sim.summary["acceptance"]["histogram"]
    assert sum(hist.values()) == summ["verify_steps"]
    assert sum(c * n for c, n in hist.items()) == summ["accepted_tokens"]


def test_conditional_rates_of_unreached_positions_are_zero():
    assert conditional_rates([0.5, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0]) == [0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_load_acceptance_names_a_bad_file(tmp_path):
    bad = tmp_path / "a.json"
    bad.write_text(json.dumps({"rates": [0.5, 0.5]}))
    with pytest.raises(ConfigError, match=r"a\.json: rates=\[0\.5, 0\.5\].*7 probabilities"):
        load_acceptance(bad)
    bad.write_text(json.dumps({"rates": [0.5] * 6 + [1.5]}))
    with pytest.raises(ConfigError, match=r"rates\[6\]=1\.5.*<= 1"):
        load_acceptance(bad)
    with pytest.raises(ConfigError, match="--acceptance-from='.*missing.json'.*no such file"):
        load_acceptance(tmp_path / "missing.json")


# ---- the oracle ----------------------------------------------------------------------------------
def test_incremental_oracle_equals_full_recompute(golden):
    prompt = np.random.default_rng(11).integers(2, golden.cfg.vocab_size, 40)
    assert sequential_greedy(golden, prompt, 5) == sequential_greedy(golden, prompt, 5, mode="recompute")


def test_first_difference_names_request_and_position():
    ref = {"a": [1, 2, 3], "b": [4, 5, 6]}
    assert first_difference({"a": [1, 2, 3], "b": [4, 5, 6]}, ref) is None
    assert first_difference({"a": [1, 2, 3], "b": [4, 9, 6]}, ref) == ("b", 1, 9, 5)
    assert first_difference({"a": [1, 2], "b": [4, 5, 6]}, ref) == ("a", 2, None, 3)
    assert first_difference({"a": [1, 2, 3, 7], "b": [4, 5, 6]}, ref) == ("a", 3, 7, None)


# ---- the two lowerings agree, and a wrong staged slot is caught ---------------------------------------
def check_prefill(d, cfg, spans, pages, items) -> None:
    """The staged dispatch against golden's own lowering of the same spans (what golden.dispatch runs)."""
    staged_check_prefill(d, golden_lower(cfg, spans, form=PREFILL), items, pages)


def _prefill_case():
    dep = make_dep()
    ctx = LoweringContext(dep, slots=2)
    pages = PageMap(ctx)
    blocks = {f: tuple(range(2, 2 + min(4, n))) for f, n in ctx.num_blocks.items()}
    items = (PrefillItem("a", tuple(range(3, 63)), 100, 160, blocks, partition=1),)
    d = lower(PrefillBatch(items), ctx)
    spans = [Span(0, 100, items[0].chunk_tokens, pages.to_golden(1, blocks))]
    return dep, d, spans, pages, items


def test_prefill_dispatch_and_golden_write_the_same_slots():
    dep, d, spans, pages, items = _prefill_case()
    check_prefill(d, dep.model, spans, pages, items)
    meta = golden_lower(dep.model, spans, form=PREFILL)
    assert (meta.slots["ori"] >= pages.num_blocks["ori"] * 32).all()      # partition 1's pages in golden's pool


@pytest.mark.parametrize("arg", ["ori_slot_mapping_full", "csa_cmp_slot_mapping_full", "position_ids_full"])
def test_a_wrong_staged_argument_is_caught(arg):
    dep, d, spans, pages, items = _prefill_case()
    args = dict(d.args)
    a = np.array(args[arg])
    row = a[4]                                    # group 1's leader rank
    i = int(np.flatnonzero(row[:60] >= 0)[-1])
    row[i] += 1
    args[arg] = a
    with pytest.raises(AbiError, match=arg):
        check_prefill(type(d)(d.program, args, d.meta), dep.model, spans, pages, items)


# ---- bad input -----------------------------------------------------------------------------------
def test_executor_rejects_what_it_cannot_run(golden):
    with pytest.raises(AbiError, match="golden.cfg"):
        GoldenExecutor(deployment("small", ep=8, max_model_len=512), 2, golden)
    ex = GoldenExecutor(make_dep(), 2, golden)
    blocks = {f: (0,) for f in ex.ctx.num_blocks}
    stray = PrefillBatch((PrefillItem("ghost", (5, 6, 7), 0, 3, blocks, 0, 63, 1),))
    with pytest.raises(AbiError, match="request_id.*ghost"):
        ex.execute(StepPlan(1, (stray,), (), None, ((), ()), False))
    with pytest.raises(AbiError, match=r"block_ids\[ori\]"):
        ex.host.pages.to_golden(0, {"ori": (ex.host.pages.num_blocks["ori"],)})


def test_golden_executor_refuses_flash_on_the_cli(tmp_path, capsys):
    from twin.cli import main
    assert main(["simulate", "--executor", "golden", "--out", str(tmp_path), "--no-plots", "--json"]) != 0
    assert "preset='flash'" in capsys.readouterr().err


# ---- the CLI path --------------------------------------------------------------------------------
def test_cli_golden_run_writes_the_cost_report_plus_tokens(tmp_path, capsys):
    from twin.cli import main
    common = ["simulate", "--preset", "tiny", "--ep", "8", "--max-model-len", "512", "--chunk", "64",
              "--max-num-seqs", "4", "--requests", "3", "--no-plots", "--json"]
    assert main(common + ["--executor", "golden", "--out", str(tmp_path / "g")]) == 0
    assert main(common + ["--out", str(tmp_path / "c")]) == 0
    capsys.readouterr()
    g, c = tmp_path / "g", tmp_path / "c"
    assert {p.name for p in c.iterdir()} | {"tokens.jsonl", "acceptance.json"} == {p.name for p in g.iterdir()}
    gs, cs = json.loads((g / "summary.json").read_text()), json.loads((c / "summary.json").read_text())
    assert gs.keys() == cs.keys() and gs["deployment"]["executor"] == "golden"
    rows = [json.loads(line) for line in (g / "tokens.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["r0", "r1", "r2"]
    assert all(len(r["tokens"]) == 16 and r["finish"] == "length" for r in rows)
    vocab = make_dep().model.vocab_size
    assert all(0 <= t < vocab for r in rows for t in r["tokens"])
    acc = json.loads((g / "acceptance.json").read_text())
    assert len(acc["rates"]) == 7 and acc["verify_steps"] == gs["acceptance"]["verifies"]
    # the exported vector feeds a cost-model run
    assert main(common + ["--acceptance-from", str(g / "acceptance.json"), "--out", str(tmp_path / "a")]) == 0


# ---- import rules --------------------------------------------------------------------------------
def test_functional_imports_only_abi_sim_and_golden_and_hw_only_for_parity():
    """The golden executor needs no hw: only the parity run (twin.functional.parity) plugs the
    lockstep checker in."""
    bad = []
    for path in (ROOT / "twin/functional").rglob("*.py"):
        allowed = ("twin.abi", "twin.sim", "twin.functional", "golden") + (("hw",) if path.name == "parity.py" else ())
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for m in mods:
                if m.split(".")[0] in ("twin", "golden", "hw") and not any(m == a or m.startswith(a + ".") for a in allowed):
                    bad.append(f"{path.name} imports {m}")
    assert not bad, bad


def test_an_executor_error_inside_the_simulation_keeps_its_message(golden):
    """SimPy re-raises a process's exception as type(e)(*e.args): the ABI errors survive that."""
    from twin.functional import functional_simulate
    from twin.abi.batches import Request, Sampling
    dep = make_dep()
    bad = Request("r0", np.full(20, dep.model.vocab_size + 5), Sampling(2))      # token ids past the vocabulary
    with pytest.raises(AbiError, match="input_ids|token"):
        functional_simulate(dep, [bad], golden, slots=2)


def test_cli_golden_run_with_the_v41_drafter(tmp_path, capsys):
    """--drafter v4.1: the golden executor drafts with the V4.1 wiring; the tokens stay the device
    drafter's (speculation never changes a token) and the summary names the drafter."""
    from twin.cli import main
    from twin.functional import golden_model
    from golden.dspark.variants import DEVICE, V41
    assert golden_model("tiny", drafter="v4.1").drafter is V41 and golden_model("tiny").drafter is DEVICE
    common = ["simulate", "--preset", "tiny", "--ep", "8", "--max-model-len", "512", "--chunk", "64",
              "--max-num-seqs", "4", "--requests", "2", "--no-plots", "--json", "--executor", "golden"]
    for d in ("device", "v4.1"):
        assert main(common + ["--drafter", d, "--out", str(tmp_path / d)]) == 0
    capsys.readouterr()
    s = {d: json.loads((tmp_path / d / "summary.json").read_text()) for d in ("device", "v4.1")}
    assert s["v4.1"]["deployment"]["drafter"] == "v4.1" and s["device"]["deployment"]["drafter"] == "device"
    tokens = {d: (tmp_path / d / "tokens.jsonl").read_text() for d in ("device", "v4.1")}
    assert tokens["device"] == tokens["v4.1"]
