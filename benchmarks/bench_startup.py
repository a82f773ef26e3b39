"""Cold start of the ``packkit`` command: the CPU time of a fresh process, this tree against packkit's own
earlier version (there is no competitor CLI: a user of an older packkit is the baseline).

Commands, each a new interpreter (``python -m packkit.cli ...``, ``PYTHONPATH`` the tree measured):

* ``--help``; ``waste`` (the bundled sample); ``plan --synthetic 2000``; ``plan small.jsonl``;
* ``pack small.jsonl out.arrow``: a 200-row JSON lines file of token ids (5-100 tokens a row, seeded),
  window 128, written fresh each run.

Both trees are copies in a temporary folder: ``--base-rev`` (default ``fd3b24d``) by ``git archive``, this
tree's ``packkit/`` as it is on disk (uncommitted edits included). Each runs under two conditions:

* ``cached``: the trees compiled first (``compileall``), as ``pip install`` leaves a package: what a user meets;
* ``source``: no bytecode and ``PYTHONDONTWRITEBYTECODE=1``, so every start compiles packkit from source, as a
  checkout run with that variable set (this machine's environment) does.

Runs alternate in rounds (before, after; after, before; ...), ``--pairs`` of them per command and condition;
several baselines (``--base-rev fd3b24d,4920e2c``) share the rounds, each round one run of every tree, the order
rotated and reversed round after round. The figure is the child's CPU time (user + system,
``resource.getrusage(RUSAGE_CHILDREN)`` around each run; on a shared machine the wall time is mostly waiting for a
core), and each round gives a ratio after / before against each baseline:
the table shows their median and spread (lowest-highest, and the middle half) with the load average beside.
Python's own modules and numpy's are read from their installed bytecode in both conditions. One extra run
each records which of torch, datasets, pandas, transformers the command imported, and the outputs are
compared (stdout, the packed file's bytes).

    python benchmarks/bench_startup.py                          # ~5 minutes on 2 busy cores
    python benchmarks/bench_startup.py --only waste,plan-synthetic --pairs 25
    python benchmarks/bench_startup.py --base-rev e489664 --conditions cached
    python benchmarks/bench_startup.py --base-rev fd3b24d,4920e2c --pairs 15 --json-out startup.jsonl

Prints a table last, then one JSON line.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from benchlib import emit_json, loadavg, ratio_spread, versions

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "datasets", "pandas", "transformers")
COMMANDS = {  # key -> (label, argv after ``packkit``)
    "help": ("--help", ["--help"]),
    "waste": ("waste (bundled sample)", ["waste"]),
    "plan-synthetic": ("plan --synthetic 2000", ["plan", "--synthetic", "2000"]),
    "plan-file": ("plan small.jsonl", ["plan", "small.jsonl", "--window", "128"]),
    "pack": ("pack small.jsonl out.arrow", ["pack", "small.jsonl", "out.arrow", "--window", "128"]),
}
CONDITIONS = ("cached", "source")
#: Runs the command as ``python -m packkit.cli`` does and says, on exit, which heavy packages it imported.
PROBE = ("import atexit, runpy, sys\n"
         "atexit.register(lambda: sys.stderr.write('HEAVY ' + ' '.join(m for m in %r if m in sys.modules) + '\\n'))\n"
         "sys.argv = ['packkit', *sys.argv[1:]]\n"
         "runpy.run_module('packkit.cli', run_name='__main__', alter_sys=True)\n") % (HEAVY,)


def small_jsonl(path: Path, rows: int = 200, seed: int = 0) -> None:
    """``rows`` JSON lines of ``input_ids`` (5-100 tokens each, ids 1-999), seeded."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for n in rng.integers(5, 101, rows):
            f.write(json.dumps({"input_ids": rng.integers(1, 1000, int(n)).tolist()}) + "\n")


def tree_of(rev: str | None, into: Path, *, compiled: bool) -> Path:
    """``packkit/`` under ``into``: at ``rev`` (``git archive``), or this tree's as on disk (``rev`` None), without
    bytecode; ``compiled``: then compiled, as an installed package is."""
    into.mkdir()
    if rev is None:
        shutil.copytree(ROOT / "packkit", into / "packkit", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    else:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "packkit"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    if compiled:
        assert compileall.compile_dir(into / "packkit", quiet=1, force=True), f"{into}: does not compile"
    return into


def child_env(tree: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}


def timed(tree: Path, argv: list, cwd: Path) -> tuple[float, str]:
    """``(CPU s of the child, stdout)`` of one fresh ``python -m packkit.cli argv`` on ``tree``."""
    out = cwd / "out.arrow"
    if out.exists():
        out.unlink()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "packkit.cli", *argv], cwd=cwd, env=child_env(tree),
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"packkit {' '.join(argv)} on {tree} exited {proc.returncode}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), proc.stdout.decode()


def probe(tree: Path, argv: list, cwd: Path) -> tuple[list, str, bytes | None]:
    """``(heavy packages imported, stdout, the packed file's bytes or None)`` of one run on ``tree``."""
    out = cwd / "out.arrow"
    if out.exists():
        out.unlink()
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=cwd, env=child_env(tree),
                          capture_output=True, text=True)
    heavy = [line[6:].split() for line in proc.stderr.splitlines() if line.startswith("HEAVY ")]
    return (heavy[-1] if heavy else ["?"]), proc.stdout, (out.read_bytes() if out.exists() else None)


def _order(names: list, i: int) -> list:
    """Round ``i``'s order of the trees: rotated by one each round, reversed every other, so that each goes first
    and last in turn: ``(["a", "b", "c"], 1) -> ["a", "c", "b"]``."""
    r = i // 2 % len(names)
    turn = names[r:] + names[:r]
    return turn[::-1] if i % 2 else turn


def _measure(trees: dict, work: dict, names: list, argv: list, c: str, pairs: int) -> tuple[dict, list]:
    """``({tree: [CPU s of each round]}, [load before, load after])`` of ``pairs`` rounds, each tree once a round."""
    cpu = {name: [] for name in names}
    load = [loadavg()]
    for i in range(pairs):
        for name in _order(names, i):
            cpu[name].append(timed(trees[name, c], argv, work[name])[0])
    load.append(loadavg())
    return cpu, load


def _row(label: str, c: str, base: str, cpu: dict, load: list, seen: dict, printed: dict) -> dict:
    same = printed[base] == printed["after"] and seen[base][2] == seen["after"][2]
    return {"command": label, "condition": c, "base_rev": base, "cpu_before_s": statistics.median(cpu[base]),
            "cpu_after_s": statistics.median(cpu["after"]), "ratio": ratio_spread(cpu["after"], cpu[base]), "load": load,
            "heavy_before": seen[base][0], "heavy_after": seen["after"][0], "same_output": same,
            "cpu_runs_before": [round(x, 3) for x in cpu[base]], "cpu_runs_after": [round(x, 3) for x in cpu["after"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-rev", default="fd3b24d", help="the earlier packkit to compare with (default fd3b24d); "
                    "several, comma-separated, are measured in the same rounds")
    ap.add_argument("--pairs", type=int, default=9, help="alternating rounds (one run of each tree) per command and "
                    "condition")
    ap.add_argument("--only", default=",".join(COMMANDS), help=f"commands, comma-separated, of {', '.join(COMMANDS)}")
    ap.add_argument("--conditions", default=",".join(CONDITIONS), help="cached, source or both (default both)")
    ap.add_argument("--json-out", default=None, help="also append the JSON line to this file")
    args = ap.parse_args()
    commands = {k: COMMANDS[k] for k in args.only.split(",")}
    conditions = args.conditions.split(",")
    assert set(conditions) <= set(CONDITIONS), conditions
    bases = args.base_rev.split(",")
    assert "after" not in bases and len(set(bases)) == len(bases), bases
    names = [*bases, "after"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        tmp = Path(tmp)
        trees = {(name, c): tree_of(None if name == "after" else name, tmp / f"{name}-{c}", compiled=c == "cached")
                 for name in names for c in conditions}
        work = {name: tmp / f"run-{name}" for name in names}
        for (name, c), tree in trees.items():
            work[name].mkdir(exist_ok=True)
            small_jsonl(work[name] / "small.jsonl")
            where = subprocess.run([sys.executable, "-c", "import packkit; print(packkit.__file__)"], cwd=work[name],
                                   env=child_env(tree), capture_output=True, text=True)
            assert where.stdout.startswith(str(tree)), f"{name}: packkit from {where.stdout.strip()}"
        for key, (label, argv) in commands.items():
            seen = {name: probe(trees[name, conditions[0]], argv, work[name]) for name in names}
            printed = {name: seen[name][1].replace(str(work[name]), "WORK") for name in names}
            for c in conditions:
                cpu, load = _measure(trees, work, names, argv, c, args.pairs)
                for base in bases:
                    rows.append(_row(label, c, base, cpu, load, seen, printed))
                    print(f"  {label} [{c}]: after/{base} {rows[-1]['ratio']['median']:.3f} (load {load[0]:.1f})",
                          file=sys.stderr, flush=True)
    v = versions("pyarrow", "datasets", "pandas", "transformers")
    print(f"packkit cold start: {', '.join(bases)} (before) against this tree (after); {args.pairs} alternating rounds "
          f"a command and condition; child CPU (user + system), medians; ratio = after / before of each round")
    print(f"python {v['python']}, {v['cpus']} CPUs, numpy {v['numpy']}, torch {v['torch']}, pyarrow {v['pyarrow']}, "
          f"datasets {v['datasets']}, pandas {v['pandas']}")
    print(f"{'command':<28} {'bytecode':<8} {'before':<8} {'CPU before':>10} {'CPU after':>10} {'ratio':>6} "
          f"{'middle half':>11} {'range':>11} {'load':>9}  {'imports before -> after':<30} same output")
    for r in rows:
        imports = f"{','.join(r['heavy_before']) or '-'} -> {','.join(r['heavy_after']) or '-'}"
        q = r["ratio"]
        print(f"{r['command']:<28} {r['condition']:<8} {r['base_rev']:<8} {r['cpu_before_s']:>10.3f} "
              f"{r['cpu_after_s']:>10.3f} {q['median']:>6.3f} {q['q1']:>5.2f}-{q['q3']:<5.2f} "
              f"{q['low']:>5.2f}-{q['high']:<5.2f} {r['load'][0]:>4.1f}-{r['load'][1]:<4.1f}  {imports:<30} "
              f"{'yes' if r['same_output'] else 'NO'}")
    emit_json({"bench": "startup", "base_rev": args.base_rev, "pairs": args.pairs, "versions": v, "rows": rows},
              args.json_out)


if __name__ == "__main__":
    main()
