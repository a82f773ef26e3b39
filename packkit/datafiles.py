"""The door in: data files (:data:`INPUTS` by suffix, or a ``save_to_disk`` folder), each read through an
:class:`Input` as tables of examples, their token columns and their lengths (:func:`read_lengths` says from what),
without per-token Python: what ``packkit waste`` and ``plan`` measure is what ``packkit pack`` accepts. This module
decides; behind it: :mod:`packkit.jsonlines`, :mod:`packkit.readers`, :mod:`packkit.tokenizer`."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import warnings
from pathlib import Path

import numpy as np

from . import jsonlines
from .arrow import pyarrow, replay
from .binpack import as_lengths
from .chatoptions import ChatOptions
from .csr import batch_sums
from .epoch import Lengths
from .errors import DataError, Message, MissingError, PackkitError, arg
from .rules import not_integer, null_tokens, segment_key
from .sample import SAMPLE_PATH, bundled_sample  # noqa: F401 - their home is packkit.sample, off the readers
from .segments import lengths_to_offsets, range_index

__all__ = ["Lengths", "read_preference_lengths", "bundled_sample", "load_table", "load_dataset", "parquet_batches",
           "parquet_schema", "read_lengths", "reader_pyarrow", "table_chunks", "Tokenizing", "tokenize", "FORMATS",
           "INPUTS", "Input", "Rows", "input_format", "lines_named"]

#: The input formats: suffix (lower case) -> (how it is read, :func:`input_format`; its name in messages). A folder
#: is a ``save_to_disk`` dataset. This module is the only one that knows them (``tests/test_layering.py``).
INPUTS = {
    ".npy": ("npy", "numpy array of lengths"),
    ".jsonl": ("json", "JSON lines"), ".ndjson": ("json", "JSON lines"),
    ".json": ("json", "JSON (lines, or one list of objects)"),
    ".parquet": ("parquet", "Parquet"), ".pq": ("parquet", "Parquet"),
    ".arrow": ("arrow", "Arrow IPC"), ".feather": ("arrow", "Arrow IPC"), ".ipc": ("arrow", "Arrow IPC"),
    ".txt": ("text", "text, one example per line"), ".text": ("text", "text, one example per line"),
}

#: Suffix -> the format's name in messages.
FORMATS = {suffix: words for suffix, (_, words) in INPUTS.items()}

#: ``{name: module}``: what :mod:`packkit.tokenizer`, :mod:`packkit.readers` and :mod:`packkit.tokenizing` lend here
#: under the old address (``packkit.datafiles.tokenize``, ``.parquet_schema``), each imported on first use.
_LENT = {**dict.fromkeys(("load_tokenizer", "rust_tokenizer", "tokenize", "tokenizer_name"), "tokenizer"),
         **dict.fromkeys(("load_dataset", "parquet_batches", "parquet_schema", "read_arrow", "read_npy", "read_parquet",
                          "read_text", "text_byte_lengths", "text_tables"), "readers"), "Tokenizing": "tokenizing"}


def _readers():
    from . import readers  # lazy: the other formats' readers, off a JSON lines file's start (``plan FILE.jsonl``)
    return readers


def __getattr__(name: str):  # a name of _LENT, from its module (the tokenizers: for text or pairs only)
    if name not in _LENT:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_LENT[name]}", __package__), name)


def input_format(path) -> str:
    """How ``path`` is read: by its suffix (:data:`INPUTS`, the one place an input's format is chosen), ``"folder"``
    for a ``save_to_disk`` folder, ``""`` when unknown. ``input_format("d.JSONL") -> "json"``."""
    path = Path(path)
    return "folder" if path.is_dir() else INPUTS.get(path.suffix.lower(), ("",))[0]


def reader_pyarrow(path):
    """pyarrow, to read ``path``; without it, the one-line error naming the format and the extra:
    ``reading JSON lines ('data.jsonl') needs pyarrow: pip install 'packkit[datasets]'``."""
    path = Path(path)
    what = "a datasets folder" if path.is_dir() else FORMATS.get(path.suffix.lower(), "this format")
    return pyarrow(f"reading {what.split(' (')[0].split(',')[0]} ({path.name!r})")


def check_path(path) -> Path:
    """``path`` as a ``Path`` when it is a file of a known format or a ``save_to_disk`` folder, else the
    one-line error: ``check_path("d.csv")`` raises naming the formats read here."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist")
    if path.is_dir():
        if not any((path / f).exists() for f in ("state.json", "dataset_dict.json", "dataset_info.json")):
            raise ValueError(f"{str(path)!r} is a folder but not a dataset saved with save_to_disk (no state.json or "
                             "dataset_dict.json in it)")
    elif not path.is_file():  # a named pipe, /dev/stdin from a pipe, a device
        raise DataError(f"{str(path)!r} is a pipe or a device, not a file: packkit reads its input more than once "
                        "(to measure, then to gather, and to name a bad line); save it to a file first")
    elif not input_format(path):
        raise ValueError(f"cannot read {str(path)!r}: unknown format {path.suffix or '(no suffix)'!r}; use one of "
                         f"{', '.join(sorted(FORMATS))}, or a folder saved with save_to_disk")
    return path


def _packed_rows(path) -> bool:
    """Whether the first row of a JSON lines file is a packed row (its examples are documents, not lines)."""
    first = next(jsonlines.lines(path), (0, b"{}"))[1]
    try:
        return segment_key(list(json.loads(first))) is not None
    except (ValueError, TypeError):
        return False


@contextlib.contextmanager
def lines_named(path):
    """Inside, an error about a row of the JSON lines file ``path`` (its :class:`packkit.errors.Where` field, no
    message parsed) names that row's line too: ``dataset row 149999 (line 150,001 of 'data.jsonl') has ...`` (an
    example is a row, unless the rows are packed). A float token (:func:`packkit.rules.not_integer`, its value and key
    the error's fields) is blamed on the first row whose key holds a float: one ``5.0`` on line 900 makes pyarrow read
    the whole column as floats, so the rules blamed ``1.0`` on line 1; Python's reader tells ``5.0`` from ``5``."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        if (path is None or input_format(path) != "json" or not os.path.isfile(path)
                or jsonlines.first_byte(path) == b"["):  # not JSON lines (whose rows are its non-blank lines)
            raise
        from .located import ExampleTypeError, located  # lazy: the error path only, off a file that reads
        fields, moved = (exc.fields if isinstance(exc, ExampleTypeError) else {}), exc
        if isinstance(fields.get("value"), float) and (found := jsonlines.first_float(path, fields["key"])):
            text = not_integer(found[0], 0, fields["key"], fields["kind"], found[1]).text
            moved = located(ExampleTypeError, found[0], 0, f"{text} (a JSON number written with a decimal point or "
                            "an exponent; one makes pyarrow read the whole column as floats)")
        where = moved.where if isinstance(moved, PackkitError) else None
        if where is not None and not where.line and (where.row or not _packed_rows(path)):
            line = jsonlines.line_of_row(path, where.number)
            moved = moved if line is None else moved.at_line(f"line {line:,} of {str(path)!r}")
        if moved is exc:
            raise
        raise moved from exc


def load_table(path, *, split: str | None = None):
    """Read a file (or a ``save_to_disk`` folder, memory-mapped, a selection applied) into a ``pyarrow.Table``."""
    path = check_path(path)
    reader_pyarrow(path)
    if path.is_dir():  # public API: the columns stay memory-mapped views
        return _readers().load_dataset(path, split=split).with_format("arrow")[:]
    kind = input_format(path)
    if kind in ("json", "parquet", "arrow", "text"):
        return jsonlines.read_json(path) if kind == "json" else getattr(_readers(), f"read_{kind}")(path)
    raise DataError(f"{str(path)!r}: a {FORMATS[path.suffix.lower()]} file has no table of examples")


#: Rows per chunk when an Arrow table (a memory-mapped file or folder) is tokenized a chunk at a time.
TOKENIZE_ROWS = 4096

#: Bytes of JSON lines per chunk tokenized at a time: more than :data:`packkit.jsonlines.JSON_BLOCK_BYTES`, since a
#: tokenizer's batch call runs its threads better over more texts.
TOKENIZE_BLOCK_BYTES = 4 << 20

#: Characters of a ``.txt`` per chunk tokenized (:func:`packkit.readers.text_tables`): up to four chunks are in flight,
#: each as Python strings, an Arrow array and ids. Qwen3's tokenizer over 16 MB of ShareGPT text (freed memory
#: handed back) peaked 94 MiB over the warm command with 4 MiB chunks, 51 MiB with these.
TEXT_BLOCK_CHARS = 256 << 10


def table_chunks(path, *, split: str | None = None, block_size: int | None = None):
    """The rows of a data file (or a ``save_to_disk`` folder) as ``pyarrow.Table``\\ s in order, a bounded chunk at a
    time: JSON lines and text ``block_size`` bytes at a time, Parquet a batch at a time, Arrow memory-mapped and
    sliced (:data:`TOKENIZE_ROWS` rows); one JSON list is read whole. Empty input yields nothing."""
    kind = input_format(path)
    if kind == "json":
        any_table = False
        for table in jsonlines.json_tables(path, block_size=block_size):
            any_table = True
            yield table
        if any_table or not jsonlines.first_byte(path):
            return
    if kind == "text":
        yield from _readers().text_tables(path, size=block_size or jsonlines.JSON_BLOCK_BYTES)
    elif kind == "parquet":
        pa = reader_pyarrow(path)
        batches = _readers().parquet_batches(path, batch_rows=TOKENIZE_ROWS)
        yield from (pa.Table.from_batches([batch]) for batch in batches)
    else:
        table = load_table(path, split=split)  # memory-mapped (Arrow, a folder), or one JSON list
        yield from (table.slice(lo, TOKENIZE_ROWS) for lo in range(0, table.num_rows, TOKENIZE_ROWS))


def warn_unused_tokenizer(tokenizer, where: str) -> None:
    """Say in one line that ``tokenizer``, asked for by name, was not used: ``where`` held token ids or lengths."""
    if tokenizer not in (None, "bytes"):
        warnings.warn(UserWarning(Message("{where} holds token ids already: {arg} is not used (nothing is "
                                          "tokenized)", where=where, arg=arg("tokenizer"))), stacklevel=3)


@dataclasses.dataclass
class Rows:
    """How :meth:`Input.rows` reads an input's rows for packing: exactly one of ``dataset`` (memory-mapped token
    ids), ``parquet`` (a Parquet file's path), ``make`` (a chunk at a time, :func:`packkit.readers.replay`) or
    ``table`` (read whole); ``how`` the tokens were made (None: the rows held them); ``nbytes`` on disk."""

    path: Path
    how: str | None = None
    dataset: object = None
    parquet: Path | None = None
    make: object = None
    table: object = None
    nbytes: int = 0


class Input:
    """One input, read through the one door in: its format, how its tokens come, and whether it is read a chunk at a
    time or whole, decided here once. ``Input(path, column=..., text_column=..., tokenizer=..., chat=ChatOptions(),
    split=...)`` checks the path (:func:`check_path`). Its readers: :meth:`lengths` (what ``packkit waste`` and
    ``plan`` measure), :meth:`rows` (what ``packkit pack`` packs), :meth:`tokenized` (what ``packkit tokenize``
    writes), each a chunk at a time where it can; :meth:`read` falls back to the whole read for every reader."""

    def __init__(self, path, *, column: str = "input_ids", text_column: str = "text", tokenizer="bytes",
                 chat: ChatOptions | None = None, split: str | None = None):
        self.path = check_path(path)
        self.format = input_format(self.path)
        self.column, self.text_column, self.tokenizer, self.split = column, text_column, tokenizer, split
        self.chat = chat or ChatOptions()
        self.where = repr(str(self.path))

    def read(self, use):
        """``use(whole=False)``, or ``use(whole=True)`` where that met :class:`packkit.jsonlines.JsonLinesChanged` (read
        whole, pyarrow unifies the types). Errors name their line (:func:`lines_named`)."""
        with lines_named(self.path):
            try:
                return use(whole=False)
            except jsonlines.JsonLinesChanged:
                return use(whole=True)

    def tokenizing(self, schema) -> Tokenizing | None:
        """How rows of ``schema`` get their token column (:class:`Tokenizing`; its errors name what to pass), or None
        when they hold it."""
        if self.column in schema.names:
            return None
        from .tokenizing import Tokenizing  # lazy: text and conversations to tokenize, off a file of token ids
        return Tokenizing(schema, column=self.column, text_column=self.text_column, tokenizer=self.tokenizer,
                          chat=self.chat, where=self.where)

    def chunks(self):
        """``(make, how)``: ``make()`` yields the rows with their token column a chunk at a time (:func:`table_chunks`;
        its first call continues the read begun here): JSON lines of token ids parsed (``how`` None), or text and
        conversations tokenized (``how`` decided from the first chunk). None where the rows are read as they are (a
        memory-mapped or Parquet file of token ids) or whole, or hold no row."""
        if self.format == "json":
            reader_pyarrow(self.path)  # without pyarrow: the one line naming the format
            rest = jsonlines.json_tables(self.path)
            first = next(rest, None)
            if first is not None and self.column in first.column_names:  # token ids: parsed a chunk at a time
                return replay(first, rest, lambda: jsonlines.json_tables(self.path)), None
        size = TEXT_BLOCK_CHARS if self.format == "text" else TOKENIZE_BLOCK_BYTES
        again = lambda: table_chunks(self.path, split=self.split, block_size=size)  # noqa: E731
        rest = again()
        first = next(rest, None)
        how = None if first is None else self.tokenizing(first.schema)
        if how is None:
            return None
        tables = replay(first, rest, again)

        def make():
            from .allocators import release_freed  # lazy: for rows tokenized, off a file of token ids
            row = 0
            for table in tables():
                if table.num_rows:
                    encoded = how.encode(table, row)
                    if how.chat is not None or how.tokenizer != "bytes":  # counting bytes frees nothing to hand back
                        release_freed()  # what the chunk's tokenizing freed, before the next chunk is read
                    yield encoded
                    row += table.num_rows
            how.finish(row)

        return make, how.how

    def table(self, *, progress: bool = False, table=None):
        """``(table, how)``: the rows read whole (or ``table``) with their token column, and how it was made (None:
        they held it)."""
        table = load_table(self.path, split=self.split) if table is None else table
        how = self.tokenizing(table.schema)
        if how is None:
            typ = table.schema.field(self.column).type
            if not (pyarrow().types.is_list(typ) or pyarrow().types.is_large_list(typ)):
                raise TypeError(f"column {self.column!r} holds {typ}, not lists of token ids")
            return table, None
        out = how.encode(table, 0, progress=progress)
        how.finish(table.num_rows)
        return out, how.how

    def tokenized(self, *, whole: bool = False, progress: bool = False):
        """``(tables, how)``: the rows with their tokens, a chunk at a time (whole with ``whole``); ``how`` None when
        the rows held token ids already or there is no row."""
        if whole:
            table, how = self.table(progress=progress)
            return iter([table]), how
        made = self.chunks()
        return (iter(()), None) if made is None or made[1] is None else (made[0](), made[1])

    def rows(self, *, whole: bool = False, progress: bool = False) -> Rows:
        """How ``packkit pack`` reads the rows (:class:`Rows`): token ids where they are (a folder, Parquet), a chunk at
        a time (:meth:`chunks`), or whole; an input without a row is refused."""
        empty = DataError(f"{self.where} holds no examples")
        got = None
        if self.format == "folder":
            ds = _readers().load_dataset(self.path, split=self.split)
            if len(ds) == 0:
                raise empty
            if self.column in ds.column_names:
                got = Rows(self.path, dataset=ds)
        elif self.format == "parquet" and self.column in _readers().parquet_schema(self.path).names:
            got = Rows(self.path, parquet=self.path)
        if got is None and not whole and (made := self.chunks()) is not None:
            size = (sum(f.stat().st_size for f in self.path.rglob("*.arrow")) if self.path.is_dir()
                    else self.path.stat().st_size)
            got = Rows(self.path, made[1], make=made[0], nbytes=size)
        if got is None:
            table, how = self.table(progress=progress)
            if table.num_rows == 0:
                raise empty
            got = Rows(self.path, how, table=table)
        if got.how is None and not whole:  # said once: a whole read follows a chunked one (:meth:`read`)
            warn_unused_tokenizer(self.tokenizer, self.where)
        return got

    def lengths(self, *, progress: bool = False) -> Lengths:
        """The examples' lengths and loss targets (:func:`read_lengths`): a ``.npy``, a ``.txt`` counted in bytes (no
        pyarrow), the rows a chunk at a time where the input allows (:meth:`_streamed_lengths`), or whole."""
        if self.format == "npy":
            got = as_lengths(_readers().read_npy(self.path), name=self.where), None, None, f"{self.path.name} (lengths)"
        elif (self.format, self.tokenizer, self.text_column) == ("text", "bytes", "text") and self.column != "text":
            got = _readers().text_byte_lengths(self.path), None, "column 'text' tokenized with bytes", None
        else:
            got = self.read(lambda whole: self._streamed_lengths(whole) or self._whole_lengths(progress))
        lengths, targets, how, source = got
        if lengths.size == 0:
            raise ValueError(f"{self.where} holds no examples")
        if how is None:
            warn_unused_tokenizer(self.tokenizer, self.where)
        unit = "bytes" if how is not None and self.tokenizer in (None, "bytes") else "tokens"  # the byte tokenizer
        loss = None if targets is None else batch_sums(targets, lengths_to_offsets(lengths))  # loss tokens each
        return Lengths(lengths, source or f"{self.path.name}, " + (how or f"column {self.column!r}"), unit, loss,
                       targets)

    def _streamed_lengths(self, whole: bool):
        """``(lengths, targets or None, how, None)`` of the rows' token ids (``column``, or the ``input_ids`` a chat
        template wrote) read a chunk at a time (:meth:`chunks`) under the Arrow path's rules, errors naming the row in
        the whole input. None where the whole read must do: ``whole``, packed rows (read whole as their documents), no
        row, or a loss column in some chunks only."""
        made = None if whole else self.chunks()
        if made is None:
            return None
        from .listcolumns import loss_targets, table_lengths  # lazy: off waste and plan's start
        pa = pyarrow()
        lengths, targets, row = [], [], 0
        for table in made[0]():
            if row == 0 and made[1] is None and not (pa.types.is_list(table.schema.field(self.column).type)
                                                     and segment_key(table.column_names) is None):
                return None
            key = self.column if self.column in table.column_names else "input_ids"
            lengths.append(table_lengths(table, key=key, rows=row))
            targets.append(loss_targets(table, lengths[-1], key=key, rows=row))
            row += table.num_rows
        if not lengths or any(t is None for t in targets) != all(t is None for t in targets):
            return None
        lengths = as_lengths(np.concatenate(lengths), name=f"lengths in {self.path.name}")
        return lengths, (np.concatenate(targets) if targets[0] is not None else None), made[1], None

    def _whole_lengths(self, progress: bool):
        """``(lengths, targets, how, source)`` of the rows read whole: an integer column of lengths, or token ids
        (packed rows, packkit's own output, read as their documents)."""
        pa = reader_pyarrow(self.path)
        table = load_table(self.path, split=self.split)
        col, name = self.column, self.path.name
        if col in table.column_names and pa.types.is_integer(table.column(col).type):
            if table.column(col).null_count:
                raise ValueError(f"column {col!r} has null lengths")
            lengths = as_lengths(table.column(col).to_numpy(), name=f"column {col!r}")
            return lengths, None, None, f"{name}, column {col!r} (lengths)"
        table, how = self.table(progress=progress, table=table)
        key = col if col in table.column_names else "input_ids"
        # every rule `packkit pack` holds token ids to (packkit.rules): waste and plan measure what pack accepts
        from .listcolumns import loss_targets, packed_segments, source_order, table_lengths  # lazy: off the start
        lengths = as_lengths(table_lengths(table, key=key), name=f"lengths in {name}")
        source = f"{name}, " + (how or f"column {col!r}")
        docs = packed_segments(table, lengths, key=key) if lengths.size else None
        docs = None if docs is None else docs[0]
        targets = loss_targets(table, lengths, key=key, segments=docs) if lengths.size else None
        if docs is not None:
            source += f"; {lengths.size:,} packed rows read as their {docs.size:,} documents"
            order = source_order(table, docs)
            if order is None:  # what depends on the order (random batches, streaming) sees the packed order
                source += " in packed order " + ("(pieces of split examples)" if "example_ids" in table.column_names
                    else "(no example_ids: pack with example_ids to measure them in the dataset's order)")
            else:  # the dataset's own order: every figure as of the rows before packing
                source += ", in the dataset's order (example_ids)"
                if targets is not None:
                    targets = targets[range_index(lengths_to_offsets(docs)[:-1][order], docs[order])]
                docs = docs[order]
        return (lengths if docs is None else docs), targets, how, source


def read_lengths(path=None, *, column: str = "input_ids", text_column: str = "text", tokenizer="bytes",
                 split: str | None = None, progress: bool = False, chat: ChatOptions | None = None) -> Lengths:
    """Example lengths from a file (:meth:`Input.lengths`), or the bundled sample when ``path`` is None.

    ``column`` may name an integer column of lengths. Text is tokenized with ``tokenizer`` (``"bytes"`` by default:
    the lengths are UTF-8 bytes and ``unit == "bytes"``), conversations through their chat template (``chat``:
    :class:`packkit.chat.ChatOptions`). The loss lengths come from ``labels`` or a loss mask when the data has one
    (:func:`packkit.listcolumns.loss_targets`). Packed rows (a ``seq_lengths`` or restarting ``position_ids`` column,
    as ``packkit pack`` writes) are read as their documents: a document is an example, never a row."""
    if path is None:
        return bundled_sample()
    inp = Input(path, column=column, text_column=text_column, tokenizer=tokenizer, chat=chat, split=split)
    from .fileio import held_still  # lazy: off waste and plan's start
    with held_still([inp.path]):  # no file may change under the read (a truncated memory map is a SIGBUS)
        return inp.lengths(progress=progress)


#: TRL's tokenized preference columns, then integer columns of lengths, read by :func:`read_preference_lengths`.
PREFERENCE_COLUMNS = (("prompt_ids", "chosen_ids", "rejected_ids"), ("prompt", "chosen", "rejected"))


def preference_columns(names) -> tuple | None:
    """Which of :data:`PREFERENCE_COLUMNS` a table's column ``names`` hold (token ids first), or None."""
    return next((cols for cols in PREFERENCE_COLUMNS if all(c in names for c in cols)), None)


def read_preference_lengths(path, *, split: str | None = None, tokenizer=None,
                            trust_remote_code: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """``(prompt, chosen, rejected, source)``: per-pair token counts of a preference file: TRL's tokenized columns
    (:data:`PREFERENCE_COLUMNS`, as ``DPOTrainer`` or ``packkit tokenize`` makes them), integer counts in ``prompt`` /
    ``chosen`` / ``rejected``, or text (or conversations) there, tokenized with ``tokenizer`` (an unused one is said;
    :func:`packkit.preference.tokenize_pairs`; without one, refused naming the ways to tokenize it)."""
    table = load_table(path, split=split)  # the path checked (check_path), pyarrow asked for by the format's name
    pa = pyarrow()
    cols = preference_columns(table.column_names)
    if cols is None:
        raise MissingError("{path!r} has no preference columns (prompt_ids, chosen_ids, rejected_ids); the columns "
                           "are {names}", path=str(path), names=table.column_names)
    how = f"columns {', '.join(cols)}"
    if cols[0] == "prompt" and not pa.types.is_integer(table.column("prompt").type):
        if tokenizer in (None, "bytes"):
            raise DataError("column 'prompt' of {path!r} holds {typ}: pass {tok} to tokenize the pairs as TRL's "
                            "DPOTrainer does (or once, for every later run: packkit tokenize IN OUT --tokenizer T; "
                            "in Python packkit.preference.tokenize_preference)", path=str(path),
                            typ=str(table.column("prompt").type), tok=arg("tokenizer", metavar="FOLDER_OR_MODEL_ID"))
        from .preference import tokenize_pairs  # lazy: torch, only for text pairs
        table, cols = tokenize_pairs(table, tokenizer, trust_remote_code=trust_remote_code), PREFERENCE_COLUMNS[0]
        from .tokenizer import tokenizer_name  # lazy: the tokenizers, for pairs to tokenize only
        how = f"pairs tokenized with {tokenizer_name(tokenizer)}"
    else:
        warn_unused_tokenizer(tokenizer, repr(str(path)))
    out = []
    for c in cols:
        col = table.column(c)
        if pa.types.is_integer(col.type):
            if col.null_count:  # a pair without its count: named by its row, as a null list of token ids is
                raise null_tokens(int(np.argmax(col.is_null().to_numpy())), 0, c)
            out.append(np.asarray(col.to_numpy(), np.int64))
        elif pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            from .listcolumns import token_lengths  # lazy: off waste and plan's start
            out.append(token_lengths(col, key=c))
        else:
            raise DataError(f"column {c!r} of {str(path)!r} holds {col.type}, not token ids or counts")
    return (*out, f"{Path(path).name}, {how}")
