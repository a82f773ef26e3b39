"""DataLoader epoch throughput (tokens/s), fetch + collate, over a ``datasets.Dataset``.

Real chat lengths by default (``--lengths chat``: ShareGPT conversations under Qwen3's tokenizer, those of at
most 4,096 tokens; ``--lengths sft-like``: the synthetic lognormal, median 250, labelled), random token ids, the
prompt third masked with -100 in ``labels``, int64 ``input_ids`` and ``labels`` list columns, shuffled batches of
32. One epoch of ``torch.utils.data.DataLoader`` per measurement; with workers the loader is
persistent and a first epoch warms it up (worker start-up is not counted for any provider). Providers,
measured in the same run over the same dataset and the same batches:

* ``hf_flatten``      ``DataLoader(ds, collate_fn=DataCollatorWithFlattening(return_flash_attn_kwargs=True))``,
                      the baseline a transformers user picks
* ``pf_rows``         ``DataLoader(ds, collate_fn=PaddingFreeCollator())`` (``datasets`` rows as Python lists)
* ``pf_numpy``        the same over ``ds.with_format("numpy")``
* ``pf_columnar``     ``DataLoader(ColumnarDataset(ds), collate_fn=PaddingFreeCollator())``: no token becomes
                      a Python object
* ``floor``           (with workers only) a loader whose workers return one prebuilt batch of the same
                      kind without fetching or collating: what the DataLoader's own worker protocol
                      (indices out, batch back) costs, a ceiling for every provider

``--repeats`` rounds, one epoch of every provider a round, the order rotated every round (each goes first in
turn), garbage collected before each epoch and off during it (``benchlib.rotating_rounds``, wall time: the
workers' CPU is not this process's). Figures: median epoch seconds, and the median and spread (lowest-highest,
middle half) of the pair ratios baseline / provider. Prints a table last and one JSON line.
``python benchmarks/bench_loader.py [--quick] [--rows 10000] [--workers 0 2]``.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import numpy as np
import torch
from benchlib import (LENGTH_SOURCES, add_lengths_option, bench_lengths, loadavg, parse_quick, ratio_spread,
                      rotating_rounds, spread_text, verdict, versions)
from torch.utils.data import DataLoader

from packkit.collate import PaddingFreeCollator
from packkit.columnar import ColumnarDataset

TARGET = 20.0  # pf_columnar over hf_flatten, single process and with 2 workers (issue 13)


def make_dataset(rows: int, *, seed: int = 0, window: int = 4096, source: str = "chat"):
    """A ``datasets.Dataset`` of ``source`` lengths (``--lengths``): ``input_ids`` and ``labels`` (prompt third
    -100)."""
    import datasets
    import pyarrow as pa

    from packkit.arrow import list_array
    from packkit.segments import IGNORE_INDEX, lengths_to_offsets, lengths_to_position_ids, lengths_to_seq_idx

    lengths = bench_lengths(source, rows, seed=seed, high=window)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 32000, int(lengths.sum()), dtype=np.int64)
    labels = ids.copy()
    prompt = lengths // 3
    labels[lengths_to_position_ids(lengths) < prompt[lengths_to_seq_idx(lengths)]] = IGNORE_INDEX
    offsets = lengths_to_offsets(lengths)
    table = pa.table({"input_ids": list_array(offsets, ids), "labels": list_array(offsets, labels)})
    return datasets.Dataset(table), int(lengths.sum())


def loader(dataset, collate, *, workers: int, batch_size: int, seed: int):
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=collate, num_workers=workers,
                      persistent_workers=workers > 0, generator=torch.Generator().manual_seed(seed),
                      prefetch_factor=4 if workers else None)


class _Indices:
    """A dataset whose batch is its indices (the floor provider fetches nothing)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitems__(self, indices):
        return indices


class _Ready:
    """Returns one prebuilt batch for every batch of indices, scaled so an epoch counts ``total`` tokens."""

    def __init__(self, batch, total: int, batches: int):
        self.batch, self.scale = batch, total / (batch["input_ids"].numel() * batches)

    def __call__(self, indices):
        return self.batch


def epoch(dl) -> tuple[float, int]:
    """Seconds for one pass over ``dl`` and the tokens it yielded."""
    start = time.perf_counter()
    tokens = 0
    for batch in dl:
        tokens += int(batch["input_ids"].numel())
    return time.perf_counter() - start, tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--repeats", type=int, default=5)
    add_lengths_option(parser)
    args = parse_quick(parser, argv, "2,000 rows, two epochs each", rows=2000, repeats=2)

    import transformers
    from transformers import DataCollatorWithFlattening

    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    ds, total = make_dataset(args.rows, source=args.lengths)
    providers = {
        "hf_flatten": (ds, DataCollatorWithFlattening(return_flash_attn_kwargs=True)),
        "pf_rows": (ds, PaddingFreeCollator()),
        "pf_numpy": (ds.with_format("numpy"), PaddingFreeCollator()),
        "pf_columnar": (ColumnarDataset(ds), PaddingFreeCollator()),
    }
    # the same batch gives the same tokens and labels through the baseline and the columnar path
    first = list(range(args.batch_size))
    ref = providers["hf_flatten"][1]([ds[i] for i in first])
    ours = PaddingFreeCollator()(providers["pf_columnar"][0].__getitems__(first))
    assert torch.equal(ref["input_ids"], ours.input_ids) and torch.equal(ref["labels"], ours.labels)
    assert torch.equal(ref["position_ids"], ours.position_ids)

    ready = PaddingFreeCollator()(providers["pf_columnar"][0].__getitems__(first))
    rows = []
    for workers in args.workers:
        loaders = {name: loader(d, c, workers=workers, batch_size=args.batch_size, seed=1)
                   for name, (d, c) in providers.items()}
        if workers:
            loaders["floor"] = loader(_Indices(len(ds)), _Ready(ready, total, len(ds) // args.batch_size + 1),
                                      workers=workers, batch_size=args.batch_size, seed=1)
        if workers:
            for dl in loaders.values():  # start the persistent workers; not timed
                epoch(dl)

        def run(name, dl):
            def one():
                tokens = epoch(dl)[1]
                assert name == "floor" or tokens == total, (name, tokens, total)
            return one

        times = rotating_rounds({name: run(name, dl) for name, dl in loaders.items()}, args.repeats,
                                clock=time.perf_counter)
        if workers:  # the floor's batches are copies of one: count the epoch's real tokens
            times["floor"] = [t / loaders["floor"].collate_fn.scale for t in times["floor"]]
        del loaders
        for name, ts in times.items():
            spread = ratio_spread(times["hf_flatten"], ts)
            seconds = spread["den_median"]
            rows.append({"workers": workers, "provider": name, "tokens": total, "seconds": seconds,
                         "mtok_per_s": total / seconds / 1e6, "speedup": spread["median"], "spread": spread})

    def speedup(workers, provider="pf_columnar"):
        return next((r["speedup"] for r in rows if r["workers"] == workers and r["provider"] == provider), None)

    targets = {f"columnar_workers{w}": {"speedup": speedup(w), "target": TARGET} for w in args.workers}
    for t in targets.values():
        t["met"] = bool(t["speedup"] is not None and t["speedup"] >= t["target"])

    info = versions("transformers", "datasets", "pyarrow")
    print(f"# bench_loader: {args.rows:,} rows, {total:,} tokens, batch {args.batch_size}; lengths: "
          f"{LENGTH_SOURCES[args.lengths]}; {args.repeats} rotated rounds, wall medians; load {loadavg():.1f}; "
          + ", ".join(f"{k} {v}" for k, v in info.items()))
    print(f"{'workers':>7s} {'provider':12s} {'seconds':>8s} {'Mtok/s':>8s} {'hf / provider, pair ratios':>38s}")
    for r in rows:
        print(f"{r['workers']:7d} {r['provider']:12s} {r['seconds']:8.3f} {r['mtok_per_s']:8.2f} "
              f"{spread_text(r['spread']):>38s}")
    for name, t in targets.items():
        print(f"target {name}: {verdict(t['speedup'], t['target'])}")
    print(json.dumps({"bench": "loader", "versions": info, "rows": args.rows, "tokens": total,
                      "lengths": args.lengths, "load": loadavg(),
                      "batch_size": args.batch_size, "results": rows, "targets": targets}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
