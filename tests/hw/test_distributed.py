"""Four ranks on CPU (gloo, 127.0.0.1): CP all-gathers, TP all-reduce, EP all-to-all dispatch and
combine as real collectives, checked against the single-process golden of the same layer."""
from hw.distributed import spawn_local


def test_four_ranks_match_the_golden_layer(tmp_path):
    r = spawn_local(4, preset="tiny", rows=64, layer=1, out=str(tmp_path / "rank0.json"), timeout_s=150)
    assert r["verdict"] == "pass", r
    assert r["world"] == 4 and r["backend"] == "gloo"
    assert r["collectives"]["ep_all_to_all"] >= 2 and r["collectives"]["cp_allgather"] >= 1
    assert r["collectives"]["tp_allreduce"] >= 1
    assert r["metrics"]["cosine"] > 0.999
