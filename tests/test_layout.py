"""The layout in docs/design.md can be read against the tree: every module of every package is
named there, and every module it names exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["schemafill", "data_gen", "train", "infer", "benchmarks"]


def layout_section() -> str:
    design = (ROOT / "docs" / "design.md").read_text()
    start = design.index("## Layout")
    end = design.find("\n## ", start + 1)
    return design[start: end if end != -1 else None]


def test_every_module_is_in_the_design_layout_and_every_named_one_exists():
    text = layout_section()
    modules = {p.stem for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if p.stem != "__init__"}
    missing = sorted(m for m in modules if not re.search(rf"\b{m}\b", text))
    assert not missing, f"modules the layout in docs/design.md does not name: {missing}"
    tests = {p.stem for p in (ROOT / "tests").rglob("*.py")}  # the section may point at a test
    stale = sorted(m for m in set(re.findall(r"\b([a-z_0-9]+)\.py\b", text)) if m not in modules | tests)
    assert not stale, f"the layout in docs/design.md names modules that do not exist: {stale}"
