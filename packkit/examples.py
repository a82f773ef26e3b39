"""Python examples in: one example (streaming packing) and a batch of them (the collators' hot path),
read by the rules of :mod:`packkit.rules`, and :class:`ExampleBatch`, a batch held as columns.

* Python examples (a list of dicts of lists, numpy arrays or tensors): :func:`read_examples`. Every
  check is one vectorised pass over the batch (one ``struct.pack_into`` of the concatenated lists, or
  one ``np.concatenate`` of the arrays); the offending example is located only when a check fails.
* Columns (flat values and offsets, as an Arrow list column stores them): :class:`ExampleBatch`, a batch
  the columnar DataLoader path fetched, read by the same rules (:func:`_read_rules`).

numpy only: offline packing imports this without torch (tensors are recognised without importing
torch).
"""

from __future__ import annotations

import collections.abc
import numbers
import struct
import sys
import warnings

import numpy as np

from .located import ExampleTypeError, ExampleValueError, located, location, not_integral
from .rules import (ATTENTION_MASK_KEY, FLAG_KINDS, INT64_MAX, MASK_KEYS, SEGMENT_KEYS, UNSUPERVISED_WARNING,
                    LossMaskWarning,
                    any_bad_id, beyond_int64, any_bad_label, any_bad_mask, check_column, check_loss_mask_mode,
                    check_values, column_kind, empty_example, length_mismatch, locate, mask_not_expected, nested,
                    no_labels, no_mask, not_integer, null_tokens)
from .segments import IGNORE_INDEX, lengths_to_offsets

__all__ = [
    "ExampleBatch",
    "ExampleRow",
    "example_arrays",
    "read_batch",
    "read_column",
    "read_examples",
]


# ----------------------------------------------------------------------------------------------
# one Python example (streaming packing)
# ----------------------------------------------------------------------------------------------


def example_arrays(ex, keys, *, index: int, rows=None) -> dict:
    """One Python example's columns ``keys`` (the token column first) as checked 1-D numpy arrays.

    Every column follows its rule (:func:`~packkit.rules.column_kind`, :func:`~packkit.rules.check_column`);
    other columns must be integers (bools kept). A key other than the token column that the example lacks (or
    holds None) is left out of the result: the example does not have it. An ``attention_mask`` the example carries
    is checked even when ``keys`` do not read it (a 0 is a pad token: refused, :func:`~packkit.rules.padded_example`).
    ``example_arrays({"input_ids": [5, 6]}, ["input_ids", "labels"], index=0) -> {"input_ids": array([5, 6])}``.
    """
    if not isinstance(ex, collections.abc.Mapping):
        raise located(ExampleTypeError, index, rows, f"is a {type(ex).__name__}, not a dict with 'input_ids'")
    out, first = {}, None
    checked = keys if ATTENTION_MASK_KEY in keys else [*keys, ATTENTION_MASK_KEY]  # read or not, never a pad
    for j, key in enumerate(checked):
        v = ex.get(key)
        if v is None:
            if j == 0:
                raise _missing(index, rows, ex, key)
            continue
        kind = column_kind(key, keys[0])
        arr = _one_array(v, index, rows, key, kind)
        try:  # checked as a one-example column, then located as example `index`
            check_column(arr, np.array([0, arr.size], np.int64), kind=kind, key=key,
                         ref_lengths=None if j == 0 else [first.size], ref_key=keys[0])
        except (ExampleValueError, ExampleTypeError) as exc:
            raise located(type(exc), index, rows, exc.text) from None
        if j < len(keys):
            out[key] = arr
        if j == 0:
            first = arr
    return out


def _one_array(v, i, rows, key, kind) -> np.ndarray:
    """One example's column as a 1-D integer (or bool) numpy array, or the error that names it. A list
    (or tuple) becomes an array here, bools kept as bools in a mask or an ``"other"`` column."""
    if isinstance(v, (list, tuple)):
        if kind not in _BOOL_KINDS and any(isinstance(x, (bool, np.bool_)) for x in v):
            raise not_integer(i, rows, key, kind, next(x for x in v if isinstance(x, (bool, np.bool_))))
        try:
            arr = np.asarray(v)
        except ValueError:  # ragged nesting
            raise nested(i, rows, key, "lists of different lengths inside") from None
        if arr.dtype == object:
            bad = next((x for x in v if isinstance(x, (list, tuple, np.ndarray))), None)
            if bad is not None:
                raise nested(i, rows, key, f"a {type(bad).__name__} inside a list")
            raise not_integer(i, rows, key, kind, next(x for x in v if not isinstance(x, numbers.Integral)))
        return _checked_array(arr, i, key, kind, rows)
    return _checked_array(v, i, key, kind, rows)


def _checked_array(x, i: int, key: str, kind: str, rows) -> np.ndarray:
    """One example's column given as a numpy array (or tensor), checked: 1-D, integers (bools too in a
    mask or an ``"other"`` column); an empty array of another dtype reads as int64. Anything else is the
    error naming example ``i``. ``_checked_array(np.array([3.0, 1.5]), 0, "input_ids", "ids", None)``
    raises ``"example 0 has 1.5 (float) in 'input_ids'; ..."``."""
    if _is_tensor(x):
        x = x.detach().cpu().numpy()
    elif not isinstance(x, np.ndarray):
        raise located(ExampleTypeError, i, rows, f"has a {type(x).__name__} in {key!r}; pass a list, numpy array "
                     "or tensor of integers")
    if x.ndim != 1:
        raise nested(i, rows, key, f"shape {x.shape}")
    k = x.dtype.kind
    if k not in "iu" and not (k == "b" and kind in _BOOL_KINDS):
        if x.size == 0:
            return x.astype(np.int64)
        raise not_integer(i, rows, key, kind, x[int(np.argmax(not_integral(x)))] if k == "f" else x[0])
    if k == "u" and x.itemsize == 8 and kind not in FLAG_KINDS and x.size and x.max() > INT64_MAX:  # int64 wraps it
        raise beyond_int64(i, rows, key, kind, x[int(np.argmax(x > INT64_MAX))])
    return x


#: Kinds whose columns may hold bools (kept as bools when read one example at a time).
_BOOL_KINDS = (*FLAG_KINDS, "other")


def _is_tensor(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _missing(i, rows, ex, key):
    return located(ExampleValueError, i, rows,
                  f"has no {key!r} (keys: {sorted(map(str, ex))}); every example needs its token ids")


# ----------------------------------------------------------------------------------------------
# a batch of Python examples: the collators' hot path
# ----------------------------------------------------------------------------------------------


def read_examples(examples, *, need_labels: bool = False, loss_mask: str = "auto", rows=None):
    """Examples -> ``(input_ids, labels, lengths)``: ``(T,)`` int64, ``(T,)`` int64 (writable), ``(n,)`` int64.

    ``examples`` is a list of mappings (dicts of lists, numpy arrays or tensors), or an
    :class:`ExampleBatch` (columns; its dataset rows locate errors). ``labels`` are each example's own
    labels or token ids, ``-100`` where a loss mask it carries is 0 (:mod:`packkit.rules`); no first-label
    masking here (that depends on the segments).

    Args:
        need_labels: every example must have ``labels`` (pre-shifted labels, ``mask_first_label=False``).
        loss_mask: ``"auto"`` or ``"required"`` (every example must carry a loss mask).
        rows: the dataset row of every example (or of example 0, an int), to locate errors.

    ``read_examples([{"input_ids": [5, 6]}, {"input_ids": [7], "completion_mask": [0]}])``
    -> ``([5, 6, 7], [5, 6, -100], [2, 1])``.
    """
    return _read(examples, need_labels, check_loss_mask_mode(loss_mask), rows)[:3]


def read_batch(examples, *, need_labels: bool = False, loss_mask: str = "auto", warned: list | None = None):
    """What a collator reads: :func:`read_examples`, plus the loss-mask policy's warning.

    With ``loss_mask="auto"``, a batch in which no example carries labels or a loss mask is read as
    "loss on every token", and a :class:`~packkit.rules.LossMaskWarning` says so once per ``warned`` holder (a one-item
    list the collator keeps: ``[False]`` before the warning): that is what a ``transformers.Trainer``
    with its default ``remove_unused_columns=True`` turns masked data into, and the warning names the
    setting. ``loss_mask="none"`` (pretraining: every token a target) never warns; ``"required"`` raises
    instead. Returns ``(input_ids, labels, lengths)``.
    """
    ids, labels, lengths, supervised = _read(examples, need_labels, loss_mask, None)
    if not supervised and loss_mask == "auto" and warned is not None and not warned[0]:
        warned[0] = True
        warnings.warn(UNSUPERVISED_WARNING.format(keys=", ".join(("labels", *MASK_KEYS))), LossMaskWarning,
                      stacklevel=3)
    return ids, labels, lengths


def _read(examples, need_labels: bool, mode: str, rows):
    """:func:`read_examples` without keyword handling, plus whether any example carried labels or a
    loss mask: the batch's form is recognised, and :func:`_read_rules` reads it."""
    if type(examples) is not list:
        if isinstance(examples, ExampleBatch):
            return examples.read(need_labels=need_labels, mode=mode)
        if isinstance(examples, collections.abc.Mapping) or not isinstance(examples, collections.abc.Sequence):
            raise TypeError(f"a collator takes a list of examples (dicts with 'input_ids'), got "
                            f"{type(examples).__name__}")
        examples = list(examples)
    if not examples:
        raise ValueError("the collator got an empty list of examples")
    if type(examples[0]) is ExampleRow:
        batch = ExampleBatch.from_rows(examples)
        if batch is not None:
            return batch.read(need_labels=need_labels, mode=mode)
    return _read_rules(_Dicts(examples, rows), need_labels, mode)


def _read_rules(form, need_labels: bool, mode: str):
    """The rules of a batch (:mod:`packkit.rules`), written once, in this order: token ids not null, not
    empty, not negative; an ``attention_mask`` (where examples carry one) 0 or 1, as long as the token ids, no 0
    (padding); labels (each example's own, else its token ids; ``need_labels``) by their rule;
    each of :data:`~packkit.rules.MASK_KEYS` (an error under ``mode="none"``; ones for the examples without it) by its
    rule, ``-100`` where it is 0; then ``mode="required"``: every example carries a mask.

    ``form`` reads the columns, :class:`_Dicts` (Python examples) or :class:`_Columns` (an
    :class:`ExampleBatch`): ``ids()`` every example's token ids; ``read_ids(xs, kinds)`` ``(parts, lengths
    list, first empty example or None)``; ``get(key)`` every example's ``key`` (None where it lacks it)
    or None; ``join(key, kind, parts, kinds)`` a column as checked ``(T,)`` int64, as long as the token
    ids; ``lengths_array()``. Returns ``(input_ids, labels, lengths, supervised)`` (``supervised``: some
    example carried labels or a loss mask). Every check is one vectorised pass over the batch; the
    offending example is located (:func:`~packkit.rules.locate`) only when one fails.
    """
    rows = form.rows
    xs = form.ids()
    kinds = set(map(type, xs))
    if _NONE in kinds:
        raise null_tokens(_first_none(xs), rows, "input_ids")
    ids, lengths, empty = form.read_ids(xs, kinds)
    if empty is not None:
        raise empty_example(empty, rows)
    input_ids = form.join("input_ids", "ids", ids)
    if any_bad_id(input_ids):
        raise locate(input_ids, "ids", "input_ids", rows, lengths=lengths)
    # packed rows (another packer's too: segment ids or padding in their mask) hold their documents elsewhere
    xs = None if any(form.get(k) is not None for k in SEGMENT_KEYS) else form.get(ATTENTION_MASK_KEY)
    kinds = {_NONE} if xs is None else set(map(type, xs))
    if kinds != {_NONE} and not _all_ones(xs, kinds, lengths):  # a 0 (padding) refused; all ones: no mask
        if _NONE in kinds:
            xs, kinds = [np.ones(k, np.int8) if x is None else x for x, k in zip(xs, lengths)], None
        check_values(form.join(ATTENTION_MASK_KEY, "attention", xs, kinds), kind="attention", key=ATTENTION_MASK_KEY,
                     rows=rows, lengths=lengths)
    xs = form.get("labels")
    kinds = {_NONE} if xs is None else set(map(type, xs))
    supervised = kinds != {_NONE}  # a key every example holds as None is a key none of them has
    if supervised:
        if _NONE in kinds:  # examples without labels: their token ids are their labels
            if need_labels:
                raise no_labels(_first_none(xs), rows)
            xs, kinds = [p if x is None else x for x, p in zip(xs, ids)], None
        labels = form.join("labels", "labels", xs, kinds)
        if any_bad_label(labels):
            raise locate(labels, "labels", "labels", rows, lengths=lengths)
    else:
        if need_labels:
            raise no_labels(0, rows)
        labels = input_ids.copy()
    masked = None  # per example: it carries a loss mask (None: no example does)
    for key in MASK_KEYS:
        xs = form.get(key)
        kinds = {_NONE} if xs is None else set(map(type, xs))
        if kinds == {_NONE}:
            continue
        if mode == "none":
            raise mask_not_expected(next(i for i, x in enumerate(xs) if x is not None), rows, key)
        if _NONE in kinds:  # examples without this mask: loss on every token
            has = [x is not None for x in xs]
            masked = has if masked is None else [a or b for a, b in zip(masked, has)]
            xs, kinds = [(([1] * k) if type(p) is list else np.ones(k, np.int8)) if x is None else x
                         for x, p, k in zip(xs, ids, lengths)], None
        else:
            masked = [True] * len(xs)
        mask = form.join(key, "mask", xs, kinds)
        if any_bad_mask(mask):
            raise locate(mask, "mask", key, rows, lengths=lengths)
        labels[mask == 0] = IGNORE_INDEX
    if mode == "required" and (masked is None or not all(masked)):
        raise no_mask(0 if masked is None else masked.index(False), rows)
    return input_ids, labels, form.lengths_array(), supervised or masked is not None


class _Dicts:
    """Column access over Python examples (a list of mappings of lists, numpy arrays or tensors) for
    :func:`_read_rules`. A column's parts are checked as they are read, with one set over the batch
    over the batch (:func:`_parts`), and joined by one ``struct.pack_into`` or ``np.concatenate``
    (:func:`_concat`); ``lengths`` is a list."""

    __slots__ = ("examples", "rows", "keys", "lengths", "total", "layout")

    def __init__(self, examples: list, rows):
        self.examples, self.rows, self.keys = examples, rows, None

    def ids(self) -> list:
        """Every example's token ids; an error naming the first example that is not a mapping with them."""
        try:
            return [ex["input_ids"] for ex in self.examples]
        except (KeyError, TypeError, IndexError):
            for i, ex in enumerate(self.examples):
                if not isinstance(ex, collections.abc.Mapping):
                    raise located(ExampleTypeError, i, self.rows,
                                 f"is a {type(ex).__name__}, not a dict with 'input_ids'") from None
                if "input_ids" not in ex:
                    raise _missing(i, self.rows, ex, "input_ids") from None
            raise

    def read_ids(self, xs: list, kinds: set) -> tuple[list, list, int | None]:
        """``(parts, lengths, the first empty example or None)`` of the token ids, their types checked."""
        parts, lengths, self.layout = _parts(xs, "input_ids", "ids", self.rows, kinds)
        self.lengths, self.total = lengths, sum(lengths)
        return parts, lengths, lengths.index(0) if 0 in lengths else None

    def lengths_array(self) -> np.ndarray:
        return np.array(self.lengths, np.int64)

    def get(self, key: str) -> list | None:
        """Every example's ``key`` (None where it lacks it), or None when no example has it."""
        if self.keys is None:
            self.keys = set().union(*self.examples)
        return _values(self.examples, key) if key in self.keys else None

    def join(self, key: str, kind: str, xs: list, kinds=None) -> np.ndarray:
        """A column as ``(T,)`` int64, read by ``kind``'s types and (but the token ids) as long as the
        token ids example by example."""
        if kind == "ids":
            return _concat(xs, self.layout, self.total, key, kind, self.rows)
        parts, lengths, layout = _parts(xs, key, kind, self.rows, kinds)
        _same_lengths(lengths, self.lengths, key, self.rows)
        return _concat(parts, layout, self.total, key, kind, self.rows)


class _Columns:
    """Column access over an :class:`ExampleBatch` for :func:`_read_rules`: every part is a 1-D numpy
    array (a view of an Arrow buffer), the lengths are known; a column is checked as long as the token
    ids, then by dtype and shape over the batch, and joined by one ``np.concatenate`` (:func:`_join_arrays`)."""

    __slots__ = ("columns", "rows", "array", "lengths", "total")

    def __init__(self, batch: "ExampleBatch"):
        self.columns, self.rows, self.array = batch.columns, batch.rows, batch.lengths

    def ids(self) -> list:
        return self.columns["input_ids"]

    def read_ids(self, xs: list, kinds: set) -> tuple[list, list, int | None]:
        lengths = self.lengths = self.array.tolist()
        self.total = sum(lengths)
        return xs, lengths, lengths.index(0) if 0 in lengths else None

    def lengths_array(self) -> np.ndarray:
        return self.array

    def get(self, key: str) -> list | None:
        return self.columns.get(key)

    def join(self, key: str, kind: str, xs: list, kinds=None) -> np.ndarray:
        if kind != "ids":
            _same_lengths(list(map(len, xs)), self.lengths, key, self.rows)
        return _join_arrays(xs, key, kind, self.rows, self.total)


def _all_ones(xs: list, kinds: set, lengths: list) -> bool:
    """Whether every example's ``attention_mask`` (None: it has none) is a list of int ones as long as its token
    ids, what a tokenizer without padding gives: one ``list.count`` an example, no copy (measured 6 us against
    215 us joining and checking 16,000 values). A 1.0 or True after an int counts as a 1 here (nothing is padded);
    anything else is read and checked in full. ``_all_ones([[1, 1], None], {list, type(None)}, [2, 3]) -> True``."""
    return kinds <= {list, _NONE} and all(x is None or (len(x) == n and type(x[0]) is int and x.count(1) == n)
                                          for x, n in zip(xs, lengths))


def _first_none(xs: list) -> int:
    return next(i for i, x in enumerate(xs) if x is None)


_NONE = type(None)
_INT_DTYPES = frozenset(np.dtype(t) for t in (np.int64, np.int32, np.int16, np.int8, np.uint8, np.uint16,
                                                  np.uint32, np.uint64))
_MASK_DTYPES = _INT_DTYPES | {np.dtype(np.bool_)}
_UINT64 = np.dtype(np.uint64)


def _values(examples, key: str) -> list:
    """Every example's ``key``, None where an example lacks it."""
    try:
        return [ex[key] for ex in examples]
    except KeyError:
        return [ex.get(key) for ex in examples]


def _parts(xs: list, key: str, kind: str, rows, kinds=None) -> tuple[list, list, str]:
    """One column of every example: ``(parts, lengths, layout)``, each part a list or a 1-D integer
    array, ``layout`` ``"lists"``, ``"arrays"`` or ``"mixed"``. The types are checked over the whole
    column at once (a set of them), with a checked loop that names the offending example as fallback. ``_parts([[5, 6]], "input_ids", "ids", None) -> ([[5, 6]], [2], "lists")``.
    ``kinds``: ``set(map(type, xs))`` when the caller has it.
    """
    if kinds is None:
        kinds = set(map(type, xs))
    if kinds == {list}:
        lengths = list(map(len, xs))
        if 0 not in lengths and {type(x[0]) for x in xs} <= ({int, bool} if kind in FLAG_KINDS else {int}):
            return xs, lengths, "lists"
    elif kinds == {np.ndarray}:
        # ndim is checked where it is cheap: len() of a 0-d array raises, and a 2-D array makes the
        # concatenation fail; both fall back to the checked loop below, which names the example.
        if {x.dtype for x in xs} <= (_MASK_DTYPES if kind in FLAG_KINDS else _INT_DTYPES):
            try:
                return xs, list(map(len, xs)), "arrays"
            except TypeError:
                pass
    parts, lengths, lists = [], [], 0
    for i, x in enumerate(xs):
        part, length, is_list = _column(x, i, key, kind, rows)
        parts.append(part)
        lengths.append(length)
        lists += is_list
    return parts, lengths, "lists" if lists == len(xs) else "arrays" if not lists else "mixed"


def _column(x, i: int, key: str, kind: str, rows):
    """One example's column as a list or a 1-D integer numpy array, checked (the slow path).

    Returns ``(part, length, is_list)``: ``_column([3, 4], 0, "input_ids", "ids", None) -> ([3, 4], 2, True)``.
    """
    if type(x) is list:
        if x:
            first = x[0]
            if type(first) is not int and (isinstance(first, bool) or not isinstance(first, numbers.Integral)):
                if kind in FLAG_KINDS and isinstance(first, (bool, np.bool_)):
                    return x, len(x), True
                if isinstance(first, (list, tuple, np.ndarray)) or _is_tensor(first):
                    raise nested(i, rows, key, f"a {type(first).__name__} inside a list")
                raise not_integer(i, rows, key, kind, first)
        return x, len(x), True
    if isinstance(x, tuple):
        return _column(list(x), i, key, kind, rows)
    x = _checked_array(x, i, key, kind, rows)
    return x, x.shape[0], False


def _join_arrays(parts: list, key: str, kind: str, rows, total: int | None = None) -> np.ndarray:
    """Every example's part of a column, 1-D integer numpy arrays (bools too in a mask), joined into one
    writable ``(total,)`` int64 array (``total``: the sum of their lengths, counted when None). The
    dtypes and shapes are tested over the whole batch first, then the error names the first part that fails (:func:`_column`)."""
    if not {p.dtype for p in parts} <= (_MASK_DTYPES if kind in FLAG_KINDS else _INT_DTYPES) \
            or any(p.ndim != 1 for p in parts):
        for i, p in enumerate(parts):
            _column(p, i, key, kind, rows)
    out = np.empty(sum(map(len, parts)) if total is None else total, np.int64)
    return np.concatenate(parts, out=out, casting="unsafe") if parts else out


_NO_VALUES = np.zeros(0, np.int64)


def _list_into(flat: list, out: np.ndarray, bools_ok: bool) -> None:
    """Write a flat list of ints into ``out`` (int64, same length) with one ``struct.pack_into``.

    ``struct`` rejects floats (numpy would truncate them) but takes ``True``/``False`` as 1/0, so
    unless ``bools_ok`` the positions holding 0 or 1 (rare in token ids) are checked for bools;
    ``_BoolAt`` names the first bool's position: ``_list_into([3, True], out, False)`` raises.
    """
    struct.pack_into(f"{len(flat)}q", out, 0, *flat)
    if not bools_ok:
        cand = np.flatnonzero(out.view(np.uint64) <= 1)
        if cand.size:
            for t in cand.tolist():
                if type(flat[t]) is not int and isinstance(flat[t], (bool, np.bool_)):
                    raise _BoolAt(t)


class _BoolAt(Exception):
    """A bool at flat position ``args[0]`` (turned into an error naming the example)."""


def _concat(parts: list, layout: str, total: int, key: str, kind: str, rows) -> np.ndarray:
    """Concatenate example columns (laid out as :func:`_parts` says) into one writable ``(total,)`` int64 array.

    Lists: joined into one list and converted by a single ``struct.pack_into`` straight into the
    output buffer (measured faster than ``np.fromiter``/``np.array`` on a list, about 2x, and it
    rejects floats instead of truncating them); bools are rejected unless ``kind`` is a flag
    (:data:`~packkit.rules.FLAG_KINDS`).
    Arrays: one ``np.concatenate``. ``_concat([[1], [2, 3]], "lists", 3, "input_ids", "ids", None) -> [1, 2, 3]``.
    """
    out = np.empty(total, np.int64)
    bools_ok = kind in FLAG_KINDS
    try:
        if layout == "lists":
            flat: list = []
            for p in parts:
                flat += p
            _list_into(flat, out, bools_ok)
            return out
        if layout == "mixed":  # lists mixed with arrays: each list through struct
            parts = [p if isinstance(p, np.ndarray) else _list_array(p, bools_ok) for p in parts]
        if _UINT64 in {p.dtype for p in parts}:  # past int64 the cast below would wrap: refused by name
            _locate_bad_part(parts, key, kind, rows)
        return np.concatenate(parts, out=out, casting="unsafe")
    except (_BoolAt, ValueError, TypeError, OverflowError, struct.error):
        _locate_bad_part(parts, key, kind, rows)
        raise AssertionError(f"{key!r} could not be read as integers, yet no example holds a bad value") from None


def _list_array(part: list, bools_ok: bool) -> np.ndarray:
    """One example's list as int64 through :func:`_list_into`: ``[3, 4] -> array([3, 4])``."""
    out = np.empty(len(part), np.int64)
    _list_into(part, out, bools_ok)
    return out


def _locate_bad_part(parts: list, key: str, kind: str, rows) -> None:
    """The error path of :func:`_concat`: raise the error that names the first bad example."""
    for i, p in enumerate(parts):
        if isinstance(p, np.ndarray):
            _column(p, i, key, kind, rows)  # raises for a wrong shape or dtype
            continue
        for v in p:
            if type(v) is int:
                if not -2**63 <= v < 2**63:
                    raise beyond_int64(i, rows, key, kind, v)
                continue
            if isinstance(v, (bool, np.bool_)):
                if kind in FLAG_KINDS:
                    continue
                raise not_integer(i, rows, key, kind, v)
            if isinstance(v, (list, tuple, np.ndarray)) or _is_tensor(v):
                raise nested(i, rows, key, f"a {type(v).__name__} inside a list")
            if not isinstance(v, numbers.Integral):
                raise not_integer(i, rows, key, kind, v)


def int_arrays(xs: list) -> np.ndarray | None:
    """``xs``, 1-D integer numpy arrays, joined into one new ``(T,)`` int64 array, or None where they are not all
    that (a list, None, a float or uint64 dtype, a 0-d or 2-D array: the checked readers then name the example).
    The usual column of numpy-formatted rows, read in three calls over the whole column (its types, its dtypes, one
    ``np.concatenate`` whose result's ndim is the shapes' check), none per example.
    ``int_arrays([np.array([2, 1]), np.array([3], np.int32)]) -> [2, 1, 3]``; ``int_arrays([[2, 1]]) -> None``.
    """
    if set(map(type, xs)) != {np.ndarray}:
        return None
    dtypes = {x.dtype for x in xs}
    if not dtypes <= _INT_DTYPES or _UINT64 in dtypes:  # past int64 the cast would wrap
        return None
    try:  # a 0-d array, or arrays of unequal ndim, fail the join; 2-D arrays of one width join as 2-D
        flat = np.concatenate(xs, dtype=np.int64, casting="unsafe")
    except ValueError:
        return None
    return flat if flat.ndim == 1 else None


def read_column(examples, key: str, *, missing: str, rows=None) -> tuple[np.ndarray, np.ndarray]:
    """Another integer column of every example (``seq_lengths``, ``position_ids`` of packed rows):
    ``(values (T,) int64, lengths (n,) int64)``, read with the same rules as token ids' types.
    An example without ``key`` is an error that names it and ends with ``missing`` (the fix).
    ``read_column([{"seq_lengths": [2, 1]}], "seq_lengths", missing="...") -> ([2, 1], [2])``.
    """
    if isinstance(examples, ExampleBatch):
        if key in examples.columns and _NONE not in set(map(type, examples.columns[key])):
            values, offsets = examples.column(key)
            return values, np.diff(offsets)
        rows = examples.rows
        examples = list(examples)
    xs = _values(examples, key)
    flat = int_arrays(xs)
    if flat is not None:  # the usual rows (numpy-formatted datasets): one concatenation, checked at once
        return flat, np.fromiter(map(len, xs), np.int64, len(xs))
    kinds = set(map(type, xs))
    if _NONE in kinds:
        i = next(i for i, x in enumerate(xs) if x is None)
        raise located(ExampleValueError, i, rows, f"has no {key!r}; {missing}")
    parts, lengths, layout = _parts(xs, key, "ids", rows, kinds)
    return _concat(parts, layout, sum(lengths), key, "ids", rows), np.array(lengths, np.int64)


def _same_lengths(got: list, lengths: list, key: str, rows) -> None:
    if got != lengths:
        i = next(i for i, (a, b) in enumerate(zip(got, lengths)) if a != b)
        raise length_mismatch(i, rows, key, got[i], "input_ids", lengths[i])


# ----------------------------------------------------------------------------------------------
# a batch as columns (the columnar DataLoader path)
# ----------------------------------------------------------------------------------------------


class ExampleBatch(collections.abc.Sequence):
    """A batch of examples held as columns: for every key, one 1-D numpy array per example (views
    of the dataset's Arrow buffers, no Python objects per token), None where an example lacks the key.

    What :class:`packkit.columnar.ColumnarDataset` hands a collator; every packkit collator takes it
    directly. ``rows`` are the examples' dataset rows (errors name them). As a sequence it yields
    :class:`ExampleRow` views (mappings, not dicts, so ``transformers.Trainer``'s column remover
    passes them through untouched); a list of the rows of one batch collates as the batch.

    ``ExampleBatch({"input_ids": [np.array([5, 6]), np.array([7])]}, rows=[10, 4])`` is two examples,
    dataset rows 10 and 4.
    """

    __slots__ = ("columns", "rows", "lengths")

    def __init__(self, columns: dict, *, rows=None, lengths=None):
        if "input_ids" not in columns:
            raise ValueError(f"an ExampleBatch needs 'input_ids'; it has {sorted(columns)}")
        self.columns = {k: list(v) for k, v in columns.items()}
        n = len(self.columns["input_ids"])
        if any(len(v) != n for v in self.columns.values()):
            raise ValueError("every column of an ExampleBatch has one entry per example")
        self.rows = None if rows is None else np.asarray(rows, np.int64)
        self.lengths = np.fromiter(map(len, self.columns["input_ids"]), np.int64, n) if lengths is None \
            else np.asarray(lengths, np.int64)

    def __len__(self) -> int:
        return self.lengths.size

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.take(range(len(self))[i])
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"example {i} of a batch of {n}")
        return ExampleRow(self, i % n)

    def __repr__(self) -> str:
        return f"ExampleBatch({len(self)} examples, {int(self.lengths.sum())} tokens, keys {sorted(self.columns)})"

    def take(self, index) -> "ExampleBatch":
        """The examples at ``index`` (a sequence of positions), as a new batch."""
        index = list(index)
        return ExampleBatch({k: [v[i] for i in index] for k, v in self.columns.items()},
                            rows=None if self.rows is None else self.rows[index], lengths=self.lengths[index])

    @staticmethod
    def from_rows(rows: list) -> "ExampleBatch | None":
        """The batch a list of :class:`ExampleRow` views came from (itself when the list is all of it, in
        order), or None when they come from several batches (they are then read as mappings)."""
        batch = rows[0].batch
        if any(type(r) is not ExampleRow or r.batch is not batch for r in rows):
            return None
        index = [r.index for r in rows]
        return batch if index == list(range(len(batch))) else batch.take(index)

    def column(self, key: str):
        """``(values, offsets)`` of one column: flat ``(T,)`` values (int64) and ``(n + 1,)`` offsets;
        ``KeyError`` when no example has it. An example without it (None) has no values. Integers only,
        checked as a collator reads the column from dicts (:func:`read_column`)."""
        parts = self.columns[key]
        if _NONE in set(map(type, parts)):
            parts = [_NO_VALUES if p is None else p for p in parts]
        values = _join_arrays(parts, key, "ids", self.rows)
        return values, lengths_to_offsets(np.fromiter(map(len, parts), np.int64, len(parts)))

    def read(self, *, need_labels: bool = False, mode: str = "auto"):
        """``(input_ids, labels, lengths, supervised)``: what :func:`read_examples` returns and whether an
        example carried labels or a loss mask, by the same rules (:func:`_read_rules`), checked with
        vectorised numpy over the batch (no per-token Python; two reductions per column on the usual
        path, the offending example located only when a check fails). ``mode`` is a collator's ``loss_mask``."""
        return _read_rules(_Columns(self), need_labels, mode)

    @classmethod
    def _trusted(cls, columns: dict, rows: np.ndarray, lengths: np.ndarray) -> "ExampleBatch":
        """A batch from lists of parts already aligned (what :class:`~packkit.columnar.ColumnarDataset`
        builds), without the constructor's copies and checks; the values are checked by :meth:`read`."""
        obj = object.__new__(cls)
        obj.columns, obj.rows, obj.lengths = columns, rows, lengths
        return obj


class ExampleRow(collections.abc.Mapping):
    """Example ``index`` of an :class:`ExampleBatch`, as a read-only mapping of numpy views (keys the
    example lacks are absent). Not a ``dict``: ``transformers.Trainer``'s ``RemoveColumnsCollator``
    leaves it, and so its loss mask, as it is."""

    __slots__ = ("batch", "index")

    def __init__(self, batch: ExampleBatch, index: int):
        self.batch, self.index = batch, index

    def __getitem__(self, key):
        v = self.batch.columns[key][self.index]
        if v is None:
            raise KeyError(key)
        return v

    def __iter__(self):
        return (k for k, v in self.batch.columns.items() if v[self.index] is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        where = location(self.index, self.batch.rows)
        return f"ExampleRow({where}, keys {list(self)})"
