"""No import cycle among the modules of dpcore (issue 37, "Accounting without the circle").

The graph is built from the source alone: every ``.py`` file under the package is parsed with
:mod:`ast`, nothing is imported. Its edges:

* ``import dpcore.a.b`` is an edge to ``dpcore.a.b`` and to every package on the way that is not
  an ancestor of the importer (importing a submodule first runs its package's ``__init__``; the
  importer's own packages are already being initialised when it runs).
* ``from P import n`` is an edge to the submodule ``P.n`` when there is one (a ``.py`` file, an
  extension, a stub or a package named ``n``), and an edge to ``P`` itself when some ``n`` is a
  name defined by ``P`` (its ``__init__`` for a package) or when ``P`` is not an ancestor of the
  importer. So ``from . import x`` of a submodule is an edge to that submodule only, while
  ``from . import name`` of a name of the parent's ``__init__`` is an edge to it: the
  ``pkg/__init__ -> pkg.sub -> pkg/__init__`` cycle that a submodule closes by importing from its
  own package.
* Relative imports are resolved against the importer's package (a package's ``__init__`` is its
  own package).

An import inside a function body is *deferred* (it runs on the first call); any other import,
in a class body or a ``try`` included, runs when the module is imported. Imports under
``if TYPE_CHECKING:`` never run and are left out.

The first test fails on any cycle of the imports that run at import time. Deferring an import is
the usual way to hide a cycle, so the second fails on a deferred import that closes a cycle
(with the imports that run at import time and the other deferred ones). The deferred imports
listed in :data:`ALLOWED_DEFERRED` are left out of that graph: each is a lower module reaching
up, lazily, for a reason given beside it; the imports that close a cycle only through one of
them are not reported.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

import pytest

MODULE = "module"
DEFERRED = "deferred"
TYPE_ONLY = "type_checking"

#: Deferred imports that close a cycle and stay, by (importer, imported module), each with the
#: reason it stays. An entry that no longer closes a cycle fails the test: remove it.
ALLOWED_DEFERRED: Dict[Tuple[str, str], str] = {
    ("dpcore.sampling._cyclic", "dpcore.matrix_factorization"):
        "the cyclic samplers' schemas are matrix_factorization.Participation, and importing any part of that "
        "package runs its __init__, which loads the MF accounting, above dpcore.accounting and its samplers",
}


@dataclass(frozen=True)
class Edge:
    target: str
    kind: str  # MODULE, DEFERRED or TYPE_ONLY
    line: int


@dataclass
class Graph:
    root: pathlib.Path
    files: Dict[str, pathlib.Path]
    edges: Dict[str, List[Edge]]

    def adjacency(self, kinds: Iterable[str]) -> Dict[str, Set[str]]:
        kinds = set(kinds)
        return {m: {e.target for e in es if e.kind in kinds} for m, es in self.edges.items()}

    def where(self, source: str, target: str, kinds: Iterable[str]) -> str:
        lines = sorted({e.line for e in self.edges[source] if e.target == target and e.kind in set(kinds)})
        return f"{self.files[source].relative_to(self.root.parent)}:{','.join(map(str, lines))}"


def _module_name(path: pathlib.Path, root: pathlib.Path, package: str) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> List[Tuple[str, int, int, Optional[str], Optional[List[str]]]]:
    """(kind, line, level, module, names) of every import statement; names is None for
    ``import a.b`` (module then holds a.b)."""
    out: List[Tuple[str, int, int, Optional[str], Optional[List[str]]]] = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            k = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and kind == MODULE:
                k = DEFERRED
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    record(stmt, TYPE_ONLY)
                    visit(stmt, TYPE_ONLY)
                for stmt in child.orelse:
                    record(stmt, k)
                    visit(stmt, k)
                continue
            record(child, k)
            visit(child, k)

    def record(node: ast.AST, kind: str) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((kind, node.lineno, 0, alias.name, None))
        elif isinstance(node, ast.ImportFrom):
            out.append((kind, node.lineno, node.level, node.module, [a.name for a in node.names]))

    visit(tree, MODULE)
    return out


def build_graph(root: pathlib.Path, package: str) -> Graph:
    """The import graph of the package ``package`` whose directory is ``root``."""
    files = {_module_name(p, root, package): p for p in sorted(root.rglob("*.py"))}
    packages = {m for m, p in files.items() if p.name == "__init__.py"}

    def is_submodule(pkg: str, name: str) -> bool:
        if f"{pkg}.{name}" in files:
            return True
        # Extensions (_core.abi3.so) and their stubs count too: importing them runs no dpcore
        # code, so they only need to be told apart from a name of the package's __init__.
        return pkg in packages and any(files[pkg].parent.glob(name + ".*"))

    edges: Dict[str, List[Edge]] = defaultdict(list)
    for mod, path in files.items():
        parts = mod.split(".")
        ancestors = {".".join(parts[:i]) for i in range(1, len(parts))} | ({mod} if mod in packages else set())
        here = mod if mod in packages else mod.rpartition(".")[0]
        for kind, line, level, module, names in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if level:
                base = here.split(".")
                base = base[: len(base) - (level - 1)]
                target = ".".join(base + ([module] if module else []))
            else:
                target = module or ""
            if target != package and not target.startswith(package + "."):
                continue
            hit: List[str] = []
            tparts = target.split(".")
            hit += [p for p in (".".join(tparts[:i]) for i in range(1, len(tparts))) if p not in ancestors]
            if names is None:
                hit.append(target)
            else:
                subs = [n for n in names if is_submodule(target, n)]
                hit += [f"{target}.{n}" for n in subs]
                if len(subs) < len(names) or target not in ancestors:
                    hit.append(target)
            for t in dict.fromkeys(hit):
                if t in files and t != mod:
                    edges[mod].append(Edge(t, kind, line))
    for mod in files:
        edges.setdefault(mod, [])
    return Graph(root, files, dict(edges))


def strongly_connected(adj: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan, iteratively)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []
    counter = 0
    for root in sorted(adj):
        if root in index:
            continue
        work = [(root, iter(sorted(adj[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(adj.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def shortest_path(adj: Dict[str, Set[str]], start: str, goal: str) -> Optional[List[str]]:
    prev: Dict[str, Optional[str]] = {start: None}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        if v == goal:
            path = [v]
            while prev[path[-1]] is not None:
                path.append(prev[path[-1]])  # type: ignore[arg-type]
            return path[::-1]
        for w in sorted(adj.get(v, ())):
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return None


def describe_cycle(graph: Graph, cycle: List[str], kinds: Iterable[str]) -> str:
    kinds = tuple(kinds)
    hops = [f"    {a} -> {b}  ({graph.where(a, b, kinds)})" for a, b in zip(cycle, cycle[1:])]
    return "\n".join(hops)


def module_cycles(graph: Graph) -> List[str]:
    """One readable cycle per strongly connected component of the import-time graph."""
    adj = graph.adjacency([MODULE])
    out = []
    for comp in strongly_connected(adj):
        inside = {m: adj[m] & set(comp) for m in comp}
        first = comp[0]
        back = min((shortest_path(inside, w, first) for w in inside[first]), key=len)
        out.append(f"  {' , '.join(comp)}\n" + describe_cycle(graph, [first, *back], [MODULE]))
    return out


def deferred_cycles(graph: Graph, allowed: Iterable[Tuple[str, str]] = ()) -> Dict[Tuple[str, str], str]:
    """The deferred imports (importer, imported) that close a cycle, each with one such cycle,
    in the graph without the deferred imports ``allowed``."""
    at_import = graph.adjacency([MODULE])
    adj = graph.adjacency([MODULE, DEFERRED])
    for src, dst in allowed:
        if src in adj and dst not in at_import[src]:
            adj[src].discard(dst)
    found: Dict[Tuple[str, str], str] = {}
    for src, es in graph.edges.items():
        for e in es:
            if e.kind != DEFERRED or (src, e.target) in found or e.target not in adj[src]:
                continue
            if e.target in at_import[src]:
                continue  # the same import also runs at import time: the first test's business
            back = shortest_path(adj, e.target, src)
            if back is not None:
                found[(src, e.target)] = describe_cycle(graph, [src, *back], [MODULE, DEFERRED])
    return found


def _package_root() -> pathlib.Path:
    # Located without being imported: the graph is that of the source tree as it is.
    spec = importlib.util.find_spec("dpcore")
    assert spec is not None and spec.submodule_search_locations
    return pathlib.Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="module")
def graph() -> Graph:
    return build_graph(_package_root(), "dpcore")


def test_the_graph_sees_the_package(graph):
    assert len(graph.files) > 40
    adj = graph.adjacency([MODULE])
    assert "dpcore.accounting.base" in adj["dpcore.accounting.rdp"]
    assert "dpcore.accounting.pld" in adj["dpcore.accounting"]


def test_no_import_cycle_at_module_level(graph):
    cycles = module_cycles(graph)
    assert not cycles, "import cycles among the imports that run at import time:\n" + "\n".join(cycles)


def test_no_deferred_import_closes_a_cycle(graph):
    unlisted = deferred_cycles(graph, ALLOWED_DEFERRED)
    stale = sorted(k for k in ALLOWED_DEFERRED if k not in deferred_cycles(graph, set(ALLOWED_DEFERRED) - {k}))
    msg = []
    if unlisted:
        msg.append("deferred imports that close an import cycle (move the shared code lower instead):")
        msg += [f"  {a} -> {b}:\n{cycle}" for (a, b), cycle in sorted(unlisted.items())]
    if stale:
        msg.append("ALLOWED_DEFERRED entries that no longer close a cycle (remove them): " + ", ".join(map(str, stale)))
    assert not msg, "\n".join(msg)


# -- the rules above, on a package made up for the purpose -------------------------------------


def _write(root: pathlib.Path, files: Dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        p = root / "pkg" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root / "pkg"


def test_a_submodule_importing_its_package_is_a_cycle(tmp_path):
    root = _write(tmp_path, {
        "__init__.py": "from .sub import f\nNAME = 1\n",
        "sub.py": "from . import NAME\ndef f(): pass\n",
    })
    cycles = module_cycles(build_graph(root, "pkg"))
    assert len(cycles) == 1 and "pkg -> pkg.sub" in cycles[0] and "pkg.sub -> pkg" in cycles[0]


def test_importing_a_sibling_submodule_is_not_an_edge_to_the_package(tmp_path):
    root = _write(tmp_path, {
        "__init__.py": "from .a import f\n",
        "a.py": "from . import b\nfrom .b import g\nimport pkg.b\ndef f(): pass\n",
        "b.py": "def g(): pass\n",
    })
    g = build_graph(root, "pkg")
    assert g.adjacency([MODULE]) == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": set()}
    assert module_cycles(g) == []


def test_deferred_and_type_checking_imports(tmp_path):
    root = _write(tmp_path, {
        "__init__.py": "",
        "low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .high import H\n"
                  "def make():\n    from .high import H\n    return H()\n",
        "high.py": "from .low import make\nclass H: pass\n",
        "sub/__init__.py": "",
        "sub/x.py": "from ..low import make\n",
    })
    g = build_graph(root, "pkg")
    assert module_cycles(g) == []
    assert [e.kind for e in g.edges["pkg.low"]] == [TYPE_ONLY, DEFERRED]
    assert list(deferred_cycles(g)) == [("pkg.low", "pkg.high")]
    # A package that is not the importer's own is initialised first: an edge to it.
    assert g.adjacency([MODULE])["pkg.sub.x"] == {"pkg.low"}
