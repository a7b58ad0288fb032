"""The package's imports: no circles (type-only ones included, and imports inside functions), and
no import from a lower layer of the data path into a higher one (docs/architecture.md)."""

import ast
from pathlib import Path

import dspark

ROOT = Path(dspark.__file__).resolve().parent

# what each lower layer may import of the package besides itself
ALLOWED = {
    "runtime": {"errors"},
    "drafters": {"errors", "runtime", "sampling"},
    "scheduling": {"errors", "runtime"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports, wherever the import statement stands."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(0, node.level - 1)):
                base = base.rsplit(".", 1)[0]
            target = (base + ("." + node.module if node.module else "")) if node.level else (node.module or "")
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in modules else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_import_circles():
    graph = _graph()
    state: dict[str, int] = {}      # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_import_runs_back_up():
    bad = []
    for m, targets in _graph().items():
        layer = m.split(".")[1] if m.count(".") >= 1 else ""
        if layer not in ALLOWED:
            continue
        for t in targets:
            top = t.split(".")[1] if t.count(".") >= 1 else ""
            if top != layer and top not in ALLOWED[layer]:
                bad.append(f"{m} -> {t}")
    assert not bad, bad


def test_the_checks_see_a_circle_and_an_upward_import(tmp_path):
    """The walker finds relative imports inside functions and under TYPE_CHECKING."""
    modules = {"dspark.runtime.a": tmp_path / "a.py", "dspark.runtime.b": tmp_path / "b.py", "dspark.engine": tmp_path / "e.py"}
    modules["dspark.runtime.a"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import X\n")
    modules["dspark.runtime.b"].write_text("def f():\n    from ..engine import Engine\n    from . import a\n")
    assert _imports("dspark.runtime.a", modules["dspark.runtime.a"], modules) == {"dspark.runtime.b"}
    assert _imports("dspark.runtime.b", modules["dspark.runtime.b"], modules) == {"dspark.engine", "dspark.runtime.a"}
