"""Offline packing of a ``datasets.Dataset``: packkit's ``pack_dataset`` against TRL's ``pack_dataset``.

The data: ``--n`` examples (default 200,000) of real chat lengths (``--lengths chat``, the default: ShareGPT
conversations under Qwen3's tokenizer, median 1,697 tokens, drawn with replacement; ``--lengths sft-like``: the
synthetic lognormal, median 250, sigma 1, clipped to [8, 4096], labelled as such in the table); token ids int32 from numpy (a random block of 2**24 ids tiled to the
total, since the ids' values do not change the work); one ``input_ids`` list column built from Arrow
arrays. Window ``W = 2048``.

Providers, measured in the same run on the same Dataset:

* ``trl bfd (default)``: ``trl.data_utils.pack_dataset(ds, W, strategy="bfd")``. TRL runs its best fit
  inside ``Dataset.map(batched=True)`` with map's default ``batch_size=1000``: it packs each chunk of
  1,000 examples on its own, so every chunk leaves a part-filled tail window.
* ``trl bfd (whole dataset)``: the same with ``map_kwargs={"batch_size": len(ds)}``: one plan over the
  whole dataset.
* ``packkit bfd (truncate)``: ``packkit.offline.pack_dataset(ds, window=W, overflow="truncate")``, the
  policy TRL's ``bfd`` applies (TRL truncates over-long examples and says nothing; packkit counts the
  cut tokens). Rows are shuffled (seeded), as packkit does by default.
* ``packkit bfd (split)``: ``overflow="split"``: no token lost.

``--repeat`` rounds (default 3), the providers rotated every round (each first in turn), garbage collected
before each call and off during it (``benchlib.rotating_rounds``, CPU time; the count of the output's tokens, a
read of its offsets, is inside the clock). Reported: median seconds, rows, rows over the lower bound
``ceil(kept tokens / W)``, tokens cut, and the median and spread of the pair ratios TRL whole / packkit. Target:
packkit at least 8x faster than TRL's whole-dataset bfd (median pair ratio) at equal or fewer rows.

``--stream-table`` instead prints the fill of :func:`packkit.packer.pack_stream` against buffer size.

``--files`` (issue 13) measures ``packkit pack`` end to end through real files, each case in a
subprocess of its own whose peak anonymous memory (``RssAnon`` in ``/proc/PID/status``, sampled every
5 ms by this process: pages of memory-mapped files are not anonymous) and CPU time are recorded:

* inputs (made once in ``--dir``, ``--n`` examples of ``--lengths``, int32 ids): a ``save_to_disk`` folder, an
  Arrow IPC stream file (record batches of 1,000 rows, as ``datasets`` writes its cache) and a parquet
  file written by ``datasets.Dataset.to_parquet`` (as a user's parquet usually is);
* ``packkit``: ``packkit pack IN OUT -w W -q`` with OUT of the same format as IN;
* ``pyarrow floor``: pyarrow reading IN whole (``pq.read_table``; ``ipc.open_stream(OSFile).read_all``
  for Arrow files and each shard of the folder) and writing packkit's output table, already in memory,
  in the same format with the same settings (parquet: snappy, no dictionary; Arrow: IPC stream;
  the folder: IPC stream shards of at most 500 MB). Only that read and write are timed; flushing
  the written file to disk (which packkit's atomic write does before its rename) is timed apart and
  printed, not counted.
* ``--scale`` also runs packkit on a folder of twice the rows (memory should stay flat).

Rounds alternate packkit and the floor (``--repeat`` rounds; who goes first alternates too), each
run on an input read once just before (warm in the page cache for both); the best wall time of each
is reported, with its CPU time, and the load average before each run. Targets: packkit within 1.5x
the floor's wall time per format (judged on the median pair ratio) (the median and spread of the pair ratios printed beside the best of each); peak anonymous memory at most 0.5x the token data for
memory-mapped input (flat when the rows double) and 1.0x for parquet. ``--keep`` leaves the input
files in ``--dir`` for another run (they are deleted otherwise).

``--files --jsonl`` (issue 19) packs JSON lines of ``--n`` examples' token ids (``--lengths``) streamed (parsed a
chunk at a time and staged) against the path before streaming (the same code with
``ArrowSource.from_tables`` turned off: the file parsed whole), alternating, peak memory and CPU as above.
Targets: peak at most 0.5x the tokens as int32, wall no slower (the median pair ratio). ``--text`` instead packs a ``.txt`` of
real text, the first ``--n`` KB of ShareGPT's messages, with Qwen3's ``tokenizer.json`` (``--sharegpt``,
``--tokenizer``: ``fetch_chat_data.sh``; before, prose from CPython's help topics and a BPE trained on them, whose
helpers ``bench_chat`` no longer has): tokenized a chunk at a time, against the whole read.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np
from benchlib import (LENGTH_SOURCES, add_lengths_option, bench_lengths, loadavg, ratio_spread, rotating_rounds,
                      spread_text, versions)



def make_dataset(lengths: np.ndarray, *, seed: int = 0, vocab: int = 32000):
    """A ``datasets.Dataset`` with one ``input_ids`` column of int32 ids in ``[0, vocab)`` (a random
    block of at most 2**24 ids, tiled to the total), built from Arrow arrays (``large_list`` past
    2**31 - 1 tokens)."""
    import datasets
    import pyarrow as pa
    from datasets.fingerprint import generate_random_fingerprint

    from packkit.arrow import list_array
    from packkit.segments import lengths_to_offsets

    rng = np.random.default_rng(seed)
    total = int(lengths.sum())
    block = rng.integers(0, vocab, min(total, 1 << 24), dtype=np.int32)
    col = list_array(lengths_to_offsets(lengths), np.resize(block, total))
    # A given fingerprint: otherwise datasets hashes every token to make one.
    return datasets.Dataset(pa.table({"input_ids": col}), fingerprint=generate_random_fingerprint())


def _remove(path) -> None:
    """Delete the file or the folder at ``path``, if there is one (only what this benchmark wrote)."""
    import os
    import shutil

    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def stream_table(n: int, window: int, source: str = "chat") -> None:
    from packkit.binpack import pack
    from packkit.binpack import stream_windows

    lengths = np.minimum(bench_lengths(source, n), window)
    lb = -(-int(lengths.sum()) // window)
    rows = []
    for buffer in (1, 10, 100, 1000, 10000):
        t = time.perf_counter()
        windows = sum(1 for _ in stream_windows(zip(range(n), lengths.tolist()), window=window, buffer_size=buffer))
        rows.append((f"stream buffer={buffer}", windows, time.perf_counter() - t))
    t = time.perf_counter()
    plan = pack(lengths, window=window)
    rows.append(("offline bfd", plan.num_windows, time.perf_counter() - t))
    print(f"{n:,} lengths ({LENGTH_SOURCES[source]}) truncated to W={window}; lower bound {lb:,} windows")
    print(f"{'planner':<22}{'windows':>10}{'fill':>9}{'over bound':>12}{'seconds':>9}")
    for name, w, s in rows:
        print(f"{name:<22}{w:>10,}{lengths.sum() / (w * window):>9.4f}{(w - lb) / lb:>12.3%}{s:>9.2f}")


# ----------------------------------------------------------------------------------------------
# --files: packkit pack through real files, against the pyarrow I/O floor (issue 13)
# ----------------------------------------------------------------------------------------------

FORMATS = {"save_to_disk": ("ds", ""), "arrow": ("in.arrow", ".arrow"), "parquet": ("in.parquet", ".parquet")}


def make_inputs(folder, n: int, *, formats=("save_to_disk", "arrow", "parquet"), tag: str = "",
                source: str = "chat") -> dict:
    """The input files for ``n`` examples of ``source`` lengths (made once; a marker file records n and source)."""
    import os

    import datasets
    import pyarrow as pa

    datasets.disable_progress_bars()
    os.makedirs(folder, exist_ok=True)
    marker = os.path.join(folder, f"made{tag}.json")
    paths = {f: os.path.join(folder, tag + FORMATS[f][0]) for f in formats}
    made = json.load(open(marker)) if os.path.exists(marker) else {}
    if made.get("n") == n and made.get("lengths") == source and all(os.path.exists(p) for p in paths.values()):
        return paths
    lengths = bench_lengths(source, n)
    total = int(lengths.sum())
    ds = make_dataset(lengths, vocab=128_000)
    table = ds.with_format("arrow")[:].replace_schema_metadata(None)  # the Arrow file: no datasets metadata
    if "save_to_disk" in paths:
        _remove(paths["save_to_disk"])
        ds.save_to_disk(paths["save_to_disk"])
    if "arrow" in paths:
        with pa.OSFile(paths["arrow"], "wb") as f:
            w = pa.ipc.new_stream(f, table.schema)
            w.write_table(table, max_chunksize=1000)
            w.close()
    if "parquet" in paths:
        ds.to_parquet(paths["parquet"])
    json.dump({"n": n, "tokens": total, "lengths": source}, open(marker, "w"))
    return paths


def _status_kib(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def run_child(args: list[str]) -> dict:
    """Run ``bench_offline.py --child ...`` and sample its RssAnon every 5 ms; its JSON line, plus peak."""
    import os
    import subprocess

    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        kib = _status_kib(proc.pid, "RssAnon:")
        if kib is not None:
            peak = max(peak, kib)
        time.sleep(0.005)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed ({proc.returncode}): {err[-2000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_anon_mib"] = peak / 1024
    return result


def warm(path) -> None:
    """Read ``path`` (a file, or every file of a folder) once, so that both providers find it in the
    page cache: the runs measure packing and writing, not which one the disk cache favoured."""
    import os

    files = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for name in files:
        with open(name, "rb", buffering=0) as f:
            while f.read(1 << 24):
                pass


def _cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(argv) -> int:
    """One measured case in this process: ``packkit IN OUT W`` or ``floor FORMAT IN PACKED OUT``."""
    import os

    kind = argv[0]
    if kind == "packkit-in-memory":  # the path before streaming (issue 19): JSON lines and text read whole
        from packkit.datafiles import Input

        Input.chunks = lambda self: None  # JSON lines and text read whole, not a chunk at a time
        kind = "packkit"
    if kind == "packkit":
        src, out, window, extra = argv[1], argv[2], argv[3], argv[4:]
        import datasets  # noqa: F401 - imported before the clock starts, as the floor imports pyarrow

        import packkit.cli.pack  # noqa: F401 - the subcommand and what it imports, before the clock too
        from packkit.cli import main as cli

        _remove(out)
        base = _status_kib(os.getpid(), "RssAnon:")
        c0, t0 = _cpu(), time.perf_counter()
        code = cli(["pack", src, out, "-w", window, "-q", *extra])
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
        assert code == 0
        print(json.dumps({"wall": wall, "cpu": cpu, "base_anon_mib": base / 1024}))
        return 0
    fmt, src, packed, out = argv[1], argv[2], argv[3], argv[4]
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    # packkit's output, read into memory before the clock starts: the floor writes the same table
    if fmt == "save_to_disk":
        import datasets

        table = datasets.load_from_disk(packed).with_format("arrow")[:]
        table = pa.Table.from_batches([b for b in table.to_batches()]).combine_chunks()
    elif fmt == "arrow":
        table = ipc.open_stream(pa.OSFile(packed)).read_all()
    else:
        table = pq.read_table(packed)
    table = table.replace_schema_metadata(None)
    _remove(out)
    base = _status_kib(os.getpid(), "RssAnon:")
    c0, t0 = _cpu(), time.perf_counter()
    if fmt == "parquet":
        data = pq.read_table(src)
        pq.write_table(table, out, use_dictionary=False, compression="snappy")
    elif fmt == "arrow":
        data = ipc.open_stream(pa.OSFile(src)).read_all()
        with pa.OSFile(out, "wb") as f:
            w = ipc.new_stream(f, table.schema)
            w.write_table(table)
            w.close()
    else:
        shards = sorted(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".arrow"))
        data = [ipc.open_stream(pa.OSFile(p)).read_all() for p in shards]
        os.makedirs(out)
        k = max(1, -(-table.nbytes // (500 * 10**6)))
        cuts = np.linspace(0, table.num_rows, k + 1).astype(int)
        for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
            with pa.OSFile(os.path.join(out, f"data-{i:05d}-of-{k:05d}.arrow"), "wb") as f:
                w = ipc.new_stream(f, table.schema)
                w.write_table(table.slice(a, b - a))
                w.close()
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    del data
    # not in the floor's time: flushing what it wrote to disk (packkit's atomic write does it before renaming)
    t1 = time.perf_counter()
    from packkit.fileio import fsync_tree

    fsync_tree(out)
    print(json.dumps({"wall": wall, "cpu": cpu, "base_anon_mib": base / 1024, "fsync": time.perf_counter() - t1}))
    return 0


def make_jsonl(folder, n: int, source: str = "chat") -> tuple[str, int]:
    """JSON lines of ``n`` examples of ``source`` lengths (token ids), written by packkit's jsonl writer; made once."""
    import os

    from packkit.outputs import write_batches

    path = os.path.join(folder, f"in-{source}-{n}.jsonl")
    lengths = bench_lengths(source, n)
    if not os.path.exists(path):
        table = make_dataset(lengths, vocab=128_000).with_format("arrow")[:].replace_schema_metadata(None)
        os.makedirs(folder, exist_ok=True)
        write_batches(path, table.schema, table.to_batches(max_chunksize=10_000), format="jsonl")
    return path, int(lengths.sum())


def make_text(folder, n: int, sharegpt: str, tokenizer: str) -> tuple[str, str]:
    """A ``.txt`` of real text, the first ``n`` KB of ShareGPT's messages, one a line
    (``bench_text_memory.make_text``), made once; and Qwen3's ``tokenizer.json`` (``--sharegpt``, ``--tokenizer``:
    ``fetch_chat_data.sh`` fetches both). ``(text path, tokenizer.json path)``."""
    import os

    from bench_text_memory import make_text as sharegpt_text

    path = os.path.join(folder, f"sharegpt-{n}k.txt")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        sharegpt_text(sharegpt, path + ".part", n * 1000)
        os.replace(path + ".part", path)
    return path, (tokenizer if tokenizer.endswith(".json") else os.path.join(tokenizer, "tokenizer.json"))


def jsonl_mode(args) -> int:
    """``--files --jsonl``: packkit pack of JSON lines, streamed (issue 19) against today's in-memory path
    (the same code with the stream turned off: the file parsed whole, then packed), in the same run. With
    ``--text``, a ``.txt`` of prose tokenized with a BPE ``tokenizer.json`` instead (streamed: tokenized a
    chunk at a time and staged; in memory: read and tokenized whole)."""
    import os

    import pyarrow as pa

    extra = []
    if args.text:
        src, tok = make_text(args.dir, args.n, args.sharegpt, args.tokenizer)
        extra = ["--tokenizer", tok]
        tokens = None  # counted from the first run's output; every run must write as many
    else:
        src, tokens = make_jsonl(args.dir, args.n, args.lengths)
    out = os.path.join(args.dir, "out-jsonl.arrow")
    runs: dict = {}
    loads = []
    for r in range(args.repeat):
        for who in (("packkit-in-memory", "packkit") if r % 2 else ("packkit", "packkit-in-memory")):
            warm(src)
            loads.append(os.getloadavg()[0])
            got = run_child([who, src, out, str(args.window), *extra])
            rows = pa.ipc.open_stream(pa.memory_map(out)).read_all().column("input_ids")
            written = sum(len(c.values) for c in rows.chunks)
            tokens = written if tokens is None else tokens
            assert written == tokens  # every token written
            runs.setdefault(who, []).append(got)
            print(f"round {r}: {who}: {got['wall']:.1f}s (cpu {got['cpu']:.1f}s), peak {got['peak_anon_mib']:,.0f} "
                  f"MiB (after imports {got['base_anon_mib']:,.0f}), load {loads[-1]:.1f}", file=sys.stderr)
    _remove(out)
    token_mib = tokens * 4 / 2**20
    table = []
    for who in ("packkit", "packkit-in-memory"):
        best = min(runs[who], key=lambda g: g["wall"])
        peak = min(g["peak_anon_mib"] - g["base_anon_mib"] for g in runs[who])
        table.append(dict(provider=who, wall_s=best["wall"], cpu_s=best["cpu"], peak_over_imports_mib=peak,
                          peak_over_tokens=peak / token_mib))
    print()
    what = ("a .txt of ShareGPT messages tokenized with Qwen3's tokenizer.json" if args.text
            else "JSON lines of token ids")
    size = f"{args.n:,} KB" if args.text else f"{args.n:,} examples ({LENGTH_SOURCES[args.lengths]})"
    print(f"packkit pack of {what}, {size}, {tokens:,} tokens ({token_mib:,.0f} MiB int32, "
          f"{os.path.getsize(src) / 2**20:,.0f} MiB of text), W={args.window}, out .arrow; best of {args.repeat} "
          f"interleaved rounds; load average {min(loads):.1f}..{max(loads):.1f} on {os.cpu_count()} cores")
    print(f"{'provider':<20}{'wall s':>8}{'cpu s':>8}{'peak MiB over imports':>23}{'x tokens':>10}")
    for row in table:
        print(f"{row['provider']:<20}{row['wall_s']:>8.2f}{row['cpu_s']:>8.2f}{row['peak_over_imports_mib']:>23,.0f}"
              f"{row['peak_over_tokens']:>10.2f}")
    ours, old = table
    pairs = ratio_spread([g["wall"] for g in runs["packkit"]], [g["wall"] for g in runs["packkit-in-memory"]])
    print(f"streamed / in memory, wall pair ratios: {spread_text(pairs)}")
    met_mem, met_time = ours["peak_over_tokens"] <= 0.5, pairs["median"] <= 1.0  # the median pair, not the best
    print(f"memory target (<= 0.5x the tokens as int32 over imports): {'met' if met_mem else 'MISSED'}; "
          f"time target (no slower than the in-memory path): {'met' if met_time else 'MISSED'} "
          f"(median pair {pairs['median']:.2f}x; best / best {ours['wall_s'] / old['wall_s']:.2f}x)")
    print(json.dumps(dict(bench="offline-text" if args.text else "offline-jsonl",
                          versions=versions("datasets", "pyarrow", "tokenizers"), n=args.n, tokens=tokens,
                          window=args.window, repeat=args.repeat, load=[min(loads), max(loads)], results=table,
                          lengths=args.lengths, streamed_over_in_memory=pairs,
                          memory_target_met=met_mem, time_target_met=met_time)))
    if not args.keep:
        _remove(src)
    return 0


def files_mode(args) -> int:
    import os

    import pyarrow as pa

    import packkit

    folder = args.dir
    W = str(args.window)
    t = time.perf_counter()
    paths = make_inputs(folder, args.n, source=args.lengths)
    tokens = json.load(open(os.path.join(folder, "made.json")))["tokens"]
    print(f"inputs for {args.n:,} examples, {tokens:,} tokens ({tokens * 4 / 2**20:,.0f} MiB of int32 ids) ready "
          f"in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    outs = {f: os.path.join(folder, "out" + FORMATS[f][1]) for f in FORMATS}
    floors = {f: os.path.join(folder, "floor" + FORMATS[f][1]) for f in FORMATS}
    runs: dict = {}
    loads = []
    for r in range(args.repeat):
        for fmt in FORMATS:
            # the input warm in the page cache for each run; who goes first alternates between rounds
            order = ("packkit", "floor") if r % 2 == 0 else ("floor", "packkit")
            for who in order:
                if who == "floor" and not os.path.exists(outs[fmt]):  # the floor writes packkit's rows
                    run_child(["packkit", paths[fmt], outs[fmt], W])
                warm(paths[fmt])
                loads.append(os.getloadavg()[0])
                argv = ["packkit", paths[fmt], outs[fmt], W] if who == "packkit" else \
                    ["floor", fmt, paths[fmt], outs[fmt], floors[fmt]]
                got = run_child(argv)
                runs.setdefault((who, fmt), []).append(got)
                print(f"round {r}: {who} {fmt}: {got['wall']:.1f}s (cpu {got['cpu']:.1f}s), "
                      f"peak {got['peak_anon_mib']:,.0f} MiB, load {loads[-1]:.1f}", file=sys.stderr)
    # every packed token is there: the output's tokens, from its offsets, are the input's
    import datasets

    out_tokens = sum(len(c.values) for c in datasets.load_from_disk(outs["save_to_disk"]).data.column("input_ids").chunks)
    assert out_tokens == tokens, (out_tokens, tokens)
    scale = []
    if args.scale:
        paths2 = make_inputs(folder, 2 * args.n, formats=("save_to_disk",), tag="x2-", source=args.lengths)
        tokens2 = json.load(open(os.path.join(folder, "madex2-.json")))["tokens"]
        for n_rows, src, tok in ((args.n, paths["save_to_disk"], tokens), (2 * args.n, paths2["save_to_disk"], tokens2)):
            got = min((run_child(["packkit", src, outs["save_to_disk"], W]) for _ in range(max(1, args.repeat - 1))),
                      key=lambda g: g["peak_anon_mib"])
            scale.append(dict(rows=n_rows, tokens=tok, token_mib=tok * 4 / 2**20, **got))
    table = []
    for fmt in FORMATS:
        ours = min(runs[("packkit", fmt)], key=lambda g: g["wall"])
        floor = min(runs[("floor", fmt)], key=lambda g: g["wall"])
        peak = min(g["peak_anon_mib"] for g in runs[("packkit", fmt)])
        limit = 1.0 if fmt == "parquet" else 0.5
        table.append(dict(format=fmt, packkit_s=ours["wall"], packkit_cpu_s=ours["cpu"], floor_s=floor["wall"],
                          floor_cpu_s=floor["cpu"], floor_fsync_s=floor["fsync"], ratio=ours["wall"] / floor["wall"],
                          cpu_ratio=ours["cpu"] / floor["cpu"], packkit_peak_mib=peak,
                          floor_peak_mib=min(g["peak_anon_mib"] for g in runs[("floor", fmt)]),
                          peak_over_tokens=peak / (tokens * 4 / 2**20), memory_target=limit,
                          pairs=ratio_spread([g["wall"] for g in runs[("packkit", fmt)]],
                                             [g["wall"] for g in runs[("floor", fmt)]])))
    token_mib = tokens * 4 / 2**20
    print()
    for row in table:
        print(f"{row['format']}: packkit / floor, wall pair ratios {spread_text(row['pairs'])}")
    print(f"packkit pack through files, {args.n:,} examples ({LENGTH_SOURCES[args.lengths]}), {tokens:,} tokens ({token_mib:,.0f} MiB int32), "
          f"W={W}; best of {args.repeat} interleaved rounds; load average {min(loads):.1f}..{max(loads):.1f} "
          f"on {os.cpu_count()} cores")
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, pyarrow {pa.__version__}, "
          f"datasets {datasets.__version__}, packkit {packkit.__version__}")
    print(f"{'format (in -> out)':<20}{'packkit s':>10}{'cpu s':>8}{'floor s':>9}{'cpu s':>8}{'+fsync':>8}{'ratio':>7}"
          f"{'cpu ratio':>10}{'peak MiB':>10}{'x tokens':>9}{'floor MiB':>10}")
    for row in table:
        print(f"{row['format']:<20}{row['packkit_s']:>10.2f}{row['packkit_cpu_s']:>8.2f}{row['floor_s']:>9.2f}"
              f"{row['floor_cpu_s']:>8.2f}{row['floor_fsync_s']:>8.2f}{row['ratio']:>7.2f}{row['cpu_ratio']:>10.2f}"
              f"{row['packkit_peak_mib']:>10,.0f}{row['peak_over_tokens']:>9.2f}{row['floor_peak_mib']:>10,.0f}")
    for row in scale:
        print(f"memory-mapped folder, {row['rows']:,} rows ({row['token_mib']:,.0f} MiB of tokens): peak "
              f"{row['peak_anon_mib']:,.0f} MiB = {row['peak_anon_mib'] / row['token_mib']:.2f}x the tokens "
              f"(after imports {row['base_anon_mib']:,.0f} MiB), {row['wall']:.1f}s")
    met_time = all(row["pairs"]["median"] <= 1.5 for row in table)  # the median pair ratio, not the best of each
    met_mem = all(row["peak_over_tokens"] <= row["memory_target"] for row in table)
    print(f"time target (median pair ratio <= 1.5x the floor per format): {'met' if met_time else 'MISSED'}; memory target "
          f"(<= 0.5x tokens memory-mapped, 1.0x parquet): {'met' if met_mem else 'MISSED'}")
    print(json.dumps(dict(bench="offline-files", versions=versions("datasets", "pyarrow"), n=args.n, tokens=tokens,
                          window=int(W), repeat=args.repeat, load=[min(loads), max(loads)], results=table,
                          scale=scale, time_target_met=met_time, memory_target_met=met_mem)))
    for p in list(outs.values()) + list(floors.values()):
        _remove(p)
    if not args.keep:
        _remove(folder)
    return 0


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200_000, help="examples (default 200,000)")
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3, help="rounds of each provider (pairs of --files)")
    parser.add_argument("--no-trl-default", action="store_true", help="skip TRL's chunked default mode (slowest)")
    parser.add_argument("--stream-table", action="store_true", help="print streaming fill against buffer size")
    parser.add_argument("--files", action="store_true",
                        help="packkit pack through real files against the pyarrow I/O floor, with peak memory")
    parser.add_argument("--dir", default="/tmp/packkit-bench-offline", help="--files: where the files go")
    parser.add_argument("--scale", action="store_true", help="--files: also a folder of twice the rows")
    parser.add_argument("--keep", action="store_true", help="--files: keep the input files")
    parser.add_argument("--jsonl", action="store_true",
                        help="--files: JSON lines input, streamed against today's in-memory path (issue 19)")
    parser.add_argument("--text", action="store_true",
                        help="--files --jsonl: the first --n KB of ShareGPT's messages and Qwen3's tokenizer instead of "
                             "JSON lines of ids (needs --sharegpt and --tokenizer)")
    parser.add_argument("--sharegpt", default=None, help="--text: ShareGPT's JSON (fetch_chat_data.sh)")
    parser.add_argument("--tokenizer", default=None, help="--text: Qwen3's tokenizer folder (fetch_chat_data.sh)")
    add_lengths_option(parser)
    args = parser.parse_args(argv)
    if args.stream_table:
        stream_table(min(args.n, 200_000), args.window, args.lengths)
        return 0
    if args.text and not (args.sharegpt and args.tokenizer):
        parser.error("--text needs --sharegpt and --tokenizer (benchmarks/fetch_chat_data.sh prints both)")
    if args.files:
        if args.window == 2048 and "--window" not in (argv or sys.argv):
            args.window = 8192
        return jsonl_mode(args) if args.jsonl else files_mode(args)

    import datasets
    import trl
    from trl.data_utils import pack_dataset as trl_pack

    import packkit
    from packkit.offline import pack_dataset

    datasets.disable_progress_bars()
    W = args.window
    t = time.perf_counter()
    lengths = bench_lengths(args.lengths, args.n)
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
                                                        return_report=True), "packkit", kept_trunc),
        ("packkit bfd (split)", lambda: pack_dataset(ds, window=W, overflow="split", progress=False,
                                                     return_report=True), "packkit", int(lengths.sum())),
    ]
    import logging

    logging.getLogger("packkit").setLevel(logging.ERROR)  # the truncation count is in the table
    seen: dict = {}

    def run(name, fn, kind):
        def one():
            out = fn()
            if kind == "packkit":
                out, plan = out
                # nothing lost: the packed rows hold exactly the kept tokens
                assert list_tokens(out, "input_ids") == plan.total_tokens
                seen[name] = (len(out), plan.total_tokens, plan.cut_tokens)
            else:
                tokens = list_tokens(out, "input_ids")
                seen[name] = (len(out), tokens, int(lengths.sum()) - tokens)
        return one

    load = loadavg()
    times = rotating_rounds({name: run(name, fn, kind) for name, fn, kind, _ in providers}, args.repeat)
    results = []
    for name, _, _, kept in providers:
        rows, tokens, cut = seen[name]
        lb = -(-kept // W)
        results.append(dict(provider=name, seconds=round(statistics.median(times[name]), 3), rows=rows,
                            lower_bound=lb, rows_over_bound=rows - lb, tokens=tokens, cut_tokens=cut))

    whole = next(r for r in results if r["provider"] == "trl bfd (whole dataset)")
    ours = next(r for r in results if r["provider"] == "packkit bfd (truncate)")
    pairs = {name: ratio_spread(times[name], times["packkit bfd (truncate)"]) for name, _, kind, _ in providers
             if kind == "trl"}
    speedup = pairs["trl bfd (whole dataset)"]["median"]
    met = speedup >= 8 and ours["rows"] <= whole["rows"]

    print()
    print(f"offline packing, {args.n:,} examples, {LENGTH_SOURCES[args.lengths]}, W={W}; "
          f"{over:,} examples > W ({cut_trunc:,} tokens, {cut_trunc / lengths.sum():.2%}, cut under truncation)")
    print(f"python {platform.python_version()}, numpy {np.__version__}, datasets {datasets.__version__}, "
          f"trl {trl.__version__}, packkit {packkit.__version__}; CPU medians of {args.repeat} rotated rounds, "
          f"load {load:.1f}-{loadavg():.1f}")
    print(f"{'provider':<36}{'seconds':>9}{'rows':>11}{'lower bound':>13}{'over bound':>12}{'cut tokens':>13}")
    for r in results:
        print(f"{r['provider']:<36}{r['seconds']:>9.2f}{r['rows']:>11,}{r['lower_bound']:>13,}"
              f"{r['rows_over_bound']:>12,}{r['cut_tokens']:>13,}")
    for name, sp in pairs.items():
        print(f"{name} / packkit bfd (truncate), pair ratios: {spread_text(sp)}")
    print(f"speedup vs TRL whole-dataset bfd: {speedup:.1f}x, median pair ratio (target >= 8x at equal or fewer "
          f"rows: {'met' if met else 'MISSED'})")
    print(json.dumps(dict(bench="offline", versions=versions("datasets", "pyarrow", "trl"), n=args.n, window=W,
                          lengths=args.lengths, results=results, trl_over_packkit=pairs,
                          speedup_vs_trl_whole=round(speedup, 2), target_met=met)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
