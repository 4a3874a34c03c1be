"""The package's layering, read from its source with ``ast``: imports go downward only, no circles, no
Lightning below the doors, a short top level, and every folder says what it owns and may import."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_zero3"
NAME = PACKAGE.name

#: The package's layers, lowest first: a module may import its own layer's modules and those of the
#: layers before it. Names in one tuple are siblings that may not import each other.
LAYERS = [
    ("errors",),
    ("config",),
    ("engine",),
    ("export",),
    ("checkpoint",),
    ("pretrained",),
    ("callbacks",),
    ("frontends",),
    ("__init__",),  # the package's public names (``import lightning_zero3``)
    ("cli",),
]
#: Inside ``engine/`` (its ``__init__`` docstring draws the same order); the loose modules are on top.
ENGINE_LAYERS = [
    ("memory",),
    ("comm",),
    ("failure",),
    ("layout",),
    ("offload",),
    ("shard",),
    ("grads",),
    ("schedule",),
    ("state",),
    ("plan",),
    ("scaler", "optimizers", "engine", "__init__"),
]
#: Inside ``frontends/``: what both doors share, the two doors (apart), then what names them.
FRONTENDS_LAYERS = [
    ("cpu_threads", "precision_core"),
    ("shared_setup",),
    ("trainer", "fabric"),
    ("registration", "__init__"),
]
#: Folders whose siblings in one layer tuple may import each other (the engine's loose top modules do).
_OPEN_SIBLINGS = {("scaler", "optimizers", "engine", "__init__"), ("cpu_threads", "precision_core")}
#: Layers that never import Lightning (the engine is usable without it).
LIGHTNING_FREE = ("errors", "config", "engine", "export", "checkpoint", "pretrained")
LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(module: str, path: Path, top_level_only: bool) -> list[str]:
    """Package modules ``module`` imports (``from X import y`` counts X, and X.y when that is a module)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != NAME:
                continue
            found.append(target)
            found += [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == NAME]
    return [t for t in found if t in MODULES]


def _position(module: str) -> tuple:
    """Where ``module`` sits: a tuple of (layer index, layer) pairs, outermost first."""
    parts = module.split(".")[1:] or ["__init__"]
    head = parts[0]
    where = [_layer_of(LAYERS, head, module)]
    inner = {"engine": ENGINE_LAYERS, "frontends": FRONTENDS_LAYERS}.get(head)
    if inner is not None:
        where.append(_layer_of(inner, parts[1] if len(parts) > 1 else "__init__", module))
    return tuple(where)


def _layer_of(layers, name: str, module: str):
    for index, layer in enumerate(layers):
        if name in layer:
            return index, layer, name
    raise AssertionError(f"{module}: `{name}` is in no declared layer of tests/package/test_layout.py; add it to one")


def _upward(source: str, target: str) -> bool:
    for (i, layer, a), (j, _, b) in zip(_position(source), _position(target)):
        if a == b:
            continue  # the same folder: look one level in
        if j > i or (j == i and layer not in _OPEN_SIBLINGS):
            return True
        return False
    return False


def test_imports_only_go_down_the_layers():
    upward = [
        f"{source} imports {target}"
        for source, path in MODULES.items()
        for target in _imports(source, path, top_level_only=False)
        if target != source and not target.startswith(source + ".") and _upward(source, target)
    ]
    assert not upward, "imports that go up a layer (or sideways between sibling folders):\n" + "\n".join(upward)


def test_no_import_circles():
    graph = {m: set(_imports(m, p, top_level_only=True)) - {m} for m, p in MODULES.items()}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            # a package's __init__ importing its own submodules, which import the package: not a circle
            if len(component) > 1 and not _only_package_reexports(component):
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not circles, f"import circles: {circles}"


def _only_package_reexports(component: list[str]) -> bool:
    packages = [m for m in component if MODULES[m].name == "__init__.py"]
    return len(packages) == 1 and all(m.startswith(packages[0]) for m in component)


def test_lower_layers_never_import_lightning():
    offenders = []
    for module, path in MODULES.items():
        parts = module.split(".")
        if len(parts) < 2 or parts[1] not in LIGHTNING_FREE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{module} imports {n}" for n in names if n.split(".")[0] in LIGHTNING_PACKAGES]
    assert not offenders, "\n".join(offenders)


def test_top_level_is_short_and_every_folder_says_what_it_owns_and_imports():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 6, f"modules loose at the top of {NAME}/: {loose} (put them in the folder of their concern)"
    for folder in sorted(p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        init = folder / "__init__.py"
        assert init.exists(), f"{folder.relative_to(PACKAGE.parent)} has no __init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Imports" in doc or "imports" in doc, f"{init.relative_to(PACKAGE.parent)}: its docstring should say what the folder may import"
