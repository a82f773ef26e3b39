"""DataLoader epoch throughput (tokens/s), fetch + collate, over a ``datasets.Dataset``.

Chat-like examples (SFT-like lengths: log-normal, median 250, clipped to [8, 4096]; the prompt third
masked with -100 in ``labels``), int64 ``input_ids`` and ``labels`` list columns, shuffled batches of
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

The rounds of the providers alternate, so a burst of load on a shared machine hits all of them; each
figure is the best of ``--repeats`` epochs. Prints a table last and one JSON line.
``python benchmarks/bench_loader.py [--quick] [--rows 10000] [--workers 0 2]``.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import numpy as np
import torch
from benchlib import parse_quick, sft_like_lengths, verdict, versions
from torch.utils.data import DataLoader

from packkit.collate import PaddingFreeCollator
from packkit.columnar import ColumnarDataset

TARGET = 20.0  # pf_columnar over hf_flatten, single process and with 2 workers (issue 13)


def make_dataset(rows: int, *, seed: int = 0, window: int = 4096):
    """A ``datasets.Dataset`` of chat-like examples: ``input_ids`` and ``labels`` (prompt third -100)."""
    import datasets
    import pyarrow as pa

    from packkit.arrow import list_array
    from packkit.segments import IGNORE_INDEX, lengths_to_offsets, lengths_to_position_ids, lengths_to_seq_idx

    lengths = sft_like_lengths(rows, seed=seed, high=window)
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
    args = parse_quick(parser, argv, "2,000 rows, one epoch each", rows=2000, repeats=1)

    import transformers
    from transformers import DataCollatorWithFlattening

    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    ds, total = make_dataset(args.rows)
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
        best = {name: float("inf") for name in loaders}
        if workers:
            for dl in loaders.values():  # start the persistent workers; not timed
                epoch(dl)
        for _ in range(args.repeats):
            for name, dl in loaders.items():
                seconds, tokens = epoch(dl)
                if name == "floor":  # its batches are copies of one: count the epoch's real tokens
                    seconds /= dl.collate_fn.scale
                else:
                    assert tokens == total, (name, tokens, total)
                best[name] = min(best[name], seconds)
        del loaders
        base = total / best["hf_flatten"]
        for name, seconds in best.items():
            rows.append({"workers": workers, "provider": name, "tokens": total, "seconds": seconds,
                         "mtok_per_s": total / seconds / 1e6, "speedup": (total / seconds) / base})

    def speedup(workers, provider="pf_columnar"):
        return next((r["speedup"] for r in rows if r["workers"] == workers and r["provider"] == provider), None)

    targets = {f"columnar_workers{w}": {"speedup": speedup(w), "target": TARGET} for w in args.workers}
    for t in targets.values():
        t["met"] = bool(t["speedup"] is not None and t["speedup"] >= t["target"])

    info = versions("transformers", "datasets", "pyarrow")
    print(f"# bench_loader: {args.rows:,} rows, {total:,} tokens, batch {args.batch_size}; "
          + ", ".join(f"{k} {v}" for k, v in info.items()))
    print(f"{'workers':>7s} {'provider':12s} {'seconds':>8s} {'Mtok/s':>8s} {'vs hf':>7s}")
    for r in rows:
        print(f"{r['workers']:7d} {r['provider']:12s} {r['seconds']:8.3f} {r['mtok_per_s']:8.2f} {r['speedup']:6.1f}x")
    for name, t in targets.items():
        print(f"target {name}: {verdict(t['speedup'], t['target'])}")
    print(json.dumps({"bench": "loader", "versions": info, "rows": args.rows, "tokens": total,
                      "batch_size": args.batch_size, "results": rows, "targets": targets}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
