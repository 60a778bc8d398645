"""Errors raised by the ABI layer.

Every error names the argument, the value that was given and what is allowed, so that a user
sees the rule that was broken instead of an opaque device failure.
"""
from __future__ import annotations


class AbiError(ValueError):
    """A configuration, limit, shape or argument broke an ABI rule."""

    def __init__(self, name: str, value, allowed: str, where: str = ""):
        self.name = name
        self.value = value
        self.allowed = allowed
        self.where = where
        prefix = f"{where}: " if where else ""
        self.message = f"{prefix}{name}={value!r} is invalid; allowed: {allowed}"
        super().__init__(self.message)
        # `type(e)(*e.args)` rebuilds the error: SimPy re-raises a process's exception that way
        self.args = (name, value, allowed, where)

    def __str__(self) -> str:
        return self.message


class ConfigError(AbiError):
    """An invalid preset, topology, serving limit or environment value."""


class CapacityError(AbiError):
    """Startup admission cannot fit even one capacity slot."""
