"""The README and docs/api.md: the integration examples are the files that are run, and every link resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "docs" / "api.md"]
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))

pytestmark = pytest.mark.skipif(not all(p.exists() for p in DOCS), reason="not run from a checkout")


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_the_readme_shows_every_example_exactly_as_it_is_run() -> None:
    blocks = code_blocks((ROOT / "README.md").read_text())
    assert EXAMPLES, "docs/examples holds no example"
    for example in EXAMPLES:
        assert example.read_text() in blocks, f"README.md does not show {example.name} as it is"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc: Path) -> None:
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text())
    assert links
    for link in links:
        assert (doc.parent / link).exists(), f"{doc.name} links {link}, which does not exist"


def test_the_readme_links_only_files_the_source_distribution_ships() -> None:
    """An index page shows the README without the files beside it: its links name what the sdist holds."""
    shipped = re.search(r"^only-include = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), flags=re.M)
    assert shipped is not None
    roots = set(re.findall(r'"([^"]+)"', shipped.group(1)))
    text = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert link.split("/")[0] in roots, f"README.md links {link}, which the source distribution leaves out"
    assert "on a package index page they may not open" in text


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_prose_lines_stay_readable(doc: Path) -> None:
    """Wrapped prose reads in a terminal and in diffs; tables and code blocks may run longer."""
    in_code = False
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and not line.startswith("|"):
            assert len(line) <= 120, f"{doc.name}:{number} is {len(line)} characters long"


def test_readme_anchors_name_its_own_sections() -> None:
    text = (ROOT / "README.md").read_text()
    sections = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}
    for anchor in re.findall(r"\]\(#([^)]+)\)", text):
        assert anchor in sections, f"README.md links #{anchor}, which is no section"


def test_the_dataloader_recipe_runs_as_written(tmp_path: Path) -> None:
    """The recipe with collate() and prefetch(), pasted into a file and run: real workers, a real DataLoader. The
    README and api.md show the same one."""
    import subprocess
    import sys

    recipes = [
        [b for b in code_blocks(doc.read_text()) if "DataLoader workers re-import this file" in b] for doc in DOCS
    ]
    assert len(recipes[0]) == 1 and recipes[0] == recipes[1]
    script = tmp_path / "recipe.py"
    script.write_text(recipes[0][0] + "    print(type(loss).__name__, loss.dim())\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "Tensor 0"


def test_a_run_of_compiled_tests_and_doctests_ends_without_a_traceback() -> None:
    """dynamo keeps entries in the globals of what it compiled and deletes them when the code dies: doctest clears a
    doctest's globals, and the interpreter's exit a test module's, first. The test set-up (tests/conftest.py) has
    both go in order, so a green run ends green."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    tests = ["tests/test_compile.py::test_fullgraph_move_matches_eager", "docs/api.md"]
    run = subprocess.run([*command, *tests], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:]
    assert "Traceback" not in run.stdout + run.stderr and "Exception ignored" not in run.stdout + run.stderr


def test_one_floor_is_stated_everywhere() -> None:
    """pyproject's lowest torch is the one the README, .ci/floor's usage and the CHANGELOG name."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    found = re.search(r'"torch>=([0-9.]+)"', pyproject)
    assert found is not None
    floor = found.group(1)
    assert f"# {floor}: the oldest release the whole suite has passed on" in pyproject
    assert f"torch {floor} or later" in (ROOT / "README.md").read_text()
    assert f"todevice installs and runs with torch {floor} and later" in (ROOT / "CHANGELOG.md").read_text()
    ci = ROOT / ".ci" / "floor"
    if ci.exists():  # a checkout's; the source distribution leaves .ci/ out
        assert f"(torch>={floor})" in ci.read_text()
