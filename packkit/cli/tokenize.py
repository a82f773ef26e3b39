"""``packkit tokenize IN OUT``: token ids, and the loss mask TRL would train with, written once.

Conversational data (TRL's ``messages``, ``conversations``, ``prompt`` + ``completion``) goes through ``--tokenizer``'s
chat template (:func:`packkit.chat.tokenize_chat`); text is tokenized (:class:`packkit.datafiles.Tokenizing`). IN is
read, tokenized and written a bounded chunk at a time (:meth:`packkit.datafiles.Input.tokenized`), never whole. OUT
holds ``input_ids`` and the loss mask (``assistant_masks`` or ``completion_mask``) when one applies, in any format
``packkit pack`` writes, written beside its name and renamed when complete; ``waste``, ``plan`` and ``pack`` read it
without tokenizing again, and measure exactly what they would on IN with the same options."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from ._options import Parser, add_output_switches
from ..chat import chat_format
from ..datafiles import Input, lines_named, load_table, preference_columns, reader_pyarrow, table_chunks
from ..errors import ArgumentError, DataError, MissingError, arg
from ..fileio import check_output, held_still
from ..rules import MASK_KEYS
from ..allocators import bound_allocators
from ..tokenizer import tokenizer_name
from ..outputs import example_suffixes, output_format, write_batches
from ._chat import add_input_arguments, chat_options

#: Rows per record batch written.
BATCH_ROWS = 8192


def parser() -> Parser:
    p = Parser(prog="packkit tokenize",
               description="Tokenize text or conversational data once (input_ids, and TRL's loss mask for chat data),\n"
                           "so that packkit waste, plan and pack read the result without tokenizing again. Preference\n"
                           "pairs (prompt, chosen, rejected) become TRL's prompt_ids, chosen_ids and rejected_ids,\n"
                           "for packkit waste --preference.")
    add_input_arguments(p, column=False, tokenizer=None)
    p.add_argument("output", help=", ".join(f"OUT{s}" for s in example_suffixes()) + ", or a folder (save_to_disk)")
    p.add_argument("--num-proc", type=int, default=None,
                   help="processes that render and tokenize (default 1), as datasets.map's num_proc")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT (never IN)")
    add_output_switches(p, instead_of="the summary")
    return p


def run(args, options=None) -> int:
    """``packkit tokenize IN OUT --tokenizer T``: IN held still while it is read (:func:`packkit.fileio.held_still`:
    a memory-mapped IN truncated under the read was a SIGBUS)."""
    inp = Input(args.input, tokenizer=args.tokenizer, text_column=args.text_column, split=args.split,
                chat=chat_options(args, num_proc=args.num_proc))
    bound_allocators(args.tokenizer)  # a tokenizer named: pyarrow on the system allocator, for the rest of the process
    with held_still([inp.path]) as hold:
        return _run(args, inp, hold)


def _run(args, inp: Input, hold) -> int:
    src, out = inp.path, Path(args.output)
    fmt = output_format(out)
    if fmt.packed:
        raise ArgumentError(f"{str(out)!r} would be {fmt.title}, which holds packed rows; tokenize writes examples: "
                            f"name OUT {', '.join(example_suffixes())} or a folder (then packkit pack it)")
    check_output(out, kind=fmt.kind, inputs=[src], overwrite=args.overwrite)
    reader_pyarrow(src)  # without pyarrow: one line naming IN's format and the extra
    first = next(table_chunks(src, split=args.split), None)
    if first is not None and preference_columns(first.column_names) == ("prompt", "chosen", "rejected"):
        return _pairs(args, src, out, fmt, hold)
    with lines_named(src):
        if first is not None and args.text_column not in first.column_names and "input_ids" not in first.column_names:
            if chat_format(first.schema, format=inp.chat.format) is None:  # tokenize has no --column to name
                raise MissingError("{src!r} holds no text column {text!r}, conversation or preference pair; the "
                                   "columns are {names}: pass {fix}", src=str(src), text=args.text_column,
                                   names=first.column_names, fix=arg("text_column", metavar="NAME"))

        def write(whole: bool):  # a bounded chunk at a time: read, tokenized, written (whole where it must)
            tables, how = inp.tokenized(whole=whole, progress=not (args.quiet or args.json))
            if how is None and (first is None or first.num_rows == 0):  # no row, or token ids already: refused
                raise DataError(f"{str(src)!r} holds no examples")
            if how is None and "input_ids" in first.column_names:
                raise DataError(f"{str(src)!r} holds token ids already (input_ids): nothing to tokenize; packkit "
                                "waste, plan and pack read it as it is")
            return (*_write(tables, out, fmt, src, args.overwrite, hold), how)

        rows, tokens, keep, how = inp.read(write)
    return _report(args, src, out, fmt, rows, tokens, keep, how, what="examples",
                   readers="packkit waste, plan and pack read it without tokenizing again")


def _report(args, src: Path, out: Path, fmt, rows: int, tokens: int, keep: list, how: str, *, what: str,
            readers: str) -> int:
    """What tokenize wrote: one JSON line (``--json``), else two lines (``what`` were tokenized; ``readers``)."""
    print(json.dumps({"input": str(src), "output": str(out), "format": fmt.name, "columns": keep, "examples": rows,
                      "tokens": tokens, "tokenized": how}) if args.json
          else f"tokenized {rows:,} {what} ({tokens:,} tokens): {how}\nwrote {str(out)!r}; columns {keep}: {readers}")
    return 0


def _pairs(args, src: Path, out: Path, fmt, hold) -> int:
    """Preference pairs (text or conversational ``prompt`` / ``chosen`` / ``rejected``), read whole, as TRL's
    ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids`` (:func:`packkit.preference.tokenize_pairs`): what ``packkit
    waste --preference`` and :class:`packkit.preference.PreferenceCollator` read."""
    if args.tokenizer is None:
        raise ArgumentError("{src!r} holds preference pairs (prompt, chosen, rejected): pass {tok}", src=str(src),
                            tok=arg("tokenizer", metavar="FOLDER_OR_MODEL_ID"))
    from ..preference import tokenize_pairs  # lazy: torch, only for preference pairs
    with lines_named(src):
        table = tokenize_pairs(load_table(src, split=args.split), args.tokenizer,
                               trust_remote_code=args.trust_remote_code)
    how = f"preference pairs with {tokenizer_name(args.tokenizer)}, as TRL's DPOTrainer"
    rows, tokens, keep = _write(iter([table]), out, fmt, src, args.overwrite, hold, keep=list(table.column_names))
    return _report(args, src, out, fmt, rows, tokens, keep, how, what="pairs",
                   readers="packkit waste --preference reads it")


def _write(tables, out: Path, fmt, src: Path, overwrite: bool, hold, keep: list | None = None):
    """Write the columns ``keep`` (else ``input_ids`` and the loss columns) of ``tables``, tokenized chunks in the first
    one's schema, to ``out`` as they come: ``(rows, tokens of the *_ids columns, columns)``. ``hold``
    (:func:`packkit.fileio.held_still`'s) is released once IN is read to the end, before OUT is placed."""
    first = next(tables, None)
    if first is None:  # rows none (a parquet file of empty row groups): refused before OUT is written
        raise DataError(f"{str(src)!r} holds no examples")
    keep = keep or [c for c in ("input_ids", "labels", *MASK_KEYS) if c in first.column_names]
    counts = [0, 0]

    def batches():
        for table in itertools.chain([first], tables):
            table = table.select(keep)
            counts[0] += table.num_rows
            for name in (c for c in keep if c.endswith("_ids")):
                ids = table.column(name).chunks
                counts[1] += sum(int(c.offsets[-1].as_py() - c.offsets[0].as_py()) for c in ids)
            yield from table.to_batches(max_chunksize=BATCH_ROWS)
        hold.release()

    write_batches(out, first.select(keep).schema, batches(), format=fmt, inputs=[src], overwrite=overwrite)
    return counts[0], counts[1], keep
