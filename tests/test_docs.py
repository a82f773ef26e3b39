"""The documentation site (issue 33): ``mkdocs build --strict`` (warnings are errors: a broken link, a
docstring reference mkdocstrings cannot resolve, a page missing from the nav) into a temporary folder, never
into the repository; and the docstring conversion the API reference relies on (docs/griffe_rst.py)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def griffe_rst():
    pytest.importorskip("griffe")
    spec = importlib.util.spec_from_file_location("griffe_rst", ROOT / "docs" / "griffe_rst.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # about 15 s: mkdocstrings imports every documented module's source through griffe
def test_the_site_builds_with_no_warning(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    cmd = [mkdocs] if mkdocs else [sys.executable, "-m", "mkdocs"]
    site = tmp_path / "site"
    proc = subprocess.run([*cmd, "build", "--strict", "--site-dir", str(site)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={"NO_MKDOCS_2_WARNING": "1", **__import__("os").environ})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-4000:]
    api = (site / "api" / "index.html").read_text()
    assert "PaddingFreeCollator" in api and "&gt;&gt;&gt;" in api  # the docstrings, their doctests as code
    assert "<blockquote>" not in api  # a doctest read as Markdown quotes (>>>) was three nested quotes
    trl = (site / "trl" / "index.html").read_text()  # a way-in page: the README's sections, code and all
    assert "With Trainer" in trl and "PackedRowsCollator" in trl and "remove_unused_columns" in trl
    assert not (ROOT / "site").exists()


def test_docstring_blocks_become_markdown_code():
    """A doctest, a literal block after ``::`` and a simple table are fenced; a role is its name in code.
    Read as Markdown, the doctest was a quote three deep and the grids lost their columns."""
    to_markdown = griffe_rst().to_markdown
    text = ("Lengths in, a plan out::\n\n    cu_seqlens = [0, 2, 6]\n\n"
            ">>> pack([3, 4], window=8).bins\n[[0, 1]]\n\n"
            "======  ======\nname    what\n======  ======\n``a``   one\n======  ======\n\n"
            "See :class:`~packkit.batch.PackedBatch` and :func:`packkit.binpack.pack`.")
    out = [line for line in to_markdown(text).splitlines() if line]  # blank lines around a fence are free
    assert out == ["Lengths in, a plan out:", "```text", "cu_seqlens = [0, 2, 6]", "```",
                   "```pycon", ">>> pack([3, 4], window=8).bins", "[[0, 1]]", "```",
                   "```text", "======  ======", "name    what", "======  ======", "``a``   one", "======  ======", "```",
                   "See `PackedBatch` and `packkit.binpack.pack`."]


def docs_hooks():
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_page_includes_the_readme_section_up_to_the_next_heading_of_its_level():
    """A page's ``<!-- README: ## H -->`` line is the README's section H: its own subsections and code blocks
    (a ``#`` comment inside a fence is no heading) up to the next heading of H's level or above."""
    hooks = docs_hooks()
    text = "# t\n## A\na\n```python\n# not a heading\n```\n### A.1\nb\n## B\nc\n"
    assert hooks.readme_section("## A", text) == "## A\na\n```python\n# not a heading\n```\n### A.1\nb\n"
    assert hooks.readme_section("### A.1", text) == "### A.1\nb\n"
    readme = (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        for heading in hooks.INCLUDE.findall(page.read_text()):  # every page's includes resolve today
            assert hooks.readme_section(heading, readme).startswith(heading + "\n"), (page.name, heading)


def test_a_heading_the_readme_no_longer_has_stops_the_build():
    from mkdocs.exceptions import PluginError

    page = type("Page", (), {"file": type("File", (), {"src_path": "trl.md"})()})()
    with pytest.raises(PluginError, match=r"trl.md: README.md has no heading '## Gone'"):
        docs_hooks().on_page_markdown("<!-- README: ## Gone -->\n", page)
