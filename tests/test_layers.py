"""The package's layers hold: no import cycles, and no module imports from a layer above its own.

Every `import` counts, wherever it is written (module level, inside a function, under `if TYPE_CHECKING:`).
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hopperlm"

# Layers, lowest first; a module may import from lower layers, or from its own layer without a cycle. In layer
# 2 the order is hardware/selftest < model < data (data may import model and hardware; model may import
# hardware; not the reverse), written as 2.0 < 2.1 < 2.2. The longest matching prefix decides; "hopperlm" is
# the package's __init__ alone.
LAYERS = {
    "hopperlm": 0,
    "hopperlm.errors": 0,
    "hopperlm.diskspace": 0,  # room on disk and one line when a write fails: every writer asks here
    "hopperlm.provenance": 0,
    "hopperlm.files": 0,
    "hopperlm.folder_lock": 0,  # one writer per folder: run folders, exports, prepare's shards
    "hopperlm.config": 1,  # typed sections and presets: what a run is
    "hopperlm.schedule": 1,  # the LR of a step of that config
    "hopperlm.hardware": 2.0,  # the parts: what the device can do, the network, tokens
    "hopperlm.selftest": 2.0,
    "hopperlm.cpu_allocator": 2.0,  # the C library's malloc on a CPU run: the plan decides, this switches
    "hopperlm.model": 2.1,
    "hopperlm.data": 2.2,
    "hopperlm.plan": 4,  # how this run will use this machine
    "hopperlm.memory": 4,
    "hopperlm.parallel": 4.1,  # carries out the plan's data parallelism (plan/strategy.py chooses it)
    "hopperlm.speed": 4.1,  # carries out the plan's speed-ups (plan/float8_payoff.py says which layers pay)
    "hopperlm.checkpoint": 4.2,  # a run's checkpoints, one owner: when, which format, room, resume (all ranks)
    "hopperlm.interop": 4.3,  # model folders in and out of other tools (HF, PEFT, GGUF), loading weights
    "hopperlm.observe": 4.5,  # watching a run: what training reports to, so below it
    "hopperlm.train": 5,  # running it, judging it
    "hopperlm.eval": 5,
    "hopperlm.bench": 5,
    "hopperlm.bench_rows": 5,  # the rows `hopperlm bench` times (bench.py runs them)
    "hopperlm.cli": 6,  # one verb per job
    "hopperlm.__main__": 6,
}


def module_files() -> dict[str, Path]:
    """Module name -> file, for every .py under hopperlm/ (a package is its __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported(name: str, path: Path, modules: set[str]) -> set[str]:
    """The hopperlm modules `name` imports, anywhere in its file: `import P.m` and `from P.m import x` import
    P.m (P.m's __init__ when it is a package), and P.m.x too when that is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(targets)
    return {m for m in found if m in modules and m != name}


def layer_of(name: str) -> float:
    prefixes = [p for p in LAYERS if name == p or (p != "hopperlm" and name.startswith(p + "."))]
    assert prefixes, f"{name} is in no layer; add it to LAYERS in tests/test_layers.py"
    return LAYERS[max(prefixes, key=len)]


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported(name, path, set(files)) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    for name in module_files():
        layer_of(name)


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    lines = []
    for component in found:
        inside = set(component)
        edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & inside)]
        lines.append(f"{len(component)} modules import each other: " + "; ".join(edges))
    assert not found, "import cycles among hopperlm modules:\n  " + "\n  ".join(lines)


def test_no_import_from_a_higher_layer():
    upward = [
        f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})"
        for name, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(name)
    ]
    assert not upward, (
        "imports against the layering (each layer imports only from those below it):\n  "
        + "\n  ".join(upward)
    )


def test_no_two_packages_import_each_other():
    """Within a layer, packages may import each other's modules without a cycle among the modules; the
    packages still read as one tangle. Each pair of packages is one-way."""
    package = {name: ".".join(name.split(".")[:2]) for name in module_files()}
    edges: dict[tuple[str, str], list[str]] = {}
    for name, targets in import_graph().items():
        for target in targets:
            if package[name] != package[target]:
                edges.setdefault((package[name], package[target]), []).append(f"{name} -> {target}")
    both = [
        f"{a} <-> {b}: " + "; ".join(sorted(edges[a, b]) + sorted(edges[b, a]))
        for a, b in sorted(edges)
        if a < b and (b, a) in edges
    ]
    assert not both, "packages that import each other:\n  " + "\n  ".join(both)
