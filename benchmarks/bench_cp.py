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
* shard time: ``packkit.cp.shard`` of one ``[1, W]`` ``PackedBatch`` for one rank (plan included), median;
* shard against a plain zigzag: for every layout, ``shard`` beside a plain vectorised numpy/torch zigzag of the
  same row for the same rank (:func:`plain_zigzag`: what a user writes without packkit: the rank's two chunks of
  every document, tokens and shifted labels gathered, positions) and beside a named revision's ``shard``
  (``--against``, default aaf59a2, imported whole from ``git archive``: its own planner), in rotated rounds of
  ``--reps`` calls each, garbage collected outside the clock, in process CPU time (every thread); the median round
  ratio and its spread. Ours twice: on a collated batch (the collator planned it, ``plan_batch``, in the
  DataLoader worker: the rank's step) and planning the batch itself; the collator's ``plan_batch`` timed beside.
  Four rows: the row holding the longest document, a median row, and a row of short documents (the real lengths
  of at most 32 tokens, 125 conversations, drawn with replacement up to ``W``: thousands of documents), and a row of
  the lengths of at most 16 tokens (2,727 documents at 32k). The collated shard is checked equal to the planning one
  (the worker's plan is the rank's), both to the old revision's (the hybrid's differ from a revision before cphyb:
  its dealing changed), and the plain zigzag's to zigzag's. Target (issue 34): <= 1.2x.
* the hybrid's balance against the named revision's planner (the exact LPT before cphyb) on the same rows.

The baselines a user picks today are measured in the same run: zigzag (TransformerEngine THD, zigzag
ring) and contiguous (llama3 ring, DeepSpeed Ulysses). Targets (issue 20, at cp = 8): hybrid padding
<= 0.3% and imbalance <= 1.05.

Usage: ``python benchmarks/bench_cp.py [--n 200000] [--window 32768] [--cp 2,4,8] [--rows N] [--layouts hybrid]``.
Prints a table last, then one JSON line.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchlib import (chat_lengths, emit_json, loadavg, median_time, package_at, ratio_spread, rotating_rounds,
                      versions)

from packkit.binpack import pack
from packkit.cp import plan_batch, shard
from packkit.cp_plan import LAYOUTS, plan_cp

TARGET_PADDING = 0.003
TARGET_IMBALANCE = 1.05
TARGET_SHARD_RATIO = 1.2


def rows_of(lengths, window, seed):
    """Segment lengths of every packed row (best fit decreasing, over-long examples split)."""
    plan = pack(lengths, window=window, overflow="split").shuffled(seed=seed)
    return [plan.segments(i)[2] for i in range(plan.num_windows)]


def measure(rows, cp, layout):
    """(padding tokens, real tokens, sum of max work, sum of mean work) over the rows."""
    pad = real = 0
    top = mean = 0.0
    for row in rows:
        plan = plan_cp(row, cp_size=cp, cp_layout=layout)
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
    return median_time(lambda: shard(batch, cp_size=cp, rank=cp - 1, cp_layout=layout), warmup=2, reps=15, device="cpu")


def plain_zigzag(ids, labels, cu_seqlens, cp: int, rank: int, pad_id: int = 0):
    """The baseline: one rank's zigzag part of a ``[1, T]`` row, vectorised, as a user writes it without
    packkit (TE's THD layout: every document padded to a multiple of ``2 * cp``, the rank taking chunks
    ``rank`` and ``2cp-1-rank``): ``(input_ids, shift_labels, position_ids, seq_idx)`` of the rank, ``(n,)``."""
    import torch

    cu = cu_seqlens.numpy().astype(np.int64)
    lengths = np.diff(cu)
    chunk = -(-lengths // (2 * cp))
    starts = np.stack([rank * chunk, (2 * cp - 1 - rank) * chunk], 1).ravel()
    sizes = np.repeat(chunk, 2)
    out = np.cumsum(sizes) - sizes
    pos = np.repeat(starts - out, sizes) + np.arange(int(sizes.sum()))
    doc = np.repeat(np.arange(lengths.size).repeat(2), sizes)
    src = torch.from_numpy(np.where(pos < lengths[doc], cu[:-1][doc] + pos, -1))
    pad, keep = src < 0, src.clamp_min(0)
    targets = torch.nn.functional.pad(labels.reshape(-1)[1:], (0, 1), value=-100)
    return (ids.reshape(-1).index_select(0, keep).masked_fill_(pad, pad_id),
            targets.index_select(0, keep).masked_fill_(pad, -100), torch.from_numpy(pos),
            torch.from_numpy(doc.astype(np.int32)))


def row_batch(row):
    """A ``[1, sum(row)]`` PackedBatch of random tokens with the given segment lengths."""
    import torch

    from packkit.batch import PackedBatch
    from packkit.segments import lengths_to_cu_seqlens, lengths_to_position_ids

    ids = torch.randint(1, 32000, (1, int(row.sum())), generator=torch.Generator().manual_seed(0))
    return PackedBatch(input_ids=ids, labels=ids.clone(), cu_seqlens=torch.from_numpy(lengths_to_cu_seqlens(row)),
                       position_ids=torch.from_numpy(lengths_to_position_ids(row))[None])


def shard_vs_plain(row, cp: int, layout: str, rounds: int, reps: int, old_shard) -> dict:
    """For rank ``cp - 1`` of ``row``, ``reps`` calls each of: ``shard`` of a collated batch (the collator planned it:
    ``plan_batch``, in the DataLoader worker), ``shard`` planning the batch itself, ``old_shard`` (a named revision's,
    planning itself), :func:`plain_zigzag`, and the collator's ``plan_batch`` alone; rotated rounds
    (:func:`rotating_rounds`) in process CPU time. The pair ratios against the plain zigzag and against the old shard,
    with their median and spread."""
    batch, collated, planned = row_batch(row), row_batch(row), row_batch(row)
    plan_batch(collated, cp_size=cp, cp_layout=layout)
    fns = {
        "collated": lambda: [shard(collated, cp_size=cp, rank=cp - 1, cp_layout=layout) for _ in range(reps)],
        "planning": lambda: [shard(batch, cp_size=cp, rank=cp - 1, cp_layout=layout) for _ in range(reps)],
        "old": lambda: [old_shard(batch, cp_size=cp, rank=cp - 1, cp_layout=layout) for _ in range(reps)],
        "plain": lambda: [plain_zigzag(batch.input_ids, batch.labels, batch.cu_seqlens, cp, cp - 1)
                          for _ in range(reps)],
        "plan_batch": lambda: [plan_batch(planned, cp_size=cp, cp_layout=layout) for _ in range(reps)],
    }
    for fn in fns.values():  # warm up
        fn()
    load = loadavg()
    t = rotating_rounds(fns, rounds)
    ms = {name: float(np.median(v)) / reps * 1e3 for name, v in t.items()}
    return {"collated": ratio_spread(t["collated"], t["plain"]), "planning": ratio_spread(t["planning"], t["plain"]),
            "old": ratio_spread(t["old"], t["plain"]), "collated_vs_old": ratio_spread(t["collated"], t["old"]),
            "planning_vs_old": ratio_spread(t["planning"], t["old"]), "ms": ms, "load": [load, loadavg()]}


def same_as_old(row, cp: int, layout: str, old_shard) -> tuple[bool, bool]:
    """Whether ``shard`` of a collated batch and ``shard`` planning itself hold the same tokens, targets, positions,
    documents and indices for rank ``cp - 1`` (and the same counts): the plan made in the worker is the rank's; and
    whether the old revision's does too (the hybrid's plan changed at cphyb: its dealing)."""
    batch, collated = row_batch(row), row_batch(row)
    plan_batch(collated, cp_size=cp, cp_layout=layout)
    got = [f(b, cp_size=cp, rank=cp - 1, cp_layout=layout) for f, b in ((shard, collated), (shard, batch),
                                                                          (old_shard, batch))]
    fields = ("input_ids", "shift_labels", "position_ids", "seq_idx", "index", "num_loss_tokens",
              "num_local_loss_tokens", "max_seqlen")
    same = lambda a, b: (a.shape == b.shape and bool((a == b).all())) if hasattr(a, "shape") else a == b  # noqa: E731
    return tuple(all(same(getattr(g, f), getattr(got[0], f)) for f in fields) for g in got[1:])


def check_plain_zigzag(row, cp: int) -> bool:
    """The baseline holds what ``shard(cp_layout="zigzag")`` holds (tokens, targets, positions, documents)."""
    batch = row_batch(row)
    s = shard(batch, cp_size=cp, rank=cp - 1, cp_layout="zigzag")
    ids, targets, pos, doc = plain_zigzag(batch.input_ids, batch.labels, batch.cu_seqlens, cp, cp - 1)
    return bool((s.input_ids[0] == ids).all() and (s.shift_labels[0] == targets).all()
                and (s.position_ids[0] == pos).all() and (s.seq_idx[0] == doc).all())


def short_row(window: int, seed: int, top: int = 32) -> np.ndarray:
    """Thousands of short documents: the real lengths of at most ``top`` tokens, drawn with replacement up to
    ``window`` tokens (the last one cut to fit): 1,472 documents at 32k (``top=32``), 2,727 (``top=16``)."""
    real = chat_lengths()
    pool = real[real <= top]
    draw = np.random.default_rng(seed).choice(pool, window)  # more than enough
    row = draw[: int(np.searchsorted(np.cumsum(draw), window)) + 1].copy()
    row[-1] -= int(row.sum()) - window
    return row[row > 0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200_000, help="chat examples (drawn with replacement past 17,545)")
    p.add_argument("--window", type=int, default=32_768)
    p.add_argument("--cp", default="2,4,8")
    p.add_argument("--rows", type=int, default=None, help="measure only the first N rows (quick runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=15, help="rotated rounds, shard against the plain zigzag")
    p.add_argument("--against", default="aaf59a2", help="the revision whose shard runs in the same rounds")
    p.add_argument("--reps", type=int, default=5, help="calls timed together in each half of a pair")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="the layouts of the shard timing (default: every one)")
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

    shapes = {"longest-document row": long_row, "median row": sorted(rows, key=len)[len(rows) // 2],
              "short-document row": short_row(args.window, args.seed),
              "shorter-document row": short_row(args.window, args.seed, top=16)}
    old_shard = package_at(args.against, "cp").shard
    old_plan_cp = package_at(args.against, "cp_plan").plan_cp
    print(f"\nthe hybrid's balance against {args.against}'s planner (busiest rank's causal work / mean rank's), over the "
          f"{len(rows):,} rows and the short-document rows: summed over the rows, worst row, and the worst row's ratio "
          f"of busiest ranks (today / {args.against})")
    record["balance_vs_against"] = []
    for cp in cps:
        for name, rs in (("chat rows", rows), ("short-document rows", list(shapes.values())[2:])):
            ours = [plan_cp(r, cp_size=cp, cp_layout="hybrid").work() for r in rs]
            theirs = [old_plan_cp(r, cp_size=cp, cp_layout="hybrid").work() for r in rs]
            imb = lambda ws: float(sum(w.max() for w in ws) / sum(w.mean() for w in ws))  # noqa: E731
            worst = lambda ws: float(max(w.max() / w.mean() for w in ws))  # noqa: E731
            top = float(max(a.max() / b.max() for a, b in zip(ours, theirs)))
            rec = {"cp": cp, "rows": name, "today": imb(ours), "against": imb(theirs), "worst_today": worst(ours),
                   "worst_against": worst(theirs), "worst_row_ratio": top}
            record["balance_vs_against"].append(rec)
            print(f"  cp {cp} {name}: today {rec['today']:.5f} (worst row {rec['worst_today']:.5f}), {args.against} "
                  f"{rec['against']:.5f} (worst row {rec['worst_against']:.5f}); busiest rank, worst row: {top:.4f}x")
    print(f"\nshard against a plain vectorised zigzag and against {args.against}'s shard, rank cp-1, {args.rounds} "
          f"rotated rounds of {args.reps} calls each, CPU time; ratio = ours / plain, median (lowest-highest round); "
          f"collated: the batch planned by the collator (plan_batch, in the DataLoader worker); planning: shard "
          f"planning the batch itself; target <= {TARGET_SHARD_RATIO}x")
    print(f"| row | docs | cp | layout | collated / plain | planning / plain | {args.against} / plain | collated / "
          f"{args.against} | planning / {args.against} | plain CPU ms | plan_batch CPU ms | load | |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    record["against"] = args.against
    record["shard_vs_plain"] = []
    fmt = lambda r: f"{r['median']:.2f}x ({r['low']:.2f}-{r['high']:.2f})"  # noqa: E731
    for name, row in shapes.items():
        for cp in cps:
            same = check_plain_zigzag(row, cp)
            for layout in args.layouts.split(","):
                same_plan, same_old = same_as_old(row, cp, layout, old_shard)
                m = shard_vs_plain(row, cp, layout, args.rounds, args.reps, old_shard)
                ok = m["collated"]["median"] <= TARGET_SHARD_RATIO
                ok_planning = m["planning"]["median"] <= TARGET_SHARD_RATIO
                record["shard_vs_plain"].append({"row": name, "docs": int(row.size), "cp": cp, "layout": layout,
                                                 "baseline_checked": same, "worker_plan_same": same_plan,
                                                 "same_as_old": same_old, **m})
                print(f"| {name} | {row.size:,} | {cp} | {layout} | {fmt(m['collated'])} | {fmt(m['planning'])} | "
                      f"{fmt(m['old'])} | {fmt(m['collated_vs_old'])} | {fmt(m['planning_vs_old'])} | "
                      f"{m['ms']['plain']:.3f} | "
                      f"{m['ms']['plan_batch']:.3f} | {m['load'][0]:.1f}-{m['load'][1]:.1f} | "
                      f"{'met' if ok else 'MISSED'}{'' if ok_planning else ' (planning: missed)'}"
                      f"{'' if same else ' (baseline differs from zigzag!)'}"
                      f"{'' if same_plan else ' (the collated shard differs from the planning one!)'}"
                      f"{'' if same_old else ' (differs from the old shard)'} |")
    emit_json(record, args.json_out)


if __name__ == "__main__":
    main()
