"""What a loss weighting costs the collator: ``loss_weighting="sample"`` (per-token factors and the batch's
part of Z) against the token mean (``"token"``, nothing added), the same collator on the same batches.

Real chat lengths (ShareGPT under Qwen3's tokenizer, ``data/sharegpt_qwen3_lengths.npy``), each example's
first third masked in its labels (a prompt), numpy examples in mini-batches of ``--batch-size``. Two
collators: ``PaddingFreeCollator`` and ``FixedWindowCollator(window=W, overflow="split")`` (split examples
keep one count: the costlier path); and ``PackedRowsCollator`` over the same examples packed offline at ``W``
(``pack_dataset``, split: the rows record each piece's ``example_loss``, read and weighed as the whole example's),
batches of ``--batch-size // 4`` rows. A/B pairs alternate (which runs first flips each round), GC outside the
clock, CPU time (``time.process_time``); the figure is the median of the pair ratios, with their spread and
the load average beside it, and the ratio of the two sides' least times over the same alternated calls
(``least/least``). Under a heavy load those pairs scatter by tens of percent, so the weights' own
step is also timed alone (``isolated``: the least time of ``--rounds`` repeats of the collator's ``_weigh`` on
every batch, over the least time of the whole weighted collate, the two interleaved), which load disturbs far less. The target:
overhead <= 2%. Prints a table last and one JSON line.
``python benchmarks/bench_weighting.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from benchlib import (best_interleaved, chat_lengths, loadavg, module_at, parse_quick, ratio_spread, rotating_rounds,
                      versions)

from packkit import collate
from packkit.collate import FixedWindowCollator, PackedRowsCollator, PaddingFreeCollator

TARGET = 0.02  # overhead of the weights, at most


def make_batches(num_batches: int, batch_size: int, *, seed: int) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    lengths = chat_lengths(num_batches * batch_size, seed=seed)
    examples = []
    for n in lengths.tolist():
        ids = rng.integers(0, 151_000, n, dtype=np.int64)
        labels = ids.copy()
        labels[: n // 3] = -100
        examples.append({"input_ids": ids, "labels": labels})
    return [examples[i: i + batch_size] for i in range(0, len(examples), batch_size)]


def packed_rows(batches, window: int, rows_per_batch: int) -> list[list[dict]]:
    """The examples of ``batches`` packed offline at ``window`` (``pack_dataset``, split), as numpy rows."""
    import datasets

    from packkit.offline import pack_dataset

    ds = datasets.Dataset.from_list([ex for b in batches for ex in b])
    rows = list(pack_dataset(ds, window=window, overflow="split", seed=0).with_format("numpy"))
    return [rows[i: i + rows_per_batch] for i in range(0, len(rows), rows_per_batch)]


def weigh_share(coll, batches, repeats: int) -> float:
    """What only a weighting runs (the collator's ``_weigh``, and for packed rows ``_example_loss``, the read of
    their ``example_loss`` column) over the whole weighted collate, each the least CPU time of ``repeats`` passes
    over ``batches``; the two are timed on the very batches and arguments the collate gave them (recorded in a
    first pass). Not in it: the documents' spans, one gather of a batch's document starts in ``rows_batch_spans``."""
    calls = []
    real, read = coll._weigh, collate._example_loss
    coll._weigh = lambda *a, **k: (calls.append((real, a, k)), real(*a, **k))[1]
    collate._example_loss = lambda *a, **k: (calls.append((read, a, k)), read(*a, **k))[1]
    try:
        [coll(b) for b in batches]
    finally:
        del coll._weigh
        collate._example_loss = read
    best = best_interleaved({"weigh": lambda: [f(*a, **k) for f, a, k in calls],
                             "whole": lambda: [coll(b) for b in batches]}, repeats, clock=time.process_time)
    return best["weigh"] / best["whole"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--baseline", default="aaf59a2", help="the revision whose packkit/collate.py runs beside "
                        "this one, in the same rounds (\"\": none)")
    args = parse_quick(parser, argv, "fewer rounds", rounds=3, batches=4)
    batches = make_batches(args.batches, args.batch_size, seed=0)
    tokens = sum(len(ex["input_ids"]) for b in batches for ex in b)
    rows, packed = [], packed_rows(batches, args.window, max(1, args.batch_size // 4))
    modules = {"": collate}
    if args.baseline:
        modules["@base"] = module_at(args.baseline, "packkit/collate.py")
    for name, make, batches in (
            ("padding_free", lambda m, w: m.PaddingFreeCollator(loss_weighting=w), batches),
            ("fixed_window_split", lambda m, w: m.FixedWindowCollator(window=args.window, overflow="split",
                                                                      loss_weighting=w), batches),
            ("packed_rows_pieces", lambda m, w: m.PackedRowsCollator(window=args.window, loss_weighting=w), packed)):
        sides = {f"{w}{tag}": make(m, w) for tag, m in modules.items() for w in ("token", "sample")}
        for side, coll in sides.items():
            assert coll(batches[0]).loss_weighting == (None if side.startswith("token") else "sample")

        def run(coll):
            return lambda: [coll(b) for b in batches]

        load = loadavg()
        t = rotating_rounds({side: run(coll) for side, coll in sides.items()}, args.rounds)
        spread = ratio_spread(t["sample"], t["token"])
        isolated = weigh_share(sides["sample"], batches, args.rounds)
        row = {"collator": name, "overhead_median": spread["median"] - 1, "overhead_low": spread["low"] - 1,
               "overhead_high": spread["high"] - 1, "overhead_least": min(t["sample"]) / min(t["token"]) - 1,
               "token_s": spread["den_median"], "sample_s": spread["num_median"], "pairs": spread["pairs"],
               "isolated": isolated, "load": (load + loadavg()) / 2}
        if args.baseline:  # the same rounds: the weights' overhead at the baseline, and each side against it
            for key, num, den in (("base_overhead", "sample@base", "token@base"), ("token_vs_base", "token", "token@base"),
                                  ("sample_vs_base", "sample", "sample@base")):
                r = ratio_spread(t[num], t[den])
                row[key] = {"median": r["median"] - 1, "low": r["low"] - 1, "high": r["high"] - 1}
        rows.append(row)
    print(f"{tokens:,} tokens in {args.batches} batches of {args.batch_size} real chat examples, window {args.window}, "
          f"{args.rounds} rounds")
    print(f"{'collator':<20} {'token (s)':>10} {'sample (s)':>11} {'A/B overhead':>13} {'low..high':>16} "
          f"{'least/least':>11} {'isolated':>9} {'load':>6}  target <= 2%")
    for r in rows:
        ok = "met" if r["overhead_median"] <= TARGET else "MISSED"
        iso = "met" if r["isolated"] <= TARGET else "MISSED"
        print(f"{r['collator']:<20} {r['token_s']:>10.4f} {r['sample_s']:>11.4f} {r['overhead_median']:>12.1%} "
              f"{r['overhead_low']:>7.1%}..{r['overhead_high']:<7.1%} {r['overhead_least']:>11.1%} {r['isolated']:>9.2%} "
              f"{r['load']:>6.1f}  "
              f"A/B {ok}, isolated {iso}")
    if args.baseline:
        print(f"against {args.baseline}'s collate.py, the same rounds (median of the pair ratios, low..high):")
        print(f"{'collator':<20} {'overhead @base':>22} {'token / token@base':>24} {'sample / sample@base':>24}")
        for r in rows:
            cells = [f"{r[k]['median']:+.1%} ({r[k]['low']:+.0%}..{r[k]['high']:+.0%})"
                     for k in ("base_overhead", "token_vs_base", "sample_vs_base")]
            print(f"{r['collator']:<20} {cells[0]:>22} {cells[1]:>24} {cells[2]:>24}")
    print(json.dumps({"bench": "weighting", "baseline": args.baseline, "rows": rows, "tokens": tokens,
                      **versions("numpy", "torch")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
