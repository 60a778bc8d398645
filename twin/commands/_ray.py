"""Connecting to Ray for a command (sweep, lockstep): imported only when a command is asked to use
Ray, so `import twin.cli` never imports it."""
from __future__ import annotations

import socket

from twin.abi.errors import ConfigError

INSTALL = "Ray installed: pip install -e '.[ray]'"


def _reachable(address: str) -> bool:
    """A TCP connection to host:port opens within 3 s (ray.init would retry for about a minute)."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return False
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=3).close()
        return True
    except OSError:
        return False


def connect(flag: str, address: str | None, *, num_cpus: int | None = None, missing=None):
    """(ray, started): Ray connected to `address` (host:port or ray://host:port of a running
    cluster), or with None (or "auto") to the cluster running on this machine, else a new local one
    (`num_cpus` workers, no dashboard).  started: this call started it (the caller shuts it down).
    An unreachable address, or Ray not installed, is a ConfigError under `flag` (missing: the
    (name, value) to name when Ray is missing)."""
    try:
        import ray
    except ImportError:
        name, value = missing or (flag, address)
        raise ConfigError(name, value, INSTALL) from None
    named = address not in (None, "auto")
    # an address is tried even when this process is connected already: a wrong one is never ignored
    if named and not _reachable(address):
        raise ConfigError(flag, address, "auto, or the address of a running Ray cluster (host:port or "
                                         "ray://host:port) that accepts connections") from None
    if ray.is_initialized():
        return ray, False
    if named:
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConfigError(flag, address, f"a reachable Ray cluster ({type(e).__name__})") from None
    else:
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            # RAY_ADDRESS in the environment names a cluster, which takes no --num-cpus
            raise ConfigError("--num-cpus", num_cpus, f"unset when RAY_ADDRESS names a cluster "
                                                      f"({type(e).__name__})") from None
    return ray, True
