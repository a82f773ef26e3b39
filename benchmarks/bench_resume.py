"""What exact resume costs a training loop: packkit's sampler against the sampler before issue 27, the
collate time of the same batches as the scale.

Exact resume adds nothing to a batch: the sampler learns what the loop consumed by asking the DataLoader
iterator that drives it (a walk of a few frames at ``iter()``, one attribute read at ``state_dict()``),
and a pass is an iterator object instead of a generator. On real ShareGPT lengths, one epoch of
``PackedBatchSampler(window=2048, windows_per_batch=8, overflow="truncate", balance="compute")`` through
``DataLoader(num_workers=0)`` with ``FixedWindowCollator``, the loop calling ``sampler.state_dict()``
after every batch as the README's loop does; the two samplers alternate, round after round, GC outside
the clock; the median and spread of the pair ratios packkit / before are printed. The baseline is the sampler of ``--baseline`` (a git revision), loaded beside this one.

    python benchmarks/bench_resume.py                  # ~1 minute on 2 cores
    python benchmarks/bench_resume.py --rounds 3 --n 4000

Prints a table last, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from benchlib import chat_lengths, loadavg, ratio_spread, spread_text, versions

ROOT = Path(__file__).resolve().parents[1]


def baseline_sampler(rev: str):
    """packkit.sampler as it was at ``rev``, imported beside the current one (its relative imports resolve
    into today's packkit: only the sampler module differs)."""
    text = subprocess.run(["git", "show", f"{rev}:packkit/sampler.py"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    path = Path(tempfile.mkdtemp()) / "sampler_baseline.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("packkit._sampler_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class Rows:
    """Example ``i``: ``lengths[i]`` token ids (a numpy array, as a memory-mapped dataset gives)."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return {"input_ids": np.full(int(self.lengths[i]), 7, np.int64)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=None, help="conversations (default: all 17,545)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline", default="e2e3791", help="git revision of the sampler before issue 27")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from torch.utils.data import DataLoader

    import packkit.sampler as current
    from packkit.collate import FixedWindowCollator

    before = baseline_sampler(args.baseline)
    lengths = chat_lengths(args.n)
    rows = Rows(lengths)
    kw = dict(window=2048, windows_per_batch=8, overflow="truncate", balance="compute", seed=0, rank=0,
              world_size=1)
    collate = FixedWindowCollator(window=2048, strategy="next_fit", num_windows=8, overflow="truncate",
                                  loss_mask="none")
    samplers = {"before": before.PackedBatchSampler(lengths, **kw), "packkit": current.PackedBatchSampler(lengths, **kw)}
    for s in samplers.values():
        s.epoch_stats()  # the epoch built outside the clock
    batches = [b for b in samplers["packkit"]]
    items = [[rows[i] for i in b] for b in batches]

    def loop(sampler) -> float:
        loader = DataLoader(rows, batch_sampler=sampler, collate_fn=collate)
        gc.collect()
        gc.disable()
        t = time.perf_counter()
        for _ in loader:
            sampler.state_dict()
        out = time.perf_counter() - t
        gc.enable()
        return out

    def collate_only() -> float:
        gc.collect()
        gc.disable()
        t = time.perf_counter()
        for x in items:
            collate(x)
        out = time.perf_counter() - t
        gc.enable()
        return out

    def calls(sampler, reps=2000) -> tuple[float, float]:
        """Seconds per iter() (with the first batch) and per state_dict() in a pass, outside a DataLoader."""
        gc.collect()
        t = time.perf_counter()
        for _ in range(reps):
            next(iter(sampler))
        per_iter = (time.perf_counter() - t) / reps
        t = time.perf_counter()
        for _ in range(reps):
            sampler.state_dict()
        return per_iter, (time.perf_counter() - t) / reps

    times = {"before": [], "packkit": [], "collate": []}
    for r in range(args.rounds):
        order = ["before", "packkit"] if r % 2 == 0 else ["packkit", "before"]
        for name in order:
            times[name].append(loop(samplers[name]))
        times["collate"].append(collate_only())
    per_call = {name: calls(s) for name, s in samplers.items()}
    med = {k: float(np.median(v)) for k, v in times.items()}
    overhead = (med["packkit"] - med["before"]) / med["collate"]
    spread = {k: (min(v), max(v)) for k, v in times.items()}
    pairs = ratio_spread(times["packkit"], times["before"])

    print(f"{lengths.size:,} ShareGPT conversations, {len(batches)} batches of 8 windows of 2,048, "
          f"{args.rounds} rounds alternating; {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}")
    print(f"{'':28s}{'median s':>10s}{'min s':>9s}{'max s':>9s}")
    for name, label in (("before", f"loop, sampler of {args.baseline}"), ("packkit", "loop, packkit's sampler"),
                        ("collate", "collate alone")):
        print(f"{label:28s}{med[name]:10.3f}{spread[name][0]:9.3f}{spread[name][1]:9.3f}")
    for name in samplers:
        i, s = per_call[name]
        print(f"{name:10s} iter()+first batch {i * 1e6:8.1f} us   state_dict() {s * 1e6:8.1f} us")
    print(f"packkit / {args.baseline}, pair ratios: {spread_text(pairs)}; load {loadavg():.1f}")
    print(f"overhead: {med['packkit'] - med['before']:+.4f} s an epoch = {overhead:+.2%} of the collate time "
          f"({len(batches)} state_dict() calls included)")
    record = {"bench": "resume", "examples": int(lengths.size), "batches": len(batches), "rounds": args.rounds,
              "median_s": med, "overhead_of_collate": overhead, "packkit_over_before": pairs,
              "iter_us": {k: v[0] * 1e6 for k, v in per_call.items()},
              "state_dict_us": {k: v[1] * 1e6 for k, v in per_call.items()}, "versions": versions("numpy", "torch")}
    print(json.dumps(record))
    if args.json:
        Path(args.json).write_text(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
