"""The import structure of src/specdecode, read with the standard library's ast: no import cycle
between modules (imports inside functions and under TYPE_CHECKING count too), the library in
layers (a module imports only its own layer or lower ones), no library module imports an
application (cli, serve, bench, lab, train, demo, plan, chat), and the README's map lists every module."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
APPLICATIONS = ("cli", "serve", "bench", "lab", "train", "demo", "plan", "chat")
# the library's layers, bottom to top (the README's map); the applications sit above all of them
LAYERS = (
    ("errors", "progress", "paths"),
    ("formats",),
    ("kernels",),
    ("models", "core", "roofline"),
    ("drafters", "autotune"),
    ("engine",),
    ("opener",),
    ("__init__",),
)
RANK = {unit: i for i, units in enumerate(LAYERS) for unit in units}


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


def unit(mod: str) -> str:
    """The top-level module or package a module belongs to ('specdecode' itself: '__init__')."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def downward_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a library module to a module of a higher layer, or of a unit no layer names."""
    out = []
    for m, targets in graph.items():
        if is_application(m):
            continue
        for t in targets:
            a, b = unit(m), unit(t)
            if a != b and (a not in RANK or b not in RANK or RANK[b] >= RANK[a]):
                out.append((m, t))
    return out


def test_library_modules_import_only_lower_layers():
    """models and core < drafters < engine < opener < the package's front; imports within a
    package are free (its own modules), across packages only downwards."""
    assert downward_violations(import_graph(SRC / "specdecode")) == []


def test_the_layer_check_catches_an_upward_import(tmp_path):
    """Negative control: a model module that imports the engine."""
    pkg = tmp_path / "specdecode"
    for d in ("models", "engine"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "llama.py").write_text("from ..engine.verify import Verdict\n")
    (pkg / "engine" / "verify.py").write_text("from ..models.llama import x\n")
    assert ("specdecode.models.llama", "specdecode.engine.verify") in downward_violations(import_graph(pkg))


def readme_map(text: str | None = None) -> set[str]:
    """The module paths (relative to src/specdecode) the README's Layout block lists: a line's
    first word when it names a .py file or a package/, or every word of a line of only .py names."""
    text = text if text is not None else (SRC.parent / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    found, stack = set(), []
    lines = block.split("src/specdecode/\n", 1)[1].splitlines()
    for line in lines:
        if line and not line.startswith(" "):
            break  # the tree ends at the next top-level folder (docs/)
        if line.strip().startswith("---"):
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2 - 1
        words = line.split()
        if depth < 0 or not words:
            continue
        if all(w.endswith(".py") for w in words):
            names = words
        elif words[0].endswith((".py", "/")):
            names = words[:1]
        else:
            continue  # a description's continuation
        del stack[depth:]
        for name in names:
            found.add("/".join([*stack, name.rstrip("/")]))
        if names[0].endswith("/"):
            stack.append(names[0].rstrip("/"))
    return found


def test_the_readme_map_lists_every_module_and_nothing_else():
    root = SRC / "specdecode"
    modules = {
        str(f.relative_to(root)) for f in root.rglob("*.py") if f.name not in ("__init__.py", "__main__.py")
    }
    packages = {str(f.parent.relative_to(root)) for f in root.rglob("*.py")}
    listed = readme_map()
    assert modules - listed == set(), "modules missing from the README's Layout"
    assert listed - modules - packages == set(), "the README's Layout names files that do not exist"


def test_the_map_reader_sees_nesting_and_a_missing_module():
    """Negative control for the map test: nested packages are read as paths, and a module left
    out of the block is not reported as listed."""
    text = "## Layout\n```\nsrc/specdecode/\n  errors.py   x\n  lab/   y\n    rules.py  z\n" + (
        "    web/   w\n      api.py   v\n  cli/   c\n    a.py  b.py\ndocs/   d\n```\n"
    )
    assert readme_map(text) == {
        "errors.py",
        "lab",
        "lab/rules.py",
        "lab/web",
        "lab/web/api.py",
        "cli",
        "cli/a.py",
        "cli/b.py",
    }


def specdecode_imports(files: list[Path]) -> list[tuple[str, str, str]]:
    """(file, module, name) of every `from specdecode... import name` in these scripts."""
    out = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if (
                isinstance(node, ast.ImportFrom)
                and not node.level
                and (node.module or "").startswith("specdecode")
            ):
                out += [(f.name, node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                out += [(f.name, a.name, "") for a in node.names if a.name.startswith("specdecode")]
    return out


def unresolved(files: list[Path]) -> list[tuple[str, str, str]]:
    """The specdecode modules and names these scripts import that do not exist."""
    import importlib
    import importlib.util

    missing = []
    for f, module, name in specdecode_imports(files):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            missing.append((f, module, name))
            continue
        if name and not hasattr(mod, name) and importlib.util.find_spec(f"{module}.{name}") is None:
            missing.append((f, module, name))
    return missing


def test_every_name_the_benchmark_scripts_import_exists(tmp_path):
    """benchmarks/ and scripts/ run by hand, not in this suite: a moved or renamed module or name
    they import is caught here instead of by the next person to run them (negative control: a
    script importing a name that moved)."""
    root = SRC.parent
    files = sorted((root / "benchmarks").glob("*.py")) + sorted((root / "scripts").glob("*.py"))
    assert unresolved(files) == []
    bad = tmp_path / "old.py"
    bad.write_text("from specdecode.engine import Proposal\nfrom specdecode.options import spec_config\n")
    assert unresolved([bad]) == [
        ("old.py", "specdecode.engine", "Proposal"),
        ("old.py", "specdecode.options", "spec_config"),
    ]
