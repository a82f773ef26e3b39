"""Reading one long JSON line against the same bytes in short lines (issue 28: linear time for any line length).

The data: ``--mib`` MiB (default 128) of token ids (random ints in [0, 100,000), about 6 bytes each as text, with
``json.dumps``' separators ``", "``)
written twice: as ONE line ``{"input_ids": [...]}``, and as the same ids cut into lines of about ``--line-kib``
KiB (default 1,024). Both are read by :func:`packkit.datafiles.read_lengths` (what ``packkit waste`` and ``plan``
read with; ``pack`` streams through the same :func:`packkit.jsonlines.json_tables`), alternating which goes
first each round, garbage collected outside the clock, ``--repeat`` rounds (default 3), in this process after
a warm-up read of a small file (imports out of the clock). Reported: the median wall and CPU seconds of each,
and the median and spread of the pair ratios long / short. Target: the long line within 1.5x the short lines' wall time.

Before the fix, :func:`packkit.jsonlines.line_chunks` grew a line longer than a chunk with ``rest += block``
(a copy of the whole line per MiB read: quadratic); ``--before`` also times that old chunking alone, in the
same run, on the long file. Then pyarrow parsed the one line on one thread (a line never spans two blocks)
while short lines were parsed two at once; its long lists of integers are now parsed apart on pyarrow's
threads (:func:`packkit.longline.one_long_line`).

    python benchmarks/bench_long_lines.py [--mib 128] [--repeat 3] [--before]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import numpy as np
from benchlib import ratio_spread, spread_text, versions


def write_files(folder: str, mib: int, line_kib: int, seed: int = 0) -> tuple[str, str]:
    """``(long, short)``: the same ids as one line, and as lines of about ``line_kib`` KiB."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 100_000, (mib << 20) // 6).astype(str)
    long_path, short_path = os.path.join(folder, "one_line.jsonl"), os.path.join(folder, "short_lines.jsonl")
    with open(long_path, "w") as f:
        f.write('{"input_ids": [' + ", ".join(ids) + "]}\n")  # json.dumps' own separators
    per_line = max(1, (line_kib << 10) // 6)
    with open(short_path, "w") as f:
        for lo in range(0, ids.size, per_line):
            f.write('{"input_ids": [' + ", ".join(ids[lo: lo + per_line]) + "]}\n")
    return long_path, short_path


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn) -> tuple[float, float]:
    """``(wall, cpu)`` seconds of ``fn()``, garbage collected before and off during it."""
    gc.collect()
    gc.disable()
    try:
        w, c = time.perf_counter(), _cpu()
        fn()
        return time.perf_counter() - w, _cpu() - c
    finally:
        gc.enable()


def old_line_chunks(path, size: int = 1 << 20):
    """The chunking before the fix (``rest += block``), kept here as the baseline of ``--before``."""
    with open(path, "rb") as f:
        rest = f.read(3)
        while True:
            block = f.read(size)
            if not block:
                if rest:
                    yield rest
                return
            cut = block.rfind(b"\n")
            if cut < 0:
                rest += block
                continue
            yield rest + block[: cut + 1]
            rest = block[cut + 1:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128, help="MiB of JSON text (default 128)")
    parser.add_argument("--line-kib", type=int, default=1024, help="KiB a short line (default 1,024)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds, alternating which file goes first")
    parser.add_argument("--before", action="store_true", help="also time the old quadratic chunking (slow)")
    parser.add_argument("--dir", default=None, help="folder for the two files (default: a temporary one)")
    args = parser.parse_args(argv)

    from packkit.datafiles import read_lengths
    from packkit.jsonlines import line_chunks

    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        long_path, short_path = write_files(folder, args.mib, args.line_kib)
        small = os.path.join(folder, "warm.jsonl")
        with open(small, "w") as f:
            f.write('{"input_ids": [1, 2, 3]}\n')
        read_lengths(small)  # imports (pyarrow, pandas) out of the clock
        runs = {"long": [], "short": []}
        tokens = {}
        for r in range(args.repeat):
            order = ("long", "short") if r % 2 == 0 else ("short", "long")
            for name in order:
                path = long_path if name == "long" else short_path
                got = {}
                wall, cpu = timed(lambda: got.setdefault("n", int(read_lengths(path).lengths.sum())))
                tokens[name] = got["n"]
                runs[name].append((wall, cpu))
        if tokens["long"] != tokens["short"]:
            raise SystemExit(f"the two files hold different tokens: {tokens}")
        before = None
        if args.before:
            new_wall, _ = timed(lambda: sum(len(c) for c in line_chunks(long_path)))
            old_wall, _ = timed(lambda: sum(len(c) for c in old_line_chunks(long_path)))
            before = {"chunking_new_s": round(new_wall, 3), "chunking_old_s": round(old_wall, 3)}
        sizes = {"long": os.path.getsize(long_path), "short": os.path.getsize(short_path)}

    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()}
    pairs = ratio_spread([w for w, _ in runs["long"]], [w for w, _ in runs["short"]])
    cpu_pairs = ratio_spread([c for _, c in runs["long"]], [c for _, c in runs["short"]])
    ratio, cpu_ratio = pairs["median"], cpu_pairs["median"]
    print(f"# versions {json.dumps(versions('pyarrow'))}; load {os.getloadavg()[0]:.1f}")
    print(f"{tokens['long']:,} tokens; {args.repeat} rounds alternating, medians")
    print(f"{'file':<34} {'bytes':>13} {'wall s':>8} {'cpu s':>8}")
    print(f"{'one line':<34} {sizes['long']:>13,} {med['long'][0]:>8.2f} {med['long'][1]:>8.2f}")
    print(f"{f'lines of {args.line_kib:,} KiB':<34} {sizes['short']:>13,} {med['short'][0]:>8.2f} {med['short'][1]:>8.2f}")
    met = "met" if ratio <= 1.5 else "MISSED"
    print(f"one line / short lines, pair ratios: wall {spread_text(pairs)} ({met}, target <= 1.50x), "
          f"cpu {spread_text(cpu_pairs)}")
    if before is not None:
        print(f"chunking the long file alone: {before['chunking_new_s']:.2f} s now, {before['chunking_old_s']:.2f} s "
              "with the old += (quadratic)")
    print(json.dumps({"bench": "long_lines", "mib": args.mib, "tokens": tokens["long"],
                      "long_wall_s": round(med["long"][0], 3), "short_wall_s": round(med["short"][0], 3),
                      "long_cpu_s": round(med["long"][1], 3), "short_cpu_s": round(med["short"][1], 3),
                      "ratio_wall": round(ratio, 3), "ratio_cpu": round(cpu_ratio, 3), "pairs_wall": pairs,
                      "pairs_cpu": cpu_pairs, "before": before}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
