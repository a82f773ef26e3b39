"""benchmarks/bench_loader.py in CI: a quick run prints its table and one JSON line, every provider's
epoch counted the dataset's tokens, and the columnar path's first batch equals transformers'
DataCollatorWithFlattening (the script asserts both before any timing)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # a benchmark's smoke run in a subprocess: make test runs it, make test-fast does not

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_loader.py")


def test_quick_run_prints_every_provider():
    run = subprocess.run([sys.executable, BENCH, "--quick", "--workers", "0", "2"], capture_output=True,
                         text=True, timeout=900, cwd=os.path.dirname(BENCH))
    assert run.returncode == 0, run.stderr[-2000:]
    line = json.loads(run.stdout.strip().splitlines()[-1])
    got = {(r["workers"], r["provider"]) for r in line["results"]}
    want = {(w, p) for w in (0, 2) for p in ("hf_flatten", "pf_rows", "pf_numpy", "pf_columnar")} | {(2, "floor")}
    assert got == want
    assert all(r["tokens"] == line["tokens"] > 0 and r["seconds"] > 0 for r in line["results"])
    assert set(line["targets"]) == {"columnar_workers0", "columnar_workers2"}
