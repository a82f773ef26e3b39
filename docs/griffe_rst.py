"""A griffe extension: packkit's docstrings in the reStructuredText the README reader meets (``::`` blocks,
``>>>`` examples, ``:class:`` roles, ``====`` tables) rendered as Markdown by mkdocstrings.

The docstrings stay as they are (``help()`` and the doctests read them); only what the site shows changes:
a doctest becomes a ``pycon`` block, a literal block after ``::`` and a simple table a plain code block (the
drawn grids keep their columns), a role its name in code.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|const|py:\w+):`~?([^`]+)`")
TABLE_RULE = re.compile(r"^\s*=+(\s+=+)+\s*$")


def indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def fenced(lines: list[str], lang: str) -> list[str]:
    """``lines`` as one fenced block at column 0, dedented to the least indented line."""
    depth = min(indent(x) for x in lines if x.strip())
    return ["", "```" + lang, *(x[depth:] for x in lines), "```", ""]


def to_markdown(text: str) -> str:
    """``text`` (a docstring) with its reStructuredText blocks and roles as Markdown."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>>"):  # a doctest: up to the first blank line
            j = i
            while j < len(lines) and lines[j].strip():
                j += 1
            out += fenced(lines[i:j], "pycon")
            i = j
        elif TABLE_RULE.match(line):  # a simple table: three rules, or two if it has no header
            j, rules = i, 0
            while j < len(lines) and (lines[j].strip() or rules < 3):
                rules += bool(TABLE_RULE.match(lines[j]))
                j += 1
                if rules == 3:
                    break
            out += fenced(lines[i:j], "text")
            i = j
        elif line.rstrip().endswith("::") and not line.strip().startswith(".."):
            body = line.rstrip()[:-2].rstrip()
            out.append(body + ":" if body else "")
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            k = j
            while k < len(lines) and (not lines[k].strip() or indent(lines[k]) > indent(line)) \
                    and not lines[k].lstrip().startswith(">>>"):
                k += 1
            while k > j and not lines[k - 1].strip():
                k -= 1
            if k > j:
                out += fenced(lines[j:k], "text")
            i = k
        else:
            out.append(ROLE.sub(lambda m: "`" + m.group(1).split(".")[-1] + "`"
                                if m.group(0).count("~") else "`" + m.group(1) + "`", line))
            i += 1
    return "\n".join(out)


class RstToMarkdown(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
