"""The package's folders are layers: a module imports only from its own layer or the layers
below it, and no two modules import each other, directly or through others. Imports made only
for type checking (under ``if TYPE_CHECKING``) are not dependencies and are not counted."""

from __future__ import annotations

import ast
from pathlib import Path

import outbox_dispatch

ROOT = Path(outbox_dispatch.__file__).parent
PACKAGE = "outbox_dispatch"

# lowest first; a top-level module not named here is refused by the test
LAYERS: list[tuple[str, ...]] = [
    ("core",),
    ("observe",),
    ("store",),
    ("caps",),
    ("claim",),
    ("worker",),
    ("celery",),
    ("databases", "runtime", "settings", "operations", "writing"),
    ("", "dispatcher"),  # "" is the package's __init__
    ("demo",),
    ("ops",),
    ("contrib", "pytest_plugin"),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join((PACKAGE, *parts))] = path
    return out


def _layer(module: str) -> int:
    first = module.split(".")[1] if "." in module else ""
    for i, names in enumerate(LAYERS):
        if first in names:
            return i
    raise AssertionError(f"{module} is in no layer: add its folder to LAYERS")


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text("utf-8"))
    skip = _type_checking_lines(tree)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    found.add(f"{base}.{alias.name}")
                elif base in known:
                    found.add(base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
    found.discard(module)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(name, path, known) for name, path in modules.items()}
    # importing a.b.c runs a/b/__init__ first, unless the importer is inside a.b already
    for module, deps in graph.items():
        for dep in list(deps):
            parts = dep.split(".")
            for i in range(2, len(parts)):
                parent = ".".join(parts[:i])
                if parent in known and not module.startswith(parent + "."):
                    deps.add(parent)
        deps.discard(module)
    return graph


def test_every_module_imports_only_its_own_layer_or_lower() -> None:
    wrong = [
        f"{module} (layer {_layer(module)}) imports {dep} (layer {_layer(dep)})"
        for module, deps in sorted(_graph().items())
        for dep in sorted(deps)
        if _layer(dep) > _layer(module)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle() -> None:
    graph = _graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_core_never_imports_contrib() -> None:
    contrib = f"{PACKAGE}.contrib"
    wrong = [
        f"{module} imports {dep}"
        for module, deps in _graph().items()
        if not module.startswith(contrib)
        for dep in deps
        if dep.startswith(contrib)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_package_module_is_over_450_lines() -> None:
    """A module a newcomer reads in one sitting: a longer one is split by concern."""
    long = {
        str(path.relative_to(ROOT)): n
        for path in ROOT.rglob("*.py")
        if (n := len(path.read_text("utf-8").splitlines())) > 450
    }
    assert not long, f"split these modules by concern: {long}"
