"""The package's modules import one another without loops.

The import graph is read from the source: every import statement of every module counts, at the top, inside
a function or under `TYPE_CHECKING` (a loop that a lazy import hides is still a loop, one moved import away
from an ImportError on a partly initialised module).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]

# What each layer may import from the package (ARCHITECTURE.md: the arrows), besides itself.
LAYERS = {
    # (the custom ops the passes insert are their one bridge to the runtime)
    "zenflow_compile.passes": {"zenflow_compile.passes", "zenflow_compile.runtime.ops", "zenflow_compile.runtime"},
    "zenflow_compile.runtime": {"zenflow_compile.runtime", "zenflow_compile.triton_kernels"},
    "zenflow_compile.triton_kernels": {"zenflow_compile.triton_kernels"},
}


def package_modules() -> dict[str, Path]:
    """Every module of the package by its installed name; pyproject's package-dir maps folders into it."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    table = re.search(r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?:^\[|\Z)", pyproject, flags=re.M | re.S).group(1)
    modules = {}
    for package, folder in re.findall(r'^"([\w.]+)" = "([\w./]+)"', table, flags=re.M):
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            modules[".".join((package, *parts)).removesuffix(".__init__")] = path
    return modules


def imported_modules(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The modules of `modules` that `module` imports, each with the line of its first import.

    `import a.b.c` runs a, a.b and a.b.c; `from a.b import c` runs a and a.b, then reads `c` from a.b (a
    submodule a.b.c, which it then runs, or a name a.b defines). The packages that contain `module` started
    running before it, so passing through them on the way to another module is no edge, but reading a name
    from one of them is (`from zenflow_compile import x` inside the package reads from a package that may
    still be running its `__init__`).
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}

    def runs(name: str, line: int) -> None:
        parts = name.split(".")
        for end in range(1, len(parts) + 1):
            prefix = ".".join(parts[:end])
            if prefix in modules and not f"{module}.".startswith(f"{prefix}."):
                found.setdefault(prefix, line)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                runs(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            source = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            runs(source, node.lineno)
            if source in modules and source != module:
                found.setdefault(source, node.lineno)
            for alias in node.names:
                runs(f"{source}.{alias.name}", node.lineno)
    return found


def import_graph(modules: dict[str, Path]) -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for module, path in modules.items():
        for imported, line in imported_modules(module, path, modules).items():
            graph.add_edge(module, imported, where=f"{path.parent.name}/{path.name}:{line}")
    return graph


def import_loops(graph: nx.DiGraph) -> list[frozenset[str]]:
    return [frozenset(modules) for modules in nx.strongly_connected_components(graph) if len(modules) > 1]


def describe(graph: nx.DiGraph, loop: frozenset[str]) -> str:
    edges = nx.find_cycle(graph.subgraph(loop))
    return " -> ".join(f"{a} ({graph.edges[a, b]['where']})" for a, b in edges) + f" -> {edges[0][0]}"


def test_no_import_loops_among_the_package_modules():
    modules = package_modules()
    assert {"zenflow_compile", "zenflow_compile.backend", "zenflow_compile.passes.pipeline",
            "zenflow_compile.runtime.engine", "zenflow_compile.triton_kernels"} <= modules.keys()
    graph = import_graph(modules)
    loops = import_loops(graph)
    assert not loops, "import loops:\n" + "\n".join(describe(graph, loop) for loop in loops)


def _layer(module: str):
    return next((layer for layer in LAYERS if module == layer or module.startswith(layer + ".")), None)


def test_no_layer_imports_a_layer_above_it():
    """passes/, runtime/ and triton_kernels/ import only themselves and the layers below them (the runtime takes
    the API's config as plain values, never imports it)."""
    graph = import_graph(package_modules())
    upward = [(a, b) for a, b in graph.edges if _layer(a) is not None
              and not any(b == allowed or b.startswith(allowed + ".") for allowed in LAYERS[_layer(a)])]
    assert not upward, f"imports against the layering: {upward}"


def test_the_graph_sees_a_package_read_while_it_runs_its_init(tmp_path):
    """What the checks above rely on, on a package made for it: `from pkg import helper` inside pkg reads pkg
    (a loop when pkg's `__init__` imports that module), `import pkg.helper` does not."""
    (tmp_path / "pkg").mkdir()
    sources = {"pkg": "from pkg import backend\n", "pkg.backend": "from pkg import helper\n",
               "pkg.helper": "import pkg.util\n", "pkg.util": ""}
    modules = {}
    for name, source in sources.items():
        path = tmp_path / "pkg" / ("__init__.py" if name == "pkg" else f"{name.split('.')[1]}.py")
        path.write_text(source)
        modules[name] = path
    graph = import_graph(modules)
    assert import_loops(graph) == [frozenset({"pkg", "pkg.backend"})]
    assert set(graph.successors("pkg.helper")) == {"pkg.util"}
