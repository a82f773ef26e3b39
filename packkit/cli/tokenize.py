"""``packkit tokenize IN OUT``: token ids, and the loss mask TRL would train with, written once.

Conversational data (TRL's ``messages``, ``conversations``, ``prompt`` + ``completion``) goes through
``--tokenizer``'s chat template (:func:`packkit.chat.tokenize_chat`); text is tokenized
(:func:`packkit.datafiles.tokens_table`). OUT holds ``input_ids`` and the loss mask (``assistant_masks``
or ``completion_mask``) when one applies, in any format ``packkit pack`` writes; ``packkit waste``,
``plan`` and ``pack`` then read OUT without tokenizing again, and measure exactly what they would have
measured on IN with the same options. OUT is written beside its name and renamed when complete.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import Parser, rows_as_lines
from ..datafiles import check_path, load_dataset, load_table, reader_pyarrow, tokens_table
from ..errors import DataError
from ..fileio import check_output
from ..rules import MASK_KEYS
from ..writers import output_format, write_batches
from ._chat import add_tokenizer_arguments, chat_options

#: Rows per record batch written.
BATCH_ROWS = 8192


def parser() -> Parser:
    p = Parser(
        prog="packkit tokenize",
        description="Tokenize text or conversational data once (input_ids, and TRL's loss mask for chat data), "
                    "so that packkit waste, plan and pack read the result without tokenizing again.",
    )
    p.add_argument("input", help="jsonl, parquet, arrow, .txt (one example a line), or a save_to_disk folder")
    p.add_argument("output", help="OUT.parquet, OUT.jsonl, OUT.arrow, OUT.feather, or a folder name (save_to_disk)")
    p.add_argument("--text-column", default="text", help="text column, when the data is not conversational")
    add_tokenizer_arguments(p, default=None)
    p.add_argument("--num-proc", type=int, default=None,
                   help="processes that render and tokenize (default 1), as datasets.map's num_proc")
    p.add_argument("--split", default=None, help="split of a saved DatasetDict (default: train)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT (never IN)")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the summary")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def run(args, options=None) -> int:
    """``packkit tokenize IN OUT --tokenizer T``."""
    src, out = check_path(args.input), Path(args.output)
    fmt = output_format(out)
    check_output(out, kind="dir" if fmt == "folder" else "file", inputs=[src], overwrite=args.overwrite)
    reader_pyarrow(src)  # without pyarrow: one line naming IN's format and the extra
    with rows_as_lines(src):
        table = load_dataset(src, split=args.split).with_format("arrow")[:] if src.is_dir() else load_table(src)
        if "input_ids" in table.column_names:
            raise DataError(f"{str(src)!r} holds token ids already (input_ids): nothing to tokenize; packkit waste, "
                            "plan and pack read it as it is")
        table, how = tokens_table(table, tokenizer=args.tokenizer, text_column=args.text_column,
                                  chat={**chat_options(args), "num_proc": args.num_proc}, progress=not (args.quiet or args.json),
                                  where=repr(str(src)))
    if table.num_rows == 0:
        raise DataError(f"{str(src)!r} holds no examples")
    keep = [c for c in ("input_ids", "labels", *MASK_KEYS) if c in table.column_names]
    table = table.select(keep)
    write_batches(out, table.schema, iter(table.to_batches(max_chunksize=BATCH_ROWS)), format=fmt, inputs=[src],
                  overwrite=args.overwrite)
    tokens = sum(len(chunk.values) for chunk in table.column("input_ids").chunks)
    if args.json:
        print(json.dumps({"input": str(src), "output": str(out), "format": fmt, "columns": keep,
                          "examples": table.num_rows, "tokens": tokens, "tokenized": how}))
    else:
        print(f"tokenized {table.num_rows:,} examples ({tokens:,} tokens): {how}")
        print(f"wrote {str(out)!r}; columns {keep}: packkit waste, plan and pack read it without tokenizing again")
    return 0
