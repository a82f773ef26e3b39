"""``plan_budget`` (what ``packkit plan`` runs) on real chat lengths, against named revisions in the same process.

Lengths: the 17,545 ShareGPT conversations of ``benchlib.chat_lengths()`` tiled ``--tile`` times (4: 70,180
examples, the longest 221,070 tokens), 8 ranks, advice off. Packed: ``W = 4096``, 2 windows per rank x 4
accumulation steps, ``overflow="split"``; padded: 8 examples per rank x 4 accumulation steps. Each revision's whole
package is imported beside today's (``benchlib.package_at``: its modules import each other, not today's) and called
with its own keywords (``devices`` or ``world_size``, ``warn`` or ``advice``); the calls rotate every round (each
revision first in turn), garbage collected before each call and disabled during it, in CPU time
(``time.process_time``). Prints the median CPU ms of each, the median and spread of the pair ratios revision /
today, the load average, and whether today's figures equal each revision's (``as_dict``; the revisions before the
dealt schedule, issue 29 part 4, print other imbalances by design).

    python benchmarks/bench_budget.py                              # against 05792ec~1, ~1 minute
    python benchmarks/bench_budget.py --against 6f900d5 main --rounds 15
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess

import numpy as np
from benchlib import chat_lengths, emit_json, loadavg, package_at, parse_quick, ratio_spread, rotating_rounds, versions

from packkit import budget

MODES = {"packed": dict(per_device_batch=2, accumulation_steps=4, window=4096, overflow="split"),
         "padded": dict(per_device_batch=8, accumulation_steps=4)}


def caller(module, lengths: np.ndarray, mode: str, ranks: int):
    """``plan_budget`` of ``module`` on ``lengths`` in ``mode``, with the keywords its revision spells."""
    params = inspect.signature(module.plan_budget).parameters
    kw = dict(MODES[mode])
    kw["devices" if "devices" in params else "world_size"] = ranks
    if "warn" in params:
        kw["warn"] = False
    else:
        kw["advice"] = module.AdviceOptions(warn=False)
    return lambda: module.plan_budget(lengths, **kw)


def resolve(rev: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run(["git", "-C", root, "rev-parse", "--short", rev], check=True, capture_output=True,
                          text=True).stdout.strip()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", nargs="+", default=["05792ec~1"], help="revisions to time beside today's")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--tile", type=int, default=4)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--json", default=None)
    args = parse_quick(p, argv, "3 rounds", rounds=3)
    lengths = np.tile(chat_lengths(), args.tile)
    revs = {resolve(r): package_at(resolve(r), "budget") for r in args.against}
    print(f"{lengths.size:,} examples, longest {int(lengths.max()):,}; {args.ranks} ranks; {versions('numpy')}")
    record = {"examples": int(lengths.size), "rounds": args.rounds, "modes": {}}
    print("| mode | today CPU ms | " + " | ".join(f"{r} CPU ms | {r} / today (pairs) | same figures as {r}"
                                              for r in revs) + " | load |")
    for mode in MODES:
        fns = {"today": caller(budget, lengths, mode, args.ranks)}
        fns.update({r: caller(m, lengths, mode, args.ranks) for r, m in revs.items()})
        mine = fns["today"]().as_dict()
        same = {r: fn().as_dict() == mine for r, fn in fns.items() if r != "today"}  # (and a warm call of each)
        load = loadavg()
        times = rotating_rounds(fns, args.rounds)
        load = (load + loadavg()) / 2
        cells, out = [f"{1e3 * np.median(times['today']):.1f}"], {"today_ms": 1e3 * float(np.median(times["today"]))}
        for r in revs:
            s = ratio_spread(times[r], times["today"])
            cells += [f"{1e3 * s['num_median']:.1f}", f"{s['median']:.2f} ({s['low']:.2f}-{s['high']:.2f})",
                      "yes" if same[r] else "no"]
            out[r] = {**s, "same_figures": same[r]}
        print(f"| {mode} | " + " | ".join(cells) + f" | {load:.1f} |")
        record["modes"][mode] = {**out, "load": load}
    emit_json(record, args.json)


if __name__ == "__main__":
    main()
