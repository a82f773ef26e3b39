"""``packkit pack IN OUT --window W``: pack a dataset file offline into windows.

OUT's format follows its name or ``--output-format`` (:mod:`packkit.outputs`, the door out). Out of core: IN is read
through the door in (:meth:`packkit.datafiles.Input.rows`: memory-mapped, or a chunk at a time, staged as Arrow beside
OUT; whole only where it must), and the packed rows are gathered and written a record batch at a time: memory holds the
plan and ``--buffer-mb`` of rows, never the tokens. Every check that costs nothing runs before IN is read; OUT is
written beside its name and renamed into place when complete; IN is held still while read (:mod:`packkit.fileio`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ._options import Parser, add_cp_arguments, add_output_switches, add_window_arguments, require
from ..binpack import overflow_note
from ..epoch import trains_on_nothing
from ..errors import DataError, check_int
from ..datafiles import INPUTS, Input, lines_named, reader_pyarrow
from ..fileio import atomic_output, check_output, held_still, temp_folder
from ..offline import PROGRESS_BYTES, check_planning, pack_dataset, plan_source, show_progress
from ..mediarows import (MEDIA_INPUTS, MEDIA_SUFFIXES, file_columns, kept_media, media_columns, media_dataset,
                         refuse_media)
from ..progress import progress_bar
from ..sources import ArrowSource
from ..allocators import bound_allocators
from ..outputs import DEFAULT_BUFFER_BYTES, FORMATS, MIN_BUFFER_BYTES, documents_lost, output_format, write_packed
from ._chat import add_input_arguments, chat_options

#: The library's ``column`` (the token column) is the first of ``--columns``; ``buffer_bytes`` is ``--buffer-mb`` (MiB).
ALIASES = {"column": "columns", "buffer_bytes": "buffer_mb"}


def parser() -> Parser:
    p = Parser(prog="packkit pack",
               description="Pack a dataset of token ids into windows of at most W tokens, one row per window (columns "
                           "input_ids, labels when present or derived from a completion_mask / assistant_masks loss "
                           "mask, seq_lengths). Conversational data (messages, prompt + completion) is tokenized with "
                           "--tokenizer's chat template, -100 on prompt tokens. OUT is written beside its name and "
                           "renamed into place when complete; an existing OUT is replaced only with --overwrite.")
    add_input_arguments(p, column=False, tokenizer=None)
    p.add_argument("output", help="the file or folder to write, its format chosen by its suffix: "
                                  + ", ".join(f"OUT{f.suffixes[0]}" for f in FORMATS.values() if f.suffixes[0])
                                  + ", or a folder without one (save_to_disk); its folder must exist")
    p.add_argument("--output-format", default=None, choices=list(FORMATS), metavar="NAME",
                   help=f"OUT's format whatever its name: {', '.join(FORMATS)} (default: from OUT's suffix)")
    add_window_arguments(p)
    p.add_argument("--columns", default=None,
                   help="comma-separated list columns to pack, token ids first (default: input_ids, plus labels and "
                        "a completion_mask / assistant_masks loss mask when present; the mask becomes -100 labels)")
    p.add_argument("--seed", type=int, default=0, help="seed of the row order and of shuffle_ff (default 0)")
    p.add_argument("--no-shuffle", action="store_true", help="keep the planner's window order")
    p.add_argument("--example-ids", action="store_true", help="also write the source row of every segment")
    add_cp_arguments(p, cp_help="rows for a context-parallel group of N ranks (default 1): with --cp-layout zigzag "
                             "every example is planned padded to a multiple of 2*N, so a row still fits W once sharded",
                     layout_help="the layout packkit.cp.shard will cut rows with (default hybrid; W a multiple of N)")
    p.add_argument("--num-proc", type=int, default=None, help="threads for the token copy (default 1)")
    p.add_argument("--buffer-mb", type=int, default=None, help="memory for packed rows in flight, in MiB (default: a "
                   f"sixteenth of the packed tokens, {MIN_BUFFER_BYTES >> 20} to {DEFAULT_BUFFER_BYTES >> 20}); the "
                   "tokens are read from IN as needed, never held whole")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing OUT (never IN, nor a folder holding IN)")
    add_output_switches(p, instead_of="the summary (what was packed and written)")
    return p


def _checked(batches, hold):
    """``batches``, IN checked unchanged before each and after the last, before OUT is renamed into place
    (:meth:`packkit.fileio.held_still`'s hold: where no lease holds IN, its size and time are compared)."""
    for batch in batches:
        hold.check()
        yield batch
    hold.release()  # read to the end: a writer of IN waits no longer, and the OUT about to be placed stands


def run(args, options=None) -> int:
    # The command prints what the overflow policy did (the log would say it again); put back for an in-process caller
    logger = logging.getLogger("packkit")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return _run(args, options)
    finally:
        logger.setLevel(level)


def _run(args, options) -> int:
    inp, out, fmt, buffer_bytes, columns = _checks(args)
    bound_allocators(args.tokenizer)  # a tokenizer named: pyarrow on the system allocator, for the rest of the process
    quiet = args.quiet or args.json
    if kept_media(inp.path, inp.format, fmt.name):  # packkit.mediarows: rows packed with their media
        return _pack_media(args, inp, out, fmt, columns, buffer_bytes, quiet)
    if quiet and inp.format == "folder":  # lazy: datasets (1 s to import) reads a save_to_disk folder IN, with its bars
        import datasets
        datasets.disable_progress_bars()
    src = inp.path
    # IN may not change while it is read (a truncated memory map is a SIGBUS): packkit.fileio.held_still
    with held_still([src]) as hold, lines_named(src):
        def plan(whole: bool):
            rows = inp.rows(whole=whole, progress=not quiet)
            source = ArrowSource.of(rows, stage_dir=out.parent if out.parent.is_dir() else None)
            return source, rows.how, plan_source(
                source, window=args.window, strategy=args.strategy, overflow=args.overflow, columns=columns,
                seed=args.seed, shuffle=not args.no_shuffle, num_proc=args.num_proc, example_ids=args.example_ids,
                progress=False if quiet else None, who="packkit pack", cp_size=args.cp_size, cp_layout=args.cp_layout)

        source, how, packed = inp.read(plan)  # a type that changes after the first chunk: read whole, there
        ins = " or ".join(next(s for s, (kind, _) in INPUTS.items() if kind == k) for k in MEDIA_INPUTS)
        refuse_media(source.names, f"packkit pack keeps them from a {ins} IN to an OUT of {MEDIA_SUFFIXES}, or pack "
                     "them with packkit.offline.pack_dataset(ds, window=..., output=OUT"
                     f"{FORMATS['parquet'].suffixes[0]})")
        if packed.plan.num_examples == 0:  # one rule for every format: an empty OUT would pass for a result
            raise DataError(f"{str(src)!r} holds no examples")
        if packed.plan.num_windows == 0:  # every example longer than the window, and dropped
            raise _none_left(args, src)
        # -- the rows, a record batch at a time, written beside OUT and renamed when complete --
        max_tokens = packed.chunk_tokens(buffer_bytes, encoding=fmt.encoding, in_flight=2)
        if args.drop_loss_free:
            packed.drop_loss_free(max_tokens, where=f" of {str(src)!r}")
        total = packed.plan.total_tokens * len(packed.spec.written())
        with progress_bar(total=total, unit="tok", enabled=not quiet and show_progress(source),
                          desc="packkit pack") as bar:
            write_packed(out, packed, format=fmt, max_tokens=max_tokens, bar=bar, inputs=[src],
                         overwrite=args.overwrite, through=lambda batches: _checked(batches, hold))
    return _report(args, options, src, out, fmt, packed, how)


def _pack_media(args, inp, out: Path, fmt, columns, buffer_bytes, quiet: bool) -> int:
    """Rows with media: IN read as a ``datasets.Dataset`` (:func:`packkit.mediarows.media_dataset`) and packed by
    :func:`packkit.offline.pack_dataset` to OUT, each document's media with it. Its log lines (overflow, windows
    with no loss token, pieces left out) go to stderr as they are; the summary says what the plan holds."""
    logging.getLogger("packkit").setLevel(logging.WARNING)  # run() puts the level back
    sized = {} if buffer_bytes is None else {"buffer_bytes": buffer_bytes}
    # OUT through atomic_output, as every writer: written beside it (an existing one replaced only with --overwrite),
    # renamed onto it once IN is checked unchanged. IN's Arrow copy (datasets converts a Parquet file before it maps
    # it) goes beside OUT and away with the run, not into datasets' cache (~/.cache): data the user never asked for
    with held_still([inp.path]) as hold, atomic_output(out, kind=fmt.kind, inputs=[inp.path],
                                                       overwrite=args.overwrite) as tmp, temp_folder(out) as cache:
        ds = media_dataset(inp.path, parquet=inp.format == "parquet", cache_dir=cache,  # datasets' bars as packkit's
                           progress=not quiet and inp.path.stat().st_size >= PROGRESS_BYTES)
        _, plan = pack_dataset(
            ds, window=args.window, strategy=args.strategy, overflow=args.overflow, seed=args.seed, output=tmp,
            shuffle=not args.no_shuffle, return_report=True, columns=columns, example_ids=args.example_ids,
            cp_size=args.cp_size, cp_layout=args.cp_layout, drop_loss_free=args.drop_loss_free,
            num_proc=args.num_proc, progress=False if quiet else None, output_format=fmt.name, **sized)
        hold.release()  # IN read to the end, unchanged: OUT is renamed into place whatever comes after
        if plan.num_windows == 0:  # one rule for every format: an empty OUT would pass for a result
            raise _none_left(args, inp.path)
    names = file_columns(out, parquet=fmt.input_format == "parquet")  # by OUT's format, whatever its name ends with
    s, media = plan.summary(), media_columns(names)
    if args.json:
        print(json.dumps({"input": str(inp.path), "output": str(out), "format": fmt.name, "columns": names,
                          "media": media, "rows": plan.num_windows, "seed": args.seed, "shuffled": not args.no_shuffle,
                          "cp_size": args.cp_size, "cp_layout": args.cp_layout, **s}))
        return 0
    print(_packed(args, s, s["tokens"] + s["cut_tokens"], plan, f" with their media ({', '.join(media)})"))
    print(f"wrote {str(out)!r} as {fmt.title}; columns {names}")
    return 0


def _none_left(args, src) -> DataError:
    """The refusal of an empty OUT (it would pass for a result): the overflow policy left no example of ``src``."""
    return DataError(f"no example of {str(src)!r} is left to write ({args.overflow} and {args.window:,} tokens a "
                     "window); raise --window")


def _checks(args):
    """The checks that cost nothing, before anything is read (a refusal loses no work): ``(input, OUT, its
    format, buffer bytes or None, columns or None)``."""
    check_planning(args.window, args.strategy, args.overflow, args.seed, args.num_proc)
    buffer_bytes = None if args.buffer_mb is None else check_int(args.buffer_mb, "buffer_bytes", unit=" MiB") * 2**20
    columns = [c.strip() for c in args.columns.split(",") if c.strip()] if args.columns else None
    out = Path(args.output)
    fmt = output_format(out, args.output_format)
    inp = Input(args.input, column=columns[0] if columns else "input_ids", text_column=args.text_column,
                tokenizer=args.tokenizer, chat=chat_options(args), split=args.split)
    if inp.format == "npy":
        raise DataError(f"{inp.where} holds lengths only; packing needs token ids (jsonl, parquet, arrow)")
    check_output(out, kind=fmt.kind, inputs=[inp.path], overwrite=args.overwrite)
    reader_pyarrow(inp.path)  # without pyarrow: one line naming IN's format and the extra
    require("datasets")
    return inp, out, fmt, buffer_bytes, columns  # buffer_bytes None: sized to the data


def _report(args, options, src: Path, out: Path, fmt, packed, how) -> int:
    """What was packed and written: one JSON line (``--json``), else the summary's lines."""
    plan, names, s = packed.plan, packed.schema.names, packed.plan.summary()
    input_tokens = s["tokens"] + s["cut_tokens"] + packed.dropped_tokens
    loss = {"loss_tokens": packed.loss_tokens, "loss_tokens_assumed": "labels" not in names,
            "loss_free_windows": packed.loss_free_windows, "loss_free_pieces": packed.loss_free_pieces,
            "dropped_pieces": packed.dropped_pieces, "dropped_tokens": packed.dropped_tokens}
    note = overflow_note(s["overflow"], over=s["overflow_examples"], examples=s["examples"], cut=s["cut_tokens"],
                         tokens=input_tokens)
    packed_rows = packed.scan.packed_rows  # IN held packed rows, read as their documents
    if args.json:
        print(json.dumps({"input": str(src), "output": str(out), "format": fmt.name, "columns": names,
                          "rows": plan.num_windows, "input_tokens": input_tokens, "seed": args.seed,
                          "shuffled": not args.no_shuffle, "tokenized": how, "packed_rows_in": packed_rows,
                          "split_pieces_in": packed.split_pieces, "split_examples_in": packed.split_examples,
                          "cp_size": args.cp_size, "cp_layout": args.cp_layout, **s, **loss}))
        return 0
    if how is not None:
        print(f"tokenized {how}")
    if packed_rows is not None:
        print(f"{packed_rows:,} packed rows read as their {s['examples']:,} documents (an example is a document)")
        if packed.split_pieces:  # example_ids repeat: pieces of examples split at the window they were packed at
            print(f"{packed.split_pieces:,} of the documents are pieces of {packed.split_examples:,} examples split "
                  "when the rows were packed (their example_ids repeat): they stay separate documents (their first "
                  "labels were masked then); pack the unpacked examples to rejoin them")
        elif packed.scan.doc_ids is None:
            print("examples split when the rows were packed stay pieces (the rows carry no example_ids to tell); "
                  "pack the unpacked examples to rejoin them")
    print(_packed(args, s, input_tokens, plan))
    if note is not None:
        print(note.render(options))
    print(f"loss tokens {packed.loss_tokens:,} ({packed.loss_tokens / max(1, s['tokens']):.1%} of the tokens; "
          + ("no labels or loss mask: every token but each segment's first)" if loss["loss_tokens_assumed"]
             else "labels other than -100, each segment's first token masked)"))
    for said in trains_on_nothing(dropped=(packed.dropped_pieces, packed.dropped_tokens),
                                  rows=(packed.loss_free_windows, plan.num_windows)):
        print(said.render(options))
    if documents_lost(fmt, names):
        print(documents_lost(fmt, names))
    print(f"wrote {str(out)!r} as {fmt.title}" + ("" if fmt.sink is None else f"; columns {names}"))
    return 0


def _packed(args, s: dict, input_tokens: int, plan, media: str = "") -> str:
    """The summary's lines: what was packed (``s``: the plan's figures) of ``input_tokens`` read, and the CP group."""
    held = f"{input_tokens:,}" if s["tokens"] == input_tokens else f"{s['tokens']:,} of {input_tokens:,}"
    n = len(set(plan.seg_example.tolist()))  # in a window: not those --overflow drop or --drop-loss-free left out
    kept = f"{n:,}" if n == s["examples"] else f"{n:,} of {s['examples']:,}"
    cp = f"\nrows for a context-parallel group of {args.cp_size} ({args.cp_layout})" if args.cp_size > 1 else ""
    return (f"packed {kept} examples ({held} tokens){media} into {s['windows']:,} windows of "
            f"{s['window']:,} (lower bound {s['lower_bound']:,}, fill {s['fill']:.4f}, {args.strategy})" + cp)
