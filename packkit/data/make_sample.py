"""Make ``sample_lengths.npy``: real example lengths from CPython's own bundled documentation.

Run ``python -m packkit.data.make_sample`` (writes next to this file; ``--out PATH`` elsewhere).
The text is Python's documentation (PSF license), which ships with every CPython: nothing is
downloaded, and only the lengths are kept. Two sources, each turned into instruction-like examples
``"Explain NAME.\\n\\n" + TEXT``:

1. every section of ``pydoc_data.topics`` (the help topics of ``help("if")`` etc.), cut at its
   reStructuredText headings, NAME being the section heading;
2. the docstring (``inspect.getdoc``) of every public function, class and method defined in a
   public standard-library module that imports cleanly, NAME being its dotted name.

Each example's length is its UTF-8 byte count (the byte-level tokenizer of ``packkit.datafiles``).
Examples are stored in a seeded random order (seed 0), as int32.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import re
import sys
import warnings
from pathlib import Path

import numpy as np

# Modules with side effects on import (a browser, a window, printing) or that are not documentation.
SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "__main__"}
HEADING = re.compile(r"([=\-*~^\"'])\1{2,}")


def topic_sections(topics: dict[str, str]) -> list[tuple[str, str]]:
    """(heading, body) of every section of every help topic, in sorted topic order."""
    out = []
    for key in sorted(topics):
        lines = topics[key].split("\n")
        title, body, i = key, [], 0
        while i < len(lines):
            underline = lines[i + 1].strip() if i + 1 < len(lines) else ""
            if lines[i].strip() and HEADING.fullmatch(underline) and len(underline) >= len(lines[i].strip()) - 1:
                if "".join(body).strip():
                    out.append((title, "\n".join(body).strip()))
                title, body, i = lines[i].strip(), [], i + 2
                continue
            body.append(lines[i])
            i += 1
        if "".join(body).strip():
            out.append((title, "\n".join(body).strip()))
    return out


def stdlib_docstrings() -> list[tuple[str, str]]:
    """(dotted name, docstring) of the public API of the importable public stdlib modules."""
    out = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP:
            continue
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                warnings.simplefilter("ignore")
                mod = importlib.import_module(name)
        except Exception:  # a module this build lacks (e.g. no Tk): it is simply not in the sample
            continue
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc:
                out.append((f"{name}.{attr}", doc))
            if inspect.isclass(obj):
                for meth_name, meth in sorted(vars(obj).items()):
                    if meth_name.startswith("_") or not callable(meth):
                        continue
                    doc = inspect.getdoc(meth)
                    if doc:
                        out.append((f"{name}.{attr}.{meth_name}", doc))
    return out


def example_lengths(pairs: list[tuple[str, str]]) -> np.ndarray:
    """UTF-8 byte length of ``"Explain NAME.\\n\\nTEXT"`` for each pair: ``[("x", "ab")] -> [14]``."""
    return np.array([len(f"Explain {name}.\n\n{text}".encode()) for name, text in pairs], np.int64)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("sample_lengths.npy")))
    args = parser.parse_args(argv)
    import pydoc_data.topics

    pairs = topic_sections(pydoc_data.topics.topics) + stdlib_docstrings()
    lengths = example_lengths(pairs)
    lengths = lengths[np.random.default_rng(0).permutation(lengths.size)].astype(np.int32)
    np.save(args.out, lengths)
    q = np.percentile(lengths, [50, 90, 99]).astype(int).tolist()
    print(f"{args.out}: {lengths.size} examples from Python {sys.version.split()[0]}, "
          f"{int(lengths.sum()):,} bytes; median/p90/p99 {q}, max {int(lengths.max())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
