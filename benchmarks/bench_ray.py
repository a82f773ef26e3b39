"""Offline packing on Ray (packkit.raydata) against single-process packing, same data, same run.

Data: ``--n`` examples of real chat lengths by default (``--lengths chat``: ShareGPT conversations under Qwen3's
tokenizer, drawn with replacement; ``--lengths sft-like``: the synthetic lognormal, median 250, labelled), int32
token ids, window 2048, ``overflow="split"`` (nothing is
lost). Labels are left out unless ``--labels`` (they double the memory).

Providers, each timed from tokens in memory to packed Arrow rows (input_ids, [labels], seq_lengths):

* ``single``: one process: ``packkit.offline.pack_dataset`` on a ``datasets.Dataset`` of the same Arrow
  table when that module exists, else what it does: ``binpack.pack`` over all lengths +
  ``packer.pack_arrays`` + the Arrow row table. The table says which ran.
* ``ray local`` / ``ray global``: ``packkit.raydata.pack_dataset`` on a local Ray instance with
  ``--cpus`` workers (default 2, this machine's cores), over a dataset already in the object store
  (``--blocks`` blocks); ``ray.init`` and putting the input are timed apart.
* ``no-ray local``: the same per-block passes called in this process, one block after another: the
  per-block cost that the scaling estimate is built from.

``single``, ``ray local`` and ``ray global`` run in ``--repeat`` rounds after ``ray.init``, rotated every round (each
first in turn), garbage collected before each run and off during it (``benchlib.rotating_rounds``, wall time: Ray's
workers are other processes); medians, and the median and spread of the pair ratios single / Ray.

Scaling estimate: with the per-block compute ``c`` (pass 0 + pass 1, measured here without Ray), the
serial pass 2 ``c2`` and Ray's measured overhead ``o = T_ray - B*c/cpus - c2``, k workers take about
``o + B*c/k + c2`` (data already spread over the workers, network not modelled).

Usage: ``python benchmarks/bench_ray.py [--n 200000] [--blocks 8] [--cpus 2] [--repeat 3] [--labels]``.
Memory: about 5 bytes x tokens per copy of the tokens; 200,000 chat examples are ~450M tokens, ~1.8 GB a copy,
and the run holds about four copies (input, object store, two outputs). Use ``--n`` to shrink it.
Prints a table last, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import statistics
import time

import numpy as np
from benchlib import (LENGTH_SOURCES, add_lengths_option, bench_lengths, loadavg, ratio_spread, rotating_rounds,
                      spread_text, versions)

from packkit import raydata
from packkit.binpack import pack
from packkit.packer import pack_arrays



def make_table(lengths, labels: bool, seed=0):
    import pyarrow as pa

    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    ids = np.random.default_rng(seed).integers(0, 128_000, int(offsets[-1]), dtype=np.int32)
    cols = {"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))}
    if labels:
        cols["labels"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids.astype(np.int64)))
    return pa.table(cols)


def single_process(table, window, labels: bool):
    """What pack_dataset does on one machine: one plan over all lengths, one gather, Arrow rows."""
    import pyarrow as pa

    values, offsets, _ = raydata._list_column(table, "input_ids")
    labs = raydata._list_column(table, "labels")[0] if labels else None
    plan = pack(np.diff(offsets), window=window, overflow="split")
    rows = pack_arrays(plan.shuffled(0), values, offsets, labs)
    return raydata._rows_table(rows, labels, pa.int32()), plan.num_windows, plan.lower_bound


def hf_single_process(table, window):
    """packkit.offline.pack_dataset on a datasets.Dataset holding the same Arrow table."""
    import datasets
    from datasets.table import InMemoryTable

    from packkit import offline as hf

    import inspect

    # A given fingerprint: otherwise datasets hashes every token to make one (seconds, not packing).
    ds = datasets.Dataset(InMemoryTable(table), fingerprint=datasets.fingerprint.generate_random_fingerprint())
    quiet = {"progress": False} if "progress" in inspect.signature(hf.pack_dataset).parameters else {}
    out = hf.pack_dataset(ds, window=window, overflow="split", **quiet)
    packed = out[0] if isinstance(out, tuple) else out
    tokens = int(np.asarray(packed.data.table.column("seq_lengths").combine_chunks().flatten()).sum())
    return packed, len(packed), -(-tokens // window)


def no_ray_local(blocks, window, labels: bool, opts):
    """The local mode's passes in this process, block after block: (seconds per stage, windows)."""
    t = time.perf_counter()
    for b in blocks:
        raydata._block_lengths(b, "input_ids", "labels" if labels else None)
    t0 = time.perf_counter() - t
    t = time.perf_counter()
    outs = [raydata._pass1_block(b, i, opts) for i, b in enumerate(blocks)]
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    import pyarrow as pa

    tail, stats = raydata._pass2_tail(opts, pa.int32(), len(blocks), *[o[1] for o in outs])
    t2 = time.perf_counter() - t
    windows = sum(o[2]["windows"] for o in outs) + stats["windows"]
    return t0, t1, t2, windows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--labels", action="store_true")
    ap.add_argument("--object-store-gb", type=float, default=None,
                    help="Ray object store size (default: 3 copies of the tokens, at least 1 GB)")
    add_lengths_option(ap)
    args = ap.parse_args(argv)
    import pyarrow as pa
    import ray
    import ray.data

    W = args.window
    lengths = bench_lengths(args.lengths, args.n)
    tokens = int(lengths.sum())
    lb = -(-tokens // W)
    table = make_table(lengths, args.labels)
    cuts = np.linspace(0, args.n, args.blocks + 1).astype(int)
    blocks = [table.slice(a, b - a) for a, b in zip(cuts[:-1], cuts[1:])]
    print(f"{args.n:,} examples, {tokens:,} tokens, W={W}, lower bound {lb:,} windows, "
          f"{args.blocks} blocks, labels={args.labels}; {LENGTH_SOURCES[args.lengths]}", flush=True)
    results = []

    # -- single process --
    has_hf = importlib.util.find_spec("packkit.offline") is not None
    if has_hf:
        from packkit import offline as hf
        has_hf = hasattr(hf, "pack_dataset")
    name = "single: packkit.offline.pack_dataset" if has_hf else "single: binpack.pack + pack_arrays"
    fn = (lambda: hf_single_process(table, W)) if has_hf else (lambda: single_process(table, W, args.labels))

    # -- the local mode's passes without Ray --
    opts = dict(window=W, strategy="bfd", overflow="split", seed=0, shuffle=True, tail_slack=0.0005,
                input_key="input_ids", label_key="labels", has_labels=args.labels,
                label_type=pa.int64() if args.labels else None, mask_first_label=True)
    stage = []
    for _ in range(args.repeat):
        gc.collect()
        stage.append(no_ray_local(blocks, W, args.labels, opts))
    t0, t1, t2, windows = min(stage, key=lambda s: s[0] + s[1] + s[2])
    results.append({"provider": "no-ray local (1 core, blocks in turn)", "seconds": t0 + t1 + t2,
                    "windows": windows, "over_lb": windows - lb})
    print(f"  no-ray local: pass0 {t0:.2f}s pass1 {t1:.2f}s pass2 {t2:.3f}s", flush=True)

    # -- Ray --
    store = args.object_store_gb or max(1.0, 3 * tokens * (12 if args.labels else 4) / 1e9)
    t = time.perf_counter()
    ray.init(num_cpus=args.cpus, include_dashboard=False, object_store_memory=int(store * 1e9),
             log_to_driver=False, configure_logging=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    init_t = time.perf_counter() - t
    t = time.perf_counter()
    ds = ray.data.from_arrow(blocks)
    put_t = time.perf_counter() - t
    assert ds.num_blocks() == args.blocks
    got = {}

    def single():
        got["single"] = fn()[1]

    def on_ray(mode):
        def one():
            out, report = raydata.pack_dataset(ds, window=W, mode=mode, overflow="split", return_report=True)
            assert report.tokens == tokens, "tokens lost"
            got[mode] = report
        return one

    load = loadavg()
    names = {"single": name, "local": f"ray local ({args.cpus} cpus)", "global": f"ray global ({args.cpus} cpus)"}
    times = rotating_rounds({"single": single, "local": on_ray("local"), "global": on_ray("global")}, args.repeat,
                            clock=time.perf_counter)
    single_t = statistics.median(times["single"])
    results.insert(0, {"provider": name, "seconds": single_t, "windows": got["single"],
                       "over_lb": got["single"] - lb})
    ray_t, pairs = {}, {}
    for mode in ("local", "global"):
        report = got[mode]
        ray_t[mode] = statistics.median(times[mode])
        pairs[mode] = ratio_spread(times["single"], times[mode])
        extra = f" (handed {report.handed_windows} windows -> {report.pass2_windows})" if mode == "local" else ""
        results.append({"provider": names[mode], "seconds": ray_t[mode], "windows": report.windows,
                        "over_lb": report.windows_over_lower_bound, "note": extra.strip(), "single_over": pairs[mode]})
        print(f"  ray {mode}: {ray_t[mode]:.2f}s{extra}; single / ray {spread_text(pairs[mode])}", flush=True)
    ray.shutdown()

    # -- scaling estimate from the measured per-block cost --
    B = args.blocks
    c = (t0 + t1) / B
    overhead = ray_t["local"] - B * c / args.cpus - t2
    est = {k: overhead + B * c / k + t2 for k in (1, 2, 4, 8)}
    est_note = (f"per-block compute c={c:.3f}s (pass0+pass1), pass2 c2={t2:.3f}s, Ray overhead "
                f"o={overhead:.2f}s; local mode with k workers ~ o + {B}*c/k + c2")

    print()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"ray {ray.__version__}, pyarrow {pa.__version__}, numpy {np.__version__}")
    print(f"data: {args.n:,} examples, {tokens:,} tokens, W={W}, lower bound {lb:,}; "
          f"ray.init {init_t:.1f}s and putting the input {put_t:.1f}s not counted below")
    print(f"wall medians of {args.repeat} rotated rounds (single, ray local, ray global), load {load:.1f}-{loadavg():.1f}")
    print(f"{'provider':<44} {'seconds':>8} {'vs single':>9} {'windows':>9} {'over LB':>8} {'over LB %':>9}")
    for r in results:
        print(f"{r['provider']:<44} {r['seconds']:>8.2f} {single_t / r['seconds']:>8.2f}x "
              f"{r['windows']:>9,} {r['over_lb']:>8} {100 * r['over_lb'] / lb:>8.4f}%")
    for mode, sp in pairs.items():
        print(f"single / ray {mode}, pair ratios: {spread_text(sp)}")
    print(est_note)
    print("estimate, local mode, same data: " + ", ".join(f"{k} workers ~{v:.2f}s" for k, v in est.items()))
    print(json.dumps({"bench": "ray", "versions": versions("ray", "pyarrow", "datasets"), "n": args.n, "tokens": tokens, "window": W, "blocks": B,
                      "cpus": args.cpus, "lower_bound": lb, "ray_init_s": init_t, "put_s": put_t,
                      "lengths": args.lengths, "results": results, "per_block_s": c, "pass2_s": t2, "ray_overhead_s": overhead,
                      "estimate_s": est}))


if __name__ == "__main__":
    main()
