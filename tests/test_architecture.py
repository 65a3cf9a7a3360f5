"""The layer rules of docs/architecture.md, checked on the import statements of src/ringlet.

Every module belongs to one layer; a layer may import only the layers listed for it; training
layers never import the binding (`_core`) or the group internals; and no modules import each
other in a circle. Imports are read with `ast`, including those inside functions and under
`if TYPE_CHECKING:`: a lazy or annotation-only import is still a dependency between concepts.
"""
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

# Module prefix -> layer; the longest matching prefix wins ("ringlet" alone is the package root).
# Prefixes of modules that do not exist yet are harmless: they name where parts A and B of
# issue 30 put the mesh (ringlet.parallel.mesh) and the wire layer (ringlet._wire).
LAYER_OF = {
    "ringlet.errors": "base", "ringlet._timeout": "base", "ringlet._dtypes": "base",
    "ringlet._version": "base", "ringlet._buffers": "base",
    "ringlet._topology": "base", "ringlet._costmodel": "base", "ringlet._envvars": "base",
    "ringlet._core": "binding",
    "ringlet._auth": "wire", "ringlet.store": "wire", "ringlet.environment": "wire",
    "ringlet._wire": "wire",
    "ringlet._world": "groups", "ringlet.group": "groups", "ringlet.work": "groups",
    "ringlet.trace": "groups", "ringlet._hier": "groups", "ringlet._shm": "groups",
    "ringlet.mesh": "mesh", "ringlet.dtensor": "mesh",
    "ringlet.parallel.mesh": "mesh", "ringlet.parallel.dtensor": "mesh",
    "ringlet": "root",
    "ringlet.parallel": "training", "ringlet.nn": "training", "ringlet.pipeline": "training",
    "ringlet.checkpoint": "training", "ringlet.rpc": "training", "ringlet.optim": "training",
    "ringlet.torch": "adapter",
    "ringlet.cli": "tools", "ringlet.run": "tools", "ringlet.testing": "tools",
    "ringlet.testbed": "tools",
    "ringlet.bench": "tools",
}
# Which layers each layer may import (its own included). Lower layers never import upwards.
MAY_IMPORT = {
    "base": {"base"},
    "wire": {"base", "wire"},
    "groups": {"base", "binding", "wire", "groups"},
    "mesh": {"base", "wire", "groups", "mesh"},
    "root": {"base", "wire", "groups", "mesh"},
    # Training layers use the public API (the package root and the mesh), never the binding
    # or the group internals.
    "training": {"base", "wire", "mesh", "root", "training"},
    # An adapter to another framework's process-group API forms groups that framework's way
    # (members only), so it may use the group internals; never the binding.
    "adapter": {"base", "wire", "groups", "mesh", "root", "adapter"},
    "tools": {"base", "binding", "wire", "groups", "mesh", "root", "training", "adapter", "tools"},
}


def _modules():
    mods = {}
    for p in sorted((SRC / "ringlet").rglob("*.py")):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return mods


def _targets(name, is_pkg, node, known):
    """The ringlet modules one import statement of module `name` loads."""
    def closest(mod):
        while mod not in known and "." in mod:
            mod = mod.rsplit(".", 1)[0]
        return mod

    if isinstance(node, ast.Import):
        return [closest(a.name) for a in node.names if a.name.split(".")[0] == "ringlet"]
    if node.level:
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        pkg = ".".join(base + ([node.module] if node.module else []))
    elif (node.module or "").split(".")[0] == "ringlet":
        pkg = node.module
    else:
        return []
    return [pkg + "." + a.name if pkg + "." + a.name in known else closest(pkg) for a in node.names]


def import_graph():
    mods = _modules()
    known = set(mods) | {"ringlet._core"}
    graph = {}
    for name, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = {t for node in ast.walk(tree)
                       if isinstance(node, (ast.Import, ast.ImportFrom))
                       for t in _targets(name, is_pkg, node, known) if t != name}
    return graph


def layer_of(module):
    best = max((p for p in LAYER_OF if module == p or module.startswith(p + ".")),
               key=len, default=None)
    return LAYER_OF.get(best)


def cycles(graph):
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_graph_reader_sees_imports():
    g = import_graph()
    # One import of each kind the reader must resolve: relative submodule, absolute, lazy.
    assert "ringlet._core" in g["ringlet._world"]          # from . import _core
    assert "ringlet._auth" in g["ringlet.rpc.agent"]       # from ringlet._auth import ...
    assert "ringlet.store" in g["ringlet.environment"]     # under TYPE_CHECKING
    assert "ringlet._wire.codec" in g["ringlet.group"]     # inside a function
    assert "ringlet.checkpoint.errors" in g["ringlet.checkpoint.format"]


def test_every_module_has_a_layer():
    missing = sorted(m for m in import_graph() if layer_of(m) is None)
    assert not missing, (f"modules without a layer: {missing}; add them to LAYER_OF here and to "
                         f"the picture in docs/architecture.md")


def test_training_layers_never_import_the_binding():
    bad = sorted((m, t) for m, ts in import_graph().items() for t in ts
                 if layer_of(m) == "training" and t == "ringlet._core")
    assert not bad, f"training layers import ringlet._core: {bad}"


def test_layers_import_only_what_they_may():
    bad = set()
    for m, ts in import_graph().items():
        allowed = MAY_IMPORT[layer_of(m)]
        for t in ts:
            if layer_of(t) not in allowed:
                bad.add((m, t))
    assert not bad, ("imports across layers that docs/architecture.md forbids "
                     f"(importer, imported): {sorted(bad)}")


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, ("import cycles (each a set of modules importing each other): "
                       f"{[sorted(c) for c in found]}")


def test_cycle_finder_finds_a_planted_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(g) == [{"a", "b", "c"}]
