"""MkDocs hook: a page line ``<!-- README: ## With TRL -->`` is replaced by that section of the README (its
heading line and everything up to the next heading of the same or a higher level).

The README and the site share one text, so a section is edited in one place and the README's tests
(tests/test_readme.py README_BLOCKS) run its code blocks as pasted. A heading the README no longer has stops
the build, naming the page and the heading.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.exceptions import PluginError

README = Path(__file__).resolve().parents[1] / "README.md"
INCLUDE = re.compile(r"^<!-- README: (#+ .+?) -->$", re.M)


def readme_section(heading: str, text: str) -> str:
    """The section of ``text`` under the line ``heading`` (``"## With TRL"``), that line included."""
    level = len(heading) - len(heading.lstrip("#"))
    lines, out, fence = text.splitlines(), None, False
    for line in lines:
        if out is None:
            if line.strip() == heading:
                out = [line]
            continue
        fence ^= line.startswith("```")
        hashes = len(line) - len(line.lstrip("#"))
        if not fence and 0 < hashes <= level and line[hashes:hashes + 1] == " ":
            break
        out.append(line)
    if out is None:
        raise KeyError(heading)
    return "\n".join(out).rstrip() + "\n"


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    text = README.read_text(encoding="utf-8")

    def section(m: re.Match) -> str:
        try:
            return readme_section(m.group(1), text)
        except KeyError:
            raise PluginError(f"{page.file.src_path}: README.md has no heading {m.group(1)!r}; "
                              "fix the page's <!-- README: ... --> line") from None

    return INCLUDE.sub(section, markdown)
