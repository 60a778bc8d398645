"""Workload adapters on small files the tests write: ShareGPT, vLLM's random and prefix-repetition
sets, Mooncake traces (shared 512-token prefix blocks) and the Azure trace CSV; bad files name
the file and line."""
import json
import math

import numpy as np
import pytest

from simtest import make_dep
from twin.abi.errors import ConfigError
from twin.cli import main
from twin.sim import datasets as ds
from twin.sim.run import SimConfig, simulate

SYSTEM = "You are a careful assistant. Answer in one short paragraph, citing the manual. " * 3


def sharegpt_file(tmp_path):
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": SYSTEM + "What is KV caching?"},
                                      {"from": "gpt", "value": "It keeps the keys and values of past tokens."}]},
        {"id": "b", "conversations": [{"from": "human", "value": "only one turn"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]},
        {"id": "d", "conversations": [{"from": "human", "value": SYSTEM + "And paged attention?"},
                                      {"from": "gpt", "value": "Pages of KV rows, mapped by a block table."},
                                      {"from": "human", "value": "thanks"}]},
    ]
    p = tmp_path / "sharegpt.json"
    p.write_text(json.dumps(data, indent=1))
    return p, data


def test_sharegpt_by_characters_per_token(tmp_path):
    p, data = sharegpt_file(tmp_path)
    reqs = ds.sharegpt(p, vocab=5000)
    # one-turn 'b' and the 1-token prompt 'c' are skipped, as vLLM skips them
    assert len(reqs) == 2
    for r, entry in zip(reqs, (data[0], data[3])):
        prompt, answer = entry["conversations"][0]["value"], entry["conversations"][1]["value"]
        assert r.prompt_len == math.ceil(len(prompt) / ds.CHARS_PER_TOKEN)
        assert r.sampling.max_new_tokens == math.ceil(len(answer) / ds.CHARS_PER_TOKEN)
    # the shared system text gives a shared token prefix (whole 4-character groups)
    common = len(SYSTEM) // 4
    assert (reqs[0].prompt[:common] == reqs[1].prompt[:common]).all()
    assert (reqs[0].prompt[common + 2:] != reqs[1].prompt[common + 2:common + 2 + len(reqs[0].prompt[common + 2:])]).any()
    assert ds.sharegpt(p, vocab=5000, num_prompts=1, output_len=16)[0].sampling.max_new_tokens == 16


def test_sharegpt_with_a_local_tokenizer_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    p, data = sharegpt_file(tmp_path)
    words = sorted({w for e in data for t in e["conversations"] for w in t["value"].replace(".", " . ")
                    .replace("?", " ? ").replace(",", " , ").split()})
    tok = Tokenizer(models.WordLevel({w: i + 2 for i, w in enumerate(words)} | {"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    reqs = ds.sharegpt(p, tokenizer=ds.DirTokenizer(tmp_path / "tok"))
    # a word-level vocabulary: one token per word or punctuation mark; 'c' ("hi") has 1 < 4
    q = data[0]["conversations"][0]["value"]
    assert reqs[0].prompt_len == len(q.replace(".", " . ").replace("?", " ? ").replace(",", " , ").split())
    assert len(reqs) == 2 and reqs[0].prompt[0] == words.index("You") + 2


def test_random_dataset_follows_vllm():
    reqs = ds.random_dataset(200, input_len=100, output_len=20, range_ratio=0.5, prefix_len=16, seed=1, vocab=1000)
    plen = np.array([r.prompt_len for r in reqs]) - 16
    olen = np.array([r.sampling.max_new_tokens for r in reqs])
    assert plen.min() >= 50 and plen.max() <= 150 and olen.min() >= 10 and olen.max() <= 30
    assert plen.min() < 60 and plen.max() > 140          # the whole range is drawn
    assert all((r.prompt[:16] == reqs[0].prompt[:16]).all() for r in reqs)
    inner = reqs[3].prompt[16:] - ds.FIRST_ID
    assert (np.diff(inner) % (1000 - ds.FIRST_ID) == 1).all()   # (offset + index + position) mod vocab
    fixed = ds.random_dataset(5, input_len=64, output_len=8, seed=2)
    assert {r.prompt_len for r in fixed} == {64} and {r.sampling.max_new_tokens for r in fixed} == {8}
    with pytest.raises(ConfigError, match="--random-range-ratio"):
        ds.random_dataset(5, range_ratio=1.0)


def test_prefix_repetition_follows_vllm():
    reqs = ds.prefix_repetition(25, prefix_len=64, suffix_len=32, num_prefixes=4, output_len=9, seed=0, vocab=1000)
    assert len(reqs) == 24                             # 25 // 4 per prefix, as vLLM draws
    groups = {}
    for r in reqs:
        groups.setdefault(r.tag, []).append(r)
        assert r.prompt_len == 96 and r.sampling.max_new_tokens == 9
    assert sorted(len(g) for g in groups.values()) == [6, 6, 6, 6]
    for g in groups.values():
        assert all((r.prompt[:64] == g[0].prompt[:64]).all() for r in g)
        assert len({r.prompt[64:].tobytes() for r in g}) == len(g)
    assert [r.tag for r in reqs] != sorted(r.tag for r in reqs)       # shuffled
    with pytest.raises(ConfigError, match="num-prefixes"):
        ds.prefix_repetition(3, num_prefixes=4)


def mooncake_file(tmp_path, rows=None):
    rows = rows or [
        {"timestamp": 1000, "input_length": 1300, "output_length": 40, "hash_ids": [7, 8, 9]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 30, "hash_ids": [7, 8, 10]},
        {"timestamp": 2750, "input_length": 700, "output_length": 20, "hash_ids": [7]},
        {"timestamp": 3000, "input_length": 300, "output_length": 10, "hash_ids": []},
    ]
    p = tmp_path / "mooncake.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_mooncake_hash_ids_are_shared_512_token_blocks(tmp_path):
    reqs = ds.mooncake(mooncake_file(tmp_path), vocab=5000)
    assert [r.arrival for r in reqs] == [0.0, 0.5, 1.75, 2.0]          # ms, relative to the first
    assert [r.prompt_len for r in reqs] == [1300, 1100, 700, 300]
    a, b, c, _ = reqs
    assert (a.prompt[:1024] == b.prompt[:1024]).all()                  # blocks 7, 8
    assert (a.prompt[1024:1100] != b.prompt[1024:1100]).any()          # 9 vs 10
    assert (c.prompt[:512] == a.prompt[:512]).all() and (c.prompt[512:] != a.prompt[512:700]).any()
    # the prefix cache sees the shared blocks: requests 2 and 3 hit
    res = simulate(SimConfig(make_dep(max_model_len=2048), reqs))
    pc = res.summary["prefix_cache"]
    assert pc["hits"] >= 2 and pc["hit_tokens"] >= 1024


def test_azure_trace_csv(tmp_path):
    p = tmp_path / "azure.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.6805900,374,44\n"
                 "2023-11-16 18:15:50.9951690,396,109\n"
                 "\n"
                 "2023-11-16 18:15:51.0000000,879,3\n")
    reqs = ds.azure(p, vocab=5000)
    assert [r.prompt_len for r in reqs] == [374, 396, 879]
    assert [r.sampling.max_new_tokens for r in reqs] == [44, 109, 3]
    assert reqs[0].arrival == 0.0
    assert reqs[1].arrival == pytest.approx(50.995169 - 46.68059, abs=1e-6)
    assert reqs[2].arrival == pytest.approx(51.0 - 46.68059, abs=1e-6)
    assert len(ds.azure(p, num_prompts=2)) == 2


@pytest.mark.parametrize("kind, text, line", [
    ("mooncake", '{"timestamp": 0, "input_length": 10, "output_length": 2}\n{"timestamp": 1, "input_length": 5}\n', 2),
    ("mooncake", '{"timestamp": 0, "input_length": 10, "output_length": 2}\n\nnot json\n', 3),
    ("mooncake", '{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2, 3]}\n', 1),
    ("mooncake", '{"timestamp": 0, "input_length": 0, "output_length": 2}\n', 1),
    ("mooncake", '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": ["x"]}\n', 1),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,2\n2023-11-16 18:15:47,ten,2\n", 3),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,2\n", 2),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,0\n", 2),
    ("azure", "time,in,out\n2023-11-16 18:15:46,10,2\n", 1),
    ("sharegpt", '[{"conversations": [\n  {"from": "human", "value": "x"},\n', 3),
])
def test_bad_files_name_the_file_and_line(tmp_path, capsys, kind, text, line):
    p = tmp_path / f"bad.{kind}"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        getattr(ds, kind)(p)
    assert f"{p}:{line}" in str(e.value)
    # and through the command: exit 2, one line naming the file and line
    assert main(["simulate", "--dataset-name", kind, "--dataset-path", str(p), "--out", str(tmp_path / "o"),
                 "--no-plots", "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{p}:{line}" in err and "Traceback" not in err


@pytest.mark.parametrize("args, name", [
    (("--dataset-name", "random", "--dataset-path", "x.json"), "--dataset-path"),
    (("--dataset-name", "sharegpt"), "--dataset-path"),
    (("--dataset-path", "x.json"), "--dataset-path"),
    (("--dataset-name", "random", "--random-range-ratio", "1.5"), "--random-range-ratio"),
    (("--dataset-name", "random", "--random-output-len", "0"), "--random-output-len"),
    (("--dataset-name", "prefix_repetition", "--requests", "4", "--prefix-repetition-num-prefixes", "5"),
     "--prefix-repetition-num-prefixes"),
    (("--dataset-name", "sharegpt", "--dataset-path", "/nonexistent/sharegpt.json"), "/nonexistent/sharegpt.json"),
    (("--dataset-name", "sharegpt", "--dataset-path", "x.json", "--tokenizer", "/nonexistent"), "--tokenizer"),
    (("--dataset-name", "random", "--trace", "t.jsonl"), "--trace"),
])
def test_bad_dataset_flags_exit_2(tmp_path, capsys, args, name):
    assert main(["simulate", *args, "--out", str(tmp_path / "o"), "--no-plots", "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and name in err and "allowed" in err


def test_simulate_runs_a_dataset(tmp_path, capsys):
    p = mooncake_file(tmp_path)
    assert main(["simulate", "--dataset-name", "mooncake", "--dataset-path", str(p), "--max-model-len", "2048",
                 "--out", str(tmp_path / "m"), "--no-plots", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["completed"] == 4 and s["workload"]["dataset"] == "mooncake" and s["prefix_cache"]["hits"] >= 2
    v = json.loads((tmp_path / "m" / "vllm_result.json").read_text())
    assert v["input_lens"] == [1300, 1100, 700, 300] and v["request_rate"] == "inf"
    assert main(["simulate", "--dataset-name", "random", "--num-prompts", "12", "--random-input-len", "200",
                 "--random-output-len", "16", "--request-rate", "50", "--out", str(tmp_path / "r"),
                 "--no-plots", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["completed"] == 12 and s["total_input_tokens"] == 12 * 200 and s["workload"]["rate"] == 50.0
