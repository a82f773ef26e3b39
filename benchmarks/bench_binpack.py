"""Planning speed and quality: packkit's planner against TRL's ``pack_dataset`` (BFD), same run.

Lengths: real chat by default (``--lengths chat``: ShareGPT conversations under Qwen3's tokenizer, drawn with
replacement to ``--n``), at W = 2,048 and 4,096; ``--lengths sft-like`` (or ``uniform``) runs the synthetic cases instead,
labelled (lognormal median 250 at 2,048, uniform 16..512 at 4,096). For each case it measures, on the same lengths:

* packkit ``pack(...)`` — planning only (lengths in, a Plan out), every strategy;
* packkit ``pack`` + ``pack_arrays`` — planning plus moving every token once, for a like-for-like
  comparison with TRL, whose ``pack_dataset`` always moves the tokens;
* TRL ``pack_dataset(ds, W, strategy="bfd")`` in its default chunked mode (``datasets.map`` batches of
  1,000 examples, each planned on its own) and over the whole dataset (one batch).

TRL's "bfd" truncates over-long examples, so packkit runs with ``overflow="truncate"`` for the
comparison (and reports the cut tokens that TRL does not). Windows over the lower bound use
``ceil(tokens after truncation / W)``.

The strategies' planning times are packkit alone (best of ``--repeat``; their fill and windows are exact).
packkit against TRL: ``--rounds`` rounds, the three providers rotated every round (each first in turn), garbage
collected outside the clock (``benchlib.rotating_rounds``, CPU time); medians, and the median and spread of the pair
ratios TRL / packkit.

Usage: ``python benchmarks/bench_binpack.py [--n 1000000] [--no-trl] [--big 10000000] [--lengths chat]``.
Prints a table last, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
import tracemalloc

import numpy as np

from benchlib import (LENGTH_SOURCES, add_lengths_option, bench_lengths, loadavg, ratio_spread, rotating_rounds,
                      spread_text, versions)

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


def fastest(fn, repeat: int):
    """``(seconds, result)``: the fastest of ``repeat`` calls of ``fn()`` (one provider alone, no comparison)."""
    times, out = [], None
    for _ in range(repeat):
        gc.collect()
        t = time.process_time()
        out = fn()
        times.append(time.process_time() - t)
    return min(times), out


def trl_call(ds, window, whole, out: dict, key: str):
    """TRL's ``pack_dataset(ds, window, "bfd")`` (over the whole dataset when ``whole``), its rows kept in ``out``."""
    from trl.data_utils import pack_dataset as trl_pack

    kwargs = {"map_kwargs": {"batch_size": len(ds)}} if whole else {}

    def call():
        out[key] = len(trl_pack(ds, window, strategy="bfd", **kwargs))
    return call


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--big", type=int, default=10_000_000, help="size of the scaling run (0: skip)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5, help="rotated rounds of packkit against TRL")
    ap.add_argument("--no-trl", action="store_true")
    add_lengths_option(ap)
    args = ap.parse_args(argv)

    rows, spreads = [], []
    if args.lengths == "chat":  # real
        real = bench_lengths("chat", args.n)
        cases = [("ShareGPT/Qwen3 chat", real, 2048), ("ShareGPT/Qwen3 chat", real, 4096)]
    else:
        cases = [("SYNTHETIC sft-like", bench_lengths("sft-like", args.n), 2048),
                 ("SYNTHETIC uniform 16..512", bench_lengths("uniform", args.n), 4096)]
    load = loadavg()
    for name, lengths, window in cases:
        for strategy in ("bfd", "ffd", "shuffle_ff", "next_fit"):
            for overflow in ("truncate", "split"):
                if overflow == "split" and not (lengths > window).any():
                    continue
                repeat = 1 if strategy == "shuffle_ff" else args.repeat
                sec, plan = fastest(lambda: pack(lengths, window=window, strategy=strategy, overflow=overflow), repeat)
                rows.append({
                    "data": name, "W": window, "tool": f"packkit pack({strategy}, {overflow})", "seconds": sec,
                    "windows": plan.num_windows, "over_lb": plan.num_windows - plan.lower_bound,
                    "fill": plan.fill, "cut_tokens": plan.cut_tokens,
                })
        if not args.no_trl:
            ds, values, offsets = make_dataset(lengths)
            got = {}

            def plan_then_move():
                got["packed"] = pack_arrays(pack(lengths, window=window, overflow="truncate"), values, offsets)

            trl_default = "TRL pack_dataset bfd, default (chunks of 1,000)"
            trl_whole = "TRL pack_dataset bfd, whole dataset"
            times = rotating_rounds({"packkit": plan_then_move, trl_default: trl_call(ds, window, False, got, "d"),
                                     trl_whole: trl_call(ds, window, True, got, "w")}, args.rounds)
            packed = got["packed"]
            tokens = int(packed.row_offsets[-1])
            lb = -(-int(np.minimum(lengths, window).sum()) // window)
            rows.append({
                "data": name, "W": window, "tool": "packkit pack + pack_arrays (truncate)",
                "seconds": statistics.median(times["packkit"]),
                "windows": packed.num_rows, "over_lb": packed.num_rows - -(-tokens // window),
                "fill": tokens / (packed.num_rows * window), "cut_tokens": int(lengths.sum()) - tokens,
            })
            for tool, key in ((trl_default, "d"), (trl_whole, "w")):
                s = ratio_spread(times[tool], times["packkit"])
                spreads.append({"data": name, "W": window, "trl": tool, "trl_over_packkit": s})
                rows.append({
                    "data": name, "W": window, "tool": tool, "seconds": s["num_median"], "windows": got[key],
                    "over_lb": got[key] - lb, "fill": int(np.minimum(lengths, window).sum()) / (got[key] * window),
                    "cut_tokens": None,
                })
            del ds, values, offsets
            gc.collect()

    scaling = []
    if args.big:
        for n in (args.n, args.big):
            lengths = bench_lengths(args.lengths, n, seed=1)
            sec, plan = fastest(lambda: pack(lengths, window=2048, overflow="split"), 2)
            peak = peak_bytes(lambda: pack(lengths, window=2048, overflow="split"))
            scaling.append({"n": n, "seconds": sec, "peak_bytes": peak, "bytes_per_example": peak / n,
                            "over_lb": plan.num_windows - plan.lower_bound})

    # -- the table --
    print(f"\nplanner benchmark: n={args.n:,} per case, {LENGTH_SOURCES[args.lengths]}; strategies: best of "
          f"{args.repeat}; against TRL: CPU medians of {args.rounds} rotated rounds; load {load:.1f}-{loadavg():.1f}; "
          f"{platform.processor() or platform.machine()}")
    head = f"{'data':<20} {'W':>5} {'tool':<52} {'seconds':>9} {'windows':>9} {'over LB':>8} {'fill':>8} {'cut tokens':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        cut = "-" if r["cut_tokens"] is None else f"{r['cut_tokens']:,}"
        print(f"{r['data']:<20} {r['W']:>5} {r['tool']:<52} {r['seconds']:>9.3f} {r['windows']:>9,} "
              f"{r['over_lb']:>8,} {r['fill']:>8.5f} {cut:>11}")
    for sp in spreads:
        print(f"{sp['data']}, W={sp['W']}: {sp['trl']} / packkit pack + pack_arrays, pair ratios "
              f"{spread_text(sp['trl_over_packkit'])}")
    if scaling:
        print(f"\nscaling, packkit pack(bfd, split), {args.lengths}, W=2048")
        for s in scaling:
            print(f"  n={s['n']:>11,}  {s['seconds']:.3f} s  peak {s['peak_bytes'] / 2**20:,.0f} MiB "
                  f"({s['bytes_per_example']:.0f} B/example)  windows over LB {s['over_lb']}")
    print(json.dumps({"bench": "binpack", "n": args.n, "lengths": args.lengths, "versions": versions("trl", "datasets"),
                      "rows": rows, "trl_over_packkit": spreads, "scaling": scaling}))


if __name__ == "__main__":
    main()
