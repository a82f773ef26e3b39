"""Writing multimodal rows packed offline: ``pack_dataset(ds, window=W, output=OUT.parquet)`` of Gemma-3-like rows
(their images written beside their documents, :mod:`packkit.mediarows`) against writing the same rows unpacked with
pyarrow directly (``pyarrow.parquet.write_table`` of the table as it is read), in the same run.

The rows (made once in ``--dir``): ``--n`` real ShareGPT text lengths (``benchlib.chat_lengths``, Qwen3 tokenizer)
with 0-4 images each as Gemma 3 lays them out (``benchlib.with_images``: 256 placeholders and two markers an image,
rows above W left out), ``token_type_ids`` 1 on the placeholders, ``labels`` -100 on them, and ``pixel_values``
``(images, 3, --side, --side)`` float32 (Gemma 3's own images are 896 pixels a side, 9.6 MB each: a few thousand rows
of them would not fit this machine's disk; the images' bytes here are what the gather and the write copy), stored
as an Arrow IPC stream that both sides read memory-mapped (``datasets.Dataset.from_file``; ``pyarrow.ipc``).

Each case runs in a process of its own, alternating (packkit, pyarrow, pyarrow, packkit, ...): its CPU time
(``time.process_time``, every thread) and wall time from after the imports to the file flushed and closed, and its
peak resident memory from there (``VmHWM`` after a reset through ``/proc/self/clear_refs``; memory-mapped pages of IN
count as they are touched) beside the resident memory after the imports. Reported: medians, the spread of the pair ratios, the load average.

    python benchmarks/bench_media_write.py --n 3000 --dir /tmp/media_bench
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import chat_lengths, loadavg, ratio_spread, versions, with_images  # noqa: E402

IMG, BOI, EOI = 262144, 255999, 256000  # Gemma 3's image, begin-of-image and end-of-image tokens


def make_rows(path: Path, n: int, side: int, window: int, seed: int = 0) -> dict:
    """The rows (module docstring) as an Arrow IPC stream at ``path``, record batches of 500 rows."""
    import pyarrow as pa

    lengths, images = with_images(chat_lengths(n, seed=seed), window, seed=seed)
    rng = np.random.default_rng(seed)
    with pa.ipc.new_stream(str(path), schema := pa.schema([
            ("input_ids", pa.list_(pa.int32())), ("token_type_ids", pa.list_(pa.int32())),
            ("labels", pa.list_(pa.int32())), ("pixel_values", pa.list_(pa.list_(pa.list_(pa.list_(pa.float32())))))])) as w:
        for a in range(0, lengths.size, 500):
            rows = {k: [] for k in schema.names}
            for length, units in zip(lengths[a:a + 500].tolist(), images[a:a + 500].tolist()):
                text = length - units * 258
                ids = rng.integers(0, 200_000, text).tolist()
                cut = sorted(rng.integers(0, text + 1, units).tolist())
                for at in reversed(cut):
                    ids[at:at] = [BOI] + [IMG] * 256 + [EOI]
                rows["input_ids"].append(ids)
                rows["token_type_ids"].append([int(x == IMG) for x in ids])
                rows["labels"].append([-100 if x == IMG else x for x in ids])
                rows["pixel_values"].append(rng.standard_normal((units, 3, side, side), dtype=np.float32).tolist()
                                            if units else None)
            w.write_batch(pa.RecordBatch.from_pydict(rows, schema=schema))
    return {"rows": int(lengths.size), "tokens": int(lengths.sum()), "images": int(images.sum()),
            "bytes": path.stat().st_size}


def case(kind: str, src: Path, out: Path, window: int) -> dict:
    """One case in this process (the child): ``{"cpu", "wall", "rss_mb", "rss_start_mb", "bytes"}``."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from packkit.offline import pack_dataset

    datasets.disable_progress_bars()
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set from here on (VmHWM reset), not the imports'
    start = _status_kb("VmRSS")
    t, c = time.perf_counter(), time.process_time()
    if kind == "packkit":
        pack_dataset(datasets.Dataset.from_file(str(src)), window=window, output=out, progress=False)
    else:
        with pa.memory_map(str(src)) as f:
            table = pa.ipc.open_stream(f).read_all()
        pq.write_table(table, out)
        with open(out, "rb+") as f:  # packkit's atomic write flushes its file before the rename: the same here
            os.fsync(f.fileno())
    cpu, wall = time.process_time() - c, time.perf_counter() - t
    peak = _status_kb("VmHWM")
    return {"cpu": cpu, "wall": wall, "rss_mb": peak / 1024, "rss_start_mb": start / 1024, "bytes": out.stat().st_size}


def _status_kb(field: str) -> int:
    """``/proc/self/status``'s ``field`` in kB (``VmRSS``: resident now; ``VmHWM``: its peak since the reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=3000, help="ShareGPT rows drawn (rows above W left out)")
    p.add_argument("--side", type=int, default=64, help="pixels a side of an image (3 channels, float32)")
    p.add_argument("--window", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3, help="pairs of cases")
    p.add_argument("--dir", default="/tmp/packkit_media_write")
    p.add_argument("--case", choices=["packkit", "pyarrow"], help=argparse.SUPPRESS)  # the child
    args = p.parse_args(argv)
    folder = Path(args.dir)
    src = folder / f"rows-{args.n}-{args.side}.arrow"
    if args.case:
        out = folder / f"out-{args.case}.parquet"
        out.unlink(missing_ok=True)
        print(json.dumps(case(args.case, src, out, args.window)))
        out.unlink()
        return 0
    folder.mkdir(parents=True, exist_ok=True)
    made = json.loads((folder / (src.name + ".json")).read_text()) if src.exists() else None
    if made is None:
        made = make_rows(src, args.n, args.side, args.window)
        (folder / (src.name + ".json")).write_text(json.dumps(made))
    print(f"rows: {made['rows']:,} ({made['tokens']:,} tokens, {made['images']:,} images of 3x{args.side}x{args.side} "
          f"float32), IN {made['bytes'] / 2**20:,.0f} MiB; W={args.window:,}; load {loadavg():.1f}", flush=True)
    got = {"packkit": [], "pyarrow": []}
    loads = []
    for r in range(args.rounds):
        for kind in ("packkit", "pyarrow") if r % 2 == 0 else ("pyarrow", "packkit"):
            argv_child = [sys.executable, __file__, "--case", kind, "--dir", str(folder), "--n", str(args.n),
                          "--side", str(args.side), "--window", str(args.window)]
            res = json.loads(subprocess.run(argv_child, check=True, capture_output=True, text=True).stdout)
            got[kind].append(res)
            loads.append(loadavg())
            print(f"  {kind:8s} cpu {res['cpu']:6.2f} s  wall {res['wall']:6.2f} s  peak rss {res['rss_mb']:7.0f} MB "
                  f"(after imports {res['rss_start_mb']:.0f})  OUT {res['bytes'] / 2**20:,.0f} MiB", flush=True)
    record = {"rows": made, "side": args.side, "window": args.window, "load": [min(loads), max(loads)],
              "versions": versions("packkit", "pyarrow", "datasets", "numpy")}
    for key in ("cpu", "wall", "rss_mb"):
        record[key] = ratio_spread([g[key] for g in got["packkit"]], [g[key] for g in got["pyarrow"]])
    print(f"\n| | packkit pack_dataset(output=) | pyarrow write_table (unpacked) | ratio (median, low-high) |\n"
          f"| --- | ---: | ---: | ---: |")
    for key, label in (("cpu", "CPU s"), ("wall", "wall s"), ("rss_mb", "peak RSS MB")):
        s = record[key]
        print(f"| {label} | {s['num_median']:.2f} | {s['den_median']:.2f} | {s['median']:.2f} ({s['low']:.2f}-"
              f"{s['high']:.2f}) |")
    print(f"load {min(loads):.1f}-{max(loads):.1f}")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
