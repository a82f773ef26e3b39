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

Runs alternate in pairs (before, after; after, before; ...), ``--pairs`` of them per command and condition;
the figure is the child's CPU time (user + system, ``resource.getrusage(RUSAGE_CHILDREN)`` around each run;
on a shared machine the wall time is mostly waiting for a core), and each pair gives a ratio after / before:
the table shows their median and spread (lowest-highest, and the middle half) with the load average beside.
Python's own modules and numpy's are read from their installed bytecode in both conditions. One extra run
each records which of torch, datasets, pandas, transformers the command imported, and the outputs are
compared (stdout, the packed file's bytes).

    python benchmarks/bench_startup.py                          # ~5 minutes on 2 busy cores
    python benchmarks/bench_startup.py --only waste,plan-synthetic --pairs 25
    python benchmarks/bench_startup.py --base-rev e489664 --conditions cached

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
from benchlib import emit_json, loadavg, versions

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


def spread(ratios: list) -> dict:
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios), "q1": q[0], "q3": q[2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-rev", default="fd3b24d", help="the earlier packkit to compare with (default fd3b24d)")
    ap.add_argument("--pairs", type=int, default=9, help="alternating pairs of runs per command and condition")
    ap.add_argument("--only", default=",".join(COMMANDS), help=f"commands, comma-separated, of {', '.join(COMMANDS)}")
    ap.add_argument("--conditions", default=",".join(CONDITIONS), help="cached, source or both (default both)")
    ap.add_argument("--json-out", default=None, help="also append the JSON line to this file")
    args = ap.parse_args()
    commands = {k: COMMANDS[k] for k in args.only.split(",")}
    conditions = args.conditions.split(",")
    assert set(conditions) <= set(CONDITIONS), conditions
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        tmp = Path(tmp)
        trees = {(name, c): tree_of(args.base_rev if name == "before" else None, tmp / f"{name}-{c}",
                                    compiled=c == "cached") for name in ("before", "after") for c in conditions}
        work = {name: tmp / f"run-{name}" for name in ("before", "after")}
        for (name, c), tree in trees.items():
            work[name].mkdir(exist_ok=True)
            small_jsonl(work[name] / "small.jsonl")
            where = subprocess.run([sys.executable, "-c", "import packkit; print(packkit.__file__)"], cwd=work[name],
                                   env=child_env(tree), capture_output=True, text=True)
            assert where.stdout.startswith(str(tree)), f"{name}: packkit from {where.stdout.strip()}"
        for key, (label, argv) in commands.items():
            c0 = conditions[0]
            seen = {name: probe(trees[name, c0], argv, work[name]) for name in work}
            printed = {name: seen[name][1].replace(str(work[name]), "WORK") for name in work}
            same = printed["before"] == printed["after"] and seen["before"][2] == seen["after"][2]
            for c in conditions:
                cpu = {"before": [], "after": []}
                load = [loadavg()]
                for i in range(args.pairs):
                    for name in (("before", "after") if i % 2 == 0 else ("after", "before")):
                        cpu[name].append(timed(trees[name, c], argv, work[name])[0])
                load.append(loadavg())
                ratios = [a / b for a, b in zip(cpu["after"], cpu["before"])]
                rows.append({"command": label, "condition": c, "cpu_before_s": statistics.median(cpu["before"]),
                             "cpu_after_s": statistics.median(cpu["after"]), "ratio": spread(ratios),
                             "load": load, "heavy_before": seen["before"][0], "heavy_after": seen["after"][0],
                             "same_output": same, "cpu_runs_before": [round(x, 3) for x in cpu["before"]],
                             "cpu_runs_after": [round(x, 3) for x in cpu["after"]]})
                print(f"  {label} [{c}]: after/before {rows[-1]['ratio']['median']:.3f} (load {load[0]:.1f})",
                      file=sys.stderr, flush=True)
    v = versions("pyarrow", "datasets", "pandas", "transformers")
    print(f"packkit cold start: {args.base_rev} (before) against this tree (after); {args.pairs} alternating pairs a "
          f"command and condition; child CPU (user + system), medians; ratio = after / before of each pair")
    print(f"python {v['python']}, {v['cpus']} CPUs, numpy {v['numpy']}, torch {v['torch']}, pyarrow {v['pyarrow']}, "
          f"datasets {v['datasets']}, pandas {v['pandas']}")
    print(f"{'command':<28} {'bytecode':<8} {'CPU before':>10} {'CPU after':>10} {'ratio':>6} {'middle half':>11} "
          f"{'range':>11} {'load':>9}  {'imports before -> after':<30} same output")
    for r in rows:
        imports = f"{','.join(r['heavy_before']) or '-'} -> {','.join(r['heavy_after']) or '-'}"
        q = r["ratio"]
        print(f"{r['command']:<28} {r['condition']:<8} {r['cpu_before_s']:>10.3f} {r['cpu_after_s']:>10.3f} "
              f"{q['median']:>6.3f} {q['q1']:>5.2f}-{q['q3']:<5.2f} {q['low']:>5.2f}-{q['high']:<5.2f} "
              f"{r['load'][0]:>4.1f}-{r['load'][1]:<4.1f}  {imports:<30} {'yes' if r['same_output'] else 'NO'}")
    emit_json({"bench": "startup", "base_rev": args.base_rev, "pairs": args.pairs, "versions": v, "rows": rows},
              args.json_out)


if __name__ == "__main__":
    main()
