"""The rules every example is read by, and their wording: one home for both.

An example is a mapping (or one row of a table) with these keys::

    key               holds                              rule
    input_ids         token ids                          integers >= 0, at least one
    labels            the target of each token           token ids (>= 0) or -100 (no loss), one per token
    completion_mask   loss only where 1 (TRL's names:    0 or 1 (bools too), one per token
    assistant_masks   MASK_KEYS)
    attention_mask    the tokenizer's padding mask       1 only (all ones is ignored), one per token: a 0 is a pad
                      (ATTENTION_MASK_KEY)               token of padding=True, refused (packing pads nothing)

No list may be nested (a ``[1, n]`` tokenizer output is one example: squeeze it) and no value may be
a float, NaN, a bool or text where an integer belongs. Every error a user can cause names where the
example is and how to fix it, in one wording per rule::

    example 3 has label -7 in 'labels'; labels are token ids (>= 0) or -100 (no loss)
    dataset row 81204 has 1.5 (float) in 'input_ids'; token ids are integers >= 0
    dataset row 7 has 2 in the loss mask 'completion_mask'; a loss mask holds 1 (loss) or 0 (no loss)
    example 3 has an attention_mask with 2 zeros (padding from the tokenizer): packing would train on ...

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

Here the rules are checked on flat values (a column's values laid out end to end, with offsets):
:func:`check_column` (:func:`check_values` by :func:`column_kind`, :func:`check_aligned`). The readers
apply them: :mod:`packkit.listcolumns` (Arrow list columns) and :mod:`packkit.examples` (Python
examples, and the collators' batches). numpy only. Where an example is and the errors that say so are
:mod:`packkit.located`; the rules of what an example carries beside its token columns (a packed row's documents,
groups, per-example values, media grids) :mod:`packkit.row_rules`, off the path of a reader of token ids: this module
lends the names of both under their old address (``packkit.rules.row_segments``).
"""

from __future__ import annotations

import numpy as np

from .length_rules import _INT64_FIX, INT64_MAX, as_lengths, check_loss_lengths  # their home, re-exported
from .segments import IGNORE_INDEX, lengths_to_offsets

__all__ = [
    "MASK_KEYS",
    "ATTENTION_MASK_KEY",
    "DOCUMENT_KEYS",
    "as_lengths",
    "check_groups",
    "example_values",
    "grid_rows",
    "relocate_part",
    "ExampleTypeError",
    "ExampleValueError",
    "LossMaskWarning",
    "check_column",
    "column_kind",
    "location",
    "relocate",
]

#: The rules of what an example carries beside its token columns, at home in :mod:`packkit.row_rules` (a reader of
#: plain token ids does not compile them) and lent here under their old address (``packkit.rules.row_segments``).
_ROW_RULES = frozenset({"row_segments", "check_groups", "relocate_part", "example_values", "grid_rows"})


#: The errors that name an example and their wording, at home in :mod:`packkit.located` (a file that reads compiles
#: none of them), lent here under their old address (``_Located``, ``_located_again``: errors pickled before the move).
_LOCATED = frozenset({"ExampleTypeError", "ExampleValueError", "located", "location", "not_integral", "relocate",
                      "value_text", "where_of", "_Located", "_located_again"})


def _at():
    """:mod:`packkit.located`, imported where an error about an example is made (or a float checked)."""
    from . import located  # lazy: the errors that name an example, where one is raised
    return located


def __getattr__(name: str):
    """The names of :mod:`packkit.row_rules` and :mod:`packkit.located`, lent under their old address, imported where
    first asked for."""
    if name in _ROW_RULES:
        from . import row_rules  # lazy: packed rows, groups, values and grids, off a reader of token ids
        return getattr(row_rules, name)
    if name in _LOCATED:
        return getattr(_at(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Keys read as a loss mask (TRL's names): loss only where the mask is 1. The one definition.
MASK_KEYS = ("completion_mask", "assistant_masks")

#: The key of a Hugging Face tokenizer's attention mask. ``tokenizer(texts, padding=True)`` puts 0 at the pad
#: positions it adds; packed as content, those pads would be attended to and carry the loss, so an example whose
#: attention mask holds a 0 is refused (:func:`padded_example`); all ones (a tokenizer without padding) is ignored.
ATTENTION_MASK_KEY = "attention_mask"

#: Kinds of column whose values are flags, 0 or 1 (bools too): loss masks and the attention mask.
FLAG_KINDS = ("mask", "attention")

#: ``loss_mask=`` of the collators (see :func:`~packkit.examples.read_batch`): ``"auto"`` honours a mask
#: where an example has one and warns once when a whole batch has neither labels nor a mask; ``"required"`` makes an
#: example without a mask an error; ``"none"`` says no mask is expected (a mask is then an error).
LOSS_MASK_MODES = ("auto", "required", "none")

#: The rule each kind of column follows, as every error states it.
RULES = {
    "ids": "token ids are integers >= 0",
    "labels": f"labels are token ids (>= 0) or {IGNORE_INDEX} (no loss)",
    "mask": "a loss mask holds 1 (loss) or 0 (no loss)",
    "attention": "an attention_mask holds 1 (a token) or 0 (padding)",
    "other": "a packed column holds integers or bools, one per token",
}
_NESTED_FIX = "pass one flat list per example (squeeze a [1, n] tokenizer output)"


# ----------------------------------------------------------------------------------------------
# the errors of each rule (located: packkit.located)
# ----------------------------------------------------------------------------------------------


def _value_error(i, rows, text: str, **facts):
    """:class:`~packkit.located.ExampleValueError` about example ``i`` (:func:`~packkit.located.located`)."""
    at = _at()
    return at.located(at.ExampleValueError, i, rows, text, **facts)


def _type_error(i, rows, text: str, **facts):
    """:class:`~packkit.located.ExampleTypeError` about example ``i`` (:func:`~packkit.located.located`)."""
    at = _at()
    return at.located(at.ExampleTypeError, i, rows, text, **facts)


def not_integer(i, rows, key: str, kind: str, v):
    """``has 1.5 (float) in 'input_ids'; token ids are ...``: the value, its column and rule kept as fields."""
    return _type_error(i, rows, f"has {_at().value_text(v)} in {key!r}; {RULES[kind]}", value=v, key=key,
                   kind=kind)


def nested(i, rows, key: str, detail: str):
    return _type_error(i, rows, f"has a nested list in {key!r} ({detail}); {_NESTED_FIX}")


def beyond_int64(i, rows, key: str, kind: str, v):
    """A value packkit cannot keep: token ids and labels are written as int64 (2**64 - 1 would read back
    as -1), and a JSON integer past int64 arrives as a float; never cast silently."""
    return _value_error(i, rows, f"has {_at().value_text(v)} in {key!r}, beyond int64 ({_INT64_FIX}); "
                   f"{RULES[kind]}")


def _negative(i, rows, key: str, v):
    return _value_error(i, rows, f"has token id {v} in {key!r}; {RULES['ids']}")


def _bad_label(i, rows, key: str, v):
    return _value_error(i, rows, f"has label {v} in {key!r}; {RULES['labels']}")


def _bad_mask(i, rows, key: str, v):
    return _value_error(i, rows, f"has {v} in the loss mask {key!r}; {RULES['mask']}")


def _bad_attention(i, rows, key: str, v):
    return _value_error(i, rows, f"has {v} in {key!r}; {RULES['attention']}")


def padded_example(i, rows, key: str, zeros: int):
    """``example 3 has an attention_mask with 2 zeros (padding from the tokenizer): ...``: the fix named."""
    return _value_error(i, rows, f"has an {key} with {zeros} zero{'s' if zeros != 1 else ''} (padding from the "
                        "tokenizer): packing would train on the pad tokens as content; tokenize without padding "
                        "(padding=False; packkit pads nothing), or drop the pad positions")


def empty_example(i, rows, key: str = "input_ids"):
    return _value_error(i, rows, f"is empty (0 tokens in {key!r}); filter empty examples out first")


def length_mismatch(i, rows, key: str, got: int, ref_key: str, want: int):
    return _value_error(i, rows,
                        f"has {got} {key!r} for {want} {ref_key!r}; they must match token for token")


def null_tokens(i, rows, key: str):
    return _value_error(i, rows, f"has no {key!r} (null); drop the example or fill it")


def null_inside(i, rows, key: str):
    return _value_error(i, rows, f"has a null inside {key!r}; every token needs a value")


def no_labels(i, rows):
    return _value_error(i, rows,
                        "has no 'labels'; mask_first_label=False means labels are pre-shifted and every example "
                        "needs them (labels[i] = the target of token i, -100 at each example's end)")


def no_mask(i, rows):
    return _value_error(i, rows,
                        f"has no loss mask ({' or '.join(repr(k) for k in MASK_KEYS)}) and loss_mask='required': "
                        "transformers.Trainer drops the columns its model's forward does not name, so pass "
                        "TrainingArguments(remove_unused_columns=False) or train_dataset=packkit.columnar."
                        "ColumnarDataset(ds); if this example has no prompt to mask, collate with loss_mask='auto'")


def mask_not_expected(i, rows, key):
    return _value_error(i, rows,
                        f"has a loss mask {key!r} and loss_mask='none' (every token a target); collate with "
                        "loss_mask='auto' to honour it")


class LossMaskWarning(UserWarning):
    """A batch carried neither labels nor a loss mask (see :func:`~packkit.examples.read_batch`)."""


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
_ANY_BAD = {"ids": any_bad_id, "labels": any_bad_label, "mask": any_bad_mask, "attention": any_bad_mask}
_BAD_AT = {
    "ids": lambda v: v < 0,
    "labels": lambda v: (v < 0) & (v != IGNORE_INDEX),
    "mask": lambda v: (v != 0) & (v != 1),
    "attention": lambda v: (v != 0) & (v != 1),
}
_BAD_VALUE = {"ids": _negative, "labels": _bad_label, "mask": _bad_mask, "attention": _bad_attention}
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


def check_dtype(values: np.ndarray, starts, lengths, *, key: str, kind: str, rows, culprit_only: bool = False) -> None:
    """Integer values that int64 holds (bools too in a mask); the error names the first value of the
    first example that breaks the rule: ``uint64`` past ``2**63 - 1``, a float that is not an integer,
    or one past int64 (a JSON integer too large for int64 arrives as a float: its own row, not row 0).
    Floats that are all integers are refused at the first, unless ``culprit_only``."""
    k = values.dtype.kind
    if not values.size:
        return  # no values in any example: nothing to refuse
    if k == "u" and values.dtype.itemsize == 8 and kind not in FLAG_KINDS and values.max() > INT64_MAX:
        found = _first_with(values > INT64_MAX, starts, lengths)
        if found is not None:
            raise beyond_int64(found[0], rows, key, kind, values[found[1]])
    if k in "iu" or (k == "b" and kind in FLAG_KINDS):
        return
    found = None
    if k == "f":  # the first value that is not an integer (NaN included), as the Python reader reports it
        found = _first_with(_at().not_integral(values) | (np.abs(values) >= 2.0 ** 63), starts, lengths)
        if found is not None and np.isfinite(values[found[1]]) and abs(values[found[1]]) >= 2.0 ** 63:
            raise beyond_int64(found[0], rows, key, kind, values[found[1]])
    if found is None and not culprit_only:
        found = _first_with(np.ones(values.size, bool), starts, lengths)
    if found is not None:
        raise not_integer(found[0], rows, key, kind, values[found[1]])


def locate(values: np.ndarray, kind: str, key: str, rows, *, offsets=None, starts=None, lengths=None):
    """The error about the first example (in order) holding a value that breaks ``kind``'s rule, or None
    when only values outside every example do (rows not selected name nobody). The error path only.
    ``locate(np.array([3, -1]), "ids", "input_ids", None, lengths=[1, 1])`` is the error about example 1.
    """
    starts, lengths = _spans(offsets, starts, lengths)
    found = _first_with(_BAD_AT[kind](values), starts, lengths)
    return None if found is None else _BAD_VALUE[kind](found[0], rows, key, int(values[found[1]]))


def check_values(values, offsets=None, *, kind: str, key: str, starts=None, lengths=None, rows=None,
                 valid=None, empty_ok: bool = False) -> None:
    """Examples' values of one column laid out flat, checked by the rule of ``kind``: ``"ids"`` integers
    ``>= 0``, no empty or null example; ``"labels"`` integers, each a token id or ``-100``; ``"mask"`` 0 or
    1, integers or bools; ``"attention"`` (:data:`ATTENTION_MASK_KEY`) the same, then no 0 in an example (a pad
    token, :func:`padded_example`); ``"other"`` integers.

    Example ``i`` is ``values[offsets[i]:offsets[i + 1]]`` (or ``values[starts[i]:][:lengths[i]]``);
    ``valid`` is the ``(n,)`` bool non-null mask of a table column (None: no nulls; a null is an error for
    token ids only); ``rows`` locates errors (:func:`location`); ``empty_ok``: token ids of none are fine (a
    preference pair's prompt).
    ``check_values(np.array([3, -1]), [0, 1, 2], kind="ids", key="input_ids")`` raises
    ``ExampleValueError("example 1 has token id -1 in 'input_ids'; token ids are integers >= 0")``.
    """
    values = np.asarray(values)
    starts, lengths = _spans(offsets, starts, lengths)
    if kind == "ids":
        check_not_null(valid, key=key, rows=rows)
        if lengths.size and lengths.min() == 0 and not empty_ok:
            raise empty_example(int(np.argmin(lengths)), rows, key)
    check_dtype(values, starts, lengths, key=key, kind=kind, rows=rows)
    any_bad = _ANY_BAD.get(kind)
    if any_bad is not None and any_bad(values):
        error = locate(values, kind, key, rows, starts=starts, lengths=lengths)
        if error is not None:
            raise error
    if kind == "attention" and values.size and not values.all():  # 0 or 1 by now: a 0 is a pad token
        found = _first_with(values == 0, starts, lengths if valid is None else np.where(valid, lengths, 0))
        if found is not None:
            s, n = int(starts[found[0]]), int(lengths[found[0]])
            raise padded_example(found[0], rows, key, int(np.count_nonzero(values[s: s + n] == 0)))


def column_kind(key: str, token_key: str) -> str:
    """The rule column ``key`` follows when ``token_key`` holds the token ids: ``"ids"``, ``"labels"``,
    ``"mask"`` (:data:`MASK_KEYS`), ``"attention"`` (:data:`ATTENTION_MASK_KEY`) or ``"other"``.
    ``column_kind("completion_mask", "input_ids") -> "mask"``; ``column_kind("seq_lengths", "input_ids") -> "other"``.
    """
    if key == token_key:
        return "ids"
    if key == ATTENTION_MASK_KEY:
        return "attention"
    return "labels" if key == "labels" else "mask" if key in MASK_KEYS else "other"


def check_column(values, offsets, *, kind: str, key: str, rows=None, valid=None, ref_lengths=None,
                 ref_key: str = "input_ids") -> None:
    """One column of examples laid out flat (``values``, ``(n + 1,)`` ``offsets``), every rule of its
    ``kind`` (:func:`column_kind`), in this order: token ids by :func:`check_values`; any other column
    first without a null row (``"other"`` only: a null label or mask is an example without the key),
    then as long as ``ref_key``'s ``ref_lengths`` example by example (:func:`check_aligned`, when given),
    then its values (labels, masks and the attention mask, :func:`check_values`).
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
        check_values(values, offsets, kind=kind, key=key, rows=rows, valid=valid)


def check_not_null(valid, *, key: str, rows=None) -> None:
    """No null row in a column every example needs (``valid``: the ``(n,)`` non-null mask, or None)."""
    if valid is not None and not np.all(valid):
        raise null_tokens(int(np.argmin(valid)), rows, key)


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
        raise length_mismatch(i, rows, key, int(lengths[i]), ref_key, int(ref_lengths[i]))

# ----------------------------------------------------------------------------------------------
# packed rows: their documents
# ----------------------------------------------------------------------------------------------

#: Keys that mark a packed row (packkit's own output, or another packer's): its documents are
#: ``seq_lengths`` (segment lengths summing to the row length) or restarting ``position_ids``.
SEGMENT_KEYS = ("seq_lengths", "position_ids")

#: What packed rows record of each document's source (:func:`packkit.outputs.packed_schema`): its example's id,
#: where the document starts in that example (a piece of a split example starts past 0), and the loss tokens of
#: the whole example (what its pieces train on), so that a piece weighs as its whole example.
DOCUMENT_KEYS = ("example_ids", "piece_offsets", "example_loss")

#: How to read a packed row as its documents, for the errors of readers that cannot.
PACKED_FIX = ("a packed row holds several documents; repack it with packkit pack / pack_dataset (they read "
              "its documents), or collate it with PackedRowsCollator")


def segment_key(names) -> str | None:
    """The key that marks packed rows among ``names`` (:data:`SEGMENT_KEYS`), or None.

    ``segment_key(["input_ids", "seq_lengths"]) -> "seq_lengths"``; ``position_ids`` alone marks them too
    (whether they restart is :func:`~packkit.row_rules.row_segments`' to decide).
    """
    names = set(names)
    return next((k for k in SEGMENT_KEYS if k in names), None)
