"""``packkit pack IN OUT --window W``: pack a dataset file offline into windows.

OUT's format follows its name (:data:`OUTPUT_FORMATS`): ``.parquet``, ``.jsonl``, ``.arrow`` (an Arrow IPC
stream, the format of the ``datasets`` cache: ``datasets.Dataset.from_file`` reads it), or a name
without a suffix: a folder written with ``save_to_disk`` (``datasets.load_from_disk``).

OUT is written beside its final name and renamed into place when complete
(:func:`packkit.fileio.atomic_output`): killed at any moment, OUT holds its previous content or does
not exist. Before anything is read, OUT is checked: an existing OUT is refused unless ``--overwrite``;
OUT that is IN (the same file, through a hard or a symbolic link too) or a folder that holds IN is
refused even then; the folder OUT goes in must exist (it is not created, so a mistyped path fails
instead of making folders).
"""

from __future__ import annotations

import json
import logging
import numbers
from pathlib import Path

from . import DEFAULT_OVERFLOW, OVERFLOW_HELP, Parser, require, rows_as_lines
from ..binpack import OVERFLOW_POLICIES, STRATEGIES, check_seed, check_window, overflow_note
from ..errors import ArgumentError, DataError, arg
from ..fileio import atomic_output, check_output
from ._chat import add_tokenizer_arguments, chat_options

#: OUT's suffix (lower case) -> the format written; no suffix is a ``save_to_disk`` folder.
OUTPUT_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl",
                  ".ndjson": "jsonl", ".arrow": "arrow", "": "folder"}
FORMAT_NAMES = {"parquet": "parquet", "jsonl": "JSON lines", "arrow": "an Arrow IPC stream",
                "folder": "a datasets folder (load with datasets.load_from_disk)"}
#: The library's ``column`` (the token column) is the first of ``--columns`` here.
ALIASES = {"column": "columns"}


def output_format(out: Path) -> str:
    """``out.parquet -> "parquet"``, ``packed -> "folder"``; an unknown suffix is a usage error."""
    fmt = OUTPUT_FORMATS.get(out.suffix.lower())
    if fmt is None:
        raise ArgumentError(f"cannot write {str(out)!r}: unknown output format {out.suffix!r}; name OUT "
                            ".parquet, .jsonl, .arrow, or a folder without a suffix (save_to_disk)")
    return fmt


def parser() -> Parser:
    p = Parser(
        prog="packkit pack",
        description="Pack a dataset of token ids into windows of at most W tokens, one row per window "
                    "(columns input_ids, labels when present or derived from a completion_mask / "
                    "assistant_masks loss mask, seq_lengths). Conversational data (messages, prompt + "
                    "completion) is tokenized with --tokenizer's chat template, -100 on prompt tokens. OUT is "
                    "written beside its name and renamed into place when complete; an existing OUT is "
                    "replaced only with --overwrite.",
    )
    p.add_argument("input", help="jsonl, parquet, arrow, or a folder saved with save_to_disk")
    p.add_argument("output", help="OUT.parquet, OUT.jsonl, OUT.arrow (Arrow IPC stream), or a folder name "
                                  "(save_to_disk); its folder must exist")
    p.add_argument("-w", "--window", type=int, required=True, help="tokens per window")
    p.add_argument("--strategy", default="bfd", choices=STRATEGIES,
                   help="bin packing: bfd (best-fit decreasing, default), ffd, shuffle_ff, next_fit")
    p.add_argument("--overflow", default=DEFAULT_OVERFLOW, choices=OVERFLOW_POLICIES, help=OVERFLOW_HELP)
    p.add_argument("--columns", default=None,
                   help="comma-separated list columns to pack, token ids first "
                        "(default: input_ids, plus labels and a completion_mask / assistant_masks loss "
                        "mask when present; the mask becomes -100 labels)")
    p.add_argument("--text-column", default="text",
                   help="text column to tokenize when there are no token ids (needs --tokenizer)")
    add_tokenizer_arguments(p, default=None)
    p.add_argument("--split", default=None, help="split of a saved DatasetDict (default: train)")
    p.add_argument("--seed", type=int, default=0, help="seed of the row order and of shuffle_ff (default 0)")
    p.add_argument("--no-shuffle", action="store_true", help="keep the planner's window order")
    p.add_argument("--example-ids", action="store_true", help="also write the source row of every segment")
    p.add_argument("--num-proc", type=int, default=None, help="threads for the token copy (default 1)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing OUT (never IN, nor a folder holding IN)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON line (what was packed and written) instead of the text summary")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def _write(ds, path: Path, fmt: str) -> None:
    """Write ``ds`` to ``path`` (a temporary name beside OUT) in ``fmt``."""
    if fmt == "parquet":
        ds.to_parquet(str(path))
    elif fmt == "jsonl":
        ds.to_json(str(path), lines=True)
    elif fmt == "arrow":
        import pyarrow as pa

        batches = ds.with_format("arrow").iter(batch_size=10_000)
        first = next(batches, None)
        schema = first.schema if first is not None else ds.features.arrow_schema
        with pa.ipc.new_stream(str(path), schema) as writer:
            if first is not None:
                writer.write_table(first)
            for table in batches:
                writer.write_table(table)
    else:
        ds.save_to_disk(str(path))


def run(args, options=None) -> int:
    """``packkit pack IN OUT --window W``: pack a dataset file offline."""
    # -- checks that cost nothing, before anything is read: a refusal loses no work --
    check_window(args.window)
    check_seed(args.seed)
    if args.num_proc is not None and (not isinstance(args.num_proc, numbers.Integral) or args.num_proc < 1):
        raise ArgumentError("{arg} must be a positive integer, got {n}", arg=arg("num_proc"), n=args.num_proc)
    src, out = Path(args.input), Path(args.output)
    fmt = output_format(out)
    from .. import io as pio

    src = pio._check_path(src)
    if src.is_file() and src.suffix.lower() == ".npy":
        raise DataError(f"{str(src)!r} holds lengths only; packing needs token ids (jsonl, parquet, arrow)")
    kind = "dir" if fmt == "folder" else "file"
    check_output(out, kind=kind, inputs=[src], overwrite=args.overwrite)
    require("datasets", "pyarrow")

    import datasets
    import pyarrow as pa

    from ..hf import pack_dataset

    columns = [c.strip() for c in args.columns.split(",") if c.strip()] if args.columns else None
    quiet = args.quiet or args.json
    if quiet:
        datasets.disable_progress_bars()
    with rows_as_lines(src):
        if src.is_dir():
            ds = pio.load_dataset(src, split=args.split)
            if columns is None and "input_ids" not in ds.column_names:  # text or conversations to tokenize
                table = ds.data.table if getattr(ds, "_indices", None) is None else ds.flatten_indices().data.table
                ds = None
        else:
            table = pio.load_table(src)
            ds = None
        how = None
        if ds is None:
            token_col = columns[0] if columns else "input_ids"
            table, how = pio.tokens_table(table, column=token_col, text_column=args.text_column,
                                          tokenizer=args.tokenizer, chat=chat_options(args), progress=not quiet,
                                          where=repr(str(src)))
            if table.num_rows == 0:
                raise DataError(f"{str(src)!r} holds no examples")
            ds = datasets.Dataset(pa.Table.from_arrays([table.column(c) for c in table.column_names],
                                                       names=table.column_names),
                                  fingerprint=datasets.fingerprint.generate_random_fingerprint())
        if len(ds) == 0:
            raise DataError(f"{str(src)!r} holds no examples")
        # What the overflow policy did is printed below; the library's log line would repeat it on stderr.
        logging.getLogger("packkit").setLevel(logging.ERROR)
        packed, plan = pack_dataset(
            ds, window=args.window, strategy=args.strategy, overflow=args.overflow, columns=columns, seed=args.seed,
            shuffle=not args.no_shuffle, num_proc=args.num_proc, example_ids=args.example_ids,
            progress=None if not quiet else False, return_plan=True)
    with atomic_output(out, kind=kind, inputs=[src], overwrite=args.overwrite) as tmp:
        _write(packed, tmp, fmt)

    s = plan.summary()
    input_tokens = s["tokens"] + s["cut_tokens"]
    note = overflow_note(s["overflow"], over=s["overflow_examples"], examples=s["examples"], cut=s["cut_tokens"],
                         tokens=input_tokens)
    if args.json:
        print(json.dumps({"input": str(src), "output": str(out), "format": fmt, "columns": packed.column_names,
                          "rows": len(packed), "input_tokens": input_tokens, "seed": args.seed,
                          "shuffled": not args.no_shuffle, "tokenized": how, **s}))
        return 0
    if how is not None:
        print(f"tokenized {how}")
    print(f"packed {s['examples']:,} examples ({input_tokens:,} tokens) into {s['windows']:,} "
          f"windows of {s['window']:,} (lower bound {s['lower_bound']:,}, fill {s['fill']:.4f}, {args.strategy})")
    if note is not None:
        print(note.render(options))
    print(f"wrote {str(out)!r} as {FORMAT_NAMES[fmt]}; columns {packed.column_names}")
    return 0
