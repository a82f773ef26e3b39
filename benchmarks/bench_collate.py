"""Collate throughput (tokens/s): packkit's collators against transformers' DataCollatorWithFlattening.

Real chat lengths by default (``--lengths chat``: ShareGPT conversations under Qwen3's tokenizer, those of at
most ``--window`` tokens; ``--lengths sft-like`` for the synthetic lognormal, labelled), random token ids, a masked
prompt (``labels`` -100 on the first third), given as Python lists and as numpy arrays, mini-batches of 8, 32
and 128. Providers, measured in the
same run on the same batches:

* ``hf_flatten``   ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` (the baseline)
* ``padding_free`` ``packkit.collate.PaddingFreeCollator()``
* ``fixed_window`` ``packkit.collate.FixedWindowCollator(window=W)`` (best fit inside the batch)

``--repeats`` rounds of ``--iters`` calls each, the providers rotating within every round (each goes first in
turn), garbage collected before each round's call and off during it (``benchlib.rotating_rounds``, CPU time);
the figures are medians, and beside each the median and spread (lowest-highest, middle half) of the pair ratios
baseline / provider. Prints a table last and one JSON line.
``python benchmarks/bench_collate.py [--quick] [--batch-sizes 32]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
from benchlib import (LENGTH_SOURCES, add_lengths_option, bench_lengths, parse_quick, ratio_spread, rotating_rounds,
                      spread_text, verdict, versions, loadavg)
import torch

from packkit.collate import FixedWindowCollator, PaddingFreeCollator

TARGET_LIST, TARGET_NUMPY = 10.0, 50.0  # speed-ups over the baseline at batch 32 (issue 3)


def make_examples(num: int, *, seed: int, window: int, as_numpy: bool, source: str = "chat") -> list[dict]:
    """Examples of ``source`` lengths (``--lengths``) of at most ``window`` tokens, prompt third masked."""
    rng = np.random.default_rng(seed)
    lengths = bench_lengths(source, num, seed=seed, high=window)
    out = []
    for n in lengths.tolist():
        ids = rng.integers(0, 32000, n, dtype=np.int64)
        labels = ids.copy()
        labels[: n // 3] = -100
        if as_numpy:
            out.append({"input_ids": ids, "labels": labels})
        else:
            out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def time_providers(providers: dict, batches, *, iters: int, repeats: int) -> dict:
    """Seconds per call of every provider, round by round (``{name: [seconds, ...]}``), over ``repeats`` rotated
    rounds, each ``iters`` calls cycling through ``batches``."""
    for fn in providers.values():
        fn(batches[0])
    rounds = {name: (lambda fn=fn: [fn(batches[k % len(batches)]) for k in range(iters)])
              for name, fn in providers.items()}
    return {name: [t / iters for t in ts] for name, ts in rotating_rounds(rounds, repeats).items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=7)
    add_lengths_option(parser)
    args = parse_quick(parser, argv, "fewer iterations", iters=5, repeats=2)

    import transformers
    from transformers import DataCollatorWithFlattening

    providers = {
        "hf_flatten": DataCollatorWithFlattening(return_flash_attn_kwargs=True),
        "padding_free": PaddingFreeCollator(),
        "fixed_window": FixedWindowCollator(window=args.window),
    }
    rows = []
    for input_kind in ("list", "numpy"):
        for bs in args.batch_sizes:
            batches = [make_examples(bs, seed=s, window=args.window, as_numpy=input_kind == "numpy",
                                     source=args.lengths) for s in range(4)]
            tokens = np.mean([sum(len(e["input_ids"]) for e in b) for b in batches])
            # the same examples give the same tokens through every provider
            ref = providers["hf_flatten"](batches[0])
            ours = providers["padding_free"](batches[0])
            assert torch.equal(ref["input_ids"], ours.input_ids) and torch.equal(ref["labels"], ours.labels)
            assert torch.equal(ref["position_ids"], ours.position_ids)
            times = time_providers(providers, batches, iters=args.iters, repeats=args.repeats)
            for name, ts in times.items():
                s = ratio_spread(times["hf_flatten"], ts)
                t = s["den_median"]
                rows.append({"input": input_kind, "batch": bs, "provider": name, "tokens": float(tokens),
                             "us_per_batch": t * 1e6, "mtok_per_s": tokens / t / 1e6,
                             "speedup": s["median"], "spread": s})

    def speedup(kind, provider="padding_free", bs=32):
        return next((r["speedup"] for r in rows
                     if r["input"] == kind and r["batch"] == bs and r["provider"] == provider), None)

    targets = {
        "list_bs32_padding_free": {"speedup": speedup("list"), "target": TARGET_LIST},
        "numpy_bs32_padding_free": {"speedup": speedup("numpy"), "target": TARGET_NUMPY},
    }
    for t in targets.values():
        t["met"] = bool(t["speedup"] is not None and t["speedup"] >= t["target"])

    print(f"# bench_collate: python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {platform.machine()}, window={args.window}; lengths: "
          f"{LENGTH_SOURCES[args.lengths]}; {args.repeats} rotated rounds of {args.iters} calls, CPU time, medians; "
          f"load {loadavg():.1f}")
    print(f"{'input':6s} {'batch':>5s} {'provider':14s} {'tokens':>8s} {'us/batch':>10s} {'Mtok/s':>8s} "
          f"{'hf / provider, pair ratios':>38s}")
    for r in rows:
        print(f"{r['input']:6s} {r['batch']:5d} {r['provider']:14s} {r['tokens']:8.0f} {r['us_per_batch']:10.1f} "
              f"{r['mtok_per_s']:8.2f} {spread_text(r['spread']):>38s}")
    for name, t in targets.items():
        print(f"target {name}: {verdict(t['speedup'], t['target'])}")
    print(json.dumps({"bench": "collate", "versions": versions("transformers"), "window": args.window,
                      "lengths": args.lengths, "load": loadavg(), "rows": rows, "targets": targets}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
