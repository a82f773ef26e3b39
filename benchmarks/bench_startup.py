"""Cold start of the ``packkit`` command: wall and CPU time of a fresh process, this tree against packkit's
own earlier version (there is no competitor CLI: a user of an older packkit is the baseline).

Commands, each a new interpreter (``python -m packkit.cli ...``, ``PYTHONPATH`` the tree measured):

* ``--help``; ``waste`` (the bundled sample); ``plan --synthetic 2000``; ``plan small.jsonl``;
* ``pack small.jsonl out.arrow``: a 200-row JSON lines file of token ids (5-100 tokens a row, seeded),
  window 128, written fresh each run.

The baseline is ``--base-rev`` (default ``e489664``, the last commit before the split of ``packkit.cp``),
extracted with ``git archive`` into a temporary folder (nothing in the repository changes). Runs
alternate (before, after; after, before; ...), ``--reps`` each (default 5), and the table shows medians;
CPU is the child's user + system time (``os.wait4``), the figure to read on a shared machine, where the
wall time is mostly waiting for a core. One extra run each records which of torch, datasets, pandas,
transformers the command imported, and the outputs are compared (stdout, the packed file's bytes).

    python benchmarks/bench_startup.py              # ~2 minutes on 2 busy cores
    python benchmarks/bench_startup.py --reps 3 --base-rev 795d651

Prints a table last, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from benchlib import emit_json, versions

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "datasets", "pandas", "transformers")
COMMANDS = {  # name -> argv after ``packkit``
    "--help": ["--help"],
    "waste (bundled sample)": ["waste"],
    "plan --synthetic 2000": ["plan", "--synthetic", "2000"],
    "plan small.jsonl": ["plan", "small.jsonl", "--window", "128"],
    "pack small.jsonl out.arrow": ["pack", "small.jsonl", "out.arrow", "--window", "128"],
}
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


def extract(rev: str, into: Path) -> Path:
    """``packkit/`` at ``rev`` under ``into`` (``git archive``: a read-only snapshot, the repository unchanged)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "packkit"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def timed(tree: Path, argv: list, cwd: Path) -> tuple[float, float, str]:
    """``(wall s, CPU s of the child, stdout)`` of one fresh ``python -m packkit.cli argv`` on ``tree``."""
    out = cwd / "out.arrow"
    if out.exists():
        out.unlink()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "packkit.cli", *argv], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"packkit {' '.join(argv)} on {tree} exited {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime, stdout.decode()


def probe(tree: Path, argv: list, cwd: Path) -> tuple[list, str, bytes | None]:
    """``(heavy packages imported, stdout, the packed file's bytes or None)`` of one run on ``tree``."""
    out = cwd / "out.arrow"
    if out.exists():
        out.unlink()
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=cwd, env={**os.environ, "PYTHONPATH": str(tree)},
                          capture_output=True, text=True)
    heavy = [line[6:].split() for line in proc.stderr.splitlines() if line.startswith("HEAVY ")]
    return (heavy[-1] if heavy else ["?"]), proc.stdout, (out.read_bytes() if out.exists() else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-rev", default="e489664", help="the earlier packkit to compare with (default e489664)")
    ap.add_argument("--reps", type=int, default=5, help="runs of each command on each tree (default 5)")
    ap.add_argument("--json-out", default=None, help="also append the JSON line to this file")
    args = ap.parse_args()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        tmp = Path(tmp)
        (tmp / "base").mkdir()
        trees = {"before": extract(args.base_rev, tmp / "base"), "after": ROOT}
        work = {name: tmp / f"run-{name}" for name in trees}
        for name, cwd in work.items():
            cwd.mkdir()
            small_jsonl(cwd / "small.jsonl")
            where = subprocess.run([sys.executable, "-c", "import packkit; print(packkit.__file__)"], cwd=cwd,
                                   env={**os.environ, "PYTHONPATH": str(trees[name])}, capture_output=True, text=True)
            assert where.stdout.startswith(str(trees[name])), f"{name}: packkit from {where.stdout.strip()}"
        facts = {}
        for label, argv in COMMANDS.items():
            seen = {name: probe(trees[name], argv, work[name]) for name in trees}
            printed = {name: seen[name][1].replace(str(work[name]), "WORK") for name in trees}
            same = printed["before"] == printed["after"] and seen["before"][2] == seen["after"][2]
            facts[label] = {"heavy_before": seen["before"][0], "heavy_after": seen["after"][0], "same_output": same}
        times = {(label, name): {"wall": [], "cpu": []} for label in COMMANDS for name in trees}
        for rep in range(args.reps):
            for label, argv in COMMANDS.items():
                order = ("before", "after") if rep % 2 == 0 else ("after", "before")
                for name in order:
                    wall, cpu, _ = timed(trees[name], argv, work[name])
                    times[label, name]["wall"].append(wall)
                    times[label, name]["cpu"].append(cpu)
    load_end = os.getloadavg()
    rows = []
    for label in COMMANDS:
        med = {(name, k): statistics.median(times[label, name][k]) for name in trees for k in ("wall", "cpu")}
        rows.append({"command": label, **{f"{k}_{name}_s": round(med[name, k], 3) for name in trees
                                          for k in ("cpu", "wall")},
                     "cpu_speedup": med["before", "cpu"] / med["after", "cpu"],
                     "wall_speedup": med["before", "wall"] / med["after", "wall"], **facts[label],
                     "cpu_runs_before": [round(x, 3) for x in times[label, "before"]["cpu"]],
                     "cpu_runs_after": [round(x, 3) for x in times[label, "after"]["cpu"]]})
    v = versions("pyarrow", "datasets", "pandas", "transformers")
    print(f"packkit cold start: {args.base_rev} (before) against this tree (after); medians of {args.reps} "
          f"alternating runs; load average {load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end")
    print(f"python {v['python']}, {v['cpus']} CPUs, numpy {v['numpy']}, torch {v['torch']}, pyarrow {v['pyarrow']}, "
          f"datasets {v['datasets']}, pandas {v['pandas']}")
    print(f"{'command':<28} {'CPU before':>10} {'CPU after':>10} {'x':>6} {'wall before':>12} {'wall after':>11} "
          f"{'x':>6}  {'imports before -> after':<36} same output")
    for r in rows:
        imports = f"{','.join(r['heavy_before']) or '-'} -> {','.join(r['heavy_after']) or '-'}"
        print(f"{r['command']:<28} {r['cpu_before_s']:>10.2f} {r['cpu_after_s']:>10.2f} {r['cpu_speedup']:>6.1f} "
              f"{r['wall_before_s']:>12.2f} {r['wall_after_s']:>11.2f} {r['wall_speedup']:>6.1f}  {imports:<36} "
              f"{'yes' if r['same_output'] else 'NO'}")
    emit_json({"bench": "startup", "base_rev": args.base_rev, "reps": args.reps, "versions": v,
               "loadavg_start": load_start, "loadavg_end": load_end, "rows": rows}, args.json_out)


if __name__ == "__main__":
    main()
