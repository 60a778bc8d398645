"""Package-level public names that live in submodules, imported on first use (PEP 562), so that
importing a package (`hw`, `hw.real`) imports none of its submodules and no torch."""
from __future__ import annotations

import importlib


def lazy_exports(package: str, modules: dict[str, tuple[str, ...]]):
    """modules: submodule -> the public names it holds.  Returns (__all__, __getattr__, __dir__)."""
    home = {name: mod for mod, names in modules.items() for name in names}

    def __getattr__(name: str):
        mod = home.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{mod}"), name)

    def __dir__() -> list[str]:
        return sorted(set(home) | set(vars(importlib.import_module(package))))

    return sorted(home), __getattr__, __dir__
