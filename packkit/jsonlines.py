"""JSON lines read by pyarrow, a bounded chunk at a time (:func:`json_tables`) or whole (:func:`read_json`), and the
line to blame when one is bad: the back of the house behind the door in (:mod:`packkit.datafiles` decides that an
input is JSON and what its rows are; this module knows nothing of columns, tokenizers or examples). A line pyarrow
refuses is a one-line :class:`~packkit.errors.DataError` naming its 1-based line: not JSON, not an object, or a
key whose kind changes from an earlier line (a list of numbers, then text).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from pathlib import Path

import numpy as np

from .arrow import pyarrow
from .errors import DataError
from .interrupts import deferred

__all__ = ["JSON_BLOCK_BYTES", "JsonLinesChanged", "first_float", "json_batches", "json_block_size", "json_tables",
           "line_chunks", "line_of_row", "lines", "longest_line", "read_json"]

class _Clash(Exception):
    """Two JSON kinds that do not merge: ``args`` are ``(where, a, b)`` at the deepest place they differ
    (``messages[].role``, a number against text, rather than ``messages`` against itself)."""


def _json_kind(value, where: str = ""):
    """The JSON kind pyarrow's reader infers a column from: ``[1, 2] -> ("list", ("a number",))``; None for null.
    A scalar's kind is its words in messages, a list's carries its items' (None while unknown); a list that mixes
    kinds is a :class:`_Clash` (``where`` names ``value``)."""
    if value is None:
        return None
    for types, words in ((bool, "true/false"), ((int, float), "a number"), (str, "text")):  # bool first: True is an int
        if isinstance(value, types):
            return (words,)
    if isinstance(value, dict):
        return ("object", {k: _json_kind(v, f"{where}.{k}") for k, v in value.items()})
    item = None
    for v in value:
        item = _merge_kinds(item, _json_kind(v, where + "[]"), where + "[]")
    return ("list", item)


def _merge_kinds(a, b, where: str = ""):
    """The kind both ``a`` and ``b`` fit (None, a null or an empty list, fits anything), else a :class:`_Clash`."""
    if a is None or b is None:
        return a if b is None else b
    if a[0] != b[0]:
        raise _Clash(where, a, b)
    if a[0] == "object":  # field by field (pyarrow reads a struct): a field missing from one fits
        fields = dict(a[1])
        for k, v in b[1].items():
            fields[k] = _merge_kinds(fields.get(k), v, f"{where}.{k}")
        return ("object", fields)
    return ("list", _merge_kinds(a[1], b[1], where + "[]")) if a[0] == "list" else a


_PLURAL = {"a number": "numbers", "text": "text", "true/false": "true/false values"}


def _kind_text(kind, plural: bool = False) -> str:
    """``("list", ("a number",)) -> "a list of numbers"``; ``plural`` for a list's items (``objects``, ``lists``)."""
    if kind is None:
        return "nulls" if plural else "null"
    if kind[0] == "list":
        items = "" if kind[1] is None else f" of {_kind_text(kind[1], True)}"
        return ("lists" if plural else "a list") + items
    if kind[0] == "object":
        return "objects" if plural else "an object"
    return _PLURAL[kind[0]] if plural else kind[0]


def _locate_error(path: Path) -> DataError | None:
    """The first line of a JSON lines file that pyarrow's reader refuses, by its 1-based number (pyarrow counts rows
    from 0 inside its block): not JSON, not an object, or a value that changes kind from an earlier line. None if
    every line reads (the caller keeps pyarrow's message). The error path only."""
    seen: dict = {}
    name = str(path)
    for lineno, raw in lines(path):
        try:
            obj = json.loads(raw.rstrip())
        except UnicodeDecodeError:
            return DataError(f"{name!r} line {lineno:,}: not UTF-8 text")
        except ValueError as exc:
            msg, col = getattr(exc, "msg", str(exc)), getattr(exc, "colno", None)
            return DataError(f"{name!r} line {lineno:,}: not valid JSON ({msg}"
                             + (f" at column {col}" if col else "") + "); fix or remove that line")
        if not isinstance(obj, dict):
            with contextlib.suppress(_Clash):  # a list that mixes kinds is just "a list" here
                return DataError(f"{name!r} line {lineno:,}: {_kind_text(_json_kind(obj))} where a JSON object "
                                 "(one example) was expected")
            return DataError(f"{name!r} line {lineno:,}: a list where a JSON object (one example) was expected")
        for key, value in obj.items():
            try:
                kind = _json_kind(value, key)
            except _Clash as clash:
                field, first, then = clash.args
                return DataError(f"{name!r} line {lineno:,}: {field!r} mixes {_kind_text(first)} and "
                                 f"{_kind_text(then)} in one list")
            if key not in seen:
                if kind is not None:
                    seen[key] = (kind, lineno)
                continue
            try:
                seen[key] = (_merge_kinds(seen[key][0], kind, key), seen[key][1])
            except _Clash as clash:
                field, before, now = clash.args
                return DataError(f"{name!r} line {lineno:,}: {field!r} holds {_kind_text(now)}, but "
                                 f"{_kind_text(before)} on line {seen[key][1]:,}; every line must give a key "
                                 "the same kind of value")
    return None


def lines(path):
    """``(line number from 1, bytes)`` of every non-blank line of a file: the rows of JSON lines."""
    with open(path, "rb") as f:
        yield from ((lineno, raw) for lineno, raw in enumerate(f, 1) if raw.strip())


def line_of_row(path, row: int) -> int | None:
    """The 1-based line of a JSON lines file holding row ``row`` (0-based; blank lines hold none), None past the end:
    ``line_of_row("d.jsonl", 0)`` is the first non-blank line."""
    return next((lineno for k, (lineno, _) in enumerate(lines(path)) if k == row), None)


def first_float(path, key: str) -> tuple | None:
    """``(row, value)``: the first row (0-based, blank lines hold none) of a JSON lines file whose ``key`` holds a
    float at any depth (``5.0``, not ``5``: Python's reader tells them apart, pyarrow's does not); None when no row
    does, or a line does not parse. The error path only."""
    for row, (_, raw) in enumerate(lines(path)):
        try:
            found = _first_float(json.loads(raw).get(key))
        except (ValueError, AttributeError):
            return None
        if found is not None:
            return row, found
    return None


def _first_float(value):
    """The first float of a JSON value, lists searched in order (``[1, [2, 3.0]] -> 3.0``), or None."""
    if isinstance(value, list):
        return next((f for f in map(_first_float, value) if f is not None), None)
    return value if isinstance(value, float) else None


def longest_line(path, *, chunk: int = 1 << 24) -> int:
    """Bytes of the longest line of a file, its newline included, read ``chunk`` bytes at a time
    (numpy finds the newlines): ``b"ab\\nc" -> 3``."""
    longest, run = 0, 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return max(longest, run)
            ends = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
            if not ends.size:
                run += len(block)
                continue
            longest = max(longest, run + int(ends[0]) + 1, int(np.diff(ends).max(initial=0)))
            run = len(block) - int(ends[-1]) - 1


#: pyarrow's JSON reader takes blocks of at most 2**31 - 1 bytes; a line must fit in one.
MAX_JSON_BLOCK = 2**31 - 1


def _block_fits(path, need: int) -> int:
    """``need`` (bytes of a JSON block) when pyarrow's reader takes it, else the one-line error naming the file."""
    if need > MAX_JSON_BLOCK:
        raise DataError(f"{str(path)!r} holds a line of more than {MAX_JSON_BLOCK:,} bytes; JSON lines are read up "
                        "to that many bytes a line: split the example, or store it as parquet")
    return need


def json_block_size(path) -> int:
    """A block size for pyarrow's JSON reader that holds the longest line of ``path`` (1 MiB at least)."""
    return max(_block_fits(path, longest_line(path) + 1), 1 << 20)


#: Bytes of JSON text parsed at a time when JSON lines are streamed (:func:`json_batches`).
JSON_BLOCK_BYTES = 1 << 20

#: Chunks of JSON lines parsed at once, each on a thread of its own (at most this many, and pyarrow's CPU count).
JSON_PARSERS = 4


class JsonLinesChanged(DataError):
    """A streamed JSON lines file changed a column's type (or gained one) after its first block, with no line to
    blame (ints, then floats): the caller reads it whole, where pyarrow unifies the types."""


def line_chunks(path, *, size: int = JSON_BLOCK_BYTES):
    """The bytes of a file in chunks of whole lines, about ``size`` bytes each (a longer line whole, in a chunk of
    its own), a UTF-8 byte-order mark left out, with no pass over the file before; memory: one chunk.
    ``b"a\\nbb\\nc"`` at ``size=2`` -> ``[b"a\\n", b"bb\\n", b"c"]``."""
    with open(path, "rb") as f:
        head = f.read(3)
        rest = [] if head == b"\xef\xbb\xbf" else [head]  # the pieces of the line being read, joined once
        while True:
            block = f.read(size)
            if not block:
                if any(rest):
                    yield b"".join(rest)
                return
            cut = block.rfind(b"\n")
            if cut < 0:  # inside a line longer than a chunk: keep its pieces (``+=`` would copy the line each time)
                rest.append(block)
                continue
            rest.append(block[: cut + 1])
            yield b"".join(rest)
            rest = [block[cut + 1:]]


def _parse_json_chunk(chunk: bytes, schema, path):
    """``chunk`` (whole JSON lines, up to :data:`MAX_JSON_BLOCK` bytes) as a ``pyarrow.Table``, one block on the
    calling thread, with ``schema`` (the first chunk's types: a new key or another type is an error) or inferred."""
    pa = pyarrow()
    import pyarrow.json as pj
    _block_fits(path, len(chunk) + 1)
    parse = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error") if schema is not None \
        else pj.ParseOptions()
    if len(chunk) >= LONG_LINE_BYTES and chunk.count(b"\n", 0, len(chunk) - 1) == 0:
        fast = _one_long_line(chunk, parse)
        if fast is not None:
            return fast
    return pj.read_json(pa.BufferReader(chunk), read_options=pj.ReadOptions(block_size=len(chunk) + 1,
                                                                            use_threads=False),
                        parse_options=parse)


#: A chunk that is one line of at least this many bytes has its long lists of integers parsed on many threads.
LONG_LINE_BYTES = 8 << 20

#: A list of integers at least this long (bytes of text) is parsed apart from its line (:func:`_one_long_line`).
LONG_LIST_BYTES = 1 << 20


def _one_long_line(chunk: bytes, parse):
    """One JSON line whose long flat lists of integers (``"input_ids": [5, 6, ...]``, :data:`LONG_LIST_BYTES` of
    text or more) are parsed on pyarrow's threads, the rest of the line by its JSON reader; None where the line is
    anything else or a list is not plain integers (the caller parses the line whole, naming what is wrong).

    pyarrow parses a block on one thread, so one 128 MiB line took one core (1.76x the wall of the same bytes in
    short lines, load 8.5 on 2 cores). Each long list is cut out (the line keeps ``[]``), its commas made newlines
    and read as one CSV column of int64 on every thread (an empty value, a float, text or a value past int64 fails,
    and the line goes the usual way), then put back as the row's."""
    pa = pyarrow()
    import pyarrow.csv as pcsv
    import pyarrow.json as pj
    spans, at = [], 0
    while True:
        lo = chunk.find(b"[", at)
        if lo < 0:
            break
        hi = chunk.find(b"]", lo)
        if hi < 0:
            return None
        at = hi + 1
        if hi - lo < LONG_LIST_BYTES:
            continue
        body = chunk[lo + 1: hi]
        if any(body.find(c) >= 0 for c in (b"[", b"{", b'"')):  # nested or text: not a flat list of numbers
            return None
        head = chunk[max(0, lo - 4096): lo].rstrip()
        if not head.endswith(b":"):
            return None  # a list inside a list, or not a key's value
        key = head[:-1].rstrip()
        start = key.rfind(b'"', 0, len(key) - 1)
        if not key.endswith(b'"') or start < 0 or b"\\" in key[start:]:
            return None
        spans.append((key[start + 1: -1].decode("utf-8", "replace"), lo, hi, body))
    if not spans:
        return None
    skeleton, last = [], 0
    for _, lo, hi, _ in spans:  # the line with each long list emptied: "input_ids": []
        skeleton += [chunk[last: lo + 1], b"]"]
        last = hi + 1
    skeleton.append(chunk[last:])
    try:
        table = pj.read_json(pa.BufferReader(b"".join(skeleton)), parse_options=parse)
        if table.num_rows != 1:
            return None
        for key, _, _, body in spans:
            text = body.translate(None, b" \t\r\n").replace(b",", b"\n")
            values = pcsv.read_csv(pa.BufferReader(text), read_options=pcsv.ReadOptions(column_names=["v"]),
                                   parse_options=pcsv.ParseOptions(ignore_empty_lines=False),
                                   convert_options=pcsv.ConvertOptions(column_types={"v": pa.int64()})).column("v")
            if values.null_count or key not in table.column_names:
                return None
            field = table.schema.field(key)
            if not pa.types.is_list(field.type):
                return None
            vtype = field.type.value_type if not pa.types.is_null(field.type.value_type) else pa.int64()
            values = values.combine_chunks().cast(vtype)
            row = pa.ListArray.from_arrays(pa.array([0, len(values)], pa.int32()), values)
            table = table.set_column(table.schema.get_field_index(key), key, row.cast(pa.list_(vtype)))
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, UnicodeDecodeError):
        return None
    return table


def json_tables(path, *, block_size: int | None = None):
    """Tables of a JSON lines file in order, one per chunk of about ``block_size`` bytes of whole lines (default
    :data:`JSON_BLOCK_BYTES`, :func:`line_chunks`), :data:`JSON_PARSERS` parsed at once, each on a thread: memory
    holds a few chunks, never the file. The first chunk's types hold for every later one (as in pyarrow's streaming
    reader). A bad line is the one-line error naming it; a type or key that changes after the first chunk with no
    line to blame is :class:`JsonLinesChanged`. Nothing for an empty file or one JSON list (``[{...}, ...]``).

    On 240 MB of token ids (2 cores, load 1-1.5): 2.6-2.9 s wall / 4.8-5.5 s CPU with two 1 MiB chunks at once
    (2.25 / 4.4 s at 2 MiB, 40 MiB more memory), one chunk at a time on pyarrow's threads 3.3 / 5.4 s, the whole
    file by ``pyarrow.json.read_json`` 2.3-2.5 / 4.5-4.9 s (but packing end to end is faster streamed)."""
    import concurrent.futures
    pa = pyarrow(f"reading JSON lines ({Path(path).name!r})")
    chunks = iter(line_chunks(path, size=block_size or JSON_BLOCK_BYTES))
    first = next((c for c in chunks if c.strip()), None)
    if first is None or first.lstrip()[:1] == b"[":  # empty, or one JSON list of objects: not JSON lines
        return
    try:
        table = _parse_json_chunk(first, None, path)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise _error(path, exc) from None
    del first
    schema = table.schema
    yield table
    del table
    workers = max(1, min(JSON_PARSERS, pa.cpu_count()))
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="packkit-json")
    pending: list = []
    try:
        for chunk in itertools.chain(chunks, [None]):
            done = chunk is None
            if not done:
                pending.append(pool.submit(_parse_json_chunk, chunk, schema, path))
            chunk = None  # held by the pending parse only
            while pending and (done or len(pending) > workers):
                try:
                    with deferred():  # a wait takes a lock: a signal waits for the chunk's parse (milliseconds)
                        table = pending.pop(0).result()
                except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
                    raise _error(path, exc, changed=True) from None
                yield table
                del table
    finally:
        with deferred():  # no parse outlives the reader
            for future in pending:
                future.cancel()
            pool.shutdown(wait=True)


def json_batches(path, *, block_size: int | None = None):
    """Record batches of a JSON lines file in order (:func:`json_tables`, a chunk at a time)."""
    for table in json_tables(path, block_size=block_size):
        yield from table.to_batches()


def _error(path, exc, *, changed: bool = False) -> DataError:
    """JSON lines pyarrow refused: the line to blame (:func:`_locate_error`), else :class:`JsonLinesChanged` for a
    chunk after the first (``changed``), else pyarrow's words."""
    if (located := _locate_error(path)) is not None:
        return located
    if changed:
        return JsonLinesChanged(f"{str(path)!r} changes a column's type after its first block: {exc}")
    detail = re.sub(r" in row \d+", "", str(exc))  # pyarrow's row counts inside a block, from 0
    return DataError(f"cannot read {str(path)!r} as JSON lines: {detail}")


def first_byte(path, *, block: int = 1 << 16) -> bytes:
    """The file's first byte that is not blank (``b"["`` opens one JSON list), read a block at a time; ``b""`` for
    a blank file, however long."""
    with open(path, "rb") as f:
        while block_bytes := f.read(block):
            if head := block_bytes.lstrip():
                return head[:1]
    return b""


def read_json(path: Path):
    """The whole of a JSON file as a ``pyarrow.Table``: JSON lines (blocks that hold the longest line), or one JSON
    list of objects; an empty file or a bad line is the one-line error naming it."""
    pa = pyarrow()
    import pyarrow.json as pj
    first = first_byte(path)
    if not first:
        raise DataError(f"{str(path)!r} holds no examples (empty file)")
    if first == b"[":  # one JSON list of objects, not JSON lines
        try:
            with open(path, encoding="utf-8") as f:
                rows = json.load(f)
        except (ValueError, UnicodeDecodeError) as exc:
            raise DataError(f"cannot read {str(path)!r} as JSON: {exc}") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise DataError(f"{str(path)!r} must hold JSON objects, one per example")
        try:
            return pa.Table.from_pylist(rows)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise DataError(f"cannot read {str(path)!r}: {exc}") from None
    try:
        try:
            return pj.read_json(str(path))
        except pa.ArrowInvalid as exc:
            if "straddl" not in str(exc):
                raise
        # a line longer than pyarrow's block (1 MiB: one 400k-token example): blocks that hold the longest line
        return pj.read_json(str(path), read_options=pj.ReadOptions(block_size=json_block_size(path)))
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise _error(path, exc) from None
