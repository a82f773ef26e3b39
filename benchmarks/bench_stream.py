"""What the stream state costs: ``pack_stream`` throughput with state tracking against packkit before it.

Input: the real ShareGPT chat lengths (``data/sharegpt_qwen3_lengths.npy``, Qwen3 tokens), each example an
int32 array of random token ids of that length, packed into windows of ``--window`` (2,048) with the
default buffer (1,000 examples), ``overflow="split"``.

Providers, each in a fresh process (``PYTHONPATH`` the tree measured), the packing loop alone on the clock
(examples built before it, garbage collected before and disabled during it), ``--passes`` passes a run:

* ``before``: ``--base-rev`` (default ``cb9c17c``, the last commit before the stream state), extracted with
  ``git archive`` into a temporary folder (the repository unchanged);
* ``now``: this tree, no state taken (what every user of ``pack_stream`` pays for the tracking);
* ``now + state/row``: this tree, ``state_dict()`` after every row (what torchdata's ``StatefulDataLoader``
  asks of each worker with its default ``snapshot_every_n_steps=1``);
* ``now + state/100``: ``state_dict()`` every 100 rows (a checkpoint every 100 steps);
* with ``--base-states`` (a ``--base-rev`` that has stream states), ``before + state/row`` and
  ``before + state/100``: what those states cost there.

Runs alternate (the order flipped each round), ``--reps`` rounds; the table shows medians of CPU time (the
figure to read on a shared machine) and wall, microseconds per example, and the median and spread (lowest-highest,
middle half) of the pair ratios to ``before``, round by round. Then
the cost of one state at the default buffer: its JSON size, ``state_dict()`` built cold, ``load_state_dict``,
and a worker's step under torchdata's ``StatefulDataLoader`` (a row's ``state_dict()`` and ``generate_delta``
of its incremental worker state against the row before's), where torchdata is installed; CPU time.

    python benchmarks/bench_stream.py                # ~2 minutes on 2 busy cores
    python benchmarks/bench_stream.py --reps 7 --window 4096
    python benchmarks/bench_stream.py --base-rev 2dc526d --base-states

Prints a table last, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from benchlib import CHAT_LENGTHS, emit_json, loadavg, ratio_spread, spread_text, versions

ROOT = Path(__file__).resolve().parents[1]
MODES = {"before": ("base", 0), "now": ("now", 0), "now + state/row": ("now", 1), "now + state/100": ("now", 100)}
BASE_STATES = {"before + state/row": ("base", 1), "before + state/100": ("base", 100)}


def examples(window: int):
    lengths = np.load(CHAT_LENGTHS).astype(np.int64)
    rng = np.random.default_rng(0)
    return [{"input_ids": rng.integers(0, 150_000, int(n)).astype(np.int32)} for n in lengths]


def child(window: int, every: int, passes: int) -> None:
    """One run: ``passes`` passes of pack_stream over the examples; prints ``{"cpu", "wall", "rows"}``."""
    from packkit.packer import pack_stream

    src = examples(window)
    gc.collect()
    gc.disable()
    cpu, wall = time.process_time(), time.perf_counter()
    rows = 0
    for _ in range(passes):
        stream = pack_stream(src, window=window, buffer_size=1000, overflow="split")
        for k, _row in enumerate(stream, 1):
            if every and k % every == 0:
                stream.state_dict()
        rows += k
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    gc.enable()
    print(json.dumps({"cpu": cpu, "wall": wall, "rows": rows, "examples": passes * len(src)}))


def state_costs(window: int) -> dict:
    """Size and cost of one state at the default buffer, halfway through the examples (this tree): CPU time of
    this thread (not wall, which the load moves), in ms; torchdata's delta the median of 9 rows."""
    from packkit.packer import pack_stream

    def cpu(fn):
        t = time.thread_time()
        out = fn()
        return (time.thread_time() - t) * 1e3, out

    src = examples(window)
    stream = pack_stream(src, window=window, buffer_size=1000, overflow="split")
    for _ in range(len(src) // 2):
        next(stream)
    gc.collect()
    cold, state = cpu(stream.state_dict)
    warm, _ = cpu(stream.state_dict)
    text = json.dumps(state)
    fresh = pack_stream(src, window=window, buffer_size=1000, overflow="split")
    load, _ = cpu(lambda: fresh.load_state_dict(state))
    first, _ = cpu(lambda: next(fresh))  # the source read again up to the position (not packed), then a row
    pieces = [e for group in state["buffer"].values() for e in group]  # [example, document, start, length, check..]
    delta = None
    try:
        from torchdata.stateful_dataloader.incremental_state import _IncrementalState
    except ImportError:
        pass
    else:  # a worker's step: the state of the row before, one row, its state, the delta between them
        incremental, times = _IncrementalState(stream.state_dict()), []
        for _ in range(9):
            next(stream)
            times.append(cpu(lambda: incremental.generate_delta(stream.state_dict()))[0])
        delta = statistics.median(times)
    return {"buffered": len(pieces), "buffered_tokens": sum(e[3] for e in pieces), "json_mb": len(text) / 2**20,
            "state_dict_cold_ms": cold, "state_dict_warm_ms": warm, "load_ms": load,
            "first_row_after_load_ms": first, "torchdata_delta_ms": delta}


def extract(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "packkit"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def run(tree: Path, window: int, every: int, passes: int) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{ROOT / 'benchmarks'}"}
    out = subprocess.run([sys.executable, __file__, "--child", str(window), str(every), str(passes)], env=env,
                         capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--base-rev", default="cb9c17c")
    p.add_argument("--base-states", action="store_true", help="also time states at --base-rev (it must have them)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"base": extract(args.base_rev, Path(tmp)), "now": ROOT}
        modes = {**MODES, **(BASE_STATES if args.base_states else {})}
        got = {m: [] for m in modes}
        names = list(modes)
        for r in range(args.reps):
            for m in (names if r % 2 == 0 else names[::-1]):
                tree, every = modes[m]
                got[m].append(run(trees[tree], args.window, every, args.passes))
                print(f"round {r} {m:>16}: {got[m][-1]}", file=sys.stderr)
    n = got["before"][0]["examples"]
    table = {}
    for m, runs in got.items():
        cpu = statistics.median(x["cpu"] for x in runs) / n * 1e6
        wall = statistics.median(x["wall"] for x in runs) / n * 1e6
        table[m] = {"cpu_us_per_example": cpu, "wall_us_per_example": wall,
                    "cpu_spread": [min(x["cpu"] for x in runs) / n * 1e6, max(x["cpu"] for x in runs) / n * 1e6],
                    "cpu_over_before": ratio_spread([x["cpu"] for x in runs], [x["cpu"] for x in got["before"]])}
    sys.path.insert(0, str(ROOT))
    costs = state_costs(args.window)
    print(f"\npack_stream on {n // args.passes:,} ShareGPT examples x {args.passes} passes, W={args.window}, "
          f"buffer 1,000, split; medians of {args.reps} alternating runs; us per example; load {loadavg():.1f}")
    print(f"{'provider':<18}{'CPU':>8}{'(min-max)':>16}{'wall':>8}{'CPU / before, pair ratios':>42}")
    for m, t in table.items():
        lo, hi = t["cpu_spread"]
        print(f"{m:<18}{t['cpu_us_per_example']:>8.2f}{f'({lo:.2f}-{hi:.2f})':>16}{t['wall_us_per_example']:>8.2f}"
              f"{spread_text(t['cpu_over_before']):>42}")
    print(f"one state at the default buffer, halfway (CPU): {costs['buffered']} examples ({costs['buffered_tokens']:,} "
          f"tokens), {costs['json_mb']:.1f} MiB as JSON; state_dict {costs['state_dict_cold_ms']:.1f} ms cold, "
          f"{costs['state_dict_warm_ms']:.2f} ms again; load_state_dict {costs['load_ms']:.1f} ms; first row after "
          f"it (the source read again to the position) {costs['first_row_after_load_ms']:.1f} ms")
    if costs["torchdata_delta_ms"] is not None:
        print(f"torchdata's StatefulDataLoader adds to a state, in its worker at every step: state_dict and "
              f"generate_delta {costs['torchdata_delta_ms']:.2f} ms")
    emit_json({"bench": "stream_state", "window": args.window, "examples": n // args.passes, "passes": args.passes,
               "reps": args.reps, "base_rev": args.base_rev, "table": table, "state": costs,
               "versions": versions()}, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
