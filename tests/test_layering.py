"""The import rules of docs/architecture.md: arrows never point back."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("twin", "golden", "hw")
ALLOWED = {
    "twin/abi": {"twin.abi"},
    "golden": {"twin.abi", "golden"},
    "twin/sim": {"twin.abi", "twin.sim"},
    "hw": {"twin.abi", "golden", "hw"},
    # the torch device is the one independent second implementation: the ABI and itself, never golden
    "hw/torchdev": {"twin.abi", "hw.torchdev"},
    # the functional twin plugs golden into the simulator's executor slot, and a parity run plugs in
    # the lockstep checker (hw) the same way: a composition layer, the one place the three meet
    "twin/functional": {"twin.abi", "twin.sim", "golden", "hw", "twin.functional"},
}


def imported_modules(path: Path):
    tree = ast.parse(path.read_text())
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                yield ".".join(base + ([node.module] if node.module else []))
            elif node.module:
                yield node.module


def test_imports_follow_the_package_rules():
    bad = []
    for folder, allowed in ALLOWED.items():
        for path in (ROOT / folder).rglob("*.py"):
            for mod in imported_modules(path):
                if mod.split(".")[0] not in OURS:
                    continue
                if not any(mod == a or mod.startswith(a + ".") for a in allowed):
                    bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_twin_abi_needs_only_numpy():
    third_party = set()
    for path in (ROOT / "twin/abi").rglob("*.py"):
        for mod in imported_modules(path):
            top = mod.split(".")[0]
            if top not in OURS:
                third_party.add(top)
    import sys
    assert third_party - set(sys.stdlib_module_names) <= {"numpy"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_hw_has_no_import_cycles_even_through_imports_inside_functions():
    # an import inside a function still makes two modules depend on each other; the lockstep,
    # its records, replay and faults must each be readable (and testable) without the other
    mods = {_module_name(p): p for p in (ROOT / "hw").rglob("*.py")}
    graph = {}
    for name, path in mods.items():
        deps = set()
        for mod in imported_modules(path):
            # `from .x import y`: the module x, or the package's attribute y of a module we have
            while mod and mod not in mods:
                mod = mod.rpartition(".")[0]
            if mod and mod != name and mod in mods and not mods[mod].name == "__init__.py":
                deps.add(mod)
        graph[name] = deps
    state, cycle = {}, []

    def visit(m, stack):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle.append(stack[stack.index(d):] + [d] if d in stack else [m, d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycle, cycle
    assert "hw.real.step" in graph["hw.real.records"] and "hw.real.lockstep" not in graph["hw.real.records"]
