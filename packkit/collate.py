"""Collate functions: a list of examples -> one :class:`~packkit.batch.PackedBatch`.

==========================  ==============================================================================
collator                    output
==========================  ==============================================================================
``PaddingFreeCollator``     one ``[1, T]`` row, every example its own segment (what HF detects as packed)
``FixedWindowCollator``     ``[B, W]`` windows packed with :func:`packkit.binpack.pack` inside the batch
``PackedRowsCollator``      ``[B, W]`` from rows packed offline (``seq_lengths`` or ``position_ids``)
``PaddedCollator``          ``[B, L]`` right padding and an ``attention_mask`` (the fallback)
==========================  ==============================================================================

Use one as ``DataLoader(ds, batch_size=..., collate_fn=PaddingFreeCollator())`` or as
``Trainer(..., data_collator=PaddingFreeCollator())``.

An example is a mapping with ``input_ids`` (a list, numpy array or tensor of non-negative integers)
and optionally ``labels`` (same length; ``-100`` where no loss is wanted) and/or a
``completion_mask`` / ``assistant_masks`` (loss only where it is 1). Without labels the labels are the
input ids. With ``mask_first_label=True`` (default: the model shifts labels, as Hugging Face models
do) the first label of every segment becomes ``-100``, so no loss term predicts a document's first
token from the document before it. With ``mask_first_label=False`` labels are pre-shifted
(``labels[i]`` is the target of token ``i``) and are used exactly as given; every example then needs
``labels``.

Tokens are moved with one conversion of the concatenated lists (``struct.pack_into`` into the
output array), or one ``np.concatenate`` of the arrays, then numpy index arithmetic; tensors leave
through ``torch.from_numpy`` (no copy). Lists must hold Python (or numpy) integers; arrays and
tensors are checked by dtype.
"""

from __future__ import annotations

import collections.abc
import numbers
import operator
import struct

import numpy as np
import torch

from .batch import PackedBatch
from .binpack import check_overflow, check_strategy, check_window, pack
from .packer import gather_index
from .segments import IGNORE_INDEX

__all__ = ["PaddingFreeCollator", "FixedWindowCollator", "PackedRowsCollator", "PaddedCollator"]

#: Keys read as a loss mask (TRL's names): loss only where the mask is 1.
MASK_KEYS = ("completion_mask", "assistant_masks")


# ----------------------------------------------------------------------------------------------
# reading examples
# ----------------------------------------------------------------------------------------------


def _column(x, i: int, key: str, kind: str):
    """One example's column as a list or a 1-D integer numpy array, checked.

    ``kind`` is "ids" (non-negative later), "labels" or "mask". Returns ``(part, length, is_list)``.
    ``_column([3, 4], 0, "input_ids", "ids") -> ([3, 4], 2, True)``.
    """
    if type(x) is list:
        if x:
            first = x[0]
            if type(first) is not int and (isinstance(first, bool) or not isinstance(first, numbers.Integral)):
                if kind == "mask" and isinstance(first, bool):
                    return x, len(x), True
                if isinstance(first, (list, tuple, np.ndarray, torch.Tensor)):
                    raise TypeError(f"example {i}: '{key}' is nested ({type(first).__name__} inside a list); "
                                    "pass one flat sequence of token ids per example")
                raise TypeError(f"example {i}: '{key}' holds {first!r} ({type(first).__name__}); "
                                "token ids and labels must be integers")
        return x, len(x), True
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    elif isinstance(x, tuple):
        return _column(list(x), i, key, kind)
    elif not isinstance(x, np.ndarray):
        raise TypeError(f"example {i}: '{key}' is a {type(x).__name__}; pass a list, numpy array or tensor "
                        "of integers")
    if x.ndim != 1:
        raise TypeError(f"example {i}: '{key}' has shape {x.shape}; pass a 1-D sequence per example "
                        "(squeeze a [1, n] tokenizer output)")
    if x.dtype.kind not in "iu" and not (kind == "mask" and x.dtype.kind == "b"):
        raise TypeError(f"example {i}: '{key}' has dtype {x.dtype}; token ids and labels must be integers")
    return x, x.shape[0], False


def _list_into(flat: list, out: np.ndarray, bools_ok: bool) -> None:
    """Write a flat list of ints into ``out`` (int64, same length) with one ``struct.pack_into``.

    ``struct`` rejects floats (numpy would truncate them) but takes ``True``/``False`` as 1/0, so
    unless ``bools_ok`` the positions holding 0 or 1 (rare in token ids) are checked for bools;
    ``ValueError`` names the first bool's position: ``_list_into([3, True], out, False)`` raises.
    """
    struct.pack_into(f"{len(flat)}q", out, 0, *flat)
    if not bools_ok:
        cand = np.flatnonzero(out.view(np.uint64) <= 1)
        if cand.size:
            for t in cand.tolist():
                if type(flat[t]) is not int and isinstance(flat[t], (bool, np.bool_)):
                    raise _BoolAt(t)


def _list_array(part: list, bools_ok: bool) -> np.ndarray:
    """One example's list as int64 through :func:`_list_into`: ``[3, 4] -> array([3, 4])``."""
    out = np.empty(len(part), np.int64)
    _list_into(part, out, bools_ok)
    return out


class _BoolAt(Exception):
    """A bool at flat position ``args[0]`` (turned into a ``TypeError`` naming the example)."""


def _concat(parts: list, all_lists: bool, total: int, key: str, *, bools_ok: bool = False) -> np.ndarray:
    """Concatenate example columns into one writable ``(total,)`` int64 array.

    Lists: joined into one list and converted by a single ``struct.pack_into`` straight into the
    output buffer (measured faster than ``np.fromiter``/``np.array`` on a list, about 2x, and it
    rejects floats instead of truncating them); bools are rejected unless ``bools_ok`` (masks).
    Arrays: one ``np.concatenate``. ``_concat([[1], [2, 3]], True, 3, "input_ids") -> [1, 2, 3]``.
    """
    out = np.empty(total, np.int64)
    try:
        if all_lists:
            flat: list = []
            for p in parts:
                flat += p
            _list_into(flat, out, bools_ok)
            return out
        if _NDARRAY != set(map(type, parts)):  # lists mixed with arrays: each list through struct
            parts = [p if isinstance(p, np.ndarray) else _list_array(p, bools_ok) for p in parts]
        return np.concatenate(parts, out=out, casting="unsafe")
    except _BoolAt:
        for i, p in enumerate(parts):
            if not isinstance(p, np.ndarray) and any(isinstance(v, (bool, np.bool_)) for v in p):
                raise TypeError(f"example {i}: '{key}' holds a bool ({[v for v in p if isinstance(v, (bool, np.bool_))][0]!r}); "
                                "token ids and labels must be integers, not True/False") from None
        raise AssertionError("a bool was found but no example holds it") from None
    except (ValueError, TypeError, OverflowError, struct.error) as exc:
        for i, p in enumerate(parts):  # the error path only: find the example to name it
            if isinstance(p, np.ndarray):
                _column(p, i, key, "mask" if bools_ok else "ids")  # raises for a wrong shape or dtype
                continue
            try:
                struct.pack(f"{len(p)}q", *(p.tolist() if isinstance(p, np.ndarray) else p))
            except (ValueError, TypeError, OverflowError, struct.error) as inner:
                raise TypeError(f"example {i}: '{key}' is not a sequence of int64 integers ({inner})") \
                    from None
        raise TypeError(f"'{key}' could not be read as integers: {exc}") from None


def _first_bad(values: np.ndarray, bad: np.ndarray, offsets: np.ndarray) -> tuple[int, int]:
    """``(example index, value)`` of the first ``bad`` token. ``offsets`` is ``(n + 1,)``."""
    t = int(np.argmax(bad))
    return int(np.searchsorted(offsets, t, side="right") - 1), int(values[t])


def read_examples(examples, *, need_labels: bool = False):
    """Examples -> ``(input_ids, labels, lengths)``: ``(T,)`` int64, ``(T,)`` int64, ``(n,)`` int64.

    ``labels`` are the given labels (or the input ids), with ``-100`` where a completion mask is 0;
    no first-label masking here (that depends on the segments). The kind of labels (given, mask,
    none) is read from example 0 and every example must have the same keys.
    ``read_examples([{"input_ids": [5, 6]}, {"input_ids": [7]}]) -> ([5, 6, 7], [5, 6, 7], [2, 1])``.
    """
    return _read(examples, need_labels)


def _read(examples, need_labels: bool):
    """:func:`read_examples` without keyword handling. Every check is one vectorised pass over the
    whole batch; the offending example is located only when a check fails."""
    if type(examples) is not list and (isinstance(examples, collections.abc.Mapping)
                                       or not isinstance(examples, collections.abc.Sequence)):
        raise TypeError(f"a collator takes a list of examples (dicts with 'input_ids'), got "
                        f"{type(examples).__name__}")
    n = len(examples)
    if n == 0:
        raise ValueError("the collator got an empty list of examples")
    first = examples[0]
    if not isinstance(first, collections.abc.Mapping):
        raise TypeError(f"example 0 is a {type(first).__name__}, not a dict with 'input_ids'")
    has_labels = "labels" in first
    mask_key = next((k for k in MASK_KEYS if k in first), None)
    if need_labels and not has_labels:
        raise ValueError("example 0 has no 'labels': mask_first_label=False means labels are pre-shifted "
                         "and must be given (labels[i] = target of token i, -100 at each example's end)")
    ids_parts, lengths, ids_lists = _read_column(examples, "input_ids", "ids")
    empty = lengths.index(0) if 0 in lengths else None
    if empty is not None:
        raise ValueError(f"example {empty} is empty (0 tokens); filter empty examples out before collating")
    if has_labels:
        lab_parts, lab_lengths, lab_lists = _read_column(examples, "labels", "labels")
        _check_same_lengths(lab_lengths, lengths, "labels")
    if mask_key is not None:
        mask_parts, mask_lengths, mask_lists = _read_column(examples, mask_key, "mask")
        _check_same_lengths(mask_lengths, lengths, f"{mask_key} entries")
    total = sum(lengths)
    lengths = np.array(lengths, np.int64)
    input_ids = _concat(ids_parts, ids_lists, total, "input_ids")
    if input_ids.min() < 0:
        i, v = _first_bad(input_ids, input_ids < 0, _offsets(lengths))
        raise ValueError(f"example {i} has token id {v} < 0; token ids must be non-negative")
    if has_labels:
        labels = _concat(lab_parts, lab_lists, total, "labels")
        # valid: >= 0 or == -100. Two reductions without temporaries: the minimum rules out values
        # below -100; viewed as uint64, -99..-1 are the only values above -100's image.
        if labels.min() < IGNORE_INDEX or labels.view(np.uint64).max() > _IGNORE_AS_U64:
            bad = (labels < 0) & (labels != IGNORE_INDEX)
            i, v = _first_bad(labels, bad, _offsets(lengths))
            raise ValueError(f"example {i} has label {v}; labels are token ids or {IGNORE_INDEX} (no loss)")
    else:
        labels = input_ids.copy()
    if mask_key is not None:
        mask = _concat(mask_parts, mask_lists, total, mask_key, bools_ok=True)
        if mask.view(np.uint64).max() > 1:  # one vectorised check; locate only when it fails
            i, v = _first_bad(mask, mask.view(np.uint64) > 1, _offsets(lengths))
            raise ValueError(f"example {i} has {mask_key} value {v}; a loss mask holds 0 (no loss) or 1 (loss)")
        labels[mask == 0] = IGNORE_INDEX
    return input_ids, labels, lengths


_IGNORE_AS_U64 = np.array(IGNORE_INDEX, np.int64).view(np.uint64)[()]
_INT_DTYPES = frozenset(np.dtype(t) for t in (np.int64, np.int32, np.int16, np.int8, np.uint8, np.uint16,
                                                  np.uint32, np.uint64))
_MASK_DTYPES = _INT_DTYPES | {np.dtype(np.bool_)}
_first_item = operator.itemgetter(0)
_dtype_of = operator.attrgetter("dtype")


def _read_column(examples, key: str, kind: str) -> tuple[list, list, bool]:
    """One column of every example: ``(parts, lengths, all_lists)``, each part a list or a 1-D
    integer array. Checks run over the whole column with C-level ``map``/``set`` (no per-example
    Python statements) and fall back to a checked loop that names the offending example.
    ``_read_column([{"input_ids": [5, 6]}], "input_ids", "ids") -> ([[5, 6]], [2], True)``.
    """
    try:
        xs = [ex[key] for ex in examples]
    except (KeyError, TypeError, IndexError):
        for i, ex in enumerate(examples):
            if not isinstance(ex, collections.abc.Mapping):
                raise TypeError(f"example {i} is a {type(ex).__name__}, not a dict with 'input_ids'") from None
            if key not in ex:
                if key == "input_ids":
                    raise ValueError(f"example {i} has no 'input_ids' (keys {sorted(ex)}); every example "
                                     "needs its token ids") from None
                raise ValueError(f"example {i} has no '{key}' but example 0 has; give every example "
                                 f"'{key}' or none") from None
        raise
    kinds = set(map(type, xs))
    if kinds == _LIST:
        lengths = list(map(len, xs))
        if 0 not in lengths and set(map(type, map(_first_item, xs))) <= (_MASK_ITEMS if kind == "mask"
                                                                          else _INT_ITEM):
            return xs, lengths, True
    elif kinds == _NDARRAY:
        # ndim is checked where it is cheap: len() of a 0-d array raises, and a 2-D array makes the
        # concatenation fail; both fall back to the checked loop below, which names the example.
        if set(map(_dtype_of, xs)) <= (_MASK_DTYPES if kind == "mask" else _INT_DTYPES):
            try:
                return xs, list(map(len, xs)), False
            except TypeError:
                pass
    parts, lengths, all_lists = [], [], True
    for i, x in enumerate(xs):
        part, length, is_list = _column(x, i, key, kind)
        parts.append(part)
        lengths.append(length)
        all_lists &= is_list
    return parts, lengths, all_lists


_LIST, _NDARRAY = {list}, {np.ndarray}
_INT_ITEM, _MASK_ITEMS = {int}, {int, bool}


def _check_same_lengths(got: list, lengths: list, what: str) -> None:
    if got != lengths:
        i = next(i for i, (a, b) in enumerate(zip(got, lengths)) if a != b)
        raise ValueError(f"example {i} has {got[i]} {what} for {lengths[i]} input_ids; they must match")


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """``[2, 1] -> [0, 2, 3]`` (int64)."""
    out = np.zeros(lengths.size + 1, np.int64)
    out[1:] = lengths.cumsum()
    return out


# ----------------------------------------------------------------------------------------------
# building batches
# ----------------------------------------------------------------------------------------------


def _segment_fields(seg_lengths: np.ndarray):
    """Segment lengths -> ``(cu_seqlens int32 (S+1,), position_ids int64 (T,))``.

    ``[2, 1] -> ([0, 2, 3], [0, 1, 0])``. One cumsum shared by both (the same arithmetic as
    ``packkit.segments``, fused for the collators' hot path); ``seq_idx`` is left to the batch,
    which derives it from ``cu_seqlens`` when a consumer asks.
    """
    cu = _offsets(seg_lengths)
    total = int(cu[-1])
    if total > _INT32_MAX:
        raise ValueError(f"{total:,} tokens do not fit in int32 cu_seqlens; use smaller batches")
    position_ids = np.arange(total, dtype=np.int64)
    position_ids -= np.repeat(cu[:-1], seg_lengths)
    return cu.astype(np.int32), position_ids


_INT32_MAX = np.iinfo(np.int32).max
_tensor = torch.from_numpy


def padding_free_batch(input_ids, labels, lengths, *, mask_first_label: bool = True) -> PackedBatch:
    """One ``[1, T]`` row, every example a segment. ``labels`` is modified in place (first labels).
    ``padding_free_batch([5, 6, 7], [5, 6, 7], [2, 1])`` -> ``cu_seqlens [0, 2, 3]``, labels
    ``[-100, 6, -100]``, ``num_loss_tokens 1``.
    """
    n, total = lengths.size, input_ids.size
    if total > _INT32_MAX:
        raise ValueError(f"{total:,} tokens do not fit in int32 cu_seqlens; use smaller batches")
    cu = np.zeros(n + 1, np.int64)
    cu[1:] = lengths.cumsum()  # measured faster than cumsum(out=cu[1:]) on small arrays
    starts = cu[:-1]
    position_ids = np.arange(total, dtype=np.int64)
    position_ids -= np.repeat(starts, lengths)
    if mask_first_label:
        labels[starts] = IGNORE_INDEX
    ignored = int(np.count_nonzero(labels == IGNORE_INDEX))
    shape = (1, total)
    return PackedBatch._trusted(
        input_ids=_tensor(input_ids.reshape(shape)),
        labels=_tensor(labels.reshape(shape)),
        position_ids=_tensor(position_ids.reshape(shape)),
        cu_seqlens=_tensor(cu.astype(np.int32)),
        max_seqlen=int(lengths.max()),
        num_loss_tokens=total - ignored,
        num_tokens=total,
        num_examples=n,
        num_real_segments=n,
        labels_shifted=not mask_first_label,
        attention_mask=None,
    )



def rows_batch(input_ids, labels, seg_lengths, seg_ptr, *, width: int, num_rows: int | None = None,
               pad_token_id: int = 0, mask_first_label: bool = True, static_shape: bool = False,
               max_segments: int | None = None, attention_mask: bool = False) -> PackedBatch:
    """Lay segments out in ``[B, width]`` rows, each row's padding tail its own segment.

    Args:
        input_ids, labels: ``(T,)`` int64, the tokens of the rows, row after row.
        seg_lengths: ``(S,)`` int64, segment lengths, row after row (``>= 1``).
        seg_ptr: ``(R + 1,)`` int64, row ``r`` holds segments ``seg_ptr[r]:seg_ptr[r+1]``.
        width: ``W``, tokens per row; num_rows: ``B`` (default ``R``; extra rows are all padding).
        static_shape: ``cu_seqlens`` padded to ``max_segments + 1`` entries, ``max_seqlen = W``.
        attention_mask: also return the ``[B, W]`` int64 mask of real tokens (padded fallback).

    Example: tokens ``[a a b c]``, ``seg_lengths=[2, 1, 1]``, ``seg_ptr=[0, 2, 3]``, ``width=3``:
    rows ``[a a b]`` and ``[c pad pad]``, ``cu_seqlens=[0, 2, 3, 4, 6]``.
    """
    num_content = seg_ptr.size - 1
    num_rows = num_content if num_rows is None else num_rows
    if num_content > num_rows:
        raise ValueError(f"this batch needs {num_content} windows of {width} tokens > num_windows={num_rows}; "
                         "raise num_windows, lower the batch size, or batch with packkit.sampler."
                         "PackedBatchSampler")
    csum = _offsets(seg_lengths)
    loads = csum[seg_ptr[1:]] - csum[seg_ptr[:-1]]
    # every row's segments, then its padding tail (rows without content are one tail of W)
    tails = np.full(num_rows, width, np.int64)
    tails[:num_content] -= loads
    tail_at = np.full(num_rows, seg_ptr[-1], np.int64)
    tail_at[:num_content] = seg_ptr[1:]
    all_lengths = np.insert(seg_lengths, tail_at, tails)
    all_lengths = all_lengths[all_lengths > 0]
    cu, position_ids = _segment_fields(all_lengths)
    # where every real token lands in the flattened [B, W] batch
    total = int(csum[-1])
    row_start = csum[seg_ptr[:-1]]
    dest = np.repeat(np.arange(num_content, dtype=np.int64) * width - row_start, loads)
    dest += np.arange(total, dtype=np.int64)
    out_ids = np.full(num_rows * width, pad_token_id, np.int64)
    out_ids[dest] = input_ids
    out_labels = np.full(num_rows * width, IGNORE_INDEX, np.int64)
    out_labels[dest] = labels
    if mask_first_label:
        out_labels[dest[csum[:-1]]] = IGNORE_INDEX
    max_seqlen = int(all_lengths.max())
    num_real = int(all_lengths.size)
    if static_shape:
        if max_segments is None:
            raise ValueError("static_shape=True needs max_segments (the fixed number of segments of every batch)")
        if cu.size - 1 > max_segments:
            raise ValueError(f"this batch has {cu.size - 1} segments (padding tails included) > "
                             f"max_segments={max_segments}; raise max_segments")
        cu = np.concatenate([cu, np.full(max_segments + 1 - cu.size, cu[-1], np.int32)])
        max_seqlen = width
    shape = (num_rows, width)
    mask = None
    if attention_mask:
        mask = np.zeros(num_rows * width, np.int64)
        mask[dest] = 1
        mask = _tensor(mask.reshape(shape))
    return PackedBatch(
        input_ids=_tensor(out_ids.reshape(shape)),
        labels=_tensor(out_labels.reshape(shape)),
        position_ids=_tensor(position_ids.reshape(shape)),
        cu_seqlens=_tensor(cu),
        max_seqlen=max_seqlen,
        num_loss_tokens=int(np.count_nonzero(out_labels != IGNORE_INDEX)),
        attention_mask=mask,
        num_tokens=total,
        num_examples=int(seg_lengths.size),
        num_real_segments=num_real,
        labels_shifted=not mask_first_label,
    )


def _int_at_least(value, name: str, low: int) -> int:
    """``value`` as an int: ``TypeError`` for a non-integer (or a bool), ``ValueError`` below ``low``.

    The same contract as ``packkit.sampler``/``packkit.budget``: ``_int_at_least(3, "seed", 0) -> 3``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def _check_pad(pad_token_id) -> int:
    return _int_at_least(pad_token_id, "pad_token_id", 0)


def _positive_int(value, name: str) -> int:
    return _int_at_least(value, name, 1)


def _check_static(static_shape: bool, num_windows, max_segments):
    if num_windows is not None:
        num_windows = _positive_int(num_windows, "num_windows")
    if max_segments is not None:
        if not static_shape:
            raise ValueError("max_segments only applies with static_shape=True")
        max_segments = _positive_int(max_segments, "max_segments")
    if static_shape and (num_windows is None or max_segments is None):
        raise ValueError(
            "static_shape=True needs num_windows=B and max_segments=S (every batch then has B rows and "
            "S + 1 cu_seqlens entries). Segments are documents plus one padding tail per row: "
            "num_windows * (window // shortest_example + 1) always suffices without overflow='split'; "
            "a tighter S keeps cu_seqlens (and the attention kernels' grid) short, and a batch that "
            "needs more raises")
    return num_windows, max_segments


# ----------------------------------------------------------------------------------------------
# the collators
# ----------------------------------------------------------------------------------------------


class PaddingFreeCollator:
    """Examples -> one ``[1, T]`` packed row (no padding), as a :class:`PackedBatch`.

    ``PaddingFreeCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])`` gives
    ``input_ids [[5, 6, 7, 8, 9]]``, ``position_ids [[0, 1, 2, 0, 1]]``,
    ``labels [[-100, 6, 7, -100, 9]]``, ``cu_seqlens [0, 3, 5]``, ``max_seqlen 3``.

    Args:
        mask_first_label: ``True`` (default): labels are shifted by the model, the first label of
            every example becomes -100. ``False``: labels are pre-shifted and used as given.
    """

    def __init__(self, *, mask_first_label: bool = True):
        self.mask_first_label = bool(mask_first_label)

    def __call__(self, examples) -> PackedBatch:
        input_ids, labels, lengths = _read(examples, not self.mask_first_label)
        return padding_free_batch(input_ids, labels, lengths, mask_first_label=self.mask_first_label)

    def __repr__(self) -> str:
        return f"PaddingFreeCollator(mask_first_label={self.mask_first_label})"


class FixedWindowCollator:
    """Examples -> ``[B, W]`` windows packed with :func:`packkit.binpack.pack` inside the mini-batch.

    Args:
        window: ``W``, tokens per window.
        strategy: ``"bfd"`` (best fit, default), ``"ffd"``, ``"shuffle_ff"`` or ``"next_fit"`` (keeps the
            given order: fed the indices of ``k`` windows of a ``PackedBatchSampler``, it needs at most
            ``k`` windows).
        overflow: an example longer than ``W``: ``"error"`` (default), ``"split"`` (pieces, each its own
            segment with positions from 0), ``"truncate"`` or ``"drop"``. Tokens cut by the last two
            are added to ``self.cut_tokens`` (per process: each DataLoader worker has its own copy).
        num_windows: ``B``; every batch has exactly ``B`` rows (extra rows are padding), and a batch
            that needs more is an error. Default: as many rows as the plan needs.
        static_shape: one shape for every batch (``torch.compile``, CUDA graphs): needs ``num_windows``;
            ``cu_seqlens`` has ``max_segments + 1`` entries (padded by repeating the last offset:
            zero-length segments, which some flash-attn versions mishandle, flash-attn #1537),
            ``max_seqlen = W``.
        max_segments: segments per batch with a static shape, padding tails included; required with
            ``static_shape`` (``num_windows * (window // shortest_example + 1)`` always suffices
            without splitting; a tighter bound gives a shorter ``cu_seqlens``; a batch that needs more
            raises). ``batch.hf_kwargs(static=False)`` drops the zero-length tail when flash-attn
            #1537 bites.
        pad_token_id: id of padding tokens (default 0; their labels are -100 whatever it is).
        mask_first_label: as in :class:`PaddingFreeCollator` (applies to every segment).
        seed: the order of ``"shuffle_ff"``.
    """

    def __init__(self, *, window: int, strategy: str = "bfd", overflow: str = "error",
                 num_windows: int | None = None, static_shape: bool = False,
                 max_segments: int | None = None, pad_token_id: int = 0,
                 mask_first_label: bool = True, seed: int = 0):
        self.window = check_window(window)
        self.strategy, self.overflow = check_strategy(strategy), check_overflow(overflow)
        self.seed = _int_at_least(seed, "seed", 0)
        self.static_shape = bool(static_shape)
        self.num_windows, self.max_segments = _check_static(self.static_shape, num_windows, max_segments)
        self.pad_token_id = _check_pad(pad_token_id)
        self.mask_first_label = bool(mask_first_label)
        self.cut_tokens = 0

    def __call__(self, examples) -> PackedBatch:
        input_ids, labels, lengths = read_examples(examples, need_labels=not self.mask_first_label)
        plan = pack(lengths, window=self.window, strategy=self.strategy, overflow=self.overflow,
                    seed=self.seed)
        self.cut_tokens += plan.cut_tokens
        if plan.num_windows == 0:
            raise ValueError(f"overflow='drop' dropped all {lengths.size} examples of this batch (each longer "
                             f"than window={self.window}); raise window or use overflow='split'")
        index, _ = gather_index(plan, _offsets(lengths))
        return rows_batch(input_ids[index], labels[index], plan.seg_length, plan.window_ptr,
                          width=self.window, num_rows=self.num_windows, pad_token_id=self.pad_token_id,
                          mask_first_label=self.mask_first_label, static_shape=self.static_shape,
                          max_segments=self.max_segments)

    def __repr__(self) -> str:
        return (f"FixedWindowCollator(window={self.window}, strategy={self.strategy!r}, "
                f"overflow={self.overflow!r}, num_windows={self.num_windows}, "
                f"static_shape={self.static_shape})")


class PackedRowsCollator:
    """Rows packed offline -> ``[B, W]``. A row has ``input_ids`` (at most ``W`` tokens), optional
    ``labels``, and its segments as ``seq_lengths`` (summing to the row length) or ``position_ids``
    (a segment starts at every 0).

    ``PackedRowsCollator(window=4)([{"input_ids": [5, 6, 7], "seq_lengths": [2, 1]}])`` gives
    ``input_ids [[5, 6, 7, 0]]``, ``position_ids [[0, 1, 0, 0]]``, ``cu_seqlens [0, 2, 3, 4]``.

    Options as in :class:`FixedWindowCollator` (``num_windows``, ``static_shape``, ``max_segments``,
    ``pad_token_id``, ``mask_first_label``). Labels of offline rows already carry -100 on every
    segment's first token; masking again changes nothing.
    """

    def __init__(self, *, window: int, num_windows: int | None = None, static_shape: bool = False,
                 max_segments: int | None = None, pad_token_id: int = 0, mask_first_label: bool = True):
        self.window = check_window(window)
        self.static_shape = bool(static_shape)
        self.num_windows, self.max_segments = _check_static(self.static_shape, num_windows, max_segments)
        self.pad_token_id = _check_pad(pad_token_id)
        self.mask_first_label = bool(mask_first_label)

    def __call__(self, rows) -> PackedBatch:
        input_ids, labels, lengths = read_examples(rows, need_labels=not self.mask_first_label)
        over = np.flatnonzero(lengths > self.window)
        if over.size:
            i = int(over[0])
            raise ValueError(f"example {i} is a packed row of {int(lengths[i])} tokens > window={self.window}; "
                             "collate with the window it was packed for")
        seg_lengths, seg_ptr = _row_segments(rows, lengths)
        return rows_batch(input_ids, labels, seg_lengths, seg_ptr, width=self.window,
                          num_rows=self.num_windows, pad_token_id=self.pad_token_id,
                          mask_first_label=self.mask_first_label, static_shape=self.static_shape,
                          max_segments=self.max_segments)

    def __repr__(self) -> str:
        return (f"PackedRowsCollator(window={self.window}, num_windows={self.num_windows}, "
                f"static_shape={self.static_shape})")


def _row_segments(rows, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Segment lengths ``(S,)`` and row pointers ``(R + 1,)`` of packed rows, from their
    ``seq_lengths`` or ``position_ids``, checked against the row lengths."""
    key = "seq_lengths" if "seq_lengths" in rows[0] else "position_ids" if "position_ids" in rows[0] else None
    if key is None:
        raise ValueError("example 0 is a packed row without 'seq_lengths' or 'position_ids'; the collator "
                         "needs its segments (use PaddingFreeCollator or FixedWindowCollator for plain examples)")
    parts, counts, all_lists = [], [], True
    for i, row in enumerate(rows):
        try:
            x = row[key]
        except KeyError:
            raise ValueError(f"example {i} has no '{key}' but example 0 has; give every row the same keys") \
                from None
        part, n, is_list = _column(x, i, key, "ids")
        all_lists &= is_list
        parts.append(part)
        counts.append(n)
    counts = np.array(counts, np.int64)
    flat = _concat(parts, all_lists, int(counts.sum()), key)
    if key == "seq_lengths":
        if (flat < 1).any():
            i, v = _first_bad(flat, flat < 1, _offsets(counts))
            raise ValueError(f"example {i} has a segment of length {v}; seq_lengths must be >= 1")
        seg_ptr = _offsets(counts)
        csum = _offsets(flat)
        sums = csum[seg_ptr[1:]] - csum[seg_ptr[:-1]]
        bad = sums != lengths
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"example {i} has seq_lengths summing to {int(sums[i])} for {int(lengths[i])} "
                             "input_ids; they must match")
        return flat, seg_ptr
    # position_ids: a segment starts at every 0; inside a segment positions go up by one
    bad = counts != lengths
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"example {i} has {int(counts[i])} position_ids for {int(lengths[i])} input_ids")
    row_first = _offsets(lengths)[:-1]
    prev = np.concatenate(([-1], flat[:-1]))
    prev[row_first] = -1
    is_start = flat == 0
    bad = ~is_start & (flat != prev + 1)
    if bad.any():
        i, v = _first_bad(flat, bad, _offsets(lengths))
        raise ValueError(f"example {i} has position_ids that neither restart at 0 nor go up by one "
                         f"(value {v}); pass seq_lengths instead")
    starts = np.flatnonzero(is_start)
    seg_lengths = np.diff(np.append(starts, flat.size))
    seg_ptr = np.searchsorted(starts, _offsets(lengths), side="left").astype(np.int64)
    return seg_lengths.astype(np.int64), seg_ptr


class PaddedCollator:
    """Examples -> ``[B, L]`` right-padded rows with an ``attention_mask`` (the fallback when varlen
    attention is not available). ``L`` is the longest example, rounded up to ``pad_to_multiple_of``.

    ``PaddedCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])`` gives
    ``input_ids [[5, 6, 7], [8, 0, 0]]``, ``labels [[-100, 6, 7], [-100, -100, -100]]``,
    ``attention_mask [[1, 1, 1], [1, 0, 0]]``.

    With ``return_attention_mask=False`` the batch has no mask and its HF view is the packed one: each
    row's padding tail is then its own segment, which is also correct.
    """

    def __init__(self, *, pad_token_id: int = 0, pad_to_multiple_of: int | None = None,
                 return_attention_mask: bool = True, mask_first_label: bool = True):
        self.pad_token_id = _check_pad(pad_token_id)
        self.pad_to_multiple_of = (None if pad_to_multiple_of is None
                                   else _positive_int(pad_to_multiple_of, "pad_to_multiple_of"))
        self.return_attention_mask = bool(return_attention_mask)
        self.mask_first_label = bool(mask_first_label)

    def __call__(self, examples) -> PackedBatch:
        input_ids, labels, lengths = read_examples(examples, need_labels=not self.mask_first_label)
        width = int(lengths.max())
        if self.pad_to_multiple_of is not None:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        return rows_batch(input_ids, labels, lengths, np.arange(lengths.size + 1, dtype=np.int64),
                          width=width, pad_token_id=self.pad_token_id,
                          mask_first_label=self.mask_first_label,
                          attention_mask=self.return_attention_mask)

    def __repr__(self) -> str:
        return (f"PaddedCollator(pad_token_id={self.pad_token_id}, pad_to_multiple_of={self.pad_to_multiple_of}, "
                f"return_attention_mask={self.return_attention_mask})")
