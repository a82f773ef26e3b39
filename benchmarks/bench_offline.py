"""Offline packing of a ``datasets.Dataset``: packkit's ``pack_dataset`` against TRL's ``pack_dataset``.

The data: ``--n`` SFT-like examples (default 1,000,000), lengths lognormal with median 250 and sigma 1,
rounded and clipped to [8, 4096]; token ids int32 from numpy (a random block of 2**24 ids tiled to the
total, since the ids' values do not change the work); one ``input_ids`` list column built from Arrow
arrays. Window ``W = 2048``.

Providers, measured in the same run on the same Dataset:

* ``trl bfd (default)``: ``trl.data_utils.pack_dataset(ds, W, strategy="bfd")``. TRL runs its best fit
  inside ``Dataset.map(batched=True)`` with map's default ``batch_size=1000``: it packs each chunk of
  1,000 examples on its own, so every chunk leaves a part-filled tail window.
* ``trl bfd (whole dataset)``: the same with ``map_kwargs={"batch_size": len(ds)}``: one plan over the
  whole dataset.
* ``packkit bfd (truncate)``: ``packkit.hf.pack_dataset(ds, window=W, overflow="truncate")``, the
  policy TRL's ``bfd`` applies (TRL truncates over-long examples and says nothing; packkit counts the
  cut tokens). Rows are shuffled (seeded), as packkit does by default.
* ``packkit bfd (split)``: ``overflow="split"``: no token lost.

Reported: seconds, rows, rows over the lower bound ``ceil(kept tokens / W)``, tokens cut. Target: packkit
at least 8x faster than TRL's whole-dataset bfd at equal or fewer rows.

``--stream-table`` instead prints the fill of :func:`packkit.packer.pack_stream` against buffer size.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time

import numpy as np
from benchlib import sft_like_lengths, versions



def make_dataset(lengths: np.ndarray, *, seed: int = 0):
    """A ``datasets.Dataset`` with one ``input_ids`` column (int32 ids), built from Arrow arrays."""
    import datasets
    import pyarrow as pa
    from datasets.fingerprint import generate_random_fingerprint

    rng = np.random.default_rng(seed)
    total = int(lengths.sum())
    block = rng.integers(0, 32000, min(total, 1 << 24), dtype=np.int32)
    values = np.resize(block, total)
    offsets = np.zeros(lengths.size + 1, np.int32 if total < 2**31 else np.int64)
    np.cumsum(lengths, out=offsets[1:])
    cls = pa.ListArray if offsets.dtype == np.int32 else pa.LargeListArray
    col = cls.from_arrays(pa.array(offsets), pa.array(values))
    # A given fingerprint: otherwise datasets hashes every token to make one.
    return datasets.Dataset(pa.table({"input_ids": col}), fingerprint=generate_random_fingerprint())


def timed(fn):
    gc.collect()
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def stream_table(n: int, window: int) -> None:
    from packkit.binpack import pack
    from packkit.binpack import stream_windows

    lengths = np.minimum(sft_like_lengths(n), window)
    lb = -(-int(lengths.sum()) // window)
    rows = []
    for buffer in (1, 10, 100, 1000, 10000):
        t = time.perf_counter()
        windows = sum(1 for _ in stream_windows(zip(range(n), lengths.tolist()), window=window, buffer_size=buffer))
        rows.append((f"stream buffer={buffer}", windows, time.perf_counter() - t))
    t = time.perf_counter()
    plan = pack(lengths, window=window)
    rows.append(("offline bfd", plan.num_windows, time.perf_counter() - t))
    print(f"{n:,} SFT-like lengths truncated to W={window}; lower bound {lb:,} windows")
    print(f"{'planner':<22}{'windows':>10}{'fill':>9}{'over bound':>12}{'seconds':>9}")
    for name, w, s in rows:
        print(f"{name:<22}{w:>10,}{lengths.sum() / (w * window):>9.4f}{(w - lb) / lb:>12.3%}{s:>9.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="examples (default 1,000,000)")
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each provider; the best is reported")
    parser.add_argument("--no-trl-default", action="store_true", help="skip TRL's chunked default mode (slowest)")
    parser.add_argument("--stream-table", action="store_true", help="print streaming fill against buffer size")
    args = parser.parse_args(argv)
    if args.stream_table:
        stream_table(min(args.n, 200_000), args.window)
        return 0

    import datasets
    import trl
    from trl.data_utils import pack_dataset as trl_pack

    import packkit
    from packkit.hf import pack_dataset

    datasets.disable_progress_bars()
    W = args.window
    t = time.perf_counter()
    lengths = sft_like_lengths(args.n)
    ds = make_dataset(lengths)
    print(f"built {args.n:,} examples, {int(lengths.sum()):,} tokens (int32) in {time.perf_counter() - t:.1f}s",
          file=sys.stderr)
    kept_trunc = int(np.minimum(lengths, W).sum())
    cut_trunc = int(lengths.sum()) - kept_trunc
    over = int((lengths > W).sum())

    def list_tokens(out, name):
        """Tokens in a list column, from its offsets."""
        return sum(int(c.offsets[-1].as_py()) - int(c.offsets[0].as_py())
                   for c in out.data.table.column(name).chunks if len(c))

    providers = []
    if not args.no_trl_default:
        providers.append(("trl bfd (default, chunks of 1000)", lambda: trl_pack(ds, W, strategy="bfd"), "trl",
                          kept_trunc))
    providers += [
        ("trl bfd (whole dataset)", lambda: trl_pack(ds, W, strategy="bfd", map_kwargs={"batch_size": len(ds)}),
         "trl", kept_trunc),
        ("packkit bfd (truncate)", lambda: pack_dataset(ds, window=W, overflow="truncate", progress=False,
                                                        return_plan=True), "packkit", kept_trunc),
        ("packkit bfd (split)", lambda: pack_dataset(ds, window=W, overflow="split", progress=False,
                                                     return_plan=True), "packkit", int(lengths.sum())),
    ]
    import logging

    logging.getLogger("packkit").setLevel(logging.ERROR)  # the truncation count is in the table
    results = []
    for name, fn, kind, kept in providers:
        best = None
        for _ in range(args.repeat):
            secs, out = timed(fn)
            if kind == "packkit":
                out, plan = out
                rows, tokens, cut = len(out), plan.total_tokens, plan.cut_tokens
                # nothing lost: the packed rows hold exactly the kept tokens
                assert list_tokens(out, "input_ids") == tokens
            else:
                rows = len(out)
                tokens = list_tokens(out, "input_ids")
                cut = int(lengths.sum()) - tokens
            del out
            best = secs if best is None else min(best, secs)
        lb = -(-kept // W)
        results.append(dict(provider=name, seconds=round(best, 3), rows=rows, lower_bound=lb,
                            rows_over_bound=rows - lb, tokens=tokens, cut_tokens=cut))
        print(f"{name}: {best:.2f}s, {rows:,} rows", file=sys.stderr)

    whole = next(r for r in results if r["provider"] == "trl bfd (whole dataset)")
    ours = next(r for r in results if r["provider"] == "packkit bfd (truncate)")
    speedup = whole["seconds"] / ours["seconds"]
    met = speedup >= 8 and ours["rows"] <= whole["rows"]

    print()
    print(f"offline packing, {args.n:,} SFT-like examples (lognormal median 250, sigma 1, [8, 4096]), W={W}; "
          f"{over:,} examples > W ({cut_trunc:,} tokens, {cut_trunc / lengths.sum():.2%}, cut under truncation)")
    print(f"python {platform.python_version()}, numpy {np.__version__}, datasets {datasets.__version__}, "
          f"trl {trl.__version__}, packkit {packkit.__version__}; best of {args.repeat}")
    print(f"{'provider':<36}{'seconds':>9}{'rows':>11}{'lower bound':>13}{'over bound':>12}{'cut tokens':>13}")
    for r in results:
        print(f"{r['provider']:<36}{r['seconds']:>9.2f}{r['rows']:>11,}{r['lower_bound']:>13,}"
              f"{r['rows_over_bound']:>12,}{r['cut_tokens']:>13,}")
    print(f"speedup vs TRL whole-dataset bfd: {speedup:.1f}x (target >= 8x at equal or fewer rows: "
          f"{'met' if met else 'MISSED'})")
    print(json.dumps(dict(bench="offline", versions=versions("datasets", "pyarrow", "trl"), n=args.n, window=W, results=results, speedup_vs_trl_whole=round(speedup, 2),
                          target_met=met)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
