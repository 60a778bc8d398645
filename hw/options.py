"""A lockstep run's options that every entry point shares: what happens after a failing dispatch,
and the grammar of a fault injection spec."""
from __future__ import annotations

from twin.abi.errors import AbiError

# strict stops at the first failing dispatch; continuous re-syncs the golden from the device and goes on
MODES = ("strict", "continuous")


def split_fault(spec: str) -> tuple[str, int, int]:
    """'KIND', 'KIND@AT' or 'KIND@AT:LAYER' -> (kind, at, layer): AT a dispatch index, LAYER a layer
    index (both integers >= 0, 0 when left out); the fault list checks KIND."""
    kind, _, rest = spec.partition("@")
    at, _, layer = rest.partition(":")
    try:
        at, layer = int(at or 0), int(layer or 0)
    except ValueError:
        at = layer = -1
    if at < 0 or layer < 0:
        raise AbiError("--inject", spec, "KIND[@AT[:LAYER]] with integers AT >= 0 and LAYER >= 0", where="lockstep")
    return kind, at, layer
