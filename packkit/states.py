"""A saved state (a sampler's position, a stream's buffer) is input: versioned, every field checked
when it is loaded, refused in one line that names the field.

A state is a file users copy between runs and edit by hand. The owner that loads it reads every field
through one :class:`StateFields`, checks the whole state, and only then assigns anything, so a refused
state leaves the owner as it was::

    >>> f = StateFields({"version": 3, "epoch": 2, "mask": "5"}, owner="sampler", versions=(3,))
    >>> f.version, f.int("epoch"), f.hex("mask")
    (3, 2, 5)
    >>> f.done()                      # every field was read: nothing unknown in the state
    >>> StateFields({"version": 9}, owner="sampler", versions=(3,)).version
    Traceback (most recent call last):
    ...
    packkit.states.StateError: sampler state field 'version': 9 is not a version this packkit reads (3); save the state again with this packkit, or load it with the packkit that saved it

Errors are :class:`StateError` (a :class:`~packkit.errors.DataError`, so a ``ValueError``); a field of
the wrong type a :class:`StateTypeError` (also a ``TypeError``), a missing one a
:class:`StateMissingError` (also a ``KeyError``).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping

from .errors import DataError

__all__ = ["StateError", "StateTypeError", "StateMissingError", "StateFields"]


class StateError(DataError):
    """A saved state this packkit refuses; the message names the field and the fix."""


class StateTypeError(StateError, TypeError):
    """A field of a saved state has the wrong type (``epoch="3"``), or the state is not a dict."""


class StateMissingError(StateError, KeyError):
    """A saved state lacks a field its version has."""


def _shown(value) -> str:
    """A value as an error shows it, cut short: ``_shown("x" * 100) -> "'xxxxxxxx...' (str)"``."""
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{text} ({type(value).__name__})"


class StateFields:
    """Reads the fields of one saved ``state`` of ``owner`` (``"sampler"``, ``"stream"``), each checked as
    it is read; every error is one line ``"<owner> state field '<name>': <why>"``.

    ``versions``: the versions this reader accepts; ``legacy``: the version a state without a
    ``"version"`` field has (None: such a state is refused). :meth:`done` refuses fields nobody read
    (a state of another version or owner, or a typo).
    """

    def __init__(self, state, *, owner: str, versions: tuple[int, ...], legacy: int | None = None):
        if not isinstance(state, Mapping):
            raise StateTypeError("{owner} state must be the dict state_dict() returned, got {kind}", owner=owner,
                                 kind=type(state).__name__)
        self.state, self.owner, self._read = state, owner, {"version"}
        self._versioned = "version" in state
        if not self._versioned and legacy is not None:
            self.version = legacy
            return
        v = self.get("version")
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or int(v) not in versions:
            self.fail("version", f"{v!r} is not a version this packkit reads ({', '.join(map(str, versions))}); "
                      "save the state again with this packkit, or load it with the packkit that saved it")
        self.version = int(v)

    # -- errors --------------------------------------------------------------------------------

    def fail(self, name: str, why: str, cls=StateError):
        """Raise ``cls`` naming the field: ``sampler state field 'epoch': <why>``."""
        raise cls("{owner} state field {name!r}: {why}", owner=self.owner, name=name, why=why)

    # -- readers -------------------------------------------------------------------------------

    def get(self, name: str):
        """The raw value of a field that must be there."""
        if name not in self.state:
            raise StateMissingError("{owner} state lacks the field {name!r}: pass the dict state_dict() returned, "
                                    "unedited", owner=self.owner, name=name)
        self._read.add(name)
        return self.state[name]

    def int(self, name: str, *, low: int = 0, high: int | None = None) -> int:
        """An integer field in ``[low, high]`` (a bool is not an integer)."""
        v = self.get(name)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            self.fail(name, f"must be an integer, got {_shown(v)}", StateTypeError)
        v = int(v)
        if v < low or (high is not None and v > high):
            bound = f"at least {low}" if high is None else f"in [{low}, {high}]"
            self.fail(name, f"must be {bound}, got {v}")
        return v

    def text(self, name: str) -> str:
        """A string field."""
        v = self.get(name)
        if not isinstance(v, str):
            self.fail(name, f"must be a string, got {_shown(v)}", StateTypeError)
        return v

    def hex(self, name: str) -> int:
        """A non-negative integer written in hexadecimal (``"1f"``): bit masks of any size stay JSON-safe."""
        v = self.text(name)
        try:
            out = int(v, 16)
        except ValueError:
            out = -1
        if out < 0 or not v or v.strip() != v:
            self.fail(name, f"must be a hexadecimal string, got {v!r}")
        return out

    def ints(self, name: str, size: int, *, low: int = 0) -> tuple[int, ...] | None:
        """A list of ``size`` integers ``>= low``, or None."""
        v = self.get(name)
        if v is None:
            return None
        ok = isinstance(v, (list, tuple)) and len(v) == size and all(
            isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in v)
        if not ok:
            self.fail(name, f"must be a list of {size} integers or None, got {_shown(v)}", StateTypeError)
        if any(int(x) < low for x in v):
            self.fail(name, f"must hold integers of at least {low}, got {list(v)}")
        return tuple(int(x) for x in v)

    def equal(self, name: str, expected, why: str):
        """A field that must equal ``expected`` (this owner's value); ``why`` ends the error."""
        v = self.get(name)
        if type(v) is not type(expected) or v != expected:
            self.fail(name, f"{why} (the state has {v!r}, this one {expected!r})")
        return v

    def done(self) -> None:
        """Refuse the fields no reader asked for: the state is not of this version or owner."""
        extra = sorted(str(k) for k in self.state if k not in self._read)
        if extra and not self._versioned:  # a newer state that lost its version, most likely
            self.fail("version", f"is missing, which makes this a version-{self.version} state, but it has the "
                      f"field {extra[0]!r}: pass the dict state_dict() returned, unedited")
        if extra:
            self.fail(extra[0], f"is not a field of a version-{self.version} {self.owner} state: pass the dict "
                      "state_dict() returned, unedited")
