"""Context-parallel layouts on real chat rows: the padding each adds and how evenly it spreads the causal
attention work over the ranks, and the time to shard a batch.

Real chat lengths (``benchlib.chat_lengths``: 17,545 ShareGPT conversations under Qwen3's tokenizer,
**drawn with replacement** up to ``--n``) are packed into padding-free rows of ``W`` tokens (best fit
decreasing, examples over ``W`` split), one row a CP step. For every CP size and layout:

* padding: the tokens the layout adds (zigzag: each document to a multiple of ``2*cp``; contiguous /
  ulysses: the row to a multiple of ``cp``; hybrid: long documents zigzag, the rest whole), over the
  real tokens;
* imbalance: ``sum over steps of the busiest rank's causal work / sum over steps of the mean rank's``
  (a rank's causal work: the keys its real queries attend, ``sum(position + 1)``); every rank waits for
  the busiest at each step;
* shard time: ``packkit.cp.shard`` of one ``[1, W]`` ``PackedBatch`` for one rank (plan included), median.

The baselines a user picks today are measured in the same run: zigzag (TransformerEngine THD, zigzag
ring) and contiguous (llama3 ring, DeepSpeed Ulysses). Targets (issue 20, at cp = 8): hybrid padding
<= 0.3% and imbalance <= 1.05.

Usage: ``python benchmarks/bench_cp.py [--n 200000] [--window 32768] [--cp 2,4,8] [--rows N]``.
Prints a table last, then one JSON line.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchlib import chat_lengths, emit_json, median_time, versions

from packkit.binpack import pack
from packkit.cp import shard
from packkit.cp_plan import LAYOUTS, plan_cp

TARGET_PADDING = 0.003
TARGET_IMBALANCE = 1.05


def rows_of(lengths, window, seed):
    """Segment lengths of every packed row (best fit decreasing, over-long examples split)."""
    plan = pack(lengths, window=window, overflow="split").shuffled(seed=seed)
    return [plan.segments(i)[2] for i in range(plan.num_windows)]


def measure(rows, cp, layout):
    """(padding tokens, real tokens, sum of max work, sum of mean work) over the rows."""
    pad = real = 0
    top = mean = 0.0
    for row in rows:
        plan = plan_cp(row, cp_size=cp, layout=layout)
        work = plan.work()
        pad += plan.padding_tokens
        real += plan.num_tokens
        top += float(work.max())
        mean += float(work.mean())
    return pad, real, top, mean


def shard_time(row, cp, layout):
    """Median seconds of shard() for one rank of a [1, sum(row)] batch."""
    import torch

    from packkit.batch import PackedBatch
    from packkit.segments import lengths_to_cu_seqlens, lengths_to_position_ids

    T = int(row.sum())
    ids = torch.randint(1, 32000, (1, T))
    batch = PackedBatch(input_ids=ids, labels=ids.clone(), cu_seqlens=torch.from_numpy(lengths_to_cu_seqlens(row)),
                        position_ids=torch.from_numpy(lengths_to_position_ids(row))[None])
    return median_time(lambda: shard(batch, cp_size=cp, rank=cp - 1, layout=layout), warmup=2, reps=15, device="cpu")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200_000, help="chat examples (drawn with replacement past 17,545)")
    p.add_argument("--window", type=int, default=32_768)
    p.add_argument("--cp", default="2,4,8")
    p.add_argument("--rows", type=int, default=None, help="measure only the first N rows (quick runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    cps = [int(c) for c in args.cp.split(",")]
    lengths = chat_lengths(args.n, seed=args.seed)
    rows = rows_of(lengths, args.window, args.seed)[: args.rows]
    long_row = max(rows, key=lambda r: int(r.max()))  # the row with the longest document: zigzag's worst
    info = versions()
    print(f"{args.n:,} chat lengths (17,545 ShareGPT conversations, drawn with replacement), W={args.window:,}: "
          f"{len(rows):,} rows, {int(sum(r.sum() for r in rows)):,} tokens; {info}")
    table, record = [], {"bench": "cp", "n": args.n, "window": args.window, "rows": len(rows), "versions": info,
                         "with_replacement": args.n > 17_545, "results": []}
    for cp in cps:
        for layout in LAYOUTS:
            t0 = time.perf_counter()
            pad, real, top, mean = measure(rows, cp, layout)
            plan_s = (time.perf_counter() - t0) / len(rows)
            shard_s = shard_time(long_row, cp, layout)
            res = {"cp": cp, "layout": layout, "padding": pad / real, "imbalance": top / mean,
                   "plan_ms": plan_s * 1e3, "shard_ms": shard_s * 1e3}
            record["results"].append(res)
            table.append(res)
    print()
    print(f"| cp | layout | padding | imbalance (sum max / sum mean work) | plan ms/row | shard ms (1 rank, {args.window // 1024}k row) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for r in table:
        bold = "**" if r["layout"] == "hybrid" else ""
        print(f"| {r['cp']} | {bold}{r['layout']}{bold} | {r['padding']:.3%} | {r['imbalance']:.3f} | "
              f"{r['plan_ms']:.2f} | {r['shard_ms']:.2f} |")
    hybrid = next((r for r in table if r["cp"] == 8 and r["layout"] == "hybrid"), None)
    if hybrid is not None:
        pad_ok, imb_ok = hybrid["padding"] <= TARGET_PADDING, hybrid["imbalance"] <= TARGET_IMBALANCE
        record["targets"] = {"padding": [hybrid["padding"], TARGET_PADDING, pad_ok],
                             "imbalance": [hybrid["imbalance"], TARGET_IMBALANCE, imb_ok]}
        print(f"\nhybrid at cp=8: padding {hybrid['padding']:.3%} ({'met' if pad_ok else 'MISSED'}, target <= "
              f"{TARGET_PADDING:.1%}); imbalance {hybrid['imbalance']:.3f} ({'met' if imb_ok else 'MISSED'}, "
              f"target <= {TARGET_IMBALANCE})")
    emit_json(record, args.json_out)


if __name__ == "__main__":
    main()
