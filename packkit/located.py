"""Errors about one example, and where it is: ``example 3`` (the i-th of what was passed) or ``dataset row 812``
(where its index in a dataset is known), the error classes that carry it, and how a bad value reads in them.

    >>> location(3, rows=800)
    'dataset row 803'
    >>> str(located(ExampleValueError, 1, None, "is empty (0 tokens in 'input_ids'); filter empty examples out first"))
    "example 1 is empty (0 tokens in 'input_ids'); filter empty examples out first"

Below every rule that names an example (:mod:`packkit.rules`, the rules of token columns; :mod:`packkit.row_rules`,
those of packed rows, media grids, groups and per-example values), so that neither imports the other to say where an
example is. :mod:`packkit.rules` lends every name here under its old address (``packkit.rules.located``).
"""

from __future__ import annotations

import numbers

import numpy as np

from .errors import DataError, Where

__all__ = ["location", "where_of", "located", "relocate", "is_located", "ExampleValueError", "ExampleTypeError", "value_text",
           "not_integral"]


def location(i: int, rows=None) -> str:
    """Where example ``i`` is: ``"example 3"``; with ``rows`` (the dataset row of every example, or
    the dataset row of example 0 as an int) ``"dataset row 812"``.

    ``location(3) -> "example 3"``; ``location(3, rows=800) -> "dataset row 803"``;
    ``location(1, rows=[9, 4]) -> "dataset row 4"``.
    """
    return str(where_of(i, rows))


def where_of(i: int, rows=None) -> Where:
    """:func:`location` as a message field (:class:`packkit.errors.Where`): ``where_of(3, rows=800)`` reads
    ``dataset row 803``, and can name its line."""
    if rows is None:
        return Where(i)
    return Where(int(rows) + i if isinstance(rows, numbers.Integral) else int(rows[i]), row=True)


class _Located:
    """An error about one example: ``index`` (its position in what was checked) and ``text`` (the
    message after the location), so that a caller that knows more (a Ray block's first global row)
    can say where it is with :func:`relocate`. ``cls(message)`` alone works too (pickling, and
    PyTorch's DataLoader re-raising a worker's error)."""

    def __init__(self, message: str, index: int | None = None, text: str | None = None, **fields):
        super().__init__(message, **fields)
        self.index, self.text = index, text

    def __reduce__(self):  # pickled (Ray, DataLoader workers) with its location
        return (_located_again, (type(self), self.template, self.index, self.text, self.fields))

    def _again(self, fields: dict):
        return _located_again(type(self), self.template, self.index, self.text, fields)


def _located_again(cls, template, index, text, fields):
    return cls(template, index, text, **fields)


class ExampleValueError(_Located, DataError):
    """A bad value in an example (negative id, bad label or mask value, lengths that differ, ...): a
    ``ValueError`` and a :class:`packkit.errors.DataError` (the command line's data-error exit code)."""


class ExampleTypeError(_Located, DataError, TypeError):
    """A value of the wrong type in an example (float, bool, text, nested list, not a mapping): a
    ``TypeError``, and a :class:`packkit.errors.DataError` like every error about the data."""


def located(cls, i: int, rows, text: str, **facts):
    """The error ``cls`` about example ``i`` (:func:`where_of`): ``"{where} " + text``, ``text`` as it is; ``facts``
    ride along as fields (what a reader that knows more reads, never the message)."""
    return cls("{where} " + text.replace("{", "{{").replace("}", "}}"), i, text, where=where_of(i, rows), **facts)


def relocate(exc: Exception, rows) -> Exception:
    """The same error, its example located with ``rows`` (see :func:`location`); other errors as they are.

    ``relocate(err_about_example_3, rows=800)`` reads ``"dataset row 803 ..."``.
    """
    if is_located(exc):
        return located(type(exc), exc.index, rows, exc.text)
    return exc


def is_located(exc: Exception) -> bool:
    """Whether ``exc`` is an error about one example that knows its position (:func:`relocate` can move it)."""
    return isinstance(exc, _Located) and exc.index is not None


def value_text(v) -> str:
    """``1.5 (float)``, ``True (bool)``, ``'a' (str)``, ``nan (float)``."""
    if isinstance(v, np.generic):
        v = v.item()
    return f"{v!r} ({type(v).__name__})"


def not_integral(values: np.ndarray) -> np.ndarray:
    """Where a float array holds a value that is not an integer: ``[1.0, 1.5, nan] -> [F, T, T]``."""
    return ~np.isfinite(values) | (values != np.round(values))
