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
    bad = [
        (src, dst, n)
        for src, dst, n in _imports(_modules())
        if n and n.startswith("_") and not n.startswith("__") and dst != src
    ]
    assert bad == []


# The import layers, lowest first: a module imports only from its own layer or below (function-
# level imports count). The schedules package is data over the job types (jobs.py): the plan's
# validation reads its registry, and nothing in it reads a replay, a runtime or an estimate.
LAYERS = (
    ("errors", "version", "units"),
    (
        "ir",
        "jobs",
        "model",
        "presets",
        "features",
        "lora",
        "torch_tp",
        "allocator",
        "outside_allocator",
        "frameworks",
    ),
    ("liveness", "schedules"),
    ("plan",),
    ("templates", "traced", "paddle", "pipeline_estimator", "examples"),
    ("configs", "stages"),
    ("replay", "runtime", "sources"),
    ("alloc_stream", "reserved"),
    ("estimate", "report", "pipemem"),  # pipemem: the package's public API (__init__.py)
    ("planner", "validation"),
    ("cli", "__main__"),
)


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else module
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module}: add its package to LAYERS in tests/test_structure.py")


def test_imports_only_run_down_the_layers():
    up = sorted({(src, dst) for src, dst, _ in _imports(_modules()) if _layer(dst) > _layer(src)})
    assert up == []


def test_schedules_import_nothing_above_the_jobs():
    """The schedules package (generators, the registry, the zero-bubble search) stands on errors
    and jobs alone: no replay, runtime, plan or estimate."""
    bad = sorted(
        {
            dst
            for src, dst, _ in _imports(_modules())
            if src.startswith("pipemem.schedules")
            and not dst.startswith("pipemem.schedules")
            and dst not in ("pipemem.errors", "pipemem.jobs")
        }
    )
    assert bad == []
