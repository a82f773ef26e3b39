"""JSON lines read by pyarrow, a bounded chunk at a time (:func:`json_tables`) or whole (:func:`read_json`), a line it
refuses named by :mod:`packkit.jsonblame`: the back of the house behind the door in (:mod:`packkit.datafiles` decides
that an input is JSON and what its rows are; this module knows nothing of columns, tokenizers or examples).
"""

from __future__ import annotations

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

#: The line to blame, at home in :mod:`packkit.jsonblame` (a file that reads does not compile it), lent here.
_BLAME = frozenset({"first_float", "line_of_row", "lines", "locate_error"})


def __getattr__(name: str):
    """The names of :mod:`packkit.jsonblame`, lent under their old address, imported where first asked for."""
    if name in _BLAME:
        from . import jsonblame  # lazy: the line to blame, off a file that reads
        return getattr(jsonblame, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _error(path, exc, *, changed: bool = False) -> DataError:
    """JSON lines pyarrow refused: the line to blame (:func:`packkit.jsonblame.locate_error`), else
    :class:`JsonLinesChanged` for a chunk after the first (``changed``), else pyarrow's words."""
    from .jsonblame import locate_error  # lazy: the error path only
    if (located := locate_error(path)) is not None:
        return located
    if changed:
        return JsonLinesChanged(f"{str(path)!r} changes a column's type after its first block: {exc}")
    detail = re.sub(r" in row \d+", "", str(exc))  # pyarrow's row counts inside a block, from 0
    return DataError(f"cannot read {str(path)!r} as JSON lines: {detail}")


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
        from .longline import one_long_line  # lazy: a line of 8 MiB or more, off a file of short lines
        fast = one_long_line(chunk, parse)
        if fast is not None:
            return fast
    return pj.read_json(pa.BufferReader(chunk), read_options=pj.ReadOptions(block_size=len(chunk) + 1,
                                                                            use_threads=False),
                        parse_options=parse)


#: A chunk that is one line of at least this many bytes has its long lists of integers parsed on many threads.
LONG_LINE_BYTES = 8 << 20

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
