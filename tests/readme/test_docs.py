"""The documentation stays true to the tree: links resolve, the option reference is
complete, and the README's layout names every module and no module that is gone.

No Spark, no sockets: these read files (and import ``zio_spark.options``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zio_spark.options import SINK_OPTIONS, SOURCE_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
REFERENCE = ROOT / "docs" / "reference.md"
PACKAGE = ROOT / "zio_spark"

# Every Markdown page a reader reaches from the README.
PAGES = sorted(
    {README, ROOT / "bench" / "README.md", ROOT / "tests" / "README.md"}
    | {ROOT / "notebooks" / "README.md", ROOT / "scripts" / "README.md"}
    | set((ROOT / "docs").glob("*.md"))
)

LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.MULTILINE)
CODE_BLOCK = re.compile(r"^```.*?^```$", re.MULTILINE | re.DOTALL)

# Backticked words in the layout table that are not modules of their folder.
NOT_MODULES = {"spark_batch"}


def slug(heading: str) -> str:
    """The anchor GitHub makes of a heading: lower case, punctuation gone, spaces to -."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = CODE_BLOCK.sub("", page.read_text(encoding="utf-8"))
    return {slug(h) for h in HEADING.findall(text)}


def links(page: Path) -> list[str]:
    text = CODE_BLOCK.sub("", page.read_text(encoding="utf-8"))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_slug_matches_githubs_rule() -> None:
    assert slug("Install (not on PyPI)") == "install-not-on-pypi"
    assert slug("Sockets: CLIENT/SERVER or ROUTER/DEALER") == "sockets-clientserver-or-routerdealer"
    assert slug("The demo (`zio-spark demo`)") == "the-demo-zio-spark-demo"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert page.is_file(), f"{page} is missing"
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


@pytest.mark.parametrize(("what", "options"), [("source", SOURCE_OPTIONS), ("sink", SINK_OPTIONS)])
def test_reference_names_every_option(what: str, options: dict[str, object]) -> None:
    text = REFERENCE.read_text(encoding="utf-8")
    missing = sorted(k for k in options if f"`{k}`" not in text)
    assert not missing, f"docs/reference.md does not name these {what} options: {missing}"


def layout_rows() -> dict[str, str]:
    """``folder`` -> the text of its row in the README's layout table."""
    text = README.read_text(encoding="utf-8")
    at = text.index("### Layout")
    rows = {}
    for line in text[at:].splitlines()[1:]:
        if line.startswith("### ") or line.startswith("## "):
            break
        m = re.match(r"^\| `(\w+)/` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def test_layout_table_has_every_package_folder() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert set(layout_rows()) == folders


@pytest.mark.parametrize("folder", sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py")))
def test_layout_row_names_its_modules_and_no_other(folder: str) -> None:
    row = layout_rows().get(folder, "")
    modules = {p.stem for p in (PACKAGE / folder).glob("*.py")} - {"__init__", "__main__"}
    named = set(re.findall(r"`([a-z_][a-z0-9_]*)`", row)) - NOT_MODULES
    assert not modules - named, f"README layout, {folder}/: modules not named: {modules - named}"
    assert not named - modules, f"README layout, {folder}/: names no module: {named - modules}"


@pytest.mark.parametrize("page", [README, ROOT / "tests" / "README.md"], ids=["README", "tests"])
def test_paths_named_exist(page: Path) -> None:
    """Every backticked path in the README and the test map (``source/receiver.py``,
    ``tests/unit``) exists, under the project, under ``zio_spark/`` or beside the page."""
    text = page.read_text(encoding="utf-8")
    paths = set(re.findall(r"`((?:[\w.-]+/)+[\w.-]*)`", text))
    bases = (ROOT, PACKAGE, page.parent)
    gone = sorted(p for p in paths if "<" not in p and not any((b / p).exists() for b in bases))
    assert not gone, f"{page.relative_to(ROOT)} names paths that do not exist: {gone}"


def test_tests_readme_maps_every_loopback_file() -> None:
    """tests/README.md says which module each tests/loopback/test_*.py covers, for every
    file there and no file that is gone."""
    text = (ROOT / "tests" / "README.md").read_text(encoding="utf-8")
    at = text.index("## Which module each loopback file covers")
    end = text.find("\n## ", at + 1)
    mapped = set(re.findall(r"^\| `(test_\w+\.py)` \|", text[at:end], re.MULTILINE))
    files = {p.name for p in (ROOT / "tests" / "loopback").glob("test_*.py")}
    assert not files - mapped, f"tests/README.md does not map: {sorted(files - mapped)}"
    assert not mapped - files, f"tests/README.md maps files that are gone: {sorted(mapped - files)}"
