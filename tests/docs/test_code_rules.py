"""The project's code rules (docs/contributing.md), checked on the source: modules of at most 600
lines, functions over 60 lines only with the reason stated in their docstring, no import cycle
between the package's modules, and `manifolds` never importing `geomtrain`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("manifolds", "geomtrain")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
# a stated reason, a phrase that introduces one: "Long because <reason>", "<reason>: longer than 60 lines
# on purpose", "<reason>, hence the length", "just over 60 lines"; a docstring that merely contains
# "long" or "length" is not a reason
REASON = re.compile(
    r"(?i)\blong(?:er)?(?:\s+only)?\s+because\s+\w+"
    r"|\w+[^.]*\bon purpose\b|\w+[^.]*, hence the length|just over 60 lines"
)


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def test_the_package_is_found():
    assert {"manifolds.base", "geomtrain.optim.muon", "geomtrain.train"} <= set(MODULES)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_600_lines(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{MODULES[name].relative_to(REPO)}: {lines} lines"


def test_long_functions_state_why():
    unexplained = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and not REASON.search(ast.get_docstring(node) or ""):
                    unexplained.append(f"{name}.{node.name} ({length} lines)")
    assert not unexplained, "functions over 60 lines without a stated reason: " + ", ".join(unexplained)


def _imports(name: str, path: Path) -> set[str]:
    """The package modules ``name`` imports, at the top or inside a function (a lazy import is still a
    dependency: two modules that import each other lazily are one tangle)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # `from pkg import sub` imports the submodule pkg.sub
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


def test_no_import_cycles():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(cycles)


def test_manifolds_never_imports_geomtrain():
    offenders = []
    for name, path in MODULES.items():
        if name.startswith("manifolds"):
            for node in ast.walk(ast.parse(path.read_text())):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                modules += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                offenders += [f"{name} imports {m}" for m in modules if m.split(".")[0] == "geomtrain"]
    assert not offenders, offenders


# The optimizer's layers, lowest first: a module may import from its own layer's shared pieces and from lower
# layers, never from a higher one, and the two exchanges (DDP, FSDP2) are siblings that share `exchange` and never
# import each other.
OPTIM_LAYERS = (
    ("solver", "numerics", "gram", "products", "column_split", "douglas_rachford", "square_dgram"),
    ("baselines", "gram_newton", "filled_split", "registry", "certificate"),
    ("direction",),
    ("muon_step",),
    ("exchange",),
    ("muon_dist", "muon_fsdp"),
    ("muon",),
)
EXCHANGES = {"geomtrain.optim.muon_dist", "geomtrain.optim.muon_fsdp"}


def test_the_optimizer_is_layered_and_its_exchanges_are_siblings():
    layer = {f"geomtrain.optim.{m}": i for i, mods in enumerate(OPTIM_LAYERS) for m in mods}
    optim = sorted(n for n in MODULES if n.startswith("geomtrain.optim.") and n != "geomtrain.optim")
    assert set(optim) == set(layer), f"place these modules in OPTIM_LAYERS: {sorted(set(optim) ^ set(layer))}"
    upward = [
        f"{name} imports {dep}"
        for name in optim
        for dep in _imports(name, MODULES[name])
        if dep in layer and (layer[dep] > layer[name] or {name, dep} <= EXCHANGES)
    ]
    assert not upward, "imports against the optimizer's layers: " + "; ".join(upward)
