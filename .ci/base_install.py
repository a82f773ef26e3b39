"""CI: `pip install packkit` alone (the wheel, no extras) runs every command or stops in one line naming
the extra to install (exit 4), never a traceback (issue 19).

    .venv/bin/python .ci/base_install.py BASE_BIN     # BASE_BIN: bin/ of a venv holding torch and the wheel only

Run with a Python that has pyarrow (the test venv): it writes the input files; the commands run under BASE_BIN.
Inputs a base install must read: the bundled sample, a .txt (UTF-8 bytes), a .npy of lengths; the README's
command lines (jsonl, parquet, --plot, pack) may instead name their extra.
"""

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HINT = re.compile(r"pip install 'packkit\[\w+\]'")

#: An input that needs pyarrow is named by its format in the error (issue 19): "reading JSON lines ('data.jsonl')".
FORMAT_WORDS = {".jsonl": "JSON lines", ".parquet": "Parquet", ".txt": "text"}

#: Every packkit module imports on a base install, or stops on a module one of packkit's extras installs.
MODULES = r"""
import importlib, importlib.metadata as md, pkgutil, re, packkit
extras = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("-", "_") for r in md.requires("packkit") or []
          if "extra ==" in r}
for m in sorted(x.name for x in pkgutil.walk_packages(packkit.__path__, "packkit.")):
    if m.endswith("__main__"):
        continue
    try:
        importlib.import_module(m)
    except ModuleNotFoundError as exc:
        assert (exc.name or "").split(".")[0] in extras, (m, exc)
        print(f"ok   import {m}: needs {exc.name} (an extra)")
"""


def main(base_bin: str) -> int:
    exe = str(Path(base_bin) / "packkit")
    py = str(Path(base_bin) / "python")
    have = subprocess.run([py, "-c", "import importlib.util as u; print([m for m in ('pyarrow', 'datasets', "
                           "'matplotlib', 'transformers') if u.find_spec(m)])"], capture_output=True, text=True)
    assert have.returncode == 0 and have.stdout.strip() == "[]", f"the base venv holds extras: {have.stdout}"
    work = Path(tempfile.mkdtemp(prefix="packkit-base-"))
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 1000, n).tolist() for n in rng.integers(1, 300, 200)]
    (work / "data.jsonl").write_text("".join(json.dumps({"input_ids": x}) + "\n" for x in ids))
    pq.write_table(pa.table({"input_ids": ids}), work / "data.parquet")
    (work / "data.txt").write_text("\ufeffa line of text\n\nanother, longer line of text\n")
    np.save(work / "lengths.npy", np.array([len(x) for x in ids]))
    must = [["--version"], ["waste"], ["waste", "--json"], ["waste", "data.txt"], ["plan", "data.txt"],
            ["plan", "--synthetic", "100"], ["plan", "lengths.npy", "-b", "4", "-a", "8", "-d", "2", "-w", "2048"],
            ["waste", "lengths.npy"]]
    may = [["waste", "data.jsonl"], ["plan", "data.jsonl"], ["waste", "data.parquet"],
           ["waste", "data.jsonl", "--window", "4096", "--batch-size", "8", "--plot", "waste.png", "--json"],
           ["waste", "--plot", "sample.png"], ["pack", "data.parquet", "packed.parquet", "--window", "4096", "--json"],
           ["pack", "data.jsonl", "packed.jsonl", "-w", "512"], ["pack", "data.txt", "packed.arrow", "-w", "512"]]
    failures = []
    imports = subprocess.run([py, "-c", MODULES], cwd=work, capture_output=True, text=True, timeout=600)
    print(imports.stdout, end="")
    if imports.returncode != 0:
        failures.append((["import every module"], imports.returncode, imports.stderr[-2000:], []))
    for argv, required in [(a, True) for a in must] + [(a, False) for a in may]:
        proc = subprocess.run([exe, *argv], cwd=work, capture_output=True, text=True, timeout=600)
        err = proc.stderr.strip()
        ok = proc.returncode == 0 or (not required and proc.returncode == 4 and "\n" not in err
                                      and HINT.search(err) is not None)
        ok = ok and "Traceback" not in proc.stderr
        word = FORMAT_WORDS.get(Path(argv[1]).suffix) if len(argv) > 1 else None
        if proc.returncode == 4 and "pyarrow" in err and word is not None:
            ok = ok and f"reading {word} ('{argv[1]}')" in err
        left = [p.name for p in work.iterdir() if ".packkit-tmp-" in p.name]
        print(f"{'ok  ' if ok and not left else 'FAIL'} exit {proc.returncode}  packkit {' '.join(argv)}"
              + (f"   -> {err}" if proc.returncode else ""))
        if not ok or left:
            failures.append((argv, proc.returncode, proc.stderr[-2000:], left))
    for f in failures:
        print("failed:", f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
