"""The architecture, read off the imports: no module imports itself through others (no
circle), every arrow between rooms points down (decoders → slots → proposers → pricing →
spec → the ``schemafill`` core), stage packages import the core and never each other's
internals, and pure modules import only torch and the standard library."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schemafill", "data_gen", "train", "infer", "benchmarks")

# the rooms of infer/, lowest first: a module may import its own room and the ones below it
ROOMS = ["infer.spec", "infer.pricing", "infer.proposers", "infer.slots", "infer.decoders"]
TOP = {"infer.eval", "infer.serving", "infer.vllm"}  # above every room, and apart: none imports another
ENTRIES = {"infer.run", "infer.serve", "train.run"}  # entry scripts: may import what they run
PURE = {"infer.spec.tree", "infer.spec.verify", "infer.spec.commit", "infer.spec.sampling", "infer.spec.arena",
        "infer.spec.candidates", "infer.spec.share", "infer.pricing.selection", "infer.pricing.acceptance",
        "infer.proposers.lookup",
        "schemafill.losses"}


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


def test_pure_modules_import_only_torch_and_the_standard_library(graph):
    allowed_ext = {"ext:torch", "ext:__future__"} | {f"ext:{m}" for m in sys.stdlib_module_names}
    impure = {m: sorted(d for d in graph[m] if d not in PURE and d not in allowed_ext) for m in PURE}
    assert all(m in graph for m in PURE), f"pure modules that do not exist: {sorted(PURE - set(graph))}"
    assert not any(impure.values()), {m: d for m, d in impure.items() if d}


def test_the_checks_see_a_back_arrow_and_a_circle():
    """The tests above can fail: a room that imports up, and two modules importing each other."""
    fake = {"infer.spec.session": {"infer.decoders.method"}, "infer.decoders.method": {"infer.spec.session"}}
    assert room("infer.spec.session") == "infer.spec" and room("infer.decoders.method") == "infer.decoders"
    with pytest.raises(AssertionError, match="infer.spec.session -> infer.decoders.method"):
        test_arrows_between_rooms_point_down(fake)
    with pytest.raises(AssertionError, match="circle"):
        test_no_module_imports_itself_through_others(fake)
