"""`hw` and `hw.real` export their public names lazily: importing the packages imports no submodule
(and no torch), every exported name resolves and is documented, and the parity notebook imports
only from the packages."""
import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGES = ("hw", "hw.real")
NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "parity.ipynb"


def test_importing_the_packages_imports_no_submodule_and_no_torch():
    code = ("import json, sys; import hw, hw.real; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('hw', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == ["hw", "hw.lazy", "hw.real"]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_export_resolves_and_is_documented(package):
    pkg = importlib.import_module(package)
    assert pkg.__all__ and set(pkg.__all__) <= set(dir(pkg))
    for name in pkg.__all__:
        obj = getattr(pkg, name)
        assert not isinstance(obj, type(sys)), name             # a name, never a submodule
        assert re.search(rf"(?<![\w.]){re.escape(name)}\b", pkg.__doc__), \
            f"{package}.{name} is exported but not in the package's API table"
        mod = getattr(obj, "__module__", None)
        assert mod is None or mod.startswith(package + "."), (name, mod)


@pytest.mark.parametrize("package", PACKAGES)
def test_an_unknown_name_is_an_attribute_error_and_submodules_still_import(package):
    pkg = importlib.import_module(package)
    with pytest.raises(AttributeError, match=f"{package!r} has no attribute 'no_such_name'"):
        pkg.no_such_name
    sub = "metrics" if package == "hw" else "side"
    assert importlib.import_module(f"{package}.{sub}") is getattr(pkg, sub)


def test_the_parity_notebook_imports_hw_names_from_the_packages():
    nb = json.loads(NOTEBOOK.read_text())
    src = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    froms = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom) and n.module.split(".")[0] == "hw"]
    assert froms
    for node in froms:
        names = [a.name for a in node.names]
        if node.module == "hw.real.replay":             # `replay` is the one name its submodule shadows
            assert names == ["replay"]
            continue
        assert node.module in PACKAGES, node.module
        assert set(names) <= set(importlib.import_module(node.module).__all__), names
