"""The import structure of src/specdecode, read with the standard library's ast: no import cycle
between modules (imports inside functions and under TYPE_CHECKING count too), and no library
module imports an application (cli, serve, bench, lab, train, demo, plan)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
APPLICATIONS = ("cli", "serve", "bench", "lab", "train", "demo", "plan")


def module_names(root: Path) -> dict[str, Path]:
    """'specdecode.models.llama' -> its file, for every module and package under root."""
    out = {}
    for f in root.rglob("*.py"):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name imported from a package counts as the
    submodule when there is one of that name, else as the package)."""
    mods = module_names(root)
    top = root.name
    graph = {}
    for mod, f in mods.items():
        package = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                if name.split(".")[0] != top:
                    continue
                for alias in node.names:
                    sub = f"{name}.{alias.name}"
                    found.add(sub if sub in mods else name)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] == top}
        graph[mod] = {m for m in found if m in mods and m != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def is_application(mod: str) -> bool:
    parts = mod.split(".")
    return len(parts) > 1 and parts[1] in APPLICATIONS


def test_no_import_cycle_between_modules():
    assert cycles(import_graph(SRC / "specdecode")) == []


def test_no_library_module_imports_an_application():
    graph = import_graph(SRC / "specdecode")
    upward = [
        (m, t) for m, targets in graph.items() if not is_application(m) for t in targets if is_application(t)
    ]
    assert upward == []


def test_the_structure_checks_catch_a_cycle_and_an_upward_import(tmp_path):
    """Negative control: a package where engine and calibrate import each other (one of them
    inside a function) and the core imports the command line."""
    pkg = tmp_path / "specdecode"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .engine import run\n")
    (pkg / "engine.py").write_text("from .calibrate import cost\n\ndef run():\n    from .cli import main\n")
    (pkg / "calibrate.py").write_text("def cost():\n    from .engine import run\n")
    (pkg / "cli" / "__init__.py").write_text("def main():\n    pass\n")
    graph = import_graph(pkg)
    assert ["specdecode.calibrate", "specdecode.engine"] in cycles(graph)
    assert "specdecode.cli" in graph["specdecode.engine"] and is_application("specdecode.cli")
