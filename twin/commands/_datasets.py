"""`simulate`'s dataset flags, by `vllm bench serve`'s names, and the requests they select
(twin/sim/datasets.py holds the adapters)."""
from __future__ import annotations

from twin.abi.errors import ConfigError

from ._common import integer, number

FILE_DATASETS = ("sharegpt", "mooncake", "azure")
# each dataset's own flags: (default, help); given with another dataset (or none) they are refused
OWN_DEFAULTS = {
    "random_input_len": (1024, "random: mean input length"),
    "random_output_len": (128, "random: mean output length"),
    "random_range_ratio": (0.0, "random: lengths uniform in [L(1-r), L(1+r)], r in [0, 1)"),
    "random_prefix_len": (0, "random: a prefix shared by all"),
    "prefix_repetition_prefix_len": (256, "prefix_repetition: the shared prefix's length"),
    "prefix_repetition_suffix_len": (256, "prefix_repetition: each request's own suffix length"),
    "prefix_repetition_num_prefixes": (10, "prefix_repetition: distinct prefixes"),
    "prefix_repetition_output_len": (128, "prefix_repetition: output length"),
}
OWNER = {"random_": "random", "prefix_repetition_": "prefix_repetition", "sharegpt_": "sharegpt"}


def _own_flags(args) -> None:
    """Refuse a dataset's own flag given for another dataset, then fill in the defaults."""
    for name in (*OWN_DEFAULTS, "sharegpt_output_len"):
        value = getattr(args, name)
        owner = next(o for prefix, o in OWNER.items() if name.startswith(prefix))
        if value is not None and args.dataset_name != owner:
            raise ConfigError("--" + name.replace("_", "-"), value, f"only with --dataset-name {owner}")
    for name, (default, _) in OWN_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def add_dataset_args(p) -> None:
    from twin.sim.datasets import CHARS_PER_TOKEN, DATASETS

    d = p.add_argument_group("datasets (vllm bench serve's names; docs/simulation.md#datasets)")
    d.add_argument("--dataset-name", choices=DATASETS,
                   help="requests from a dataset instead of the workload spec: sharegpt / mooncake / azure "
                        "read --dataset-path; random / prefix_repetition are vLLM's synthetic sets")
    d.add_argument("--dataset-path", help="the dataset file (ShareGPT JSON, Mooncake JSONL, Azure CSV)")
    d.add_argument("--tokenizer", help=f"a local tokenizer directory (tokenizer.json) for ShareGPT lengths "
                                       f"(default: {CHARS_PER_TOKEN:g} characters per token)")
    d.add_argument("--sharegpt-output-len", type=integer, help="fix every ShareGPT output length")
    for name, (default, what) in OWN_DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        d.add_argument(flag, type=number if name == "random_range_ratio" else integer, default=None,
                       help=f"{what} (default {default:g})")

def dataset_requests(args, dep, spec):
    """The dataset's requests (None without --dataset-name) and the workload record for the summary.
    `spec` is the workload spec whose arrival process times an untimed dataset."""
    from twin.sim import datasets as ds
    from twin.sim.workload import arrivals

    name, path = args.dataset_name, args.dataset_path
    _own_flags(args)
    if name is None:
        if path is not None:
            raise ConfigError("--dataset-path", path, "only with --dataset-name sharegpt, mooncake or azure")
        return None, None
    if (name in FILE_DATASETS) != (path is not None):
        raise ConfigError("--dataset-path", path, f"given exactly for --dataset-name in {FILE_DATASETS}")
    if args.tokenizer and name != "sharegpt":
        raise ConfigError("--tokenizer", args.tokenizer, "only with --dataset-name sharegpt")
    vocab, n = dep.model.vocab_size, args.requests
    seed = args.seed if args.seed is not None else spec.seed        # the workload spec's seed, as simulate's
    if name == "sharegpt":
        tok = ds.DirTokenizer(args.tokenizer) if args.tokenizer else None
        if args.sharegpt_output_len is not None and args.sharegpt_output_len < 1:
            raise ConfigError("--sharegpt-output-len", args.sharegpt_output_len, ">= 1")
        reqs = ds.sharegpt(path, num_prompts=n, tokenizer=tok, output_len=args.sharegpt_output_len, vocab=vocab)
    elif name == "random":
        reqs = ds.random_dataset(n or spec.num_requests, input_len=args.random_input_len,
                                 output_len=args.random_output_len, range_ratio=args.random_range_ratio,
                                 prefix_len=args.random_prefix_len, seed=seed, vocab=vocab)
    elif name == "prefix_repetition":
        reqs = ds.prefix_repetition(n or spec.num_requests, prefix_len=args.prefix_repetition_prefix_len,
                                    suffix_len=args.prefix_repetition_suffix_len,
                                    num_prefixes=args.prefix_repetition_num_prefixes,
                                    output_len=args.prefix_repetition_output_len, seed=seed, vocab=vocab)
    else:
        reqs = getattr(ds, name)(path, num_prompts=n, seed=seed, vocab=vocab)
    record = {"dataset": name, "path": path, "requests": len(reqs), "seed": seed}
    if name not in ("mooncake", "azure"):          # untimed: the workload's arrival process
        import numpy as np
        timing = spec.replace(num_requests=len(reqs))
        ds.with_arrivals(reqs, arrivals(timing, np.random.default_rng(seed)))
        record.update(arrival=timing.arrival, rate=timing.rate, gamma_cv=timing.gamma_cv)
    else:
        record["trace"] = path
    return reqs, record
