"""Planning speed and quality: packkit's planner against TRL's ``pack_dataset`` (BFD), same run.

For each length distribution it measures, on the same lengths:

* packkit ``pack(...)`` — planning only (lengths in, a Plan out), every strategy;
* packkit ``pack`` + ``pack_arrays`` — planning plus moving every token once, for a like-for-like
  comparison with TRL, whose ``pack_dataset`` always moves the tokens;
* TRL ``pack_dataset(ds, W, strategy="bfd")`` in its default chunked mode (``datasets.map`` batches of
  1,000 examples, each planned on its own) and over the whole dataset (one batch).

TRL's "bfd" truncates over-long examples, so packkit runs with ``overflow="truncate"`` for the
comparison (and reports the cut tokens that TRL does not). Windows over the lower bound use
``ceil(tokens after truncation / W)``.

Usage: ``python benchmarks/bench_binpack.py [--n 1000000] [--no-trl] [--big 10000000]``.
Prints a table last, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
import tracemalloc

import numpy as np

from benchlib import best_of, sft_like_lengths, uniform_lengths, versions

from packkit.binpack import pack
from packkit.packer import pack_arrays


def peak_bytes(fn):
    gc.collect()
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def make_dataset(lengths):
    """A datasets.Dataset with an ``input_ids`` list column of the given lengths (built from Arrow)."""
    import pyarrow as pa
    from datasets import Dataset

    offsets = np.zeros(lengths.size + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = (np.arange(int(offsets[-1]), dtype=np.int64) % 32000).astype(np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    return Dataset(pa.table({"input_ids": column})), values, offsets


def run_trl(ds, window, lengths, whole):
    from trl.data_utils import pack_dataset as trl_pack

    kwargs = {"map_kwargs": {"batch_size": len(ds)}} if whole else {}
    t = time.perf_counter()
    out = trl_pack(ds, window, strategy="bfd", **kwargs)
    seconds = time.perf_counter() - t
    tokens = int(np.minimum(lengths, window).sum())
    lb = -(-tokens // window)
    return {"seconds": seconds, "windows": len(out), "lower_bound": lb}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--big", type=int, default=10_000_000, help="size of the scaling run (0: skip)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-trl", action="store_true")
    args = ap.parse_args(argv)

    rows = []
    cases = [("sft-like lognormal", sft_like_lengths(args.n), 2048), ("uniform 16..512", uniform_lengths(args.n), 4096)]
    for name, lengths, window in cases:
        for strategy in ("bfd", "ffd", "shuffle_ff", "next_fit"):
            for overflow in ("truncate", "split"):
                if overflow == "split" and not (lengths > window).any():
                    continue
                repeat = 1 if strategy == "shuffle_ff" else args.repeat
                sec, plan = best_of(lambda: pack(lengths, window=window, strategy=strategy, overflow=overflow), repeat)
                rows.append({
                    "data": name, "W": window, "tool": f"packkit pack({strategy}, {overflow})", "seconds": sec,
                    "windows": plan.num_windows, "over_lb": plan.num_windows - plan.lower_bound,
                    "fill": plan.fill, "cut_tokens": plan.cut_tokens,
                })
        if not args.no_trl:
            ds, values, offsets = make_dataset(lengths)
            plan_then_move = lambda: pack_arrays(pack(lengths, window=window, overflow="truncate"), values, offsets)
            sec, packed = best_of(plan_then_move, args.repeat)
            tokens = int(packed.row_offsets[-1])
            rows.append({
                "data": name, "W": window, "tool": "packkit pack + pack_arrays (truncate)", "seconds": sec,
                "windows": packed.num_rows, "over_lb": packed.num_rows - -(-tokens // window),
                "fill": tokens / (packed.num_rows * window), "cut_tokens": int(lengths.sum()) - tokens,
            })
            for whole in (False, True):
                r = run_trl(ds, window, lengths, whole)
                rows.append({
                    "data": name, "W": window,
                    "tool": "TRL pack_dataset bfd, " + ("whole dataset" if whole else "default (chunks of 1,000)"),
                    "seconds": r["seconds"], "windows": r["windows"], "over_lb": r["windows"] - r["lower_bound"],
                    "fill": int(np.minimum(lengths, window).sum()) / (r["windows"] * window), "cut_tokens": None,
                })
            del ds, values, offsets
            gc.collect()

    scaling = []
    if args.big:
        for n in (args.n, args.big):
            lengths = sft_like_lengths(n, seed=1)
            sec, plan = best_of(lambda: pack(lengths, window=2048, overflow="split"), 2)
            peak = peak_bytes(lambda: pack(lengths, window=2048, overflow="split"))
            scaling.append({"n": n, "seconds": sec, "peak_bytes": peak, "bytes_per_example": peak / n,
                            "over_lb": plan.num_windows - plan.lower_bound})

    # -- the table --
    print(f"\nplanner benchmark: n={args.n:,} per distribution; best of {args.repeat}; {platform.processor() or platform.machine()}")
    head = f"{'data':<20} {'W':>5} {'tool':<52} {'seconds':>9} {'windows':>9} {'over LB':>8} {'fill':>8} {'cut tokens':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        cut = "-" if r["cut_tokens"] is None else f"{r['cut_tokens']:,}"
        print(f"{r['data']:<20} {r['W']:>5} {r['tool']:<52} {r['seconds']:>9.3f} {r['windows']:>9,} "
              f"{r['over_lb']:>8,} {r['fill']:>8.5f} {cut:>11}")
    if scaling:
        print("\nscaling, packkit pack(bfd, split), sft-like, W=2048")
        for s in scaling:
            print(f"  n={s['n']:>11,}  {s['seconds']:.3f} s  peak {s['peak_bytes'] / 2**20:,.0f} MiB "
                  f"({s['bytes_per_example']:.0f} B/example)  windows over LB {s['over_lb']}")
    print(json.dumps({"bench": "binpack", "n": args.n, "versions": versions("trl", "datasets"), "rows": rows, "scaling": scaling}))


if __name__ == "__main__":
    main()
