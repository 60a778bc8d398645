"""The torch device's collectives seam (`hw.torchdev.ranks`): every program run with its ranks
split over two spawned gloo processes equals the one-process run bit for bit.

Exact by construction, not by tolerance: a split run gathers the operands of every cross-rank
point (the group stream rows, the o_proj partials, the EP dispatch rows and routed rows, the
vocabulary shards) and then performs the in-process arithmetic, in rank order, on the same values
and the same tensor shapes, in processes on one torch thread each as the in-process run is; so
float bit-equality is what the code guarantees.  Two splits: 16 ranks (each process holds two
whole TP groups; the EP dispatch and combine cross processes) and 4 ranks (one TP group spread
over both processes, so the group gathers and the o_proj reduce-scatter cross them too)."""
import pytest

pytest.importorskip("torch")

from hw.launch import gloo_problem, run_local_ranks  # noqa: E402
from split_cases import check  # noqa: E402

if gloo_problem():
    pytest.skip(gloo_problem(), allow_module_level=True)

PROGRAMS = {"prefill": "l3_prefill_fwd", "decode": "l3_decode_fwd", "drafter": "l3_dspark_drafter",
            "bootstrap": "l3_dspark_draft_step_device_state", "markov": "l3_distributed_markov_sample"}


pytestmark = pytest.mark.usefixtures("one_cpu_thread")      # tests/conftest.py


@pytest.mark.parametrize("ep, held", [(16, [list(range(8)), list(range(8, 16))]), (4, [[0, 1], [2, 3]])])
def test_every_program_split_over_two_processes_is_bit_identical(tmp_path, ep, held):
    v = run_local_ranks(check, (2, ep, str(tmp_path / "verdict.json")), 2, str(tmp_path / "verdict.json"),
                        timeout_s=150)
    assert v["ranks"] == ep and v["held"] == held
    assert {k: c["program"] for k, c in v["cases"].items()} == PROGRAMS
    for label, c in v["cases"].items():
        # what was compared is the whole result: every output, pool written and (layer, stage) tap
        assert c["outputs"] and c["taps"] > 0, label
        assert c["differ"] == {"outputs": [], "state": [], "taps": []}, label
    assert set(v["cases"]["prefill"]["state"]) >= {"kv_cache", "csa_cmp_kv", "idx_kv_cache"}
    assert v["cases"]["drafter"]["state"] == ["kv_caches"]


def test_pool_deltas_carry_exactly_the_rows_whose_bytes_differ():
    import numpy as np

    from hw.torchdev.workers import decode, encode

    held = np.zeros((2, 3, 4), np.float32)
    new = held.copy()
    new[0, 1, 2] = -0.0          # equal as a float, another bit pattern: it travels
    new[1, 2] = np.nan
    kind, idx, rows = encode(held, new)
    assert kind == "rows" and idx.tolist() == [1, 5] and rows.shape == (2, 4)
    out = decode(held, (kind, idx, rows))
    assert out.tobytes() == new.tobytes() and not held.any()        # a new array; held is not written
    assert encode(held, held.copy())[1].size == 0                   # nothing changed, nothing travels
    assert encode(None, new)[0] == "whole" and encode(held[:1], new)[0] == "whole"
    assert encode(held.astype(np.float64), new)[0] == "whole"
