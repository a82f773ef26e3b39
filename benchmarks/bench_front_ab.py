"""Issue 29's front of the house, two packkit trees A/B in one run: every user-facing path it touched, in CPU time.

The trees: two checkouts (``--old``, ``--new``: folders holding ``packkit/``, e.g. ``git worktree add --detach``),
compiled first (``compileall``, as ``pip install`` leaves a package), run with ``PYTHONDONTWRITEBYTECODE=1`` and
``PYTHONPATH`` the tree; every run checks that it imported that tree's packkit. Each run is a fresh process:

* ``cli`` paths: ``python -m packkit.cli ...``, the figure the child's CPU time (user + system,
  ``resource.getrusage(RUSAGE_CHILDREN)`` around it): the cold start and the work;
* ``lib`` paths: this script with ``--child PATH`` imports the tree's packkit, builds its input and calls the path
  once on a small input (imports and first calls off the clock), then times ``--reps`` calls by the process's CPU time
  and its finished children's (every thread), garbage collected before and off during each, and reports their median.

Pairs alternate which tree runs first (one untimed run of each before them: the page cache warm for both). A
figure is the median of the pair ratios new / old with their lowest and highest, the 1-minute load average beside
each pair. Each run's output digest is compared between the trees: the lengths read, the token ids tokenized or
packed, the written parquet's columns both trees write (``pack`` writes ``example_ids``, ``piece_offsets`` and
``example_loss`` too since 1c97d6b when an example is split), a library report's figures, a command's stdout
(``waste`` and ``plan`` print other words and the dealt epoch's figures since issue 29: "NO" is expected there).

The data, real, made once in ``--data`` from ``benchmarks/fetch_chat_data.sh``'s ShareGPT conversations and Qwen3
tokenizer (``--sharegpt``, ``--tokenizer``; TRL's ``qwen3_training.jinja``, assistant-only loss), by the NEW tree:

* ``chat.jsonl``: the first ``--chat-rows`` usable conversations as ``messages`` rows (what ``tokenize`` reads);
* ``ids.parquet`` / ``ids.jsonl``: the first ``--ids-rows`` conversations tokenized (``input_ids`` and
  ``assistant_masks``, as ``packkit tokenize`` writes them), for the readers and ``pack``;
* ``text.jsonl``: the same conversations' text, one ``text`` row each (read as UTF-8 bytes, the default tokenizer);
* lengths: ``benchlib.chat_lengths(1_000_000)`` (real ShareGPT lengths under Qwen3, drawn with replacement);
  ``packkit waste`` and ``plan`` cold on the bundled sample (``packkit/data/sample_lengths.npy``).

Where the APIs differ the common call is measured: ``measure_waste`` / ``plan_budget`` on a plain array (the new
lengths object is not in the old tree), ``pack_dataset`` returning a ``Dataset`` (``output=`` is new), with the
default ``overflow="split"`` and with ``"truncate"`` (no example split: the same three columns in both trees).

    python benchmarks/bench_front_ab.py --old /tmp/b39_old --new /tmp/b39_new \\
        --sharegpt /tmp/packkit_chat_data/sharegpt.json --tokenizer /tmp/packkit_chat_data/qwen3 [--only a,b]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import compileall
import gc
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchlib import emit_json, loadavg, ratio_spread, versions

HERE = Path(__file__).resolve().parent
WINDOW = 2048
SAMPLE = "packkit/data/sample_lengths.npy"  # the bundled sample, the same bytes in both trees
#: name -> (kind, pairs, what); a cli path's argv is :func:`cli_argv`'s, a lib path's body the child's.
PATHS = {
    "waste-cold": ("cli", 15, "packkit waste (bundled sample), cold process"),
    "plan-cold": ("cli", 15, "packkit plan sample_lengths.npy, cold process"),
    "plan-synthetic-cold": ("cli", 15, "packkit plan --synthetic 2000, cold process"),
    "measure_waste-1M": ("lib", 7, "measure_waste(1M real lengths, W=2048)"),
    "plan_budget-1M": ("lib", 7, "plan_budget(1M real lengths, b=8, W=2048)"),
    "read-ids-jsonl": ("lib", 7, "read_lengths(ids.jsonl)"),
    "read-ids-parquet": ("lib", 9, "read_lengths(ids.parquet)"),
    "read-text-jsonl": ("lib", 9, "read_lengths(text.jsonl), UTF-8 bytes"),
    "waste-ids-parquet": ("cli", 7, "packkit waste ids.parquet, cold process"),
    "plan-ids-jsonl": ("cli", 7, "packkit plan ids.jsonl, cold process"),
    "tokenize_dataset": ("lib", 5, "tokenize_dataset(chat rows, Qwen3 + template)"),
    "tokenize-cli": ("cli", 5, "packkit tokenize chat.jsonl out.parquet"),
    "pack_dataset": ("lib", 9, "pack_dataset(ids rows, W=2048)"),
    "pack_dataset-truncate": ("lib", 9, "pack_dataset(ids rows, W=2048, overflow='truncate')"),
    "pack-cli-parquet": ("cli", 7, "packkit pack ids.parquet out.parquet"),
    "pack-cli-parquet-truncate": ("cli", 7, "packkit pack ids.parquet out.parquet --overflow truncate"),
}


#: timed calls in each library process (their median), where more than ``--reps``: the short ones.
REPS = {"plan_budget-1M": 5, "read-ids-jsonl": 3, "read-ids-parquet": 5, "read-text-jsonl": 5, "pack_dataset": 5,
        "pack_dataset-truncate": 5}


def cli_argv(name: str, tree: Path, data: Path, tokenizer: str, template: str) -> list:
    tok = ["--tokenizer", tokenizer, "--chat-template", template]
    return {
        "waste-cold": ["waste"],
        "plan-cold": ["plan", str(tree / SAMPLE)],
        "plan-synthetic-cold": ["plan", "--synthetic", "2000"],
        "waste-ids-parquet": ["waste", str(data / "ids.parquet")],
        "plan-ids-jsonl": ["plan", str(data / "ids.jsonl")],
        "tokenize-cli": ["tokenize", str(data / "chat.jsonl"), str(data / "out" / "tok.parquet"), "--overwrite",
                         *tok],
        "pack-cli-parquet": ["pack", str(data / "ids.parquet"), str(data / "out" / "packed.parquet"), "--window",
                             str(WINDOW), "--overwrite"],
        "pack-cli-parquet-truncate": ["pack", str(data / "ids.parquet"), str(data / "out" / "packed.parquet"),
                                      "--window", str(WINDOW), "--overwrite", "--overflow", "truncate"],
    }[name]


def cpu_seconds() -> float:
    """CPU seconds of this process (every thread) and of its children that have finished."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def child_env(tree: Path) -> dict:
    return {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{HERE}", "PYTHONDONTWRITEBYTECODE": "1",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


#: The columns both trees write (the new ``pack`` adds ``example_ids``, ``piece_offsets``, ``example_loss``).
COMMON_COLUMNS = ("input_ids", "labels", "seq_lengths", "assistant_masks", "completion_mask")


def digest_file(path: Path) -> str:
    """A digest of a written file's data (parquet: the columns both trees write, not its metadata)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=[c for c in COMMON_COLUMNS if c in pq.read_schema(path).names])
        h = hashlib.md5(repr(table.schema.names).encode())
        for col in table.columns:
            h.update(repr(col.to_pylist()[:50]).encode())
            h.update(str(len(col)).encode())
        return h.hexdigest()
    return hashlib.md5(path.read_bytes()).hexdigest()


def run_cli(name: str, tree: Path, args) -> tuple[float, str]:
    argv = cli_argv(name, tree, args.data, args.tokenizer, args.template)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "packkit.cli", *argv], cwd=args.data / "out", env=child_env(tree),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"packkit {' '.join(argv)} on {tree} exited {proc.returncode}: {proc.stderr.decode()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    written = [Path(a) for a in argv if a.endswith(".parquet") and "/out/" in a]
    out = digest_file(written[0]) if written else hashlib.md5(proc.stdout).hexdigest()
    return cpu, out


def run_lib(name: str, tree: Path, args) -> tuple[float, str]:
    reps = max(args.reps, REPS.get(name, 1))
    proc = subprocess.run([sys.executable, str(HERE / "bench_front_ab.py"), "--child", name, "--data", str(args.data),
                           "--tokenizer", args.tokenizer, "--template", args.template, "--reps", str(reps)],
                          env=child_env(tree), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} on {tree}: {proc.stderr[-3000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if not got["file"].startswith(str(tree)):
        raise SystemExit(f"{name}: imported {got['file']}, not {tree}'s packkit")
    return got["cpu"], got["digest"]


# ---- the child: one tree's packkit on PYTHONPATH ----

def _lengths_digest(lengths) -> str:
    import numpy as np

    return hashlib.md5(np.asarray(lengths.lengths if hasattr(lengths, "lengths") else lengths,
                                  dtype=np.int64).tobytes()).hexdigest()


def child(name: str, data: Path, tokenizer: str, template: str, reps: int) -> None:
    import warnings

    import numpy as np

    import packkit

    warnings.simplefilter("ignore")
    if name in ("measure_waste-1M", "plan_budget-1M"):
        from benchlib import chat_lengths

        lengths, small = chat_lengths(1_000_000), chat_lengths(2_000, seed=1)
        if name == "measure_waste-1M":
            from packkit.waste import measure_waste

            def call(x):
                r = measure_waste(x, window=WINDOW, batch_size=8, progress=False)
                return json.dumps([(s.name, s.rows, s.steps) for s in r.strategies])
        else:
            from packkit.budget import plan_budget

            def call(x):
                r = plan_budget(x, per_device_batch=8, window=WINDOW, warn=False) if "warn" in \
                    plan_budget.__code__.co_varnames else plan_budget(x, per_device_batch=8, window=WINDOW)
                return json.dumps([r.steps_per_epoch, r.effective_batch, round(r.padding_fraction, 9)])
        arg, warm = lengths, small
    elif name.startswith("read-"):
        from packkit.datafiles import read_lengths

        path = {"read-ids-jsonl": "ids.jsonl", "read-ids-parquet": "ids.parquet", "read-text-jsonl": "text.jsonl"}[name]
        arg, warm = str(data / path), str(data / ("small_" + path))

        def call(p):
            got = read_lengths(p)
            loss = getattr(got, "loss_lengths", None)
            return _lengths_digest(got) + (_lengths_digest(loss) if loss is not None else "")
    elif name == "tokenize_dataset":
        import datasets

        from packkit.chat import tokenize_dataset

        datasets.disable_progress_bars()
        rows = [json.loads(line) for line in open(data / "chat.jsonl")]
        arg, warm = datasets.Dataset.from_list(rows), datasets.Dataset.from_list(rows[:20])

        def call(ds):
            out = tokenize_dataset(ds, tokenizer, chat_template=template, progress=False)
            ids = out.with_format("arrow")[:]["input_ids"].combine_chunks()
            return hashlib.md5(np.asarray(ids.values).tobytes() + np.asarray(ids.offsets).tobytes()).hexdigest()
    elif name.startswith("pack_dataset"):
        import datasets
        import pyarrow.parquet as pq
        from datasets.fingerprint import generate_random_fingerprint

        from packkit.offline import pack_dataset

        overflow = "truncate" if name.endswith("-truncate") else "split"
        datasets.disable_progress_bars()
        table = pq.read_table(data / "ids.parquet")
        arg = datasets.Dataset(table, fingerprint=generate_random_fingerprint())
        warm = datasets.Dataset(table.slice(0, 200), fingerprint=generate_random_fingerprint())

        def call(ds):
            out = pack_dataset(ds, window=WINDOW, progress=False, overflow=overflow)
            ids = out.with_format("arrow")[:]["input_ids"].combine_chunks()
            return hashlib.md5(np.asarray(ids.values).tobytes() + np.asarray(ids.offsets).tobytes()).hexdigest()
    else:
        raise SystemExit(f"no library path {name!r}")
    call(warm)
    times, out = [], None
    for _ in range(reps):
        gc.collect()
        gc.disable()
        try:
            t = cpu_seconds()
            out = call(arg)
            times.append(cpu_seconds() - t)
        finally:
            gc.enable()
    print(json.dumps({"file": packkit.__file__, "cpu": statistics.median(times), "times": times, "digest": out}))


# ---- the data ----

def make_data(args) -> None:
    """The files of the module docstring, made once with the new tree (skipped when present)."""
    data = args.data
    (data / "out").mkdir(parents=True, exist_ok=True)
    if not (data / "chat.jsonl").exists() or not (data / "chat_all.jsonl").exists():
        from bench_chat import sharegpt

        rows = sharegpt(args.sharegpt, max(args.chat_rows, args.ids_rows))
        with open(data / "chat_all.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows[:args.ids_rows])
        with open(data / "chat.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows[:args.chat_rows])
        with open(data / "text.jsonl", "w") as f:
            f.writelines(json.dumps({"text": "\n\n".join(m["content"] for m in r["messages"])}) + "\n"
                         for r in rows[:args.ids_rows])
    if not (data / "ids.parquet").exists():
        subprocess.run([sys.executable, "-m", "packkit.cli", "tokenize", str(data / "chat_all.jsonl"),
                        str(data / "ids.parquet"), "--tokenizer", args.tokenizer, "--chat-template", args.template,
                        "--num-proc", "2"], env=child_env(args.new), check=True)
    import pyarrow.parquet as pq

    if not (data / "ids.jsonl").exists():
        table = pq.read_table(data / "ids.parquet")
        with open(data / "ids.jsonl", "w") as f:
            for batch in table.to_batches(max_chunksize=500):
                for row in batch.to_pylist():
                    f.write(json.dumps(row, separators=(",", ":")) + "\n")
    for name in ("ids.jsonl", "text.jsonl"):
        if not (data / ("small_" + name)).exists():
            with open(data / name) as src, open(data / ("small_" + name), "w") as dst:
                dst.writelines(line for _, line in zip(range(50), src))
    if not (data / "small_ids.parquet").exists():
        pq.write_table(pq.read_table(data / "ids.parquet").slice(0, 50), data / "small_ids.parquet")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", type=Path, default=Path("/tmp/b39_old"))
    p.add_argument("--new", type=Path, default=Path("/tmp/b39_new"))
    p.add_argument("--sharegpt", default="/tmp/packkit_chat_data/sharegpt.json")
    p.add_argument("--tokenizer", default="/tmp/packkit_chat_data/qwen3")
    p.add_argument("--template", default=None, help="chat template (default: TRL's qwen3_training.jinja)")
    p.add_argument("--data", type=Path, default=Path("/tmp/b39_data"))
    p.add_argument("--chat-rows", type=int, default=1000)
    p.add_argument("--ids-rows", type=int, default=8000)
    p.add_argument("--reps", type=int, default=1, help="timed calls in each library process (their median)")
    p.add_argument("--pairs", type=int, default=None, help="pairs of every path (default: PATHS' own)")
    p.add_argument("--only", default=None, help="comma-separated paths (default: all)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    if args.template is None:
        import trl

        args.template = os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen3_training.jinja")
    if args.child:
        child(args.child, args.data, args.tokenizer, args.template, args.reps)
        return 0
    make_data(args)
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    for tree in trees.values():
        assert compileall.compile_dir(tree / "packkit", quiet=1, force=True), f"{tree}: does not compile"
    revs = {k: subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() for k, t in trees.items()}
    names = args.only.split(",") if args.only else list(PATHS)
    print(f"# old {revs['old']} ({trees['old']}), new {revs['new']} ({trees['new']}); "
          f"{versions('datasets', 'pyarrow', 'tokenizers', 'transformers')}", flush=True)
    rows = []
    for name in names:
        kind, pairs, what = PATHS[name]
        pairs = args.pairs or pairs
        runner = run_cli if kind == "cli" else run_lib
        got, digests, loads = {"old": [], "new": []}, {"old": set(), "new": set()}, []
        runner(name, trees["new"], args)  # one untimed run each: the page cache warm for both
        runner(name, trees["old"], args)
        for r in range(pairs):
            loads.append(loadavg())
            for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                cpu, out = runner(name, trees[side], args)
                got[side].append(cpu)
                digests[side].add(out)
        s = ratio_spread(got["new"], got["old"])
        same = digests["old"] == digests["new"] and len(digests["old"]) == 1
        row = {"path": name, "what": what, "pairs": pairs, "old_s": s["den_median"], "new_s": s["num_median"],
               "ratio": s["median"], "low": s["low"], "high": s["high"], "q1": s["q1"], "q3": s["q3"],
               "load_min": min(loads), "load_max": max(loads), "same_output": same, "old": got["old"],
               "new": got["new"]}
        rows.append(row)
        print(f"{name:22s} old {row['old_s']:8.3f} s  new {row['new_s']:8.3f} s  ratio {s['median']:.3f} "
              f"({s['low']:.3f}-{s['high']:.3f}, mid {s['q1']:.3f}-{s['q3']:.3f}, {pairs} pairs)  "
              f"load {min(loads):.1f}-{max(loads):.1f}  same output: {same}", flush=True)
        if args.json_out:
            with open(args.json_out, "a") as f:
                f.write(json.dumps(row) + "\n")
    print("\n| path | old CPU s | new CPU s | new/old, median (min-max) | pairs | load | same output |")
    print("| --- | ---: | ---: | --- | ---: | --- | --- |")
    for r in rows:
        print(f"| {r['what']} | {r['old_s']:.3f} | {r['new_s']:.3f} | {r['ratio']:.3f} ({r['low']:.3f}-"
              f"{r['high']:.3f}) | {r['pairs']} | {r['load_min']:.1f}-{r['load_max']:.1f} | "
              f"{'yes' if r['same_output'] else 'NO'} |")
    emit_json({"bench": "front_ab", "old": revs["old"], "new": revs["new"], "rows": rows}, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
