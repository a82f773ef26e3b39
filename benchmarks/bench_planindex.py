"""An index-only plan against rewriting the packed rows: bytes an example, and the time of a new window.

Real lengths: ``benchmarks/data/sharegpt_qwen3_lengths.npy`` (ShareGPT conversations through Qwen3's
tokenizer), resampled with replacement to ``--examples`` (default 1,000,000). The plan is made at
``W = 4096`` (best fit, split), then:

- **plan**: :meth:`packkit.planindex.PlanIndex.replan` at ``W = 8192`` and a new seed, from the lengths;
  the plan file's arrays are counted in bytes an example (goal: at most 16) and the re-plan timed (goal:
  at most 1 s for a million examples).
- **rewrite** (the baseline a user would otherwise run): ``pack_dataset`` of the tokens at the new window into
  an Arrow file, on the first ``--rewrite-examples`` examples (default 20,000; random token ids, int32),
  reported per example and scaled to ``--examples``.

Rounds alternate plan and rewrite (who goes first flips every round); the garbage collector runs before each
timed step and is off during it; wall and CPU seconds are printed (CPU is the fairer figure on a shared machine),
medians, with the median and spread of the CPU pair ratios rewrite (scaled) / plan. A table is printed last,
then one JSON line.

    python benchmarks/bench_planindex.py [--examples N] [--rewrite-examples N] [--rounds R]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchlib import loadavg, ratio_spread, spread_text  # noqa: E402
from packkit.binpack import pack  # noqa: E402
from packkit.planindex import PlanIndex  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OPTIONS = {"strategy": "bfd", "overflow": "split", "seed": 0, "shuffle": True, "cp_size": 1, "cp_layout": "hybrid"}


def timed(fn):
    """``(result, wall, cpu)`` of ``fn()``, garbage collected before and off during it."""
    gc.collect()
    gc.disable()
    try:
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        return out, time.perf_counter() - w, time.process_time() - c
    finally:
        gc.enable()


def rewrite_dataset(lengths: np.ndarray):
    import datasets

    rng = np.random.default_rng(1)
    flat = rng.integers(0, 150_000, int(lengths.sum()), dtype=np.int32)
    import pyarrow as pa

    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    col = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat))
    return datasets.Dataset(datasets.table.InMemoryTable(pa.table({"input_ids": col})))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=1_000_000)
    ap.add_argument("--rewrite-examples", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    real = np.load(os.path.join(HERE, "data", "sharegpt_qwen3_lengths.npy")).astype(np.int64)
    lengths = np.random.default_rng(0).choice(real, args.examples)
    plan = pack(lengths, window=4096, overflow="split").shuffled(0)
    index = PlanIndex(plan=plan, loss=lengths - 1, options=OPTIONS, columns=("input_ids",), mask_first_label=True,
                      fingerprint="0" * 32)
    per_example = index.nbytes() / lengths.size
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "p.packplan")
        index.save(path)
        file_per_example = os.path.getsize(path) / lengths.size

        from packkit.offline import pack_dataset

        small = rewrite_dataset(lengths[:args.rewrite_examples])
        plans, rewrites = [], []
        for r in range(args.rounds):
            out = os.path.join(tmp, f"rows{r}.arrow")
            for step in ("plan", "rewrite") if r % 2 == 0 else ("rewrite", "plan"):  # who goes first alternates
                if step == "plan":
                    again, w, c = timed(lambda: index.replan(window=8192, seed=r + 1))
                    plans.append((w, c))
                else:
                    _, w, c = timed(lambda: pack_dataset(small, window=8192, seed=r + 1, overflow="split",
                                                         cache_file_name=out, progress=False))
                    rewrites.append((w, c))
            os.remove(out)
    plan_w, plan_c = (float(np.median([p[i] for p in plans])) for i in (0, 1))
    rw_w, rw_c = (float(np.median([p[i] for p in rewrites])) for i in (0, 1))
    scale = args.examples / args.rewrite_examples
    pairs = ratio_spread([c * scale for _, c in rewrites], [c for _, c in plans])
    tokens = int(lengths.sum())
    print(f"{args.examples:,} examples ({tokens:,} tokens; ShareGPT/Qwen3 lengths), W 4096 -> 8192, "
          f"{args.rounds} rounds alternating, medians")
    print(f"{'':<34}{'wall s':>10}{'CPU s':>10}")
    print(f"{'re-plan from lengths (plan)':<34}{plan_w:>10.3f}{plan_c:>10.3f}")
    print(f"{'rewrite, scaled from ' + format(args.rewrite_examples, ',') + ' examples':<34}{rw_w * scale:>10.1f}"
          f"{rw_c * scale:>10.1f}")
    print(f"plan arrays {per_example:.2f} bytes an example (file {file_per_example:.2f}); goal <= 16: "
          f"{'met' if per_example <= 16 else 'MISSED'}; re-plan goal <= 1 s: "
          f"{'met' if plan_w <= 1 else 'missed'} (wall), {'met' if plan_c <= 1 else 'missed'} (CPU)")
    print(f"rewrite (scaled) / plan, CPU pair ratios: {spread_text(pairs)}; load {loadavg():.1f}")
    print(json.dumps({"examples": args.examples, "tokens": tokens, "bytes_per_example": round(per_example, 3),
                      "file_bytes_per_example": round(file_per_example, 3), "replan_wall_s": round(plan_w, 4),
                      "replan_cpu_s": round(plan_c, 4), "rewrite_wall_s_scaled": round(rw_w * scale, 2),
                      "rewrite_cpu_s_scaled": round(rw_c * scale, 2), "windows": again.num_rows,
                      "rewrite_over_plan_cpu": pairs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
