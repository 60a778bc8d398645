"""`simulate`'s dataset flags, by `vllm bench serve`'s names, and the requests they select
(twin/sim/datasets.py holds the adapters)."""
from __future__ import annotations

from twin.abi.errors import ConfigError

FILE_DATASETS = ("sharegpt", "mooncake", "azure")


def add_dataset_args(p) -> None:
    from twin.sim.datasets import CHARS_PER_TOKEN, DATASETS

    d = p.add_argument_group("datasets (vllm bench serve's names; docs/simulation.md#datasets)")
    d.add_argument("--dataset-name", choices=DATASETS,
                   help="requests from a dataset instead of the workload spec: sharegpt / mooncake / azure "
                        "read --dataset-path; random / prefix_repetition are vLLM's synthetic sets")
    d.add_argument("--dataset-path", help="the dataset file (ShareGPT JSON, Mooncake JSONL, Azure CSV)")
    d.add_argument("--tokenizer", help=f"a local tokenizer directory (tokenizer.json) for ShareGPT lengths "
                                       f"(default: {CHARS_PER_TOKEN:g} characters per token)")
    d.add_argument("--sharegpt-output-len", type=int, help="fix every ShareGPT output length")
    d.add_argument("--random-input-len", type=int, default=1024, help="random: mean input length (default 1024)")
    d.add_argument("--random-output-len", type=int, default=128, help="random: mean output length (default 128)")
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [L(1-r), L(1+r)], r in [0, 1) (default 0)")
    d.add_argument("--random-prefix-len", type=int, default=0, help="random: a prefix shared by all (default 0)")
    d.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="default 256")
    d.add_argument("--prefix-repetition-suffix-len", type=int, default=256, help="default 256")
    d.add_argument("--prefix-repetition-num-prefixes", type=int, default=10, help="default 10")
    d.add_argument("--prefix-repetition-output-len", type=int, default=128, help="default 128")


def dataset_requests(args, dep, spec):
    """The dataset's requests (None without --dataset-name) and the workload record for the summary.
    `spec` is the workload spec whose arrival process times an untimed dataset."""
    from twin.sim import datasets as ds
    from twin.sim.workload import arrivals

    name, path = args.dataset_name, args.dataset_path
    if name is None:
        if path is not None:
            raise ConfigError("--dataset-path", path, "only with --dataset-name sharegpt, mooncake or azure")
        return None, None
    if (name in FILE_DATASETS) != (path is not None):
        raise ConfigError("--dataset-path", path, f"given exactly for --dataset-name in {FILE_DATASETS}")
    if args.tokenizer and name != "sharegpt":
        raise ConfigError("--tokenizer", args.tokenizer, "only with --dataset-name sharegpt")
    vocab, n = dep.model.vocab_size, args.requests
    if name == "sharegpt":
        tok = ds.DirTokenizer(args.tokenizer) if args.tokenizer else None
        if args.sharegpt_output_len is not None and args.sharegpt_output_len < 1:
            raise ConfigError("--sharegpt-output-len", args.sharegpt_output_len, ">= 1")
        reqs = ds.sharegpt(path, num_prompts=n, tokenizer=tok, output_len=args.sharegpt_output_len, vocab=vocab)
    elif name == "random":
        reqs = ds.random_dataset(n or spec.num_requests, input_len=args.random_input_len,
                                 output_len=args.random_output_len, range_ratio=args.random_range_ratio,
                                 prefix_len=args.random_prefix_len, seed=args.seed, vocab=vocab)
    elif name == "prefix_repetition":
        reqs = ds.prefix_repetition(n or spec.num_requests, prefix_len=args.prefix_repetition_prefix_len,
                                    suffix_len=args.prefix_repetition_suffix_len,
                                    num_prefixes=args.prefix_repetition_num_prefixes,
                                    output_len=args.prefix_repetition_output_len, seed=args.seed, vocab=vocab)
    else:
        reqs = getattr(ds, name)(path, num_prompts=n, seed=args.seed, vocab=vocab)
    record = {"dataset": name, "path": path, "requests": len(reqs)}
    if name not in ("mooncake", "azure"):          # untimed: the workload's arrival process
        import numpy as np
        timing = spec.replace(num_requests=len(reqs))
        ds.with_arrivals(reqs, arrivals(timing, np.random.default_rng(args.seed)))
        record.update(arrival=timing.arrival, rate=timing.rate, gamma_cv=timing.gamma_cv)
    else:
        record["trace"] = path
    return reqs, record
