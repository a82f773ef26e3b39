"""What reading an ``attention_mask`` costs ``packkit waste`` / ``plan`` (``read_lengths``): CPU time of today's
reader against a named revision's (``--base``, whole package, :func:`benchlib.package_at`) in one process, the rounds
alternating, GC outside the clock, on real files on disk: SFT-like rows of token ids without the column (must be
unchanged) and with an all-ones column (the rule's check), as .jsonl (read a chunk at a time) and .parquet (whole).
``python benchmarks/bench_attention_mask_read.py --base f0e1213``; the table last, one JSON line for scripts."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # this checkout's packkit (not an installed one), and benchlib
from benchlib import ab_pairs, add_lengths_option, bench_lengths, loadavg, package_at, parse_quick, ratio_spread, spread_text  # noqa: E402

from packkit.datafiles import read_lengths  # noqa: E402


def write_files(folder: str, n: int, source: str = "chat") -> dict:
    """``{name: path}``: the same ``n`` rows (token ids 5..., ``labels`` = ids) with and without an all-ones mask."""
    lengths = bench_lengths(source, n, high=2048)  # real ShareGPT conversations under Qwen3 by default
    ids = [list(range(5, 5 + int(k))) for k in lengths]
    out = {}
    for mask in (False, True):
        rows = [{"input_ids": x, "labels": x, **({"attention_mask": [1] * len(x)} if mask else {})} for x in ids]
        name = "ones" if mask else "none"
        out[f"jsonl, {name}"] = os.path.join(folder, f"{name}.jsonl")
        with open(out[f"jsonl, {name}"], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        out[f"parquet, {name}"] = os.path.join(folder, f"{name}.parquet")
        pq.write_table(pa.Table.from_pylist(rows), out[f"parquet, {name}"])
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="f0e1213", help="the revision read before (default f0e1213)")
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=9)
    add_lengths_option(p)
    args = parse_quick(p, argv, "2,000 rows, 3 rounds", rows=2_000, rounds=3)
    before = package_at(args.base, "datafiles").read_lengths
    import packkit
    assert os.path.dirname(packkit.__file__) == os.path.join(os.path.dirname(HERE), "packkit"), packkit.__file__
    table, record = [], {"base": args.base, "rows": args.rows, "rounds": args.rounds, "cases": {}}
    with tempfile.TemporaryDirectory() as folder:
        for case, path in write_files(folder, args.rows, args.lengths).items():
            got, want = read_lengths(path), before(path)
            assert np.array_equal(got.lengths, want.lengths) and np.array_equal(got.targets, want.targets), case
            load = loadavg()
            t_new, t_old = ab_pairs(lambda: read_lengths(path), lambda: before(path), args.rounds,
                                    clock=time.process_time)
            s = ratio_spread(t_new, t_old)
            record["cases"][case] = {**s, "load": load, "bytes": os.path.getsize(path)}
            table.append(f"| {case} | {os.path.getsize(path) / 2**20:.1f} MiB | {s['den_median'] * 1e3:.0f} ms | "
                         f"{s['num_median'] * 1e3:.0f} ms | {spread_text(s)} | {load:.1f} |")
    print(f"| file | size | {args.base} CPU | today CPU | today / {args.base} | load |")
    print("|---|---|---|---|---|---|")
    print("\n".join(table))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
