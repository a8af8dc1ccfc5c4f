"""The README's layout can be read against the tree: every module of every package is named
there, and every module it names exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["schemafill", "data_gen", "train", "infer", "infer/decoders"]


def layout_section() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Layout")
    end = readme.find("\n## ", start + 1)
    return readme[start: end if end != -1 else None]


def test_every_module_is_in_the_readme_layout_and_every_named_one_exists():
    text = layout_section()
    modules = {p.stem for pkg in PACKAGES for p in (ROOT / pkg).glob("*.py") if p.stem != "__init__"}
    missing = sorted(m for m in modules if not re.search(rf"\b{m}\b", text))
    assert not missing, f"modules the README's layout does not name: {missing}"
    tests = {p.stem for p in (ROOT / "tests").glob("*.py")}  # the section may point at a test
    stale = sorted(m for m in set(re.findall(r"\b([a-z_0-9]+)\.py\b", text)) if m not in modules | tests)
    assert not stale, f"the README's layout names modules that do not exist: {stale}"
