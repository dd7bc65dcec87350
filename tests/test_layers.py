"""The layers hold: dependencies point one way, and the project's modules import no cycle.

Read from the source with `ast`, never by importing it: an import inside a function counts as much as
one at the top (it runs the day that function does), and a check that imported the modules would load
torch and could not see a lazy import at all.

Layers, low to high: inf_mllm < models < streaming < app, serve, jetson (side by side: none imports another)
< benchmarks (which may import all of them; no product package imports it).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANK = {"inf_mllm": 0, "models": 1, "streaming": 2, "app": 3, "serve": 3, "jetson": 3, "benchmarks": 4}

# Known offenders, each with why it is allowed for now: (importer, imported) pairs and cycles (sorted
# modules). None today. An entry must still be found (the tests check both ways), so it goes with its import.
KNOWN_UPWARD: set[tuple[str, str]] = set()
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the layered packages, by dotted name."""
    return {module_name(p, root): p for package in RANK for p in sorted((root / package).rglob("*.py"))}


def resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from … import` names, relative levels resolved against `importer`."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def targets(importer: str, path: Path, node: ast.AST, modules) -> list[str]:
    """The modules one import statement loads: `from pkg import name` is the submodule pkg.name when
    there is one, else pkg."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = resolve(importer, path.name == "__init__.py", node)
        named = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
        return named + ([base] if len(named) < len(node.names) else [])
    return []


def top_level(tree: ast.Module):
    """The statements that run when the module is imported: not function bodies, not `if TYPE_CHECKING:`."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack += node.orelse
            continue
        yield node
        for child in ast.iter_child_nodes(node):  # bodies of class, if, with, try and its except clauses
            stack += [child] if isinstance(child, ast.stmt) else getattr(child, "body", [])


def imports(everywhere: bool, root: Path = ROOT) -> dict[str, set[str]]:
    """{module: the project modules it imports}; `everywhere`: also inside functions, else what runs at import."""
    modules = sources(root)
    out = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        nodes = ast.walk(tree) if everywhere else top_level(tree)
        found = {t for node in nodes for t in targets(name, path, node, modules)}
        out[name] = {t for t in found if t.split(".")[0] in RANK}
    return out


def upward(root: Path = ROOT) -> set[tuple[str, str]]:
    """(importer, imported) pairs that break the layers."""
    bad = set()
    for importer, imported in imports(everywhere=True, root=root).items():
        mine = importer.split(".")[0]
        for target in imported:
            theirs = target.split(".")[0]
            if RANK[theirs] > RANK[mine] or (theirs != mine and RANK[theirs] == RANK[mine]):
                bad.add((importer, target))
    return bad


def cycles(root: Path = ROOT) -> set[tuple[str, ...]]:
    """Import cycles among the modules (strongly connected components of more than one module, or a module
    importing itself). A package's `__init__` importing its own submodules is a re-export, not an edge."""
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in imports(everywhere=False, root=root).items()}
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], set(), [0]

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.add(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_layer_imports_a_higher_one():
    found = upward()
    assert not found - KNOWN_UPWARD, "imports against the layers (importer → imported):\n" + "\n".join(
        f"  {a} → {b}" for a, b in sorted(found - KNOWN_UPWARD))
    assert KNOWN_UPWARD <= found, f"allowed but gone, drop from KNOWN_UPWARD: {KNOWN_UPWARD - found}"


def test_no_import_cycles():
    found = cycles()
    assert not found - KNOWN_CYCLES, "import cycles:\n" + "\n".join(
        "  " + " ↔ ".join(c) for c in sorted(found - KNOWN_CYCLES))
    assert KNOWN_CYCLES <= found, f"allowed but gone, drop from KNOWN_CYCLES: {KNOWN_CYCLES - found}"


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in RANK:
        (root / package).mkdir(exist_ok=True)
    return root


def test_the_checks_see_lazy_relative_and_sideways_imports(tmp_path):
    """On a made-up tree: an import inside a function counts, relative imports resolve, `from pkg import mod`
    is the submodule, app and jetson may not import each other, and nothing may import benchmarks."""
    root = _tree(tmp_path, {
        "inf_mllm/__init__.py": "",
        "inf_mllm/core.py": "def f():\n    from benchmarks import common\n",
        "streaming/__init__.py": "",
        "streaming/engine.py": "from . import records\nfrom .records import write\n",
        "streaming/records.py": "import inf_mllm.core\n",
        "streaming/late.py": "def f():\n    from app.ui import build\n",
        "app/__init__.py": "", "app/ui.py": "from jetson import soak\n",
        "jetson/__init__.py": "", "jetson/soak.py": "from streaming import records\n",
        "benchmarks/__init__.py": "", "benchmarks/common.py": "from app import ui\nfrom jetson.soak import x\n",
    })
    assert upward(root) == {("inf_mllm.core", "benchmarks.common"), ("streaming.late", "app.ui"),
                            ("app.ui", "jetson.soak")}
    assert imports(False, root)["streaming.engine"] == {"streaming.records"}
    assert imports(False, root)["jetson.soak"] == {"streaming.records"}
    assert cycles(root) == set()


def test_the_cycle_check_reads_what_runs_at_import(tmp_path):
    """A cycle of top-level imports is found, an `except` clause's too; one closed only inside a function or
    under TYPE_CHECKING is not, nor a package `__init__` re-exporting its own submodules."""
    root = _tree(tmp_path, {
        "benchmarks/__init__.py": "from .arena import run\n",
        "benchmarks/arena.py": "from .report import section\nfrom . import arena\n",
        "benchmarks/report.py": "from .arena import GOAL\n",
        "benchmarks/lazy.py": "def f():\n    from . import other\n",
        "benchmarks/other.py": "from typing import TYPE_CHECKING\nfrom . import lazy\nif TYPE_CHECKING:\n"
                               "    from . import lazy2\n",
        "benchmarks/lazy2.py": "from . import other\n",
        "benchmarks/guarded.py": "try:\n    import numpy\nexcept ImportError:\n    from . import fallback\n",
        "benchmarks/fallback.py": "from . import guarded\n",
    })
    assert cycles(root) == {("benchmarks.arena", "benchmarks.report"), ("benchmarks.fallback", "benchmarks.guarded")}
