"""Errors a user can cause, in the words of whoever reads them.

The same mistake is met from Python (``pack(lengths, window=8192)``) and from the command line
(``packkit pack IN OUT --window 8192``); its fix must be spelled in the reader's syntax. A message that
names an argument does it with :func:`arg`, and the exception keeps its template, so it is rendered
when read: in Python syntax by ``str(exc)``, in option syntax by :meth:`PackkitError.render` given the
command's options (``packkit.cli`` does that, in one place, for every error)::

    >>> err = DataError("example {i} has {n:,} tokens > {window}; pass {fix}, or raise {w}", i=812, n=9310,
    ...                 window=arg("window", 8192), fix=arg("overflow", "split", "truncate", "drop"),
    ...                 w=arg("window"))
    >>> str(err)
    "example 812 has 9,310 tokens > window=8192; pass overflow='split', 'truncate' or 'drop', or raise window"
    >>> err.render({"window": ("--window", True), "overflow": ("--overflow", True)})
    'example 812 has 9,310 tokens > --window 8192; pass --overflow split, truncate or drop, or raise --window'

The classes say whose mistake it is, which the command line turns into its exit code:

=====================  ===================================================  ==========
class                  meaning                                              ``packkit``
=====================  ===================================================  ==========
:class:`ArgumentError` an argument (option) has a value packkit refuses      usage, 2
:class:`OutputError`   the output would destroy something (exists, is IN)   usage, 2
:class:`DataError`     the input cannot be read or holds a bad example      data, 3
=====================  ===================================================  ==========

All three are ``ValueError``\\ s, so ``except ValueError`` keeps working in user code. An argument of
the wrong type (``window="8"``) is an :class:`ArgumentTypeError`: an :class:`ArgumentError` and a
``TypeError``. Every integer argument is checked by :func:`check_int`, so one mistake reads the same
(class, wording, exit code) whichever entry point met it.
"""

from __future__ import annotations

import numbers
import shlex
import warnings

__all__ = ["Arg", "arg", "Where", "check_int", "check_choice", "Message", "PackkitError", "ArgumentError", "ArgumentTypeError",
           "DataError", "MissingError", "OutputError"]


class Arg:
    """A reference to the argument ``name`` inside a message, optionally with the values to pass.

    ``values``: none (the argument itself: ``window`` / ``--window``), one, or alternatives
    (``overflow='split', 'truncate' or 'drop'`` / ``--overflow split, truncate or drop``).
    ``metavar``: a placeholder instead of a value (``split=NAME`` / ``--split NAME``).
    """

    __slots__ = ("name", "values", "metavar")

    def __init__(self, name: str, *values, metavar: str | None = None):
        self.name, self.values, self.metavar = name, values, metavar

    def __repr__(self) -> str:
        return f"arg({self.name!r}{''.join(', ' + repr(v) for v in self.values)})"

    @staticmethod
    def _alternatives(words: list[str]) -> str:
        return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]

    def python(self) -> str:
        """``window``, ``window=8192``, ``overflow='split', 'truncate' or 'drop'``, ``split=NAME``."""
        if self.metavar is not None:
            return f"{self.name}={self.metavar}"
        if not self.values:
            return self.name
        return f"{self.name}=" + self._alternatives([repr(v) for v in self.values])

    def option(self, flag: str, takes_value: bool = True, negative: str | None = None) -> str:
        """``--window``, ``--window 8192``, ``--overflow split, truncate or drop``; a switch is its flag
        (its ``negative`` flag, ``--no-x``, for a False value)."""
        if not takes_value:
            return negative if negative and self.values and self.values[0] is False else flag
        if self.metavar is None and not self.values:
            return flag
        if self.metavar is not None:
            return f"{flag} {self.metavar}"
        words = [v if isinstance(v, str) and v == shlex.quote(v) else shlex.quote(str(v)) for v in self.values]
        return f"{flag} " + self._alternatives(words)

    def render(self, options=None) -> str:
        """In option syntax when ``options`` (name -> ``(flag, takes_value[, negative flag])``) knows this
        argument."""
        if options and self.name in options:
            return self.option(*options[self.name])
        return self.python()


def arg(name: str, *values, metavar: str | None = None) -> Arg:
    """An argument named in an error message: ``arg("overflow", "split")`` (see :class:`Arg`)."""
    return Arg(name, *values, metavar=metavar)


class Where:
    """The example or dataset row a message blames, as a field: ``Where(812)`` reads ``example 812``,
    ``Where(812, row=True)`` ``dataset row 812``, and with the line the reader of the file knows
    (:meth:`PackkitError.at_line`) ``example 812 (line 813 of 'd.jsonl')``. The number stays a number: nobody
    parses a message to find it."""

    __slots__ = ("number", "row", "line")

    def __init__(self, number: int, *, row: bool = False, line: str | None = None):
        self.number, self.row, self.line = int(number), row, line

    def __str__(self) -> str:
        return f"{'dataset row' if self.row else 'example'} {self.number}" + (f" ({self.line})" if self.line else "")

    def __format__(self, spec: str) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"Where({self.number}{', row=True' if self.row else ''})"

    def __reduce__(self):
        return (_where, (self.number, self.row, self.line))


def _where(number, row, line):
    return Where(number, row=row, line=line)


def _render(template: str, fields: dict, options) -> str:
    if not fields:
        return template
    return template.format(**{k: v.render(options) if isinstance(v, Arg) else v for k, v in fields.items()})


class Message:
    """A text for the user whose :class:`Arg` fields follow the reader (a report line, advice).

    ``str(Message("pass {a}", a=arg("overflow", "split")))`` is ``"pass overflow='split'"``;
    ``.render(options)`` gives the command line's wording.
    """

    __slots__ = ("template", "fields")

    def __init__(self, template: str, /, **fields):
        self.template, self.fields = template, fields

    def render(self, options=None) -> str:
        return _render(self.template, self.fields, options)

    def __str__(self) -> str:
        return self.render()

    def __repr__(self) -> str:
        return f"Message({self.render()!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Message) and str(self) == str(other)

    __hash__ = None


class PackkitError(Exception):
    """An error a user can fix, with a message template whose :class:`Arg` fields follow the reader.

    ``PackkitError("example {i} is empty", i=3)``; a template without fields is used as it is (braces
    included). ``str(exc)`` is the Python wording; ``exc.render(options)`` the command line's.
    """

    def __init__(self, template: str, /, **fields):
        self.template, self.fields = template, fields
        super().__init__(self.render())

    def render(self, options=None) -> str:
        return _render(self.template, self.fields, options)

    def __str__(self) -> str:
        return self.render()

    def __reduce__(self):  # pickled across DataLoader workers and processes with its fields
        return (_rebuild, (type(self), self.template, self.fields))

    @property
    def where(self) -> Where | None:
        """The example or row the message blames (its :class:`Where` field), or None."""
        return next((v for v in self.fields.values() if isinstance(v, Where)), None)

    def at_line(self, line: str) -> "PackkitError":
        """The same error, its :class:`Where` naming ``line`` too (``"line 813 of 'd.jsonl'"``)."""
        return self._again({k: Where(v.number, row=v.row, line=line) if isinstance(v, Where) else v
                            for k, v in self.fields.items()})

    def _again(self, fields: dict) -> "PackkitError":
        return type(self)(self.template, **fields)


def _rebuild(cls, template, fields):
    return cls(template, **fields)


class ArgumentError(PackkitError, ValueError):
    """An argument has a value packkit refuses: ``window=0``, ``seed=-1``, an unknown policy."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of the wrong type: ``window="8"``, ``seed=1.5``, ``batch_size=True``."""


def check_int(value, name: str, *, low: int = 1, high: int | None = None, unit: str = "", fix: str = "",
              **fields) -> int:
    """``value`` as a Python int in ``[low, high]``, or the one error for that mistake, naming ``name``.

    ``check_int(16, "batch_size") -> 16``; ``check_int(np.int64(0), "seed", low=0) -> 0``. A bool, a float
    (2.0 too), a string or None raises :class:`ArgumentTypeError` ``"batch_size must be an integer, got
    2.0 (float)"``; a value out of range :class:`ArgumentError` ``"window must be at least 1 token, got
    0"`` (``unit=" token"``) or ``"rank must be between 0 and 3, got 4"``. ``fix`` (a template over
    ``fields``, which may hold :func:`arg`) follows the message: ``": {one} means no accumulation"``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError("{name} must be an integer, got {got!r} ({kind})", name=arg(name), got=value,
                                kind=type(value).__name__)
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"at least {low}{unit}" if high is None else f"between {low} and {high}{unit}"
        raise ArgumentError("{name} must be " + bound + ", got {got}" + fix, name=arg(name), got=value, **fields)
    return value


def check_choice(value, name: str, choices, *, what: str | None = None):
    """``value`` if it is one of ``choices``, else the one error for that mistake, naming ``name``.

    ``check_choice("bfd", "strategy", ("bfd", "ffd")) -> "bfd"``; ``"best"`` raises :class:`ArgumentError`
    ``"unknown strategy 'best'; choose one of strategy='bfd' or 'ffd'"`` (``what``: the kind of value the
    message names, default ``name``).
    """
    if value not in choices:
        raise ArgumentError("unknown {what} {got!r}; choose one of {choices}", what=what or name, got=value,
                            choices=arg(name, *choices))
    return value


def renamed_keyword(who: str, rest: dict, old: str, new: str, value, default):
    """``value`` (the keyword ``new``), or the value a caller still passes under its old name ``old`` in ``rest`` (the
    function's ``**`` keywords), with a one-line ``DeprecationWarning`` naming ``new``; any other keyword in ``rest``
    is the ``TypeError`` Python gives, and both names given with different values one naming both.
    ``renamed_keyword("shard", {"layout": "zigzag"}, "layout", "cp_layout", "hybrid", "hybrid") -> "zigzag"``."""
    unknown = sorted(set(rest) - {old})
    if unknown:
        raise TypeError(f"{who}() got an unexpected keyword argument {unknown[0]!r}")
    if old not in rest:
        return value
    if value != default and value != rest[old]:
        raise TypeError(f"{who}() got {old}={rest[old]!r} and {new}={value!r}; pass {new} only ({old} is its old name)")
    warnings.warn(f"{who}({old}=...) is deprecated: pass {new}={rest[old]!r}", DeprecationWarning, stacklevel=3)
    return rest[old]


def with_keywords(cls, options, keywords: dict, who: str):
    """``options`` (an instance of the dataclass ``cls``; default: its defaults) with ``keywords`` for its fields,
    as a function taking an options object and its fields as keywords builds it; a keyword that is not a field is
    the ``TypeError`` Python raises for it, an ``options`` of another type one naming the type it takes."""
    import dataclasses  # here: with inspect, ast and dis it was half of ``packkit --help``'s start

    unknown = sorted(set(keywords) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise TypeError(f"{who}() got an unexpected keyword argument {unknown[0]!r}")
    if options is not None and not isinstance(options, cls):
        raise TypeError(f"{who}(options=...) takes a {cls.__name__}, got {type(options).__name__}")
    return dataclasses.replace(options or cls(), **keywords)


class DataError(PackkitError, ValueError):
    """The input cannot be read, or an example in it is refused (the message names the row or line)."""


class MissingError(DataError, KeyError):
    """The input lacks a column, a split or a key that was asked for (a ``KeyError`` too)."""


class OutputError(PackkitError, ValueError):
    """Writing the output would destroy something: it is an input, holds one, or exists."""
