"""Offline ``pack_dataset`` CPU time, this tree against packkit at a named revision, processes alternating.

Real lengths: ``benchlib.chat_lengths(N)`` (ShareGPT conversations under Qwen3's tokenizer, drawn with
replacement), one ``input_ids`` column of int32 ids in an in-memory ``datasets.Dataset``, ``W = 2048``,
``progress=False``, ``overflow`` split and truncate. Each run is a fresh process
(``PYTHONPATH`` the tree measured: this one, or ``--base-rev`` extracted with ``git archive``) that builds the
dataset and packs a small one once (imports and first calls: the cold start is ``bench_startup.py``'s), then times
``--reps`` packs by ``time.process_time`` (every thread) with garbage collected before and disabled during each,
and keeps their median. Pairs alternate which tree runs first; the outputs' digests must be equal.

    python benchmarks/bench_offline_ab.py --pairs 8 --base-rev 795d651

Prints the median and spread of the pair ratios (this tree / base) with the load beside each pair, then one JSON
line. Target: the median ratio <= 1 for both overflows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchlib import loadavg, ratio_spread, versions

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 2048


def make_dataset(lengths, *, seed: int = 0, vocab: int = 151_669):
    """An in-memory ``datasets.Dataset`` of ``input_ids`` (int32 ids in ``[0, vocab)``, seeded) of these lengths,
    built with pyarrow alone (both trees pack the same one)."""
    import datasets
    import numpy as np
    import pyarrow as pa
    from datasets.fingerprint import generate_random_fingerprint

    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = np.random.default_rng(seed).integers(0, vocab, int(offsets[-1]), dtype=np.int32)
    col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    return datasets.Dataset(pa.table({"input_ids": col}), fingerprint=generate_random_fingerprint())


def child(overflow: str, n: int, reps: int) -> None:
    """Time ``reps`` packs of ``chat_lengths(n)`` in this process (the tree on ``PYTHONPATH``); print JSON."""
    import gc
    import hashlib
    import time

    import numpy as np
    from benchlib import chat_lengths

    import packkit

    try:
        from packkit import pack_dataset
    except ImportError:  # before packkit.offline: packkit.hf's
        from packkit.hf import pack_dataset

    ds = make_dataset(chat_lengths(n))
    pack_dataset(make_dataset(chat_lengths(500, seed=1)), window=WINDOW, overflow=overflow, progress=False)
    times = []
    for _ in range(reps):
        gc.collect()
        gc.disable()
        t = time.process_time()
        out = pack_dataset(ds, window=WINDOW, overflow=overflow, progress=False)
        times.append(time.process_time() - t)
        gc.enable()
    ids = out.with_format("arrow")[:]["input_ids"].combine_chunks()
    digest = hashlib.md5(np.asarray(ids.values).tobytes() + np.asarray(ids.offsets).tobytes()).hexdigest()
    print(json.dumps({"file": packkit.__file__, "cpu": statistics.median(times), "times": times, "rows": len(out),
                      "digest": digest}))


def run(tree: str, overflow: str, n: int, reps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    got = subprocess.run([sys.executable, __file__, "--child", overflow, str(n), str(reps)], env=env,
                         capture_output=True, text=True)
    if got.returncode:
        raise RuntimeError(f"{tree}: {got.stderr[-2000:]}")
    result = json.loads(got.stdout.strip().splitlines()[-1])
    assert result["file"].startswith(tree), (result["file"], tree)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--reps", type=int, default=3, help="timed packs in each process (their median is its figure)")
    p.add_argument("--n", type=int, default=100_000, help="examples (real chat lengths, drawn with replacement)")
    p.add_argument("--base-rev", default="795d651")
    p.add_argument("--overflow", default="split,truncate")
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.base_rev, "packkit"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "x", "-C", tmp], input=archive, check=True)
        trees = {"this tree": str(ROOT), args.base_rev: tmp}
        for overflow in args.overflow.split(","):
            got = {name: [] for name in trees}
            loads = []
            for r in range(args.pairs):
                loads.append(loadavg())
                for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                    got[name].append(run(trees[name], overflow, args.n, args.reps))
                a, b = got["this tree"][-1], got[args.base_rev][-1]
                assert a["digest"] == b["digest"] and a["rows"] == b["rows"], (a, b)  # the same windows
                print(f"{overflow} pair {r}: this tree {a['cpu']:.3f} s, {args.base_rev} {b['cpu']:.3f} s, "
                      f"ratio {a['cpu'] / b['cpu']:.3f}, load {loads[-1]:.1f}", file=sys.stderr)
            spread = ratio_spread([g["cpu"] for g in got["this tree"]], [g["cpu"] for g in got[args.base_rev]])
            results[overflow] = dict(spread, load=[min(loads), max(loads)])
    print(f"\npack_dataset, {args.n:,} real chat lengths (ShareGPT/Qwen3), W={WINDOW}, CPU s (median of {args.reps} "
          f"a process), {args.pairs} alternated process pairs")
    print(f"{'overflow':<10}{'this tree':>11}{args.base_rev:>11}{'median ratio':>14}{'spread':>15}  load")
    for overflow, s in results.items():
        print(f"{overflow:<10}{s['num_median']:>11.3f}{s['den_median']:>11.3f}{s['median']:>14.3f}"
              f"{s['low']:>8.2f}-{s['high']:.2f}  {s['load'][0]:.1f}-{s['load'][1]:.1f}")
    print(json.dumps(dict(bench="offline-ab", base=args.base_rev, n=args.n, window=WINDOW,
                          versions=versions("datasets", "pyarrow"), results=results)))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(main())
