"""The line of a JSON lines file to blame, found by Python's reader where pyarrow's refused the file or read a float
where tokens are: the error path of :mod:`packkit.jsonlines`, imported only when one is taken (a file that reads
does not compile it). Every name is lent by :mod:`packkit.jsonlines` under its old address.
"""

from __future__ import annotations

import contextlib
import json

from .errors import DataError

__all__ = ["first_float", "line_of_row", "lines", "locate_error"]


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


#: A kind's words (its first item; None for null), then their plural, for a list's items.
_WORDS = {None: ("null", "nulls"), "object": ("an object", "objects"), "a number": ("a number", "numbers"),
          "text": ("text", "text"), "true/false": ("true/false", "true/false values")}


def _kind_text(kind, plural: bool = False) -> str:
    """``("list", ("a number",)) -> "a list of numbers"``; ``plural`` for a list's items (``objects``, ``lists``)."""
    if kind is not None and kind[0] == "list":
        items = "" if kind[1] is None else f" of {_kind_text(kind[1], True)}"
        return ("lists" if plural else "a list") + items
    return _WORDS[None if kind is None else kind[0]][plural]


def locate_error(path) -> DataError | None:
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
            known, since = seen.get(key, (None, lineno))  # its kind so far (None: none yet), from line since
            try:
                known = _merge_kinds(known, kind, key)
            except _Clash as clash:
                field, before, now = clash.args
                return DataError(f"{name!r} line {lineno:,}: {field!r} holds {_kind_text(now)}, but "
                                 f"{_kind_text(before)} on line {since:,}; every line must give a key "
                                 "the same kind of value")
            if known is not None:
                seen[key] = (known, since)
    return None
