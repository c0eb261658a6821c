"""The shape of the library, held by a test: no import loop anywhere in ssm (imports inside
functions counted), no import that runs up a floor, no library module over 650 lines.

The graph is read from the sources with ``ast``, not by importing them, so that an import inside
a function body counts as much as one at the top of a module. The floors, lowest first, are those
of docs/architecture.md: a module may import its own package's modules and any lower floor.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 650

# docs/architecture.md's floors, lowest first. A package not listed here fails the test until
# it is given a floor (a new package has to say where it sits).
FLOORS = [
    {"ssm._backends", "ssm._custom_op", "ssm.native"},
    {"ssm.ops", "ssm.memory"},
    {"ssm.scan"},
    {"ssm.distributed"},
    {"ssm.layers"},
    {"ssm.models"},
    {"ssm.training"},
    {"ssm"},
]


def modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Every module of the package under ``root``: dotted name → (file, is a package's __init__)."""
    found = {}
    for path in sorted((root / "ssm").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module → the ssm modules it imports, anywhere in its body. ``from package import name``
    points at the submodule ``package.name`` when there is one, else at the package."""
    known = modules(root)
    graph = {}
    for name, (path, is_package) in known.items():
        package = name if is_package else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    targets.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
        graph[name] = {t for t in targets if t in known and t != name}
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def floor_of(module: str) -> tuple[int, str]:
    """(floor, package) of ``module``: its package is ssm.<first part>, or ssm itself."""
    parts = module.split(".")
    package = ".".join(parts[:2])
    for level, members in enumerate(FLOORS):
        if package in members:
            return level, package
    raise AssertionError(f"{package} has no floor in tests/test_import_graph.py's FLOORS: say where it sits")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for source, targets in sorted(graph.items()):
        here, package = floor_of(source)
        for target in sorted(targets):
            there, other = floor_of(target)
            if other != package and there >= here:
                bad.append(f"{source} -> {target} ({package} is floor {here}, {other} floor {there})")
    return bad


def test_no_module_imports_itself_back():
    found = loops(import_graph(ROOT))
    assert not found, "import loops (imports inside functions count):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_runs_up_a_floor():
    bad = upward_imports(import_graph(ROOT))
    assert not bad, "imports that run up a floor or across one:\n" + "\n".join(bad)


def test_no_library_module_is_over_650_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for path, _ in modules(ROOT).values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"library modules over {MAX_LINES} lines (split them by job): {long}"


# The checks themselves, on small trees written here: each must see what it is for.


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_loop_through_a_function_body_is_found(tmp_path):
    root = write_tree(
        tmp_path,
        {
            "ssm/__init__.py": "",
            "ssm/models/__init__.py": "",
            "ssm/models/a.py": "from .b import f\n",
            "ssm/models/b.py": "def f():\n    from .c import g\n    return g\n",
            "ssm/models/c.py": "from . import a\n",
            "ssm/models/d.py": "from .a import f\n",
        },
    )
    assert loops(import_graph(root)) == [["ssm.models.a", "ssm.models.b", "ssm.models.c"]]


def test_an_upward_import_and_an_unplaced_package_are_found(tmp_path):
    root = write_tree(
        tmp_path,
        {
            "ssm/__init__.py": "from .models import lm\n",
            "ssm/models/__init__.py": "",
            "ssm/models/lm.py": "from ..layers import x\n",
            "ssm/layers/__init__.py": "x = 1\n",
            "ssm/layers/y.py": "import ssm.models.lm\n",
        },
    )
    assert upward_imports(import_graph(root)) == [
        "ssm.layers.y -> ssm.models.lm (ssm.layers is floor 4, ssm.models floor 5)"
    ]
    write_tree(root, {"ssm/newpkg/__init__.py": "from ..layers import x\n"})
    with pytest.raises(AssertionError, match="ssm.newpkg has no floor"):
        upward_imports(import_graph(root))
