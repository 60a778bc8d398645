"""The corpus of bad command-line inputs: one row per case, every command and every input file.

A row is (id, argv, flag, named, allowed):
- argv: the command line; "{d}" is a scratch directory holding `FILES` (written once per session);
- flag: the argument the case is about (the coverage checks read it: every value-taking option of
  every command, and every input-file flag for each of `FILE_KINDS`, has a row);
- named: substrings the one error line must hold: the argument or file (and line), and the value;
- allowed: a substring of what the line says is allowed.
Ids are "COMMAND FLAG what"; an input file's cases use the `FILE_KINDS` words for `what`.

A flag or an input file added later gets its rows here; `test_bad_inputs` fails until it has them.
One level down, `tests/abi/malformed_corpus.py` holds the malformed dispatches `validate` refuses
(no command takes a dispatch as input: one of the twin's making that breaks the ABI is a bug).
"""
from __future__ import annotations

import json

FILE_KINDS = ("missing", "empty", "not JSON", "wrong shape")
# the options that name an input file (the run directory holds lockstep's own files)
FILE_FLAGS = {("simulate", "--workload"), ("simulate", "--trace"), ("simulate", "--profile"),
              ("simulate", "--routing-trace"), ("simulate", "--acceptance-from"), ("lockstep", "--policy"),
              ("lockstep", "--run-dir")}

REPORT = '{"index": 0, "program": "l3_prefill_fwd", "verdict": "pass"}\n'
FILES = {
    "empty.json": "",
    "bad.csv": "a,b\n1,2\n",
    "bad.yaml": "base: [1\n",
    "grid-flag.json": '{"grid": {"nope-flag": [1]}}',
    "grid-ok.json": '{"base": {"requests": 2, "rate": "inf"}, "grid": {"num-speculative-tokens": [0]}}',
    "sharegpt.json": '[{"conversations": [{"from": "human", "value": "Explain paged attention in two sentences."}, '
                     '{"from": "gpt", "value": "Rows live in fixed pages."}]}]',
    "not.json": '{"rate": 3,\n oops}',
    "list.json": "[1, 2]",
    "afile": "a regular file\n",
    # workloads
    "wl-unknown.json": '{"requests": 4}',
    "wl-type.json": '{"num_requests": "many"}',
    "wl-mean.json": '{"prompt": {"kind": "fixed", "mean": -5}}',
    "wl-range.json": '{"output": {"kind": "fixed", "mean": 50, "min": 64, "max": 128}}',
    "wl-fraction.json": '{"eos_fraction": 1.5}',
    "wl-vocab.json": '{"vocab": 1000}',
    "wl-dist.json": '{"prompt": 512}',
    "wl-stop.json": '{"stop_sequence": [7, 200000]}',
    # traces (JSONL)
    "tr-line.jsonl": '{"prompt": [5, 6], "max_new_tokens": 4}\n{"prompt": [5, 6], oops\n',
    "tr-array.jsonl": '[5, 6]\n',
    "tr-neg-len.jsonl": '{"prompt_len": -4, "max_new_tokens": 3}\n',
    "tr-neg-new.jsonl": '{"prompt": [5, 6], "max_new_tokens": -3}\n',
    "tr-neg-id.jsonl": '{"id": "a", "prompt": [5, 6], "max_new_tokens": 3}\n{"id": "b", "prompt": [1, -5, 3], '
                       '"max_new_tokens": 3}\n',
    "tr-float-id.jsonl": '{"id": "c", "prompt": [1, 2.7, 3], "max_new_tokens": 3}\n',
    "tr-huge-id.jsonl": '{"id": "d", "prompt": [1099511627776], "max_new_tokens": 3}\n',
    "tr-vocab-id.jsonl": '{"id": "e", "prompt": [5, 129280], "max_new_tokens": 3}\n',
    "tr-bool-id.jsonl": '{"id": "f", "prompt": [true], "max_new_tokens": 3}\n',
    "tr-no-prompt.jsonl": '{"max_new_tokens": 3}\n',
    "tr-no-new.jsonl": '{"prompt": [5, 6]}\n',
    "tr-key.jsonl": '{"prompt": [5, 6], "max_new_tokens": 3, "temperature": 0.7}\n',
    "tr-arrival.jsonl": '{"prompt": [5, 6], "max_new_tokens": 3, "arrival": -1}\n',
    "tr-nan.jsonl": '{"prompt": [5, 6], "max_new_tokens": 3, "arrival": NaN}\n',
    "tr-dup.jsonl": '{"id": "x", "prompt": [5], "max_new_tokens": 3}\n{"id": "x", "prompt": [6], "max_new_tokens": 3}\n',
    "tr-stop.jsonl": '{"prompt": [5, 6], "max_new_tokens": 3, "stop": [[]]}\n',
    "tr-script.jsonl": '{"prompt": [5, 6], "max_new_tokens": 3, "script": {"first": 7}}\n',
    # measured profiles
    "prof-points.json": '{"points": 5}',
    "prof-kind.json": '{"points": [{"kind": "verify", "seconds": 0.01}]}',
    "prof-field.json": '{"points": [{"kind": "decode", "seconds": 0.01}]}',
    "prof-seconds.json": '{"points": [{"kind": "seed", "seconds": -1, "rows": 128}]}',
    "prof-groups.json": '{"points": [{"kind": "decode", "seconds": 0.01, "requests_per_group": [16, 16]}]}',
    "prof-key.json": '{"device": {"hbm_bw": 2e12}, "points": [{"kind": "seed", "seconds": 0.01}]}',
    # routing traces
    "rt-layers.json": '{"layers": "x"}',
    "rt-neg.json": '{"layers": [[1, -2, 3]]}',
    "rt-count.json": json.dumps({"layers": [[1.0] * 256] * 5}),
    # acceptance exports
    "acc-short.json": '{"rates": [0.5]}',
    "acc-rate.json": '{"rates": [0.9, 0.8, 0.7, 1.5, 0.5, 0.4, 0.3]}',
    # tolerance policies
    "pol-key.json": '{"matmul": {"atol": 1}}',
    "pol-field.json": '{"matmul/bf16/none": {"atoll": 1}}',
    "pol-value.json": '{"matmul/bf16/none": {"atol": "big"}}',
    "pol-entry.json": '{"matmul/bf16/none": 0.1}',
    # lockstep run directories
    "run-config/report.jsonl": REPORT,
    "run-config/records/config.json": '{"preset": "tiny",\n oops',
    "run-empty/report.jsonl": REPORT,
    "run-empty/records/config.json": "",
    "run-keys/report.jsonl": REPORT,
    "run-keys/records/config.json": '{"preset": "tiny"}',
    "run-report/report.jsonl": REPORT + "garbage\n" + REPORT,
    "run-fault/report.jsonl": REPORT,
    "run-fault/records/config.json": json.dumps({**{k: None for k in (
        "preset", "backend", "device", "mode", "seed", "golden_mode", "k", "slots", "total_kv_pages", "chunk",
        "max_model_len", "max_num_seqs", "max_num_batched_tokens", "ep", "carry", "requests", "coverage",
        "coverage_seed")}, "fault": {"kind": "kv_row", "at": 2, "layer": 0, "seed": 2}}),
    # recorded by the NumPy reference step: a finished run (its run.json) and a killed one (its records)
    "run-ref/report.jsonl": REPORT,
    "run-ref/run.json": '{"config": {"golden": "golden:numpy", "preset": "tiny"}}',
    "run-ref-killed/report.jsonl": REPORT,
    "run-ref-killed/records/manifest.jsonl": '{"index": 0, "program": "l3_prefill_fwd", "weights": '
                                             '"04ed74e3ce2a4eca17355c0e"}\n',
}

SIM = ["simulate", "--no-plots", "--json", "--out", "{d}/out"]
SIMQ = SIM + ["--requests", "4", "--rate", "inf"]      # a generated workload, small: validation comes first
LS = ["lockstep", "--steps", "2", "--no-records"]


def trace(name: str) -> list:
    return SIM + ["--trace", "{d}/" + name]


def _rows():
    R = []

    def add(id_, argv, flag, named, allowed):
        R.append((id_, argv, flag, tuple([named] if isinstance(named, str) else named), allowed))

    def json_file(cmd, flag, base, wrong, named, allowed):
        """The four kinds of bad JSON file for `flag` (base ends with the flag); `wrong` is of the wrong shape."""
        add(f"{cmd} {flag} missing", base + ["{d}/nope.json"], flag, f"{flag}='{{d}}/nope.json'", "an existing file")
        add(f"{cmd} {flag} empty", base + ["{d}/empty.json"], flag, f"{flag}='{{d}}/empty.json'",
            "(the file is empty)")
        add(f"{cmd} {flag} not JSON", base + ["{d}/not.json"], flag, f"{flag}='{{d}}/not.json:2'", "not JSON")
        add(f"{cmd} {flag} wrong shape", base + [wrong], flag, named, allowed)

    # ---- the command itself -----------------------------------------------------------------------
    add("cli command unknown", ["frobnicate"], "command", ["command", "'frobnicate'"], "choose from 'abi'")
    add("cli flag unknown", ["simulate", "--frob"], "--frob", "--frob", "--help")

    # ---- deployment flags, on each command that takes them -------------------------------------------
    for cmd, base in (("abi", ["abi"]), ("capacity", ["capacity"]), ("simulate", SIMQ)):
        add(f"{cmd} --ep 12", base + ["--ep", "12"], "--ep", "ep=12", "one of [8, 16]")
        add(f"{cmd} --tp 2", base + ["--tp", "2"], "--tp", "tp=2", "4")
        add(f"{cmd} --max-model-len 0", base + ["--max-model-len", "0"], "--max-model-len", "max_model_len=0",
            "1..1048576")
        add(f"{cmd} --chunk 0", base + ["--chunk", "0"], "--chunk", "long_prefill_token_threshold=0", ">= 1")
        add(f"{cmd} --max-num-batched-tokens 4", base + ["--max-num-batched-tokens", "4"],
            "--max-num-batched-tokens", "max_num_batched_tokens=4", ">= 8")
        add(f"{cmd} --max-num-seqs 0", base + ["--max-num-seqs", "0"], "--max-num-seqs", "max_num_seqs=0", "")
        add(f"{cmd} -k 3", base + ["-k", "3"], "-k", "num_speculative_tokens=3", "0 (target only) or 7")
        add(f"{cmd} --utilization nan", base + ["--utilization", "nan"], "--utilization", ["--utilization", "'nan'"],
            "a number (not NaN)")
        add(f"{cmd} --temperature 0.5", base + ["--temperature", "0.5"], "--temperature", "temperature=0.5",
            "0 only")
        add(f"{cmd} --preset huge", base + ["--preset", "huge"], "--preset", ["--preset", "'huge'"], "choose from")
    add("capacity --ep word", ["capacity", "--ep", "sixteen"], "--ep", ["--ep", "'sixteen'"], "an integer")
    add("capacity --utilization 1.5", ["capacity", "--utilization", "1.5"], "--utilization",
        "npu_memory_utilization=1.5", "(0, 1]")

    # ---- abi ------------------------------------------------------------------------------------------
    add("abi program unknown", ["abi", "l3_nope"], "program", "program='l3_nope'", "l3_prefill_fwd")
    add("abi --slots 0", ["abi", "l3_prefill_fwd", "--slots", "0"], "--slots", "slots=0", "an int in 1..64")
    add("abi --slots -2", ["abi", "l3_prefill_fwd", "--slots", "-2", "--json"], "--slots", "slots=-2", "1..64")
    add("abi --slots word", ["abi", "--slots", "two"], "--slots", ["--slots", "'two'"], "an integer")

    # ---- capacity -------------------------------------------------------------------------------------
    add("capacity --hbm-gib 0", ["capacity", "--hbm-gib", "0"], "--hbm-gib", "--hbm-gib=0.0", "> 0")
    add("capacity --hbm-gib inf", ["capacity", "--hbm-gib", "inf"], "--hbm-gib", "--hbm-gib=inf", "a finite number")
    add("capacity --hbm-gib nan", ["capacity", "--hbm-gib", "nan"], "--hbm-gib", ["--hbm-gib", "'nan'"], "not NaN")
    # the KV budget's sources (capacity and simulate share them)
    for cmd, base in (("capacity", ["capacity"]), ("simulate", SIMQ)):
        add(f"{cmd} --total-kv-pages -3", base + ["--total-kv-pages", "-3"], "--total-kv-pages",
            "--total-kv-pages=-3", "a positive page count")
        add(f"{cmd} --total-kv-pages word", base + ["--total-kv-pages", "many"], "--total-kv-pages",
            ["--total-kv-pages", "'many'"], "an integer")
        add(f"{cmd} --measured-free-bytes word", base + ["--measured-free-bytes", "abc"], "--measured-free-bytes",
            ["--measured-free-bytes", "'abc'"], "an integer")
        add(f"{cmd} --measured-free-bytes past HBM", base + ["--measured-free-bytes", "99999999999999"],
            "--measured-free-bytes", "--measured-free-bytes=99999999999999", "1..68,719,476,735")
        add(f"{cmd} --measured-used-bytes 0", base + ["--measured-used-bytes", "0"], "--measured-used-bytes",
            "--measured-used-bytes=0", "an integer byte count 1..68,719,476,735")
        add(f"{cmd} --measured-slots 0", base + ["--measured-slots", "0"], "--measured-slots", "--measured-slots=0",
            "1..64")
        add(f"{cmd} --measured-slots 99", base + ["--measured-slots", "99"], "--measured-slots",
            "--measured-slots=99", "1..64")
        add(f"{cmd} --measured-slots with --total-kv-pages", base + ["--total-kv-pages", "100", "--measured-slots", "3"],
            "--measured-slots", "--measured-slots=3", "not together with --total-kv-pages")
    boot = ["--max-model-len", "1024", "--chunk", "128"]          # 9 ori blocks per request
    add("capacity --total-kv-pages below one request", ["capacity", *boot, "--total-kv-pages", "8"],
        "--total-kv-pages", "--total-kv-pages=8", "an integer >= ori blocks per request = 9")
    add("simulate --total-kv-pages below one request", SIMQ + [*boot, "--total-kv-pages", "5"],
        "--total-kv-pages", "--total-kv-pages=5", "an integer >= ori blocks per request = 9")
    add("capacity --measured-slots 3.5", ["capacity", "--measured-slots", "3.5"], "--measured-slots",
        ["--measured-slots", "'3.5'"], "an integer")
    add("capacity --measured-free-bytes -1", ["capacity", "--measured-free-bytes", "-1"], "--measured-free-bytes",
        "--measured-free-bytes=-1", "an integer byte count 1..")
    add("capacity --measured-used-bytes past HBM", ["capacity", "--measured-used-bytes", str(65 << 30)],
        "--measured-used-bytes", f"--measured-used-bytes={65 << 30}", "an integer byte count 1..")
    add("capacity --measured-used-bytes with --measured-free-bytes",
        ["capacity", "--measured-free-bytes", "1", "--measured-used-bytes", "1"], "--measured-used-bytes",
        "--measured-used-bytes=1", "not together with --measured-free-bytes")
    add("simulate --total-kv-pages with --slots", SIMQ + ["--slots", "4", "--total-kv-pages", "100"], "--slots",
        "--slots=4", "not together with a KV budget flag")
    add("simulate --drafter v5", SIMQ + ["--drafter", "v5"], "--drafter", ["--drafter", "'v5'"], "'device', 'v4.1'")
    add("capacity --ring-heap 1000", ["capacity", "--ring-heap", "1000"], "--ring-heap", ["--ring-heap", "1000"],
        "power of two")

    # ---- simulate: numbers ----------------------------------------------------------------------------
    add("simulate --requests 0", SIM + ["--requests", "0"], "--requests", "num_requests=0", ">= 1")
    add("simulate --rate -1", SIM + ["--requests", "4", "--rate", "-1"], "--rate", "rate=-1.0", "> 0")
    add("simulate --rate nan", SIM + ["--rate", "nan"], "--rate", ["--rate", "'nan'"], "not NaN")
    add("simulate --rate word", SIM + ["--rate", "fast"], "--rate", ["--rate", "'fast'"], "a number")
    add("simulate --arrival uniform", SIM + ["--arrival", "uniform"], "--arrival", ["--arrival", "'uniform'"],
        "choose from 'poisson'")
    add("simulate --seed -1", SIMQ + ["--seed", "-1"], "--seed", ["--seed", "'-1'"], "an integer >= 0")
    add("simulate --slots 0", SIMQ + ["--slots", "0"], "--slots", "slots=0", "1..64")
    add("simulate --slots 65", SIMQ + ["--slots", "65"], "--slots", "slots=65", "1..64")
    add("simulate --routing-skew -1", SIMQ + ["--routing", "skewed", "--routing-skew", "-1"], "--routing-skew",
        "skew=-1.0", ">= 0")
    add("simulate --routing-skew nan", SIMQ + ["--routing", "skewed", "--routing-skew", "nan"], "--routing-skew",
        ["--routing-skew", "'nan'"], "not NaN")
    add("simulate --routing-skew without skewed", SIMQ + ["--routing-skew", "2"], "--routing-skew",
        "--routing-skew=2.0", "only with --routing skewed")
    add("simulate --prefill-hang-prob 2", SIMQ + ["--prefill-hang-prob", "2"], "--prefill-hang-prob",
        "prefill_hang_probability=2.0", "in [0, 1]")
    add("simulate --prefill-hang-prob at EP8", SIMQ + ["--ep", "8", "-k", "0", "--slots", "4", "--prefill-hang-prob", "0.1"],
        "--prefill-hang-prob", "prefill_hang_probability=0.1", "0 at ep=8")
    add("simulate --prefill-hang-prob nan", SIMQ + ["--prefill-hang-prob", "nan"], "--prefill-hang-prob",
        ["--prefill-hang-prob", "'nan'"], "not NaN")
    add("simulate --step-timeout 0", SIMQ + ["--step-timeout", "0"], "--step-timeout", "step_timeout=0.0", "> 0")
    add("simulate --step-timeout inf", SIMQ + ["--step-timeout", "inf"], "--step-timeout", "step_timeout=inf",
        "a finite number > 0")
    add("simulate --slo-ttft -5", SIMQ + ["--slo-ttft", "-5"], "--slo-ttft", "slo_ttft=-5.0", "> 0")
    add("simulate --slo-tpot 0", SIMQ + ["--slo-tpot", "0"], "--slo-tpot", "slo_tpot=0.0", "> 0")
    add("simulate --slo-e2el nan", SIMQ + ["--slo-e2el", "nan"], "--slo-e2el", ["--slo-e2el", "'nan'"], "not NaN")
    add("simulate --acceptance forced:0", SIMQ + ["--acceptance", "forced:0"], "--acceptance",
        "forced acceptance length=0", "1..8")
    add("simulate --acceptance rates", SIMQ + ["--acceptance", "rates:2,0.5,0.5,0.5,0.5,0.5,0.5"], "--acceptance",
        "acceptance rates=[2.0", "each in [0, 1]")
    add("simulate --acceptance word", SIMQ + ["--acceptance", "greedy"], "--acceptance", "acceptance='greedy'",
        "'forced:<n>'")
    add("simulate --executor word", SIM + ["--executor", "npu"], "--executor", ["--executor", "'npu'"],
        "choose from 'cost'")
    add("simulate --executor golden on flash", SIMQ + ["--executor", "golden"], "--executor", "preset='flash'",
        "a small preset")
    add("simulate --acceptance with --executor golden", SIMQ + ["--preset", "tiny", "--ep", "8", "--executor",
                                                                "golden", "--acceptance", "forced:4"],
        "--acceptance", "--acceptance='forced:4'", "no acceptance model with --executor golden")
    add("simulate --recompute word", SIM + ["--recompute", "all"], "--recompute", ["--recompute", "'all'"],
        "choose from 'prompt'")
    add("simulate --routing word", SIM + ["--routing", "zipf"], "--routing", ["--routing", "'zipf'"],
        "choose from 'balanced'")
    add("simulate --device unknown", SIMQ + ["--device", "h100"], "--device", "device='h100'", "ascend-a3-die")
    add("simulate --stop-check word", SIM + ["--stop-check", "never"], "--stop-check", ["--stop-check", "'never'"],
        "choose from 'end'")

    # ---- simulate: --out --------------------------------------------------------------------------------
    q = ["simulate", "--no-plots", "--json", "--requests", "4", "--rate", "inf"]
    add("simulate --out under a file", q + ["--out", "{d}/afile/out"], "--out", "--out='{d}/afile/out'",
        "a directory that can be created and written (a parent is a file)")
    add("simulate --out is a file", q + ["--out", "{d}/afile"], "--out", "--out='{d}/afile'",
        "a directory that can be created and written (a file of that name exists)")
    add("simulate --out unwritable", q + ["--out", "/proc/dspark-out"], "--out", "--out='/proc/dspark-out'",
        "a directory that can be created and written")

    # ---- simulate: --workload ---------------------------------------------------------------------------
    W = SIM + ["--workload"]
    json_file("simulate", "--workload", W, "{d}/list.json", "--workload='{d}/list.json'", "not a JSON object")
    add("simulate --workload unknown key", W + ["{d}/wl-unknown.json"], "--workload",
        ["{d}/wl-unknown.json", "workload key='requests'"], "one of ['arrival'")
    add("simulate --workload wrong type", W + ["{d}/wl-type.json"], "--workload",
        ["{d}/wl-type.json", "num_requests='many'"], "an integer >= 1")
    add("simulate --workload negative mean", W + ["{d}/wl-mean.json"], "--workload",
        ["{d}/wl-mean.json", "prompt.mean=-5"], "between min and max")
    add("simulate --workload mean outside min..max", W + ["{d}/wl-range.json"], "--workload",
        ["{d}/wl-range.json", "output.mean=50"], ">= 64 and <= 128")
    add("simulate --workload fraction", W + ["{d}/wl-fraction.json"], "--workload",
        ["{d}/wl-fraction.json", "eos_fraction=1.5"], "<= 1")
    add("simulate --workload vocab", SIM + ["--preset", "tiny", "--ep", "8", "--workload", "{d}/wl-vocab.json"],
        "--workload", ["{d}/wl-vocab.json", "vocab=1000"], "1616, the vocabulary of tiny")
    add("simulate --workload distribution", W + ["{d}/wl-dist.json"], "--workload", ["{d}/wl-dist.json",
                                                                                       "prompt=512"],
        "a length distribution")
    add("simulate --workload stop token", W + ["{d}/wl-stop.json"], "--workload",
        ["{d}/wl-stop.json", "stop_sequence[1]=200000"], "[0, 129280)")

    # ---- simulate: --trace --------------------------------------------------------------------------------
    add("simulate --trace missing", trace("nope.jsonl"), "--trace", "--trace='{d}/nope.jsonl'", "an existing file")
    add("simulate --trace empty", trace("empty.json"), "--trace", "--trace='{d}/empty.json'",
        "(the file has none)")
    add("simulate --trace not JSON", trace("tr-line.jsonl"), "--trace", "{d}/tr-line.jsonl:2",
        "one JSON object per line")
    add("simulate --trace wrong shape", trace("tr-array.jsonl"), "--trace", ["{d}/tr-array.jsonl:1", "[5, 6]"],
        "a JSON object")
    add("simulate --trace negative prompt_len", trace("tr-neg-len.jsonl"), "--trace",
        ["{d}/tr-neg-len.jsonl:1", "prompt_len=-4"], "an integer >= 0")
    add("simulate --trace negative max_new_tokens", trace("tr-neg-new.jsonl"), "--trace",
        ["{d}/tr-neg-new.jsonl:1", "max_new_tokens=-3"], "an integer >= 0")
    add("simulate --trace negative token id", trace("tr-neg-id.jsonl"), "--trace",
        ["{d}/tr-neg-id.jsonl:2", "request 'b'", "prompt[1]=-5"], "an integer token id in [0, 129280)")
    add("simulate --trace fractional token id", trace("tr-float-id.jsonl"), "--trace",
        ["{d}/tr-float-id.jsonl:1", "request 'c'", "prompt[1]=2.7"], "an integer token id")
    add("simulate --trace token id beyond int32", trace("tr-huge-id.jsonl"), "--trace",
        ["request 'd'", "prompt[0]=1099511627776"], "[0, 129280)")
    add("simulate --trace token id == vocab", trace("tr-vocab-id.jsonl"), "--trace",
        ["request 'e'", "prompt[1]=129280"], "[0, 129280)")
    add("simulate --trace boolean token id", trace("tr-bool-id.jsonl"), "--trace",
        ["request 'f'", "prompt[0]=True"], "an integer token id")
    add("simulate --trace token id beyond a small vocab",
        SIM + ["--preset", "tiny", "--ep", "8", "--trace", "{d}/tr-neg-id.jsonl"], "--trace",
        ["request 'b'", "prompt[1]=-5"], "[0, 1616)")
    add("simulate --trace no prompt", trace("tr-no-prompt.jsonl"), "--trace", "{d}/tr-no-prompt.jsonl:1",
        "a 'prompt' (token ids) or a 'prompt_len'")
    add("simulate --trace no max_new_tokens", trace("tr-no-new.jsonl"), "--trace", "{d}/tr-no-new.jsonl:1",
        "a 'max_new_tokens'")
    add("simulate --trace unknown key", trace("tr-key.jsonl"), "--trace", ["{d}/tr-key.jsonl:1",
                                                                          "key='temperature'"], "one of ['arrival'")
    add("simulate --trace negative arrival", trace("tr-arrival.jsonl"), "--trace",
        ["{d}/tr-arrival.jsonl:1", "arrival=-1"], ">= 0")
    add("simulate --trace NaN arrival", trace("tr-nan.jsonl"), "--trace", ["{d}/tr-nan.jsonl:1", "arrival=nan"],
        "a finite number >= 0")
    add("simulate --trace duplicate id", trace("tr-dup.jsonl"), "--trace", ["{d}/tr-dup.jsonl:2", "id='x'"],
        "an id not already used (line 1 has it)")
    add("simulate --trace empty stop", trace("tr-stop.jsonl"), "--trace", ["{d}/tr-stop.jsonl:1", "stop[0]=[]"],
        "a non-empty list of token ids")
    add("simulate --trace script key", trace("tr-script.jsonl"), "--trace", ["{d}/tr-script.jsonl:1",
                                                                            "script key='first'"], "an output index")
    add("simulate --trace with --requests", trace("tr-neg-new.jsonl") + ["--requests", "4"], "--trace",
        "--requests=4", "no value with --trace")

    # ---- simulate: --profile ----------------------------------------------------------------------------
    P = SIMQ + ["--profile"]
    json_file("simulate", "--profile", P, "{d}/list.json", "--profile='{d}/list.json'", "not a JSON object")
    add("simulate --profile points", P + ["{d}/prof-points.json"], "--profile", ["{d}/prof-points.json",
                                                                                "points=5"], "a non-empty list")
    add("simulate --profile kind", P + ["{d}/prof-kind.json"], "--profile",
        ["{d}/prof-kind.json", "points[0]", "kind='verify'"], "one of ['decode'")
    add("simulate --profile missing field", P + ["{d}/prof-field.json"], "--profile",
        ["points[0]", "requests_per_group=None"], "a list of 4 entries, one per TP group")
    add("simulate --profile negative seconds", P + ["{d}/prof-seconds.json"], "--profile",
        ["points[0]", "seconds=-1"], "> 0")
    add("simulate --profile groups", P + ["{d}/prof-groups.json"], "--profile",
        ["points[0]", "requests_per_group=[16, 16]"], "a list of 4 entries")
    add("simulate --profile unknown key", P + ["{d}/prof-key.json"], "--profile", ["{d}/prof-key.json",
                                                                                  "key='device'"], "one of ['points']")

    # ---- simulate: --routing-trace ------------------------------------------------------------------------
    T = SIMQ + ["--routing", "trace", "--routing-trace"]
    json_file("simulate", "--routing-trace", T, "{d}/rt-layers.json", ["{d}/rt-layers.json", "layers='x'"],
              "per-layer expert histograms")
    add("simulate --routing-trace negative count", T + ["{d}/rt-neg.json"], "--routing-trace",
        ["{d}/rt-neg.json", "layers[0][1]=-2"], ">= 0")
    add("simulate --routing-trace layer count", T + ["{d}/rt-count.json"], "--routing-trace",
        "routing trace layers=5", "43 (one histogram per layer of flash)")
    add("simulate --routing-trace without --routing trace", SIMQ + ["--routing-trace", "{d}/rt-neg.json"],
        "--routing-trace", "--routing-trace='{d}/rt-neg.json'", "only with --routing trace")
    add("simulate --routing trace without a file", SIMQ + ["--routing", "trace"], "--routing-trace",
        "--routing-trace=None", "a JSON file of per-layer expert histograms")

    # ---- simulate: --acceptance-from -------------------------------------------------------------------
    A = SIMQ + ["--acceptance-from"]
    json_file("simulate", "--acceptance-from", A, "{d}/acc-short.json", ["{d}/acc-short.json", "rates=[0.5]"],
              "a list of 7 probabilities")
    add("simulate --acceptance-from rate > 1", A + ["{d}/acc-rate.json"], "--acceptance-from",
        ["{d}/acc-rate.json", "rates[3]=1.5"], "<= 1")
    add("simulate --acceptance-from with --acceptance", A + ["{d}/acc-rate.json", "--acceptance", "forced:3"],
        "--acceptance-from", "--acceptance='forced:3'", "'default' with --acceptance-from")

    # ---- lockstep -----------------------------------------------------------------------------------------
    add("lockstep --preset flash", ["lockstep", "--preset", "flash", "--steps", "2", "--run-dir", "{d}/ls-flash"],
        "--preset", "preset='flash'", "tiny")
    add("lockstep --device tpu", LS + ["--device", "tpu", "--run-dir", "{d}/ls-tpu"], "--device", "device='tpu'",
        "'cpu', 'cuda[:n]' or 'npu[:n]'")
    # a device whose runtime is missing here (skipped where it is installed: `NEEDS_ABSENT`)
    add("lockstep --device npu:0", LS + ["--device", "npu:0", "--run-dir", "{d}/ls-npu"], "--device",
        "device='npu:0'", "torch_npu is not installed")
    add("lockstep --device cuda", LS + ["--device", "cuda", "--run-dir", "{d}/ls-cuda"], "--device",
        "device='cuda'", "torch.cuda.is_available() is False")
    LT = LS + ["--backend", "torch", "-k", "0"]
    add("lockstep --nproc 3", LT + ["--nproc", "3"], "--nproc", "nproc=3", "dividing the lockstep deployment's 8 ranks")
    add("lockstep --nproc 0", LT + ["--nproc", "0"], "--nproc", "nproc=0", "dividing the lockstep deployment's 8 ranks")
    add("lockstep --nproc word", LT + ["--nproc", "two"], "--nproc", ["--nproc", "'two'"], "an integer")
    add("lockstep --nproc with selfcheck", LS + ["--nproc", "2"], "--nproc", "nproc=2", "1 with --backend selfcheck")
    add("lockstep --nproc with cuda", LT + ["--nproc", "2", "--device", "cuda"], "--nproc", "nproc=2",
        "1 with --device cuda")
    add("lockstep --nproc with replay", ["lockstep", "--replay", "--nproc", "2", "--run-dir", "{d}/run-keys"],
        "--nproc", "nproc=2", "1 with --replay")
    add("lockstep --steps 0", LS + ["--steps", "0", "--run-dir", "{d}/ls-steps"], "--steps", "steps=0", ">= 1")
    add("lockstep --steps word", LS + ["--steps", "many"], "--steps", ["--steps", "'many'"], "an integer")
    add("lockstep --seed -1", LS + ["--seed", "-1"], "--seed", ["--seed", "'-1'"], "an integer >= 0")
    add("lockstep --mode word", LS + ["--mode", "lax"], "--mode", ["--mode", "'lax'"], "choose from 'strict'")
    add("lockstep --inject kind", LS + ["--inject", "melted@2", "--run-dir", "{d}/ls-inj"], "--inject",
        "kind='melted'", "one of (")
    add("lockstep --inject position", LS + ["--inject", "ring_alias@x", "--run-dir", "{d}/ls-inj2"], "--inject",
        "--inject='ring_alias@x'", "integers AT >= 0")
    add("lockstep --run-dir under a file", LS + ["--run-dir", "{d}/afile/run"], "--run-dir",
        "--run-dir='{d}/afile/run'", "a directory that can be created and written (a parent is a file)")
    add("lockstep --run-dir missing", ["lockstep", "--replay", "--run-dir", "{d}/nope-run"], "--run-dir",
        "run_dir='{d}/nope-run'", "a real-golden run directory with records/config.json")
    add("lockstep --run-dir empty", ["lockstep", "--replay", "--run-dir", "{d}/run-empty"], "--run-dir",
        "--run-dir='{d}/run-empty/records/config.json'", "(the file is empty)")
    add("lockstep --run-dir not JSON", ["lockstep", "--replay", "--run-dir", "{d}/run-config"], "--run-dir",
        "--run-dir='{d}/run-config/records/config.json:2'", "not JSON")
    add("lockstep --run-dir not JSON (resume)", ["lockstep", "--steps", "2", "--run-dir", "{d}/run-config"],
        "--run-dir", "{d}/run-config/records/config.json:2", "not JSON")
    add("lockstep --run-dir wrong shape", ["lockstep", "--replay", "--run-dir", "{d}/run-keys"], "--run-dir",
        ["{d}/run-keys/records/config.json", "keys=['preset']"], "exactly ['backend', 'carry'")
    add("lockstep --run-dir fault without persistence", ["lockstep", "--replay", "--run-dir", "{d}/run-fault"],
        "--run-dir", ["{d}/run-fault/records/config.json", "fault={'kind': 'kv_row'"],
        "null or an object with exactly the keys ['kind', 'at', 'layer', 'seed', 'persistent']")
    add("lockstep --run-dir corrupt report", LS + ["--run-dir", "{d}/run-report"], "--run-dir",
        ["{d}/run-report/report.jsonl:2", "line='garbage'"], "a report entry written by lockstep")
    add("lockstep --run-dir of the reference step", LS + ["--run-dir", "{d}/run-ref"], "--run-dir",
        ["--run-dir='{d}/run-ref'", "{d}/run-ref/run.json: golden='golden:numpy'"], "recorded by the NumPy reference step")
    add("lockstep --run-dir of the reference step (replay)", ["lockstep", "--replay", "--run-dir", "{d}/run-ref-killed"],
        "--run-dir", ["--run-dir='{d}/run-ref-killed'", "weights='04ed74e3ce2a4eca17355c0e'"],
        "recorded by the NumPy reference step")
    add("lockstep --replay with --inject", ["lockstep", "--replay", "--inject", "kv_row@2", "--run-dir", "{d}/run-keys"],
        "--inject", "--inject='kv_row@2'", "no value with --replay")
    add("lockstep --replay with --steps", ["lockstep", "--replay", "--steps", "5", "--run-dir", "{d}/run-keys"],
        "--steps", "--steps=5", "no value with --replay")
    # asynchronous checking and replay on Ray
    add("lockstep --check-workers 0", LS + ["--check-workers", "0"], "--check-workers", "--check-workers=0", ">= 1")
    add("lockstep --check-workers word", LS + ["--check-workers", "two"], "--check-workers",
        ["--check-workers", "'two'"], "an integer")
    add("lockstep --backlog 0", LS + ["--backlog", "0"], "--backlog", "--backlog=0", ">= 1")
    add("lockstep --backlog-policy word", LS + ["--backlog-policy", "drop"], "--backlog-policy",
        ["--backlog-policy", "'drop'"], "choose from 'throttle', 'skip-oldest'")
    add("lockstep --ray empty", LS + ["--ray", " "], "--ray", "--ray=' '", "auto, or a Ray cluster address")
    # nothing listens on the discard port: refused within the connect timeout, not after Ray's retries
    add("lockstep --ray unreachable", ["lockstep", "--steps", "2", "--ray", "127.0.0.1:9", "--run-dir", "{d}/ls-ray"],
        "--ray", "--ray='127.0.0.1:9'", "the address of a running Ray cluster")
    add("lockstep --async with --no-records", LS + ["--async", "--run-dir", "{d}/ls-async"], "--no-records",
        "--no-records=True", "unset with --async")
    # sampled checking on the pool: the combinations a sampled or an asynchronous run refuses
    LA = ["lockstep", "--steps", "2", "--async", "--run-dir", "{d}/ls-async-cov"]
    add("lockstep --async --coverage 0", LA + ["--coverage", "0"], "--coverage", "--coverage=0", "an integer N >= 1")
    add("lockstep --async --coverage with --backend torch", LA + ["--backend", "torch", "-k", "0", "--coverage", "4"],
        "--coverage", "--coverage=4", "none with backend torch")
    add("lockstep --async --coverage with --no-records", LA + ["--coverage", "4", "--no-records"], "--no-records",
        "--no-records=True", "unset with --async")
    add("lockstep --replay with --coverage", ["lockstep", "--replay", "{d}/run-keys", "--coverage", "4"],
        "--coverage", "--coverage=4", "no value with --replay")
    add("lockstep --replay missing", ["lockstep", "--replay", "{d}/nope-run"], "--replay",
        "run_dir='{d}/nope-run'", "a real-golden run directory with records/config.json")
    add("lockstep --replay with --backlog", ["lockstep", "--replay", "{d}/run-keys", "--backlog", "4"], "--backlog",
        "--backlog=4", "no value with --replay")
    # the site checks' golden
    add("lockstep --checker-golden word", LS + ["--checker-golden", "fast"], "--checker-golden",
        ["--checker-golden", "'fast'"], "choose from 'numpy', 'jax', 'auto'")
    add("lockstep --checker-golden jax without --coverage", LS + ["--checker-golden", "jax"], "--checker-golden",
        "--checker-golden='jax'", "numpy or auto without --coverage")
    add("lockstep --checker-golden jax at K=7", LS + ["--coverage", "2", "--checker-golden", "jax"], "--checker-golden",
        "--checker-golden='jax'", "numpy or auto for this run (l3_decode_fwd_dspark: the JAX path runs only")
    # the parity run's workload and page budget (simulate's options)
    LW = ["lockstep", "--steps", "2", "--no-records", "--run-dir", "{d}/ls-wl"]
    add("lockstep --workload missing", LW + ["--workload", "{d}/nope.json"], "--workload",
        "--workload='{d}/nope.json'", "an existing file")
    add("lockstep --workload unknown key", LW + ["--workload", "{d}/wl-unknown.json"], "--workload",
        ["{d}/wl-unknown.json", "requests"], "")
    add("lockstep --trace missing", LW + ["--trace", "{d}/nope.jsonl"], "--trace", "--trace='{d}/nope.jsonl'",
        "an existing file")
    add("lockstep --trace not JSON", LW + ["--trace", "{d}/tr-line.jsonl"], "--trace", "{d}/tr-line.jsonl:2",
        "one JSON object per line")
    add("lockstep --requests 0", LW + ["--requests", "0"], "--requests", "--requests=0", ">= 1")
    add("lockstep --requests word", LW + ["--requests", "some"], "--requests", ["--requests", "'some'"], "an integer")
    add("lockstep -k 3", LW + ["-k", "3"], "-k", "num_speculative_tokens=3", "0 (target only) or 7")
    add("lockstep --backend word", LW + ["--backend", "pypto"], "--backend", ["--backend", "'pypto'"],
        "choose from 'selfcheck', 'torch'")
    add("lockstep --inject with --backend torch", LW + ["--backend", "torch", "-k", "0", "--inject", "kv_row@1"],
        "--inject", "--inject='kv_row@1'", "none with the torch device")
    add("lockstep --coverage 0", LW + ["--coverage", "0"], "--coverage", "--coverage=0", "an integer N >= 1")
    add("lockstep --coverage -4", LW + ["--coverage", "-4"], "--coverage", "--coverage=-4", "an integer N >= 1")
    add("lockstep --coverage word", LW + ["--coverage", "half"], "--coverage", ["--coverage", "'half'"], "an integer")
    add("lockstep --coverage with --backend torch", LW + ["--backend", "torch", "-k", "0", "--coverage", "4"],
        "--coverage", "--coverage=4", "none with backend torch")
    add("lockstep --coverage auto with --backend torch", LW + ["--steps", "8", "--backend", "torch", "-k", "0", "--coverage", "auto"],
        "--coverage", "--coverage='auto'", "none with backend torch")
    add("lockstep --coverage auto within its calibration", LW + ["--coverage", "auto"], "--coverage", "--steps=2",
        "> 4 with --coverage auto")
    add("lockstep --slots 0", LW + ["--slots", "0"], "--slots", "--slots=0", "1..64")
    add("lockstep --slots with --total-kv-pages", LW + ["--slots", "2", "--total-kv-pages", "100"], "--slots",
        "--slots=2", "not together with --total-kv-pages")
    add("lockstep --total-kv-pages -3", LW + ["--total-kv-pages", "-3"], "--total-kv-pages",
        "--total-kv-pages=-3", "a positive page count")
    add("lockstep --total-kv-pages below one request", LW + ["--total-kv-pages", "2"], "--total-kv-pages",
        "--total-kv-pages=2", "an integer >= ori blocks per request")
    for flag in ("--measured-free-bytes", "--measured-used-bytes", "--measured-slots"):
        add(f"lockstep {flag}", LW + [flag, "3"], flag, f"{flag}=3", "--total-kv-pages or --slots")
    L = LS + ["--run-dir", "{d}/ls-pol", "--policy"]
    json_file("lockstep", "--policy", L, "{d}/list.json", "--policy='{d}/list.json'", "not a JSON object")
    add("lockstep --policy key", L + ["{d}/pol-key.json"], "--policy", ["{d}/pol-key.json", "key='matmul'"],
        "'op/dtype/quant'")
    add("lockstep --policy field", L + ["{d}/pol-field.json"], "--policy", ["{d}/pol-field.json", "field='atoll'"],
        "one of ['atol'")
    add("lockstep --policy value", L + ["{d}/pol-value.json"], "--policy", ["{d}/pol-value.json", "atol='big'"],
        "a number")
    add("lockstep --policy entry", L + ["{d}/pol-entry.json"], "--policy", ["{d}/pol-entry.json", "entry=0.1"],
        "an object of tolerance fields")
    # ---- simulate: vLLM's names, datasets ----------------------------------------------------------
    add("simulate --burstiness 0", SIMQ + ["--burstiness", "0"], "--burstiness", "--burstiness=0.0",
        "a finite number > 0")
    add("simulate --burstiness nan", SIMQ + ["--burstiness", "nan"], "--burstiness", ["--burstiness", "'nan'"],
        "not NaN")
    add("simulate --burstiness with burst arrivals", SIMQ + ["--arrival", "burst", "--burstiness", "2"],
        "--burstiness", "--burstiness=2.0", "only with --arrival gamma")
    add("simulate --max-concurrency 0", SIMQ + ["--max-concurrency", "0"], "--max-concurrency",
        "max_concurrency=0", "an integer >= 1")
    add("simulate --goodput pair", SIMQ + ["--goodput", "ttft500"], "--goodput", "--goodput='ttft500'", "KEY:MS pairs")
    add("simulate --goodput key", SIMQ + ["--goodput", "foo:5"], "--goodput", "--goodput='foo:5'",
        "KEY one of ('ttft', 'tpot', 'e2el')")
    add("simulate --goodput against --slo-ttft", SIMQ + ["--slo-ttft", "400", "--goodput", "ttft:500"], "--goodput",
        "--goodput='ttft:500'", "agreeing with --slo-ttft 400")
    add("simulate --metric-percentiles 101", SIMQ + ["--metric-percentiles", "101"], "--metric-percentiles",
        "--metric-percentiles='101'", "numbers in [0, 100]")
    add("simulate --dataset-name bogus", SIMQ + ["--dataset-name", "bogus"], "--dataset-name",
        ["--dataset-name", "'bogus'"], "'sharegpt', 'random'")
    add("simulate --dataset-path without a name", SIMQ + ["--dataset-path", "{d}/sharegpt.json"], "--dataset-path",
        "--dataset-path='{d}/sharegpt.json'", "only with --dataset-name sharegpt, mooncake or azure")
    add("simulate --dataset-path missing", SIMQ + ["--dataset-name", "sharegpt", "--dataset-path", "{d}/nope.json"],
        "--dataset-path", "{d}/nope.json", "an existing ShareGPT JSON file")
    add("simulate --dataset-path wrong shape", SIMQ + ["--dataset-name", "sharegpt", "--dataset-path",
                                                       "{d}/list.json"], "--dataset-path", "{d}/list.json",
        "{'conversations'")
    add("simulate --dataset-path mooncake line", SIM + ["--dataset-name", "mooncake", "--dataset-path",
                                                         "{d}/not.json"], "--dataset-path", "{d}/not.json:1",
        "a JSON object per line")
    add("simulate --dataset-path azure header", SIM + ["--dataset-name", "azure", "--dataset-path", "{d}/bad.csv"],
        "--dataset-path", "{d}/bad.csv:1", "TIMESTAMP,ContextTokens,GeneratedTokens")
    add("simulate --dataset-path with --trace", SIM + ["--trace", "{d}/tr-key.jsonl", "--dataset-name", "azure",
                                                       "--dataset-path", "{d}/bad.csv"], "--dataset-path",
        "--trace='{d}/tr-key.jsonl'", "one source of requests")
    add("simulate --tokenizer missing", SIMQ + ["--dataset-name", "sharegpt", "--dataset-path", "{d}/sharegpt.json",
                                                "--tokenizer", "{d}/nodir"], "--tokenizer", "--tokenizer='{d}/nodir'",
        "a directory holding tokenizer.json")
    add("simulate --tokenizer not sharegpt", SIMQ + ["--dataset-name", "random", "--tokenizer", "{d}"],
        "--tokenizer", "--tokenizer='{d}'", "only with --dataset-name sharegpt")
    add("simulate --sharegpt-output-len 0", SIMQ + ["--dataset-name", "sharegpt", "--dataset-path",
                                                    "{d}/sharegpt.json", "--sharegpt-output-len", "0"],
        "--sharegpt-output-len", "--sharegpt-output-len=0", ">= 1")
    add("simulate --sharegpt-output-len without sharegpt", SIMQ + ["--sharegpt-output-len", "5"],
        "--sharegpt-output-len", "--sharegpt-output-len=5", "only with --dataset-name sharegpt")
    RND = SIMQ + ["--dataset-name", "random"]
    add("simulate --random-input-len 0", RND + ["--random-input-len", "0"], "--random-input-len",
        "--random-input-len=0", "the shortest sampled input >= 1 token")
    add("simulate --random-input-len without random", SIMQ + ["--random-input-len", "10"], "--random-input-len",
        "--random-input-len=10", "only with --dataset-name random")
    add("simulate --random-output-len -1", RND + ["--random-output-len", "-1"], "--random-output-len",
        "--random-output-len=-1", ">= 1")
    add("simulate --random-range-ratio 1.5", RND + ["--random-range-ratio", "1.5"], "--random-range-ratio",
        "--random-range-ratio=1.5", "in [0, 1)")
    add("simulate --random-prefix-len -1", RND + ["--random-prefix-len", "-1"], "--random-prefix-len",
        "--random-prefix-len=-1", ">= 0")
    PRE = SIMQ + ["--dataset-name", "prefix_repetition"]
    add("simulate --prefix-repetition-num-prefixes 0", PRE + ["--prefix-repetition-num-prefixes", "0"],
        "--prefix-repetition-num-prefixes", "--prefix-repetition-num-prefixes=0", "1..num_prompts (4)")
    for flag in ("--prefix-repetition-prefix-len", "--prefix-repetition-suffix-len", "--prefix-repetition-output-len"):
        add(f"simulate {flag} -1", PRE + ["--prefix-repetition-num-prefixes", "2", flag, "-1"], flag, f"{flag}=-1",
            ">= ")
        add(f"simulate {flag} without prefix_repetition", SIMQ + [flag, "8"], flag, f"{flag}=8",
            "only with --dataset-name prefix_repetition")

    add("simulate --max-preemptions 0", SIMQ + ["--max-preemptions", "0"], "--max-preemptions",
        "max_preemptions=0", "None (upstream: no cap) or >= 1")
    add("simulate --max-preemptions word", SIMQ + ["--max-preemptions", "many"], "--max-preemptions",
        ["--max-preemptions", "'many'"], "an integer")
    add("simulate --drafter without golden", SIMQ + ["--drafter", "v4.1"], "--drafter", "--drafter='v4.1'",
        "'device' unless --executor golden")
    add("simulate --burstiness with --trace", SIM + ["--trace", "{d}/tr-key.jsonl", "--burstiness", "2"],
        "--burstiness", "--burstiness=2.0", "no value with --trace")
    add("simulate --request-rate with a timed dataset", SIM + ["--dataset-name", "azure", "--dataset-path",
                                                             "{d}/bad.csv", "--request-rate", "5"], "--rate",
        "--rate=5.0", "no value with --dataset-name azure")

    # ---- sweep -----------------------------------------------------------------------------------------
    add("sweep grid missing", ["sweep", "{d}/nope.yaml", "--out", "{d}/sw"], "grid", "GRID='{d}/nope.yaml'",
        "an existing file holding a YAML or JSON grid")
    add("sweep grid not YAML", ["sweep", "{d}/bad.yaml", "--out", "{d}/sw"], "grid", "{d}/bad.yaml:2",
        "a YAML mapping with base / grid / slo")
    add("sweep grid wrong shape", ["sweep", "{d}/list.json", "--out", "{d}/sw"], "grid", "{d}/list.json",
        "a mapping with 'grid'")
    add("sweep grid unknown flag", ["sweep", "{d}/grid-flag.json", "--out", "{d}/sw"], "grid", "--nope-flag",
        "simulate arguments")
    add("sweep --out under a file", ["sweep", "{d}/grid-ok.json", "--out", "{d}/afile/sw"], "--out",
        "{d}/afile/sw", "a directory")
    add("sweep --num-cpus 0", ["sweep", "{d}/grid-ok.json", "--out", "{d}/sw", "--num-cpus", "0"], "--num-cpus",
        "--num-cpus=0", ">= 1")
    # --address: a value the suite cannot get wrong without a cluster to miss (a session's Ray may be up)
    add("sweep --address empty", ["sweep", "{d}/grid-ok.json", "--out", "{d}/sw", "--address", ""],
        "--address", "--address=''", "a Ray cluster address")
    return R


CASES = _rows()
# cases that hold only where a runtime is absent: case id -> the runtime
NEEDS_ABSENT = {"lockstep --device npu:0": "torch_npu", "lockstep --device npu:0 (real)": "torch_npu",
                "lockstep --device cuda": "cuda"}
