"""The golden path of `dspark-twin simulate --executor golden` (twin/commands/simulate.py).

The run is the cost-model run's (same scheduler, engine, report files, virtual time from the cost
model) with golden's tokens; it adds `tokens.jsonl` and `acceptance.json` (`run.write_outputs`).
"""
from __future__ import annotations

from importlib import resources

from twin.abi.errors import ConfigError

WORKLOAD = "functional_workload.json"


def default_workload() -> str:
    """A golden-sized workload: 8 requests, ~160-token prompts, 16 output tokens, shared prefixes."""
    return str(resources.files("twin.functional") / "data" / WORKLOAD)


def attach(cfg, *, weights_seed: int = 0, drafter: str = "device") -> dict:
    """Point `cfg` (a SimConfig) at a golden executor of its preset's synthetic weights; drafter:
    golden.dspark.variants ("device" or "v4.1")."""
    from .run import golden_factory, golden_model

    dep = cfg.dep
    if dep.model.name == "flash":
        raise ConfigError("preset", "flash", "a small preset (tiny, small) for --executor golden: golden runs "
                          "whole models on the CPU; FLASH-shaped layers are golden's per-layer tests")
    golden = golden_model(dep.model.name, seed=weights_seed, drafter=drafter)
    holder: dict = {}
    cfg.executor = golden_factory(dep, golden, holder)
    return holder

