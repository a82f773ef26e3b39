"""``packkit pack IN OUT --window W``: pack a dataset file offline into windows."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..binpack import OVERFLOW_POLICIES, STRATEGIES
from ..hf import pack_dataset
from ._chat import add_tokenizer_arguments, chat_options


def _write(ds, out: Path) -> str:
    suffix = out.suffix.lower()
    if suffix in (".parquet", ".pq"):
        ds.to_parquet(str(out))
        return "parquet"
    if suffix in (".jsonl", ".json", ".ndjson"):
        ds.to_json(str(out), lines=True)
        return "JSON lines"
    if out.suffix:
        raise ValueError(f"cannot write {str(out)!r}: use .parquet, .jsonl, or a folder name for save_to_disk")
    ds.save_to_disk(str(out))
    return "a datasets folder (load with datasets.load_from_disk)"


def cli_main(argv=None) -> int:
    """``packkit pack IN OUT --window W``: pack a dataset file offline."""
    parser = argparse.ArgumentParser(
        prog="packkit pack",
        description="Pack a dataset of token ids into windows of at most W tokens, one row per window "
                    "(columns input_ids, labels when present or derived from a completion_mask / "
                    "assistant_masks loss mask, seq_lengths). Conversational data (messages, prompt + "
                    "completion) is tokenized with --tokenizer's chat template, -100 on prompt tokens.",
    )
    parser.add_argument("input", help="jsonl, parquet, arrow, or a folder saved with save_to_disk")
    parser.add_argument("output", help="OUT.parquet, OUT.jsonl, or a folder (save_to_disk)")
    parser.add_argument("-w", "--window", type=int, required=True, help="tokens per window")
    parser.add_argument("--strategy", default="bfd", choices=STRATEGIES)
    parser.add_argument("--overflow", default="error", choices=OVERFLOW_POLICIES,
                        help="examples longer than the window (default: error)")
    parser.add_argument("--columns", default=None,
                        help="comma-separated list columns to pack, token ids first "
                             "(default: input_ids, plus labels and a completion_mask / assistant_masks loss "
                             "mask when present; the mask becomes -100 labels)")
    parser.add_argument("--text-column", default="text",
                        help="text column to tokenize when there are no token ids (needs --tokenizer)")
    add_tokenizer_arguments(parser, default=None)
    parser.add_argument("--split", default=None, help="split of a saved DatasetDict (default: train)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-shuffle", action="store_true", help="keep the planner's window order")
    parser.add_argument("--example-ids", action="store_true", help="also write the source row of every segment")
    parser.add_argument("--num-proc", type=int, default=None, help="threads for the token copy")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    import datasets
    import pyarrow as pa

    from .. import io as pio

    src = Path(args.input)
    out = Path(args.output)
    if out.exists() and src.exists() and out.resolve() == src.resolve():
        raise ValueError("OUT must differ from IN")
    columns = [c.strip() for c in args.columns.split(",") if c.strip()] if args.columns else None
    src = pio._check_path(src)
    if src.is_dir():
        ds = pio.load_dataset(src, split=args.split)
        if columns is None and "input_ids" not in ds.column_names:  # text or conversations to tokenize
            table = ds.data.table if getattr(ds, "_indices", None) is None else ds.flatten_indices().data.table
            ds = None
    else:
        if src.suffix.lower() == ".npy":
            raise ValueError(f"{str(src)!r} holds lengths only; packing needs token ids (jsonl, parquet, arrow)")
        table = pio.load_table(src)
        ds = None
    how = None
    if ds is None:
        token_col = columns[0] if columns else "input_ids"
        table, how = pio.tokens_table(table, column=token_col, text_column=args.text_column, tokenizer=args.tokenizer,
                                      chat=chat_options(args), progress=not args.quiet, where=repr(str(src)))
        if table.num_rows == 0:
            raise ValueError(f"{str(src)!r} holds no examples")
        ds = datasets.Dataset(pa.Table.from_arrays([table.column(c) for c in table.column_names],
                                                   names=table.column_names),
                              fingerprint=datasets.fingerprint.generate_random_fingerprint())
    if len(ds) == 0:
        raise ValueError(f"{str(src)!r} holds no examples")
    if args.quiet:
        datasets.disable_progress_bars()
    packed, plan = pack_dataset(
        ds, window=args.window, strategy=args.strategy, overflow=args.overflow, columns=columns, seed=args.seed,
        shuffle=not args.no_shuffle, num_proc=args.num_proc, example_ids=args.example_ids,
        progress=None if not args.quiet else False, return_plan=True)
    kind = _write(packed, out)
    s = plan.summary()
    if how is not None:
        print(f"tokenized {how}")
    print(f"packed {s['examples']:,} examples ({s['tokens'] + s['cut_tokens']:,} tokens) into {s['windows']:,} "
          f"windows of {s['window']:,} (lower bound {s['lower_bound']:,}, fill {s['fill']:.4f}, {args.strategy})")
    if s["overflow_examples"]:
        what = {"truncate": "truncated", "drop": "dropped", "split": "split into pieces"}[s["overflow"]]
        print(f"overflow={s['overflow']}: {s['overflow_examples']:,} examples longer than the window {what}; "
              f"{s['cut_tokens']:,} tokens cut")
    print(f"wrote {str(out)!r} as {kind}; columns {packed.column_names}")
    return 0
