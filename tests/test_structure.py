"""The package reads as DESIGN.md's flow: no import cycles between pipemem's modules (function-
level imports count), and no module imports another pipemem module's private names."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pipemem"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("pipemem",) + path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(mods):
    """module -> [(imported pipemem module, names)] for every `import` / `from ... import`."""
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                for a in node.names:
                    target = f"{mod}.{a.name}"
                    if target in mods:
                        yield name, target, None
                    elif mod in mods:
                        yield name, mod, a.name
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods:
                        yield name, a.name, None


def test_no_import_cycles():
    mods = _modules()
    graph = {m: set() for m in mods}
    for src, dst, _ in _imports(mods):
        if dst != src:
            graph[src].add(dst)
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_no_private_names_across_modules():
    bad = [(src, dst, n) for src, dst, n in _imports(_modules())
           if n and n.startswith("_") and not n.startswith("__") and dst != src]
    assert bad == []
