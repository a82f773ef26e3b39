"""Examples in: the one reader of examples and the one set of rules, on every path.

An example is a mapping (or one row of a table) with these keys::

    key               holds                              rule
    input_ids         token ids                          integers >= 0, at least one
    labels            the target of each token           token ids (>= 0) or -100 (no loss), one per token
    completion_mask   loss only where 1 (TRL's names:    0 or 1 (bools too), one per token
    assistant_masks   MASK_KEYS)

No list may be nested (a ``[1, n]`` tokenizer output is one example: squeeze it) and no value may be
a float, NaN, a bool or text where an integer belongs. Every error a user can cause names where the
example is and how to fix it, in one wording per rule::

    example 3 has label -7 in 'labels'; labels are token ids (>= 0) or -100 (no loss)
    dataset row 81204 has 1.5 (float) in 'input_ids'; token ids are integers >= 0
    dataset row 7 has 2 in the loss mask 'completion_mask'; a loss mask holds 1 (loss) or 0 (no loss)

The location is ``example i`` (the i-th example of what was passed) or, where the index in a dataset
is known (offline packing, a batch fetched through :class:`packkit.columnar.ColumnarDataset`),
``dataset row N``.

**Each example's own keys decide its labels** (honoured per example, whatever its batch-mates carry):
its ``labels`` if it has them, else its token ids; then ``-100`` wherever any loss mask it carries is 0
(both masks apply when both are given). A key whose value is ``None`` (a null in a table, as
``datasets`` writes a key that only some rows have) is a key the example does not have. So
``[{"input_ids": [3, 4, 5]}, {"input_ids": [6, 7, 8], "completion_mask": [0, 0, 1]}]`` gives labels
``[3, 4, 5 | -100, -100, 8]`` before the collators mask each example's first label.
``loss_mask="required"`` turns a missing mask into an error instead (it names the example and the
``transformers.Trainer`` setting that drops mask columns, ``remove_unused_columns``).

Two forms are read with the same rules:

* Python examples (a list of dicts of lists, numpy arrays or tensors): :func:`read_examples`, the
  collators' hot path. Every check is one vectorised pass over the batch (one ``struct.pack_into`` of
  the concatenated lists, or one ``np.concatenate`` of the arrays); the offending example is located
  only when a check fails.
* Columns (flat values and offsets, as an Arrow list column stores them): :class:`ExampleBatch` (a
  batch the columnar DataLoader path fetched), and for whole tables :func:`list_chunks` with
  :func:`check_column` (:func:`check_values` by :func:`column_kind`, :func:`check_aligned`), and the
  measurements :func:`token_lengths` and :func:`loss_lengths` that ``packkit waste`` / ``plan`` use.

numpy only: offline packing imports this without torch (tensors are recognised without importing
torch); pyarrow is imported only by the functions that read Arrow.
"""

from __future__ import annotations

import collections.abc
import numbers
import operator
import struct
import sys

import numpy as np

from .errors import DataError
from .segments import IGNORE_INDEX, lengths_to_offsets

__all__ = [
    "IGNORE_INDEX",
    "MASK_KEYS",
    "LOSS_MASK_MODES",
    "LossMaskWarning",
    "ExampleBatch",
    "ExampleRow",
    "ExampleTypeError",
    "ExampleValueError",
    "any_bad_id",
    "any_bad_label",
    "any_bad_mask",
    "check_aligned",
    "check_column",
    "check_labels",
    "check_loss_mask_mode",
    "check_mask",
    "check_not_null",
    "check_tokens",
    "check_values",
    "column_kind",
    "example_arrays",
    "first_bad_label",
    "first_bad_mask",
    "list_chunks",
    "location",
    "loss_lengths",
    "read_column",
    "read_batch",
    "read_examples",
    "relocate",
    "table_labels",
    "token_lengths",
]

#: Keys read as a loss mask (TRL's names): loss only where the mask is 1. The one definition.
MASK_KEYS = ("completion_mask", "assistant_masks")

#: ``loss_mask=`` of the collators (see :func:`read_batch`): ``"auto"`` honours a mask where an example
#: has one and warns once when a whole batch has neither labels nor a mask; ``"required"`` makes an
#: example without a mask an error; ``"none"`` says no mask is expected (a mask is then an error).
LOSS_MASK_MODES = ("auto", "required", "none")

#: The rule each kind of column follows, as every error states it.
RULES = {
    "ids": "token ids are integers >= 0",
    "labels": f"labels are token ids (>= 0) or {IGNORE_INDEX} (no loss)",
    "mask": "a loss mask holds 1 (loss) or 0 (no loss)",
    "other": "a packed column holds integers or bools, one per token",
}
_NESTED_FIX = "pass one flat list per example (squeeze a [1, n] tokenizer output)"


# ----------------------------------------------------------------------------------------------
# locations and errors
# ----------------------------------------------------------------------------------------------


def location(i: int, rows=None) -> str:
    """Where example ``i`` is: ``"example 3"``; with ``rows`` (the dataset row of every example, or
    the dataset row of example 0 as an int) ``"dataset row 812"``.

    ``location(3) -> "example 3"``; ``location(3, rows=800) -> "dataset row 803"``;
    ``location(1, rows=[9, 4]) -> "dataset row 4"``.
    """
    if rows is None:
        return f"example {i}"
    if isinstance(rows, numbers.Integral):
        return f"dataset row {int(rows) + i}"
    return f"dataset row {int(rows[i])}"


class _Located:
    """An error about one example: ``index`` (its position in what was checked) and ``text`` (the
    message after the location), so that a caller that knows more (a Ray block's first global row)
    can say where it is with :func:`relocate`. ``cls(message)`` alone works too (pickling, and
    PyTorch's DataLoader re-raising a worker's error)."""

    def __init__(self, message: str, index: int | None = None, text: str | None = None):
        super().__init__(message)
        self.index, self.text = index, text

    def __reduce__(self):  # pickled (Ray, DataLoader workers) with its location
        return (type(self), (str(self), self.index, self.text))


class ExampleValueError(_Located, DataError):
    """A bad value in an example (negative id, bad label or mask value, lengths that differ, ...): a
    ``ValueError`` and a :class:`packkit.errors.DataError` (the command line's data-error exit code)."""


class ExampleTypeError(_Located, DataError, TypeError):
    """A value of the wrong type in an example (float, bool, text, nested list, not a mapping): a
    ``TypeError``, and a :class:`packkit.errors.DataError` like every error about the data."""


def _error(cls, i: int, rows, text: str):
    return cls(f"{location(i, rows)} {text}", i, text)


def relocate(exc: Exception, rows) -> Exception:
    """The same error, its example located with ``rows`` (see :func:`location`); other errors as they are.

    ``relocate(err_about_example_3, rows=800)`` reads ``"dataset row 803 ..."``.
    """
    if isinstance(exc, _Located) and exc.index is not None:
        return _error(type(exc), exc.index, rows, exc.text)
    return exc


def _value_text(v) -> str:
    """``1.5 (float)``, ``True (bool)``, ``'a' (str)``, ``nan (float)``."""
    if isinstance(v, np.generic):
        v = v.item()
    return f"{v!r} ({type(v).__name__})"


def _not_integer(i, rows, key: str, kind: str, v):
    return _error(ExampleTypeError, i, rows, f"has {_value_text(v)} in {key!r}; {RULES[kind]}")


def _nested(i, rows, key: str, detail: str):
    return _error(ExampleTypeError, i, rows, f"has a nested list in {key!r} ({detail}); {_NESTED_FIX}")


def _negative(i, rows, key: str, v):
    return _error(ExampleValueError, i, rows, f"has token id {v} in {key!r}; {RULES['ids']}")


def _bad_label(i, rows, key: str, v):
    return _error(ExampleValueError, i, rows, f"has label {v} in {key!r}; {RULES['labels']}")


def _bad_mask(i, rows, key: str, v):
    return _error(ExampleValueError, i, rows, f"has {v} in the loss mask {key!r}; {RULES['mask']}")


def _empty(i, rows, key: str = "input_ids"):
    return _error(ExampleValueError, i, rows, f"is empty (0 tokens in {key!r}); filter empty examples out first")


def _length(i, rows, key: str, got: int, ref_key: str, want: int):
    return _error(ExampleValueError, i, rows,
                  f"has {got} {key!r} for {want} {ref_key!r}; they must match token for token")


def _null_tokens(i, rows, key: str):
    return _error(ExampleValueError, i, rows, f"has no {key!r} (null); drop the example or fill it")


def _null_inside(i, rows, key: str):
    return _error(ExampleValueError, i, rows, f"has a null inside {key!r}; every token needs a value")


def _no_labels(i, rows):
    return _error(ExampleValueError, i, rows,
                  "has no 'labels'; mask_first_label=False means labels are pre-shifted and every example "
                  "needs them (labels[i] = the target of token i, -100 at each example's end)")


def _no_mask(i, rows):
    return _error(ExampleValueError, i, rows,
                  f"has no loss mask ({' or '.join(repr(k) for k in MASK_KEYS)}) and loss_mask='required': "
                  "transformers.Trainer drops the columns its model's forward does not name, so pass "
                  "TrainingArguments(remove_unused_columns=False) or train_dataset=packkit.columnar."
                  "ColumnarDataset(ds); if this example has no prompt to mask, collate with loss_mask='auto'")


def _mask_not_expected(i, rows, key):
    return _error(ExampleValueError, i, rows,
                  f"has a loss mask {key!r} and loss_mask='none' (every token a target); collate with "
                  "loss_mask='auto' to honour it")


class LossMaskWarning(UserWarning):
    """A batch carried neither labels nor a loss mask (see :func:`read_batch`)."""


UNSUPERVISED_WARNING = (
    "no example of this batch carries labels or a loss mask ({keys}), so the loss is taken on every token. "
    "If your data has a loss mask and this runs under transformers.Trainer, the Trainer dropped it (it removes "
    "the columns its model's forward does not name): pass TrainingArguments(remove_unused_columns=False), or "
    "train_dataset=packkit.columnar.ColumnarDataset(ds), and loss_mask='required' to make a missing mask an "
    "error. If every token is a target (pretraining), pass loss_mask='none' to silence this warning.")


def check_loss_mask_mode(loss_mask) -> str:
    """``loss_mask=`` of a collator, checked: one of :data:`LOSS_MASK_MODES`."""
    if loss_mask not in LOSS_MASK_MODES:
        raise ValueError(f"loss_mask must be one of {', '.join(map(repr, LOSS_MASK_MODES))}, got {loss_mask!r}")
    return loss_mask


# ----------------------------------------------------------------------------------------------
# the rules on flat values (one chunk of a column, or a batch)
# ----------------------------------------------------------------------------------------------


def any_bad_id(values: np.ndarray) -> bool:
    """Whether an integer array holds a negative token id: one reduction.

    ``any_bad_id(np.array([3, -1])) -> True``; unsigned arrays never do.
    """
    return values.dtype.kind == "i" and values.size > 0 and values.min() < 0


def any_bad_label(values: np.ndarray) -> bool:
    """Whether an array holds a label that is neither a token id (>= 0) nor ``IGNORE_INDEX``.

    ``any_bad_label(np.array([3, -100])) -> False``; ``[3, -7] -> True``. Signed integers take two
    reductions without temporaries (measured 1.5-2.3x faster than counting the negatives and the -100s
    at 3,000-50,000 labels): the minimum rules out values below -100; viewed as unsigned, -99..-1 are the
    only values above -100's image.
    """
    view = _LABEL_VIEWS.get(values.dtype)
    if view is not None:
        return values.size > 0 and (values.min() < IGNORE_INDEX or values.view(view[0]).max() > view[1])
    if values.dtype.kind in "ub":
        return False
    return bool(_BAD_AT["labels"](values).any())  # floats, non-native byte order


def any_bad_mask(values: np.ndarray) -> bool:
    """Whether an array holds a loss-mask value that is neither 0 nor 1 (booleans are fine).

    ``any_bad_mask(np.array([0, 1, 2])) -> True``. Integers take one reduction: viewed as unsigned,
    0 and 1 are the only values <= 1. A mask of 2 or -1 is more likely a column mix-up than a loss
    weight, so it is refused.
    """
    view = _UNSIGNED_VIEWS.get(values.dtype)
    if view is not None:
        return values.size > 0 and values.view(view).max() > 1
    if values.dtype.kind == "b":
        return False
    return bool(_BAD_AT["mask"](values).any())


#: Per rule: whether any value breaks it (fast), where values break it (the error path), the error.
_ANY_BAD = {"ids": any_bad_id, "labels": any_bad_label, "mask": any_bad_mask}
_BAD_AT = {
    "ids": lambda v: v < 0,
    "labels": lambda v: (v < 0) & (v != IGNORE_INDEX),
    "mask": lambda v: (v != 0) & (v != 1),
}
_BAD_VALUE = {"ids": _negative, "labels": _bad_label, "mask": _bad_mask}
_UNSIGNED_VIEWS = {np.dtype(f"{k}{n}"): np.dtype(f"u{n}") for k in "iu" for n in (1, 2, 4, 8)}
#: signed dtype -> (its unsigned view, IGNORE_INDEX's image in that view)
_LABEL_VIEWS = {np.dtype(f"i{n}"): (np.dtype(f"u{n}"), np.array(IGNORE_INDEX, f"i{n}").view(f"u{n}")[()])
                for n in (1, 2, 4, 8)}


def first_bad_mask(values) -> int | None:
    """Flat index of the first loss-mask value that is neither 0 nor 1 (booleans are fine), or None.

    ``first_bad_mask([0, 1, 2]) -> 2``; ``first_bad_mask([True, False]) -> None`` (:func:`any_bad_mask`).
    """
    values = np.asarray(values)
    return int(np.argmax(_BAD_AT["mask"](values))) if any_bad_mask(values) else None


def first_bad_label(values) -> int | None:
    """Flat index of the first label that is neither a token id (>= 0) nor ``IGNORE_INDEX``, or None.

    ``first_bad_label([3, -100, -5]) -> 2``; ``first_bad_label([3, -100]) -> None`` (:func:`any_bad_label`).
    """
    values = np.asarray(values)
    return int(np.argmax(_BAD_AT["labels"](values))) if any_bad_label(values) else None


def _spans(offsets=None, starts=None, lengths=None):
    """``(starts, lengths)`` (n,) int64 of the examples, from ``offsets`` (n + 1,), or given (``starts``
    from ``lengths`` when the examples lie end to end)."""
    if offsets is not None:
        offsets = np.asarray(offsets, np.int64)
        return offsets[:-1], np.diff(offsets)
    lengths = np.asarray(lengths, np.int64)
    return np.asarray(lengths_to_offsets(lengths)[:-1] if starts is None else starts, np.int64), lengths


def _first_with(bad: np.ndarray, starts: np.ndarray, lengths: np.ndarray):
    """``(example, flat position)`` of the first example (in order) holding a position where ``bad``
    is True, or None: values outside every example (rows not selected) name nobody. Error path only."""
    before = lengths_to_offsets(bad)  # bad positions before each flat index
    hit = np.flatnonzero(before[starts + lengths] > before[starts])
    if not hit.size:
        return None
    i = int(hit[0])
    s = int(starts[i])
    return i, s + int(np.argmax(bad[s: s + int(lengths[i])]))


def _not_integral(values: np.ndarray) -> np.ndarray:
    """Where a float array holds a value that is not an integer: ``[1.0, 1.5, nan] -> [F, T, T]``."""
    return ~np.isfinite(values) | (values != np.round(values))


def _check_dtype(values: np.ndarray, starts, lengths, *, key: str, kind: str, rows) -> None:
    """Integer values (bools too in a mask); the error shows the first value of the first example."""
    k = values.dtype.kind
    if k in "iu" or (k == "b" and kind == "mask"):
        return
    if not values.size:
        return  # no values in any example: nothing to refuse
    found = None
    if k == "f":  # the first value that is not an integer (NaN included), as the Python reader reports it
        found = _first_with(_not_integral(values), starts, lengths)
    if found is None:
        found = _first_with(np.ones(values.size, bool), starts, lengths)
    if found is not None:
        raise _not_integer(found[0], rows, key, kind, values[found[1]])


def _locate(values: np.ndarray, kind: str, key: str, rows, *, offsets=None, starts=None, lengths=None):
    """The error about the first example (in order) holding a value that breaks ``kind``'s rule, or None
    when only values outside every example do (rows not selected name nobody). The error path only.
    ``_locate(np.array([3, -1]), "ids", "input_ids", None, lengths=[1, 1])`` is the error about example 1.
    """
    starts, lengths = _spans(offsets, starts, lengths)
    found = _first_with(_BAD_AT[kind](values), starts, lengths)
    return None if found is None else _BAD_VALUE[kind](found[0], rows, key, int(values[found[1]]))


def check_values(values, offsets=None, *, kind: str, key: str, starts=None, lengths=None, rows=None,
                 valid=None) -> None:
    """Examples' values of one column laid out flat, checked by the rule of ``kind``: ``"ids"`` integers
    ``>= 0``, no empty or null example; ``"labels"`` integers, each a token id or ``-100``; ``"mask"`` 0 or
    1, integers or bools; ``"other"`` integers.

    Example ``i`` is ``values[offsets[i]:offsets[i + 1]]`` (or ``values[starts[i]:][:lengths[i]]``);
    ``valid`` is the ``(n,)`` bool non-null mask of a table column (None: no nulls; a null is an error for
    token ids only); ``rows`` locates errors (:func:`location`).
    ``check_values(np.array([3, -1]), [0, 1, 2], kind="ids", key="input_ids")`` raises
    ``ExampleValueError("example 1 has token id -1 in 'input_ids'; token ids are integers >= 0")``.
    """
    values = np.asarray(values)
    starts, lengths = _spans(offsets, starts, lengths)
    if kind == "ids":
        check_not_null(valid, key=key, rows=rows)
        if lengths.size and lengths.min() == 0:
            raise _empty(int(np.argmin(lengths)), rows, key)
    _check_dtype(values, starts, lengths, key=key, kind=kind, rows=rows)
    any_bad = _ANY_BAD.get(kind)
    if any_bad is not None and any_bad(values):
        error = _locate(values, kind, key, rows, starts=starts, lengths=lengths)
        if error is not None:
            raise error


def check_tokens(values, offsets=None, *, starts=None, lengths=None, key: str = "input_ids", rows=None,
                 valid=None) -> None:
    """Token ids of examples laid out flat: :func:`check_values` with ``kind="ids"``.
    ``check_tokens(np.array([3, -1]), [0, 1, 2])`` raises naming example 1."""
    check_values(values, offsets, kind="ids", key=key, starts=starts, lengths=lengths, rows=rows, valid=valid)


def check_labels(values, offsets=None, *, starts=None, lengths=None, key: str = "labels", rows=None) -> None:
    """Labels laid out flat: :func:`check_values` with ``kind="labels"``."""
    check_values(values, offsets, kind="labels", key=key, starts=starts, lengths=lengths, rows=rows)


def check_mask(values, offsets=None, *, starts=None, lengths=None, key: str = "completion_mask", rows=None) -> None:
    """A loss mask laid out flat: :func:`check_values` with ``kind="mask"``."""
    check_values(values, offsets, kind="mask", key=key, starts=starts, lengths=lengths, rows=rows)


def column_kind(key: str, token_key: str) -> str:
    """The rule column ``key`` follows when ``token_key`` holds the token ids: ``"ids"``, ``"labels"``,
    ``"mask"`` (:data:`MASK_KEYS`) or ``"other"``.
    ``column_kind("completion_mask", "input_ids") -> "mask"``; ``column_kind("seq_lengths", "input_ids") -> "other"``.
    """
    if key == token_key:
        return "ids"
    return "labels" if key == "labels" else "mask" if key in MASK_KEYS else "other"


def check_column(values, offsets, *, kind: str, key: str, rows=None, valid=None, ref_lengths=None,
                 ref_key: str = "input_ids") -> None:
    """One column of examples laid out flat (``values``, ``(n + 1,)`` ``offsets``), every rule of its
    ``kind`` (:func:`column_kind`), in this order: token ids by :func:`check_values`; any other column
    first without a null row (``"other"`` only: a null label or mask is an example without the key),
    then as long as ``ref_key``'s ``ref_lengths`` example by example (:func:`check_aligned`, when given),
    then its values (labels and masks, :func:`check_values`).
    ``check_column(np.array([5, -7]), [0, 2], kind="labels", key="labels", ref_lengths=[2])`` raises
    ``"example 0 has label -7 in 'labels'; ..."``.
    """
    if kind == "ids":
        check_values(values, offsets, kind=kind, key=key, rows=rows, valid=valid)
        return
    if kind == "other":
        check_not_null(valid, key=key, rows=rows)
    if ref_lengths is not None:
        check_aligned(np.diff(offsets), ref_lengths, key=key, ref_key=ref_key, rows=rows, valid=valid)
    if kind != "other":
        check_values(values, offsets, kind=kind, key=key, rows=rows)


def check_not_null(valid, *, key: str, rows=None) -> None:
    """No null row in a column every example needs (``valid``: the ``(n,)`` non-null mask, or None)."""
    if valid is not None and not np.all(valid):
        raise _null_tokens(int(np.argmin(valid)), rows, key)


def check_aligned(lengths, ref_lengths, *, key: str, ref_key: str = "input_ids", rows=None, valid=None) -> None:
    """Every example has as many ``key`` entries as ``ref_key`` tokens (rows where ``valid`` is False,
    nulls, are skipped: they have no ``key``). ``check_aligned([2, 1], [2, 2], key="labels")`` raises
    ``"example 1 has 1 'labels' for 2 'input_ids'; they must match token for token"``."""
    lengths, ref_lengths = np.asarray(lengths), np.asarray(ref_lengths)
    bad = lengths != ref_lengths
    if valid is not None:
        bad &= valid
    if bad.any():
        i = int(np.argmax(bad))
        raise _length(i, rows, key, int(lengths[i]), ref_key, int(ref_lengths[i]))


# ----------------------------------------------------------------------------------------------
# Arrow list columns
# ----------------------------------------------------------------------------------------------


def _pa():
    try:
        import pyarrow
    except ImportError:  # pragma: no cover - pyarrow comes with the datasets extra
        raise ImportError("reading Arrow columns needs pyarrow: pip install 'packkit[datasets]'") from None
    return pyarrow


def _is_list(pa, t) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def list_chunks(column, *, key: str = "input_ids", kind: str = "ids", rows: int = 0):
    """The chunks of an Arrow list column as numpy: yields ``(values, offsets, valid, first_row)``.

    ``values`` are the chunk's flat values (zero-copy for integers without nulls), ``offsets`` its
    ``(n + 1,)`` int64 offsets from 0, ``valid`` the ``(n,)`` bool non-null mask or None, ``first_row``
    the dataset row of the chunk's first example (``rows`` is the column's). The column's type is
    checked first (a list of integers; of integers or bools for ``kind="mask"``; not nested; not
    floats or text), and a null inside a list is refused; the error names the first example concerned.
    ``list(list_chunks(pa.array([[5, 6], [7]])))`` -> ``[(array([5, 6, 7]), array([0, 2, 3]), None, 0)]``.
    """
    pa = _pa()
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    t = column.type
    if pa.types.is_null(t):  # every row null: no example has this key
        base = rows
        for chunk in chunks:
            n = len(chunk)
            yield np.zeros(0, np.int64), np.zeros(n + 1, np.int64), np.zeros(n, bool), base
            base += n
        return
    if not _is_list(pa, t):
        raise TypeError(f"column {key!r} holds {t}, not lists of token ids: map your tokenizer so that each "
                        "row holds a list")
    vt = t.value_type
    base = rows
    for chunk in chunks:
        n = len(chunk)
        if pa.types.is_fixed_size_list(chunk.type):
            chunk = chunk.cast(pa.list_(vt))
        offsets = chunk.offsets.to_numpy().astype(np.int64)
        child = chunk.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        offsets -= offsets[0]
        valid = np.asarray(chunk.is_valid()) if chunk.null_count else None
        if _is_list(pa, vt):
            i = _first_nonempty(offsets, valid)
            if i is not None:
                raise _nested(base + i - rows, rows, key, f"Arrow type {t}")
            values = np.zeros(0, np.int64)
        elif pa.types.is_null(vt):  # every list empty (or null)
            values = np.zeros(0, np.int64)
        elif pa.types.is_integer(vt) or pa.types.is_boolean(vt) or pa.types.is_floating(vt):
            if child.null_count:
                bad = np.flatnonzero(~np.asarray(child.is_valid()))[0]
                raise _null_inside(base - rows + int(np.searchsorted(offsets, bad, side="right") - 1), rows, key)
            values = child.to_numpy(zero_copy_only=False)
            if values.dtype.kind not in "iu":
                starts, lengths = offsets[:-1], np.diff(offsets)
                _check_dtype(values, starts, lengths, key=key, kind=kind, rows=base)
        else:
            i = _first_nonempty(offsets, valid)
            if i is not None:
                raise _not_integer(base + i - rows, rows, key, kind, child[0].as_py())
            values = np.zeros(0, np.int64)
        yield values, offsets, valid, base
        base += n


def _first_nonempty(offsets, valid):
    ne = np.diff(offsets) > 0
    if valid is not None:
        ne &= valid
    return int(np.argmax(ne)) if ne.any() else None


def token_lengths(column, *, key: str = "input_ids", rows: int = 0) -> np.ndarray:
    """``(n,)`` int64 lengths of a token-id list column, every rule checked (:func:`check_values`) on
    the way: what ``packkit waste`` measures is what ``packkit pack`` accepts.
    ``token_lengths(pa.array([[5, 6], [7]])) -> [2, 1]``; ``[[5], [-1]]`` raises naming row 1."""
    out = []
    for values, offsets, valid, first in list_chunks(column, key=key, kind="ids", rows=rows):
        check_values(values, offsets, kind="ids", key=key, rows=first, valid=valid)
        out.append(np.diff(offsets))
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def loss_lengths(table, lengths=None, *, key: str = "input_ids", rows: int = 0) -> np.ndarray | None:
    """Loss tokens of every example of an Arrow table, as a packed batch counts them, or None when the
    table has neither ``labels`` nor a loss mask (:data:`MASK_KEYS`).

    A position counts when it is not the example's first (the model shifts labels), its label (the
    token id when the example has no labels) is not -100, and every loss mask the example carries is 1.
    Labels and masks follow the rules (values, lengths); a null is a key the example does not have.
    ``labels [[-100, 7, 8], [9, -100]]`` -> ``[2, 0]``. ``(n,)`` int64.
    """
    if not _loss_keys(table):
        return None
    if lengths is None:
        lengths = token_lengths(table.column(key), key=key, rows=rows)
    lengths = np.asarray(lengths, np.int64)
    offsets = lengths_to_offsets(lengths)
    loss = np.ones(int(offsets[-1]), bool)
    for kind, span, values, given in _loss_columns(table, lengths, offsets, key=key, rows=rows):
        keep = values != (IGNORE_INDEX if kind == "labels" else 0)
        if given is not None:  # a null row has no such key: every one of its tokens is kept
            keep |= ~given
        loss[span] &= keep
    loss[offsets[:-1]] = False  # the first token of an example is never a target
    csum = lengths_to_offsets(loss)  # loss tokens before each flat index
    return csum[offsets[1:]] - csum[offsets[:-1]]


def table_labels(table, *, key: str = "input_ids", rows: int = 0) -> np.ndarray | None:
    """The labels of every example of an Arrow table, flat and laid out like its token column, or None
    when it has neither ``labels`` nor a loss mask: each example's labels (its token ids when it has
    none, a null included), ``-100`` where any loss mask it carries is 0 (no first-label masking).
    Every rule is checked; errors name the dataset row (``rows`` is the table's first).
    ``labels [[5, -100], null]``, ``input_ids [[5, 6], [7]]`` -> ``[5, -100, 7]`` (int64).
    """
    if not _loss_keys(table):
        return None
    tok = [(values, off) for values, off, _, _ in list_chunks(table.column(key), key=key, rows=rows)]
    ids = np.concatenate([v for v, _ in tok]) if len(tok) != 1 else tok[0][0]
    lengths = np.concatenate([np.diff(o) for _, o in tok]) if tok else np.zeros(0, np.int64)
    offsets = lengths_to_offsets(lengths)
    labels = ids.astype(np.int64)
    for kind, span, values, given in _loss_columns(table, lengths, offsets, key=key, rows=rows):
        out = labels[span]
        if kind == "labels":  # an example without labels (a null row) keeps its token ids
            if given is None:
                out[:] = values
            else:
                out[given] = values[given]
        else:
            drop = values == 0
            if given is not None:  # an example without this mask (a null row) keeps every label
                drop &= given
            out[drop] = IGNORE_INDEX
    return labels


def _loss_keys(table) -> list:
    """The columns of ``table`` that decide the loss: ``labels``, then :data:`MASK_KEYS`, those present."""
    names = table.column_names
    return [k for k in ("labels", *MASK_KEYS) if k in names]


def _loss_columns(table, lengths: np.ndarray, offsets: np.ndarray, *, key: str, rows: int):
    """The loss columns of ``table`` (:func:`_loss_keys`) a chunk at a time, each checked against its rule
    and the token column's ``lengths`` (:func:`check_column`; errors name the dataset row): yields
    ``(kind, span, values, given)``, ``span`` the chunk's slice of the flat token layout (``offsets``),
    ``values`` the chunk's values laid out like it and ``given`` None, or where a chunk has null rows
    (examples without the key), the positions of the rows with a value (:func:`_lay_out`)."""
    for k in _loss_keys(table):
        kind = column_kind(k, key)
        done = 0
        for values, off, valid, first in list_chunks(table.column(k), key=k, kind=kind, rows=rows):
            m = off.size - 1
            ref = lengths[done: done + m]
            check_column(values, off, kind=kind, key=k, rows=first, valid=valid, ref_lengths=ref, ref_key=key)
            given = None
            if valid is not None:
                values, given = _lay_out(values, off, valid, ref)
            yield kind, slice(offsets[done], offsets[done + m]), values, given
            done += m


def _lay_out(values: np.ndarray, offsets: np.ndarray, valid: np.ndarray, lengths: np.ndarray):
    """A chunk of a column with null rows (which hold no values), laid out like ``lengths`` (the token
    column's): ``(laid, given)``, ``given`` the ``(sum(lengths),)`` bool positions of the rows with a
    value, ``laid`` their values there and 0 elsewhere. Those rows are as long as ``lengths`` says
    (:func:`check_aligned`), so one ``np.repeat`` of ``valid`` on each side gathers them all (measured
    78 ms against 493 ms for a copy row by row, 1M rows with 10% null): ``values [5, 6]``, ``offsets
    [0, 0, 2]``, ``valid [F, T]``, ``lengths [1, 2]`` -> ``[0, 5, 6]``, ``[F, T, T]``."""
    given = np.repeat(valid, lengths)
    laid = np.zeros(given.size, values.dtype)
    laid[given] = values[np.repeat(valid, np.diff(offsets))]
    return laid, given


# ----------------------------------------------------------------------------------------------
# one Python example (streaming packing)
# ----------------------------------------------------------------------------------------------


def example_arrays(ex, keys, *, index: int, rows=None) -> dict:
    """One Python example's columns ``keys`` (the token column first) as checked 1-D numpy arrays.

    Every column follows its rule (:func:`column_kind`, :func:`check_column`); other columns must be
    integers (bools kept). A key other than the token column that the
    example lacks (or holds None) is left out of the result: the example does not have it.
    ``example_arrays({"input_ids": [5, 6]}, ["input_ids", "labels"], index=0) -> {"input_ids": array([5, 6])}``.
    """
    if not isinstance(ex, collections.abc.Mapping):
        raise _error(ExampleTypeError, index, rows, f"is a {type(ex).__name__}, not a dict with 'input_ids'")
    out, first = {}, None
    for j, key in enumerate(keys):
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
            raise _error(type(exc), index, rows, exc.text) from None
        out[key] = arr
        if j == 0:
            first = arr
    return out


def _one_array(v, i, rows, key, kind) -> np.ndarray:
    """One example's column as a 1-D integer (or bool) numpy array, or the error that names it. A list
    (or tuple) becomes an array here, bools kept as bools in a mask or an ``"other"`` column."""
    if isinstance(v, (list, tuple)):
        if kind not in _BOOL_KINDS and any(isinstance(x, (bool, np.bool_)) for x in v):
            raise _not_integer(i, rows, key, kind, next(x for x in v if isinstance(x, (bool, np.bool_))))
        try:
            arr = np.asarray(v)
        except ValueError:  # ragged nesting
            raise _nested(i, rows, key, "lists of different lengths inside") from None
        if arr.dtype == object:
            bad = next((x for x in v if isinstance(x, (list, tuple, np.ndarray))), None)
            if bad is not None:
                raise _nested(i, rows, key, f"a {type(bad).__name__} inside a list")
            raise _not_integer(i, rows, key, kind, next(x for x in v if not isinstance(x, numbers.Integral)))
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
        raise _error(ExampleTypeError, i, rows, f"has a {type(x).__name__} in {key!r}; pass a list, numpy array "
                     "or tensor of integers")
    if x.ndim != 1:
        raise _nested(i, rows, key, f"shape {x.shape}")
    k = x.dtype.kind
    if k not in "iu" and not (k == "b" and kind in _BOOL_KINDS):
        if x.size == 0:
            return x.astype(np.int64)
        raise _not_integer(i, rows, key, kind, x[int(np.argmax(_not_integral(x)))] if k == "f" else x[0])
    return x


#: Kinds whose columns may hold bools (kept as bools when read one example at a time).
_BOOL_KINDS = ("mask", "other")


def _is_tensor(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _missing(i, rows, ex, key):
    return _error(ExampleValueError, i, rows,
                  f"has no {key!r} (keys: {sorted(map(str, ex))}); every example needs its token ids")


# ----------------------------------------------------------------------------------------------
# a batch of Python examples: the collators' hot path
# ----------------------------------------------------------------------------------------------


def read_examples(examples, *, need_labels: bool = False, loss_mask: str = "auto", rows=None):
    """Examples -> ``(input_ids, labels, lengths)``: ``(T,)`` int64, ``(T,)`` int64 (writable), ``(n,)`` int64.

    ``examples`` is a list of mappings (dicts of lists, numpy arrays or tensors), or an
    :class:`ExampleBatch` (columns; its dataset rows locate errors). ``labels`` are each example's own
    labels or token ids, ``-100`` where a loss mask it carries is 0 (module docstring); no first-label
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
    "loss on every token", and a :class:`LossMaskWarning` says so once per ``warned`` holder (a one-item
    list the collator keeps: ``[False]`` before the warning): that is what a ``transformers.Trainer``
    with its default ``remove_unused_columns=True`` turns masked data into, and the warning names the
    setting. ``loss_mask="none"`` (pretraining: every token a target) never warns; ``"required"`` raises
    instead. Returns ``(input_ids, labels, lengths)``.
    """
    ids, labels, lengths, supervised = _read(examples, need_labels, loss_mask, None)
    if not supervised and loss_mask == "auto" and warned is not None and not warned[0]:
        warned[0] = True
        import warnings

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
    """The rules of a batch (module docstring), written once, in this order: token ids not null, not
    empty, not negative; labels (each example's own, else its token ids; ``need_labels``) by their rule;
    each of :data:`MASK_KEYS` (an error under ``mode="none"``; ones for the examples without it) by its
    rule, ``-100`` where it is 0; then ``mode="required"``: every example carries a mask.

    ``form`` reads the columns, :class:`_Dicts` (Python examples) or :class:`_Columns` (an
    :class:`ExampleBatch`): ``ids()`` every example's token ids; ``read_ids(xs, kinds)`` ``(parts, lengths
    list, first empty example or None)``; ``get(key)`` every example's ``key`` (None where it lacks it)
    or None; ``join(key, kind, parts, kinds)`` a column as checked ``(T,)`` int64, as long as the token
    ids; ``lengths_array()``. Returns ``(input_ids, labels, lengths, supervised)`` (``supervised``: some
    example carried labels or a loss mask). Every check is one vectorised pass over the batch; the
    offending example is located (:func:`_locate`) only when one fails.
    """
    rows = form.rows
    xs = form.ids()
    kinds = set(map(type, xs))
    if _NONE in kinds:
        raise _null_tokens(_first_none(xs), rows, "input_ids")
    ids, lengths, empty = form.read_ids(xs, kinds)
    if empty is not None:
        raise _empty(empty, rows)
    input_ids = form.join("input_ids", "ids", ids)
    if any_bad_id(input_ids):
        raise _locate(input_ids, "ids", "input_ids", rows, lengths=lengths)
    xs = form.get("labels")
    kinds = _NO_KEY if xs is None else set(map(type, xs))
    supervised = kinds != _NO_KEY  # a key every example holds as None is a key none of them has
    if supervised:
        if _NONE in kinds:  # examples without labels: their token ids are their labels
            if need_labels:
                raise _no_labels(_first_none(xs), rows)
            xs, kinds = [p if x is None else x for x, p in zip(xs, ids)], None
        labels = form.join("labels", "labels", xs, kinds)
        if any_bad_label(labels):
            raise _locate(labels, "labels", "labels", rows, lengths=lengths)
    else:
        if need_labels:
            raise _no_labels(0, rows)
        labels = input_ids.copy()
    masked = None  # per example: it carries a loss mask (None: no example does)
    for key in MASK_KEYS:
        xs = form.get(key)
        kinds = _NO_KEY if xs is None else set(map(type, xs))
        if kinds == _NO_KEY:
            continue
        if mode == "none":
            raise _mask_not_expected(next(i for i, x in enumerate(xs) if x is not None), rows, key)
        if _NONE in kinds:  # examples without this mask: loss on every token
            has = [x is not None for x in xs]
            masked = has if masked is None else [a or b for a, b in zip(masked, has)]
            xs, kinds = [(([1] * k) if type(p) is list else np.ones(k, np.int8)) if x is None else x
                         for x, p, k in zip(xs, ids, lengths)], None
        else:
            masked = [True] * len(xs)
        mask = form.join(key, "mask", xs, kinds)
        if any_bad_mask(mask):
            raise _locate(mask, "mask", key, rows, lengths=lengths)
        labels[mask == 0] = IGNORE_INDEX
    if mode == "required" and (masked is None or not all(masked)):
        raise _no_mask(0 if masked is None else masked.index(False), rows)
    return input_ids, labels, form.lengths_array(), supervised or masked is not None


class _Dicts:
    """Column access over Python examples (a list of mappings of lists, numpy arrays or tensors) for
    :func:`_read_rules`. A column's parts are checked as they are read, with C-level ``map``/``set``
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
                    raise _error(ExampleTypeError, i, self.rows,
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
    ids, then by dtype and shape over the batch, and joined by one ``np.concatenate`` (:func:`_join_arrays`).
    The lengths are compared as a list: measured 0.3 us against 2.4 us for ``np.array_equal`` at 8 examples,
    1.1 against 3.3 at 32."""

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


def _first_none(xs: list) -> int:
    return next(i for i, x in enumerate(xs) if x is None)


_NONE = type(None)
_NO_KEY = {_NONE}
_INT_DTYPES = frozenset(np.dtype(t) for t in (np.int64, np.int32, np.int16, np.int8, np.uint8, np.uint16,
                                                  np.uint32, np.uint64))
_MASK_DTYPES = _INT_DTYPES | {np.dtype(np.bool_)}
_first_item = operator.itemgetter(0)
_dtype_of = operator.attrgetter("dtype")
_ndim_of = operator.attrgetter("ndim")
_ONE = {1}
_LIST, _NDARRAY = {list}, {np.ndarray}
_INT_ITEM, _MASK_ITEMS = {int}, {int, bool}


def _values(examples, key: str) -> list:
    """Every example's ``key``, None where an example lacks it."""
    try:
        return [ex[key] for ex in examples]
    except KeyError:
        return [ex.get(key) for ex in examples]


def _parts(xs: list, key: str, kind: str, rows, kinds=None) -> tuple[list, list, str]:
    """One column of every example: ``(parts, lengths, layout)``, each part a list or a 1-D integer
    array, ``layout`` ``"lists"``, ``"arrays"`` or ``"mixed"``. Checks run over the whole column with
    C-level ``map``/``set`` (no per-example Python statements) and fall back to a checked loop that
    names the offending example. ``_parts([[5, 6]], "input_ids", "ids", None) -> ([[5, 6]], [2], "lists")``.
    ``kinds``: ``set(map(type, xs))`` when the caller has it.
    """
    if kinds is None:
        kinds = set(map(type, xs))
    if kinds == _LIST:
        lengths = list(map(len, xs))
        if 0 not in lengths and set(map(type, map(_first_item, xs))) <= (_MASK_ITEMS if kind == "mask"
                                                                          else _INT_ITEM):
            return xs, lengths, "lists"
    elif kinds == _NDARRAY:
        # ndim is checked where it is cheap: len() of a 0-d array raises, and a 2-D array makes the
        # concatenation fail; both fall back to the checked loop below, which names the example.
        if set(map(_dtype_of, xs)) <= (_MASK_DTYPES if kind == "mask" else _INT_DTYPES):
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
                if kind == "mask" and isinstance(first, (bool, np.bool_)):
                    return x, len(x), True
                if isinstance(first, (list, tuple, np.ndarray)) or _is_tensor(first):
                    raise _nested(i, rows, key, f"a {type(first).__name__} inside a list")
                raise _not_integer(i, rows, key, kind, first)
        return x, len(x), True
    if isinstance(x, tuple):
        return _column(list(x), i, key, kind, rows)
    x = _checked_array(x, i, key, kind, rows)
    return x, x.shape[0], False


def _join_arrays(parts: list, key: str, kind: str, rows, total: int | None = None) -> np.ndarray:
    """Every example's part of a column, 1-D integer numpy arrays (bools too in a mask), joined into one
    writable ``(total,)`` int64 array (``total``: the sum of their lengths, counted when None). The
    dtypes and shapes are tested over the batch with C-level ``map``/``set`` first, then the error names
    the first part that fails (:func:`_column`)."""
    if not set(map(_dtype_of, parts)) <= (_MASK_DTYPES if kind == "mask" else _INT_DTYPES) \
            or set(map(_ndim_of, parts)) != _ONE:
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
        cand = (out.view(np.uint64) <= 1).nonzero()[0]  # out is 1-D: 0.9 us less than np.flatnonzero's wrapper
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
    rejects floats instead of truncating them); bools are rejected unless ``kind == "mask"``.
    Arrays: one ``np.concatenate``. ``_concat([[1], [2, 3]], "lists", 3, "input_ids", "ids", None) -> [1, 2, 3]``.
    """
    out = np.empty(total, np.int64)
    bools_ok = kind == "mask"
    try:
        if layout == "lists":
            flat: list = []
            for p in parts:
                flat += p
            _list_into(flat, out, bools_ok)
            return out
        if layout == "mixed":  # lists mixed with arrays: each list through struct
            parts = [p if isinstance(p, np.ndarray) else _list_array(p, bools_ok) for p in parts]
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
                    raise _error(ExampleValueError, i, rows, f"has {v} in {key!r}, outside int64; {RULES[kind]}")
                continue
            if isinstance(v, (bool, np.bool_)):
                if kind == "mask":
                    continue
                raise _not_integer(i, rows, key, kind, v)
            if isinstance(v, (list, tuple, np.ndarray)) or _is_tensor(v):
                raise _nested(i, rows, key, f"a {type(v).__name__} inside a list")
            if not isinstance(v, numbers.Integral):
                raise _not_integer(i, rows, key, kind, v)


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
    if _NONE in set(map(type, xs)):
        i = next(i for i, x in enumerate(xs) if x is None)
        raise _error(ExampleValueError, i, rows, f"has no {key!r}; {missing}")
    parts, lengths, layout = _parts(xs, key, "ids", rows)
    return _concat(parts, layout, sum(lengths), key, "ids", rows), np.array(lengths, np.int64)


def _same_lengths(got: list, lengths: list, key: str, rows) -> None:
    if got != lengths:
        i = next(i for i, (a, b) in enumerate(zip(got, lengths)) if a != b)
        raise _length(i, rows, key, got[i], "input_ids", lengths[i])


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

