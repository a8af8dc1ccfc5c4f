"""The architecture, read off the imports: no module imports itself through others (no
circle), every arrow between rooms points down (decoders → slots → proposers → pricing →
rounds → the ``schemafill`` core; inside the core, runtime → config → contract → plumbing),
stage packages import the core and never each other's internals, the model and its storage
never reach a backend, and pure modules import only torch and the standard library."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schemafill", "data_gen", "train", "infer", "benchmarks")

# the rooms of infer/, lowest first: a module may import its own room and the ones below it
ROOMS = ["infer.rounds", "infer.pricing", "infer.proposers", "infer.slots", "infer.decoders"]
TOP = {"infer.eval", "infer.serving", "infer.vllm"}  # above every room, and apart: none imports another
ENTRIES = {"infer.run", "infer.serve", "train.run"}  # entry scripts: may import what they run
PURE = {"infer.rounds.tree", "infer.rounds.verify", "infer.rounds.commit", "infer.rounds.sampling",
        "infer.rounds.arena", "infer.rounds.candidates", "infer.rounds.share", "infer.pricing.selection",
        "infer.pricing.acceptance", "infer.proposers.lookup", "schemafill.runtime.layers", "schemafill.contract.schemas",
        "train.losses"}
# the core's rooms, lowest first: a module may import its own room and the ones below it
CORE = ["schemafill.atomic", "schemafill.fingerprint", "schemafill.contract", "schemafill.config",
        "schemafill.tracking", "schemafill.runtime"]
BACKENDS = "schemafill.runtime.backends"
FALLBACK = "schemafill.runtime.backends.eager"  # what the other backends run the calls they do not cover on
# what a backend runs: none of them may reach a backend, even through another module
BENEATH_BACKENDS = ["schemafill.runtime.model", "schemafill.runtime.storage", "schemafill.runtime.calls",
                    "schemafill.runtime.layers", "schemafill.runtime.drafter", "schemafill.runtime.products",
                    "schemafill.runtime.kernels.batch_invariant", "schemafill.runtime.probing"]


def project_modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports, anywhere in it (function bodies too), and the
    names of the outside packages it imports (prefixed ``ext:``)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            top = t.split(".")[0]
            if top in PACKAGES:
                while t not in modules and "." in t:
                    t = t.rpartition(".")[0]
                out.add(t)
            else:
                out.add(f"ext:{top}")
    out.discard(name)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def room(module: str) -> str | None:
    return next((r for r in ROOMS + sorted(TOP) if module == r or module.startswith(r + ".")), None)


def test_no_module_imports_itself_through_others(graph):
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"modules that import each other in a circle: {circles}"


def test_arrows_between_rooms_point_down(graph):
    back = []
    for module, deps in graph.items():
        mine = room(module)
        for dep in deps:
            theirs = room(dep)
            if dep in ENTRIES and module not in ENTRIES:  # an entry script is a command line, not a library
                back.append(f"{module} -> {dep}")
            if dep.startswith("ext:") or theirs is None or theirs == mine or module in ENTRIES:
                continue
            if mine is None:  # outside the rooms: infer's package itself may not reach in; other stages may
                if module.split(".")[0] == "infer":
                    back.append(f"{module} -> {dep}")
            elif mine in TOP:
                if theirs in TOP:
                    back.append(f"{module} -> {dep} ({mine} and {theirs} stay apart)")
            elif theirs in TOP or ROOMS.index(theirs) > ROOMS.index(mine):
                back.append(f"{module} -> {dep}")
    assert not back, "imports against the direction of the rooms:\n" + "\n".join(sorted(back))


def test_stage_packages_import_the_core_not_each_other(graph):
    wrong = []
    for module, deps in graph.items():
        pkg = module.split(".")[0]
        for dep in deps:
            other = dep.split(".")[0]
            if dep.startswith("ext:") or other == pkg or module in ENTRIES:
                continue
            if other == "benchmarks" or (pkg == "schemafill") or (other != "schemafill" and pkg != "benchmarks"):
                wrong.append(f"{module} -> {dep}")
    assert not wrong, "stage packages reaching into each other (or the core into a stage):\n" + "\n".join(wrong)


def core_room(module: str) -> int | None:
    return next((i for i, r in enumerate(CORE) if module == r or module.startswith(r + ".")), None)


def test_the_cores_rooms_point_down(graph):
    back = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
            if core_room(m) is not None and core_room(d) is not None and core_room(d) > core_room(m)]
    assert not back, "imports against the direction of the core's rooms:\n" + "\n".join(sorted(back))


def reached(graph: dict[str, set[str]], module: str) -> set[str]:
    """Every project module ``module`` imports, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep in graph and dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_model_and_its_storage_never_reach_a_backend(graph):
    wrong = {m: sorted(d for d in reached(graph, m) if d.startswith(BACKENDS)) for m in BENEATH_BACKENDS}
    assert all(m in graph for m in BENEATH_BACKENDS), sorted(set(BENEATH_BACKENDS) - set(graph))
    assert not any(wrong.values()), {m: d for m, d in wrong.items() if d}


def test_a_backend_imports_no_other_but_the_eager_fallback(graph):
    backends = [m for m in graph if m.startswith(BACKENDS + ".")]
    assert FALLBACK in backends and len(backends) >= 3
    wrong = [f"{m} -> {d}" for m in backends for d in graph[m] if d.startswith(BACKENDS + ".") and d != FALLBACK]
    assert not wrong, "backends reading each other:\n" + "\n".join(wrong)


def test_pure_modules_import_only_torch_and_the_standard_library(graph):
    allowed_ext = {"ext:torch", "ext:__future__"} | {f"ext:{m}" for m in sys.stdlib_module_names}
    impure = {m: sorted(d for d in graph[m] if d not in PURE and d not in allowed_ext) for m in PURE}
    assert all(m in graph for m in PURE), f"pure modules that do not exist: {sorted(PURE - set(graph))}"
    assert not any(impure.values()), {m: d for m, d in impure.items() if d}


def test_the_checks_see_a_back_arrow_and_a_circle():
    """The tests above can fail: a room that imports up, and two modules importing each other."""
    fake = {"infer.rounds.session": {"infer.decoders.method"}, "infer.decoders.method": {"infer.rounds.session"}}
    assert room("infer.rounds.session") == "infer.rounds" and room("infer.decoders.method") == "infer.decoders"
    with pytest.raises(AssertionError, match="infer.rounds.session -> infer.decoders.method"):
        test_arrows_between_rooms_point_down(fake)
    with pytest.raises(AssertionError, match="circle"):
        test_no_module_imports_itself_through_others(fake)
