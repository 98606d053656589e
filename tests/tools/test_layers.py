"""pdhal's layers (docs/architecture.md), read from its imports: a module imports only from
its own layer or the ones below it (function-local imports included), so nothing calls
upward, and no two modules import each other."""

from __future__ import annotations

import ast
import os

import pdhal

PACKAGE = os.path.dirname(pdhal.__file__)

#: Bottom to top; a module's layer is the first whose prefix its name starts with.
LAYERS = [
    ("pdhal._errors", "pdhal._version", "pdhal._compiled", "pdhal._pdhal_c"),
    ("pdhal._inputs",),  # what engines pass: tensors, buffers, DLPack, int addresses
    ("pdhal._protocol",),  # the C core's binding and the shared-memory protocol
    ("pdhal._memory",),  # host buffers, shared buffers, extents, block copies
    ("pdhal._backends",),  # the backend contract, registry, runtime base, the cpu backend
    # the public API
    ("pdhal.ops", "pdhal.blocks", "pdhal.plugin", "pdhal.compat", "pdhal.testing", "pdhal"),
    ("pdhal._transfer", "pdhal.transfer"),  # the layer-wise KV streamer, transports
    ("pdhal._tools", "pdhal.__main__"),  # the command line
]


def layer_of(module: str) -> int:
    for index, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and the architecture doc")


def modules() -> dict[str, str]:
    """{dotted name: path} of every Python module of pdhal."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = "pdhal." + os.path.relpath(path[:-3], PACKAGE).replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def imports_of(path: str, known: dict[str, str]) -> set[str]:
    """The pdhal modules `path` imports, anywhere in it ("from pdhal.x import y" counts as
    importing pdhal.x.y where that is a module, else pdhal.x)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("pdhal")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pdhal"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return found


def test_every_module_imports_only_its_own_layer_and_those_below():
    known = modules()
    upward = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})"
        for module, path in known.items()
        for dep in imports_of(path, known)
        if dep != "pdhal" and layer_of(dep) > layer_of(module)
    ]
    assert upward == []


def test_no_two_modules_import_each_other_through_a_chain():
    known = modules()
    graph = {
        m: {d for d in imports_of(p, known) if d in known and d != m} for m, p in known.items()
    }
    graph["pdhal"] = set()  # the package itself: every submodule's parent, imported first

    def reach(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(graph.get(module, ()))
        return seen

    assert [m for m in graph if m in reach(m)] == []


def test_the_engine_adapters_use_only_public_pdhal_api():
    """pdhal.compat adapts an engine's call shapes onto pdhal's public API (pdhal, pdhal.ops,
    pdhal.blocks, pdhal.plugin): an adapter that reaches into a private module is a second
    implementation layer the public API does not cover."""
    known = modules()
    private = [
        f"{module} imports {dep}"
        for module, path in known.items()
        if module.startswith("pdhal.compat")
        for dep in imports_of(path, known)
        if any(part.startswith("_") for part in dep.split("."))
    ]
    assert private == []
