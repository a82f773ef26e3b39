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
every batch, and for packed rows what reading ``example_loss`` adds, over the least time of the whole weighted
collate, the interleaved: :func:`weigh_share`), which load disturbs far less, and inside the collate (``in situ``:
``--pairs`` turns of adjacent calls of every side on one warmed batch, the median of the sample / token ratios and
their quartiles: :func:`situ_pairs`; what the weights cost where the collate runs them, caches included, which a
replay of their step alone understates). The baseline (``--baseline``) is packkit's whole package at that revision,
in the same rounds and turns. The target: overhead <= 2%. Prints a table last and one JSON line.
``python benchmarks/bench_weighting.py [--quick]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import numpy as np
from benchlib import (best_interleaved, chat_lengths, loadavg, package_at, parse_quick, ratio_spread,
                      rotating_rounds, versions)

from packkit import collate
from packkit.batch import _WEIGHT_NOTES, _note
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
    """What only a weighting runs, over the whole weighted collate, each the least CPU time of ``repeats`` passes
    over ``batches``, timed on the very batches and arguments the collate gave them (recorded in a first pass): the
    collator's ``_weigh`` and, for packed rows, what reading their ``example_loss`` adds to reading their segments
    (``_row_segments(whole=True)`` less ``_row_segments(whole=False)``, the same rows; since the column is read in
    the join of ``seq_lengths``). Every replay of ``_weigh`` starts from the batch as the collate left it: the notes
    of the last replay are taken off the clock (before, every replay after the first also timed their removal, which
    no collate does). Not in it: the documents' spans (one gather of a batch's document starts in
    ``rows_batch_spans``); the in-situ pairs (:func:`situ_pairs`) have everything."""
    calls, reads = [], []
    weigh, read = coll._weigh, collate._row_segments
    coll._weigh = lambda *a, **k: (calls.append((a, k)), weigh(*a, **k))[1]
    collate._row_segments = lambda *a, **k: (reads.append((a, k)), read(*a, **k))[1]
    try:
        [coll(b) for b in batches]
    finally:
        del coll._weigh
        collate._row_segments = read
    labels = [a[0]["labels"] for a, _ in calls]
    plain = [(a, {**k, "whole": False}) for a, k in reads]

    def as_collated():
        for lab in labels:
            note = _note(lab)
            for key in _WEIGHT_NOTES.intersection(note):
                del note[key]

    best = best_interleaved({"weigh": lambda: ([weigh(*a, **k) for a, k in calls], [read(*a, **k) for a, k in reads]),
                             "read": lambda: [read(*a, **k) for a, k in plain],
                             "whole": lambda: [coll(b) for b in batches]}, repeats, clock=time.process_time,
                            setup=as_collated)
    return (best["weigh"] - best["read"]) / best["whole"]


def situ_pairs(sides: dict, batches, pairs: int) -> dict:
    """The weights inside the collate, where the measure cannot leave anything out: for each of ``pairs`` turns (the
    batches in turn), one untimed call of every side (so each times a batch whose data is as warm as the others'),
    then one timed call of each, the order rotated every turn; CPU time, GC between turns and off during them.
    ``{side: [seconds, ...]}``, turn by turn (pairs for :func:`benchlib.ratio_spread`)."""
    names = list(sides)
    out = {name: [] for name in names}
    for i in range(pairs):
        b = batches[i % len(batches)]
        gc.collect()
        gc.disable()
        try:
            for name in names:
                sides[name](b)
            for name in names[i % len(names):] + names[:i % len(names)]:
                t = time.process_time()
                sides[name](b)
                out[name].append(time.process_time() - t)
        finally:
            gc.enable()
    return out


def quartiles(num, den) -> tuple[float, float, float]:
    """The pair ratios ``num[i] / den[i] - 1``: first quartile, median, third quartile."""
    q = statistics.quantiles([x / y - 1 for x, y in zip(num, den)], n=4)
    return q[0], q[1], q[2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--pairs", type=int, default=400, help="turns of the in-situ pairs (every side once a turn)")
    parser.add_argument("--baseline", default="a166061", help="the revision whose packkit (the whole package: the "
                        "collate reads columns with packkit.examples) runs beside this one, in the same rounds and "
                        "turns (\"\": none)")
    args = parse_quick(parser, argv, "fewer rounds", rounds=3, batches=4, pairs=20)
    batches = make_batches(args.batches, args.batch_size, seed=0)
    tokens = sum(len(ex["input_ids"]) for b in batches for ex in b)
    rows, packed = [], packed_rows(batches, args.window, max(1, args.batch_size // 4))
    modules = {"": collate}
    if args.baseline:
        modules["@base"] = package_at(args.baseline, "collate")
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
        situ = situ_pairs(sides, batches, args.pairs)
        row = {"collator": name, "overhead_median": spread["median"] - 1, "overhead_low": spread["low"] - 1,
               "overhead_high": spread["high"] - 1, "overhead_least": min(t["sample"]) / min(t["token"]) - 1,
               "token_s": spread["den_median"], "sample_s": spread["num_median"], "pairs": spread["pairs"],
               "isolated": isolated, "load": (load + loadavg()) / 2,
               "situ": quartiles(situ["sample"], situ["token"]), "situ_token_s": statistics.median(situ["token"])}
        if args.baseline:  # the same rounds: the weights' overhead at the baseline, and each side against it
            for key, num, den in (("base_overhead", "sample@base", "token@base"), ("token_vs_base", "token", "token@base"),
                                  ("sample_vs_base", "sample", "sample@base")):
                r = ratio_spread(t[num], t[den])
                row[key] = {"median": r["median"] - 1, "low": r["low"] - 1, "high": r["high"] - 1}
            row["base_situ"] = quartiles(situ["sample@base"], situ["token@base"])
            row["token_vs_base_situ"] = quartiles(situ["token"], situ["token@base"])
        rows.append(row)
    print(f"{tokens:,} tokens in {args.batches} batches of {args.batch_size} real chat examples, window {args.window}, "
          f"{args.rounds} rounds")
    print(f"{'collator':<20} {'token (s)':>10} {'sample (s)':>11} {'A/B overhead':>13} {'low..high':>16} "
          f"{'least/least':>11} {'isolated':>9} {'in situ (q1..q3)':>24} {'load':>6}  target <= 2%")
    for r in rows:
        ok = "met" if r["overhead_median"] <= TARGET else "MISSED"
        iso = "met" if r["isolated"] <= TARGET else "MISSED"
        situ = "met" if r["situ"][1] <= TARGET else "MISSED"
        cell = f"{r['situ'][1]:+.2%} ({r['situ'][0]:+.1%}..{r['situ'][2]:+.1%})"
        print(f"{r['collator']:<20} {r['token_s']:>10.4f} {r['sample_s']:>11.4f} {r['overhead_median']:>12.1%} "
              f"{r['overhead_low']:>7.1%}..{r['overhead_high']:<7.1%} {r['overhead_least']:>11.1%} {r['isolated']:>9.2%} "
              f"{cell:>24} {r['load']:>6.1f}  A/B {ok}, isolated {iso}, in situ {situ}")
    print(f"in situ: median of {args.pairs} turns of adjacent calls on one warmed batch (sample / token - 1), "
          "first..third quartile")
    if args.baseline:
        print(f"against packkit at {args.baseline}, the same rounds (median of the pair ratios, low..high) and turns "
              "(in situ: median, q1..q3):")
        print(f"{'collator':<20} {'overhead @base':>22} {'token / token@base':>24} {'sample / sample@base':>24} "
              f"{'in situ @base':>24} {'in situ token/@base':>24}")
        for r in rows:
            cells = [f"{r[k]['median']:+.1%} ({r[k]['low']:+.0%}..{r[k]['high']:+.0%})"
                     for k in ("base_overhead", "token_vs_base", "sample_vs_base")]
            cells += [f"{r[k][1]:+.2%} ({r[k][0]:+.1%}..{r[k][2]:+.1%})" for k in ("base_situ", "token_vs_base_situ")]
            print(f"{r['collator']:<20} {cells[0]:>22} {cells[1]:>24} {cells[2]:>24} {cells[3]:>24} {cells[4]:>24}")
    print(json.dumps({"bench": "weighting", "baseline": args.baseline, "rows": rows, "tokens": tokens,
                      **versions("numpy", "torch")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
