"""From a :class:`~packkit.binpack.Plan` and token arrays to packed rows.

Every example's tokens live in one flat array (``values``) with CSR ``offsets`` (Arrow's layout for
a list column). A plan turns into the flat index of every token of every window, in window order
(:func:`gather_index`, for small batches), or, at scale, into one strided copy per group of
equal-length segments with no per-token index at all (:func:`gather_segments`)::

    >>> from packkit.binpack import pack
    >>> plan = pack([3, 2, 2], window=4)          # windows: [ex 0], [ex 1, ex 2]
    >>> index, row_offsets = gather_index(plan, offsets=[0, 3, 5, 7])
    >>> index.tolist(), row_offsets.tolist()
    ([0, 1, 2, 3, 4, 5, 6], [0, 3, 7])

Several list columns of the same examples (tokens, labels, a loss mask, anything aligned with the
tokens) move together with :func:`pack_columns`; :func:`pack_arrays` is its two-column form. Labels
follow one rule everywhere (:func:`loss_labels`): ``IGNORE_INDEX`` where a loss mask
(``completion_mask`` / ``assistant_masks``, :data:`MASK_KEYS`) is 0, and on the first token of every
segment when ``mask_first_label`` (models that shift labels)::

    >>> rows = pack_columns(pack([3, 2], window=8),
    ...                     {"input_ids": ([5, 6, 7, 8, 9], [0, 3]), "completion_mask": ([0, 1, 1, 1, 1], [0, 3])},
    ...                     loss_mask="completion_mask")
    >>> rows.columns["input_ids"].tolist(), rows.columns["labels"].tolist(), rows.seq_lengths.tolist()
    ([5, 6, 7, 8, 9], [-100, 6, 7, -100, 9], [3, 2])

Rows are not padded here: the collators pad windows to ``W`` at batch time.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .binpack import Plan
from .segments import IGNORE_INDEX, segment_starts

__all__ = [
    "MASK_KEYS",
    "check_offsets",
    "first_bad_label",
    "first_bad_mask",
    "label_dtype",
    "loss_labels",
    "gather_index",
    "gather_segments",
    "PackedColumns",
    "pack_columns",
    "PackedRows",
    "pack_arrays",
]

#: Columns read as a loss mask (TRL's names): loss only where the mask is not 0. The same tuple as
#: ``packkit.collate.MASK_KEYS`` (a test keeps them equal); it lives here too so that offline packing
#: does not import torch.
MASK_KEYS = ("completion_mask", "assistant_masks")

logger = logging.getLogger("packkit")

#: Tokens copied per numpy call at most (bounds the temporary of one copy: 4M tokens).
GROUP_TOKENS = 1 << 22


def check_offsets(plan: Plan, offsets, *, size: int | None = None) -> np.ndarray:
    """``offsets`` as ``(num_examples + 1,)`` int64 after checking them against ``plan.lengths``.

    ``check_offsets(pack([3, 2], window=4), [0, 3, 5]) -> [0, 3, 5]``; ``[0, 2, 5]`` raises, naming
    example 0 (2 tokens in ``offsets``, 3 in the plan): a plan made from other lengths than the
    tokens would duplicate or lose tokens. ``size``: the length of the flat values, which the last
    offset may not pass.
    """
    offsets = np.asarray(offsets)
    if offsets.dtype.kind not in "iu" and offsets.size:
        raise TypeError(f"offsets must be integers, got {offsets.dtype}")
    offsets = offsets.astype(np.int64, copy=False)
    if offsets.shape != (plan.num_examples + 1,):
        raise ValueError(
            f"offsets must have num_examples + 1 = {plan.num_examples + 1} entries, got {offsets.shape}"
        )
    if offsets[0] < 0:
        raise ValueError(f"offsets must start at 0 or later, got {int(offsets[0])}")
    bad = np.flatnonzero(np.diff(offsets) != plan.lengths)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"example {i} has {int(offsets[i + 1] - offsets[i])} tokens in offsets but "
                         f"{int(plan.lengths[i])} in the plan; plan the lengths of these very tokens "
                         "(np.diff(offsets))")
    if size is not None and offsets[-1] > size:
        raise ValueError(f"offsets end at {int(offsets[-1])} but there are only {size} values")
    return offsets


def _check_starts(plan: Plan, starts, size: int, name: str) -> np.ndarray:
    """Column ``name``'s ``(num_examples,)`` starts as int64, every example inside its ``size`` values."""
    starts = np.asarray(starts)
    if starts.dtype.kind not in "iu" and starts.size:
        raise TypeError(f"starts of {name!r} must be integers, got {starts.dtype}")
    starts = starts.astype(np.int64, copy=False)
    if starts.shape != (plan.num_examples,):
        raise ValueError(f"{name!r} needs one start per example ({plan.num_examples}), got {starts.shape}")
    bad = np.flatnonzero((starts < 0) | (starts + plan.lengths > size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"example {i} of {name!r} (start {int(starts[i])}, {int(plan.lengths[i])} tokens) "
                         f"lies outside its {size} values")
    return starts


def label_dtype(dtype) -> np.dtype:
    """The dtype labels are kept in: signed of at least 16 bits as given (-100 must fit), else int64.

    ``label_dtype(np.int32) -> int32``; ``label_dtype(np.uint16) -> int64``.
    """
    dtype = np.dtype(dtype)
    return dtype if dtype.kind == "i" and dtype.itemsize >= 2 else np.dtype(np.int64)


def loss_labels(input_ids, labels=None, mask=None) -> np.ndarray:
    """Labels with ``IGNORE_INDEX`` where the loss ``mask`` is 0 (the collators' rule, on flat arrays).

    ``loss_labels([5, 6, 7], mask=[0, 1, 1]) -> [-100, 6, 7]``; without ``labels`` the token ids are the
    labels; without ``mask`` the labels come back as they are. Returns ``(T,)`` of :func:`label_dtype`
    (a new array when a mask is applied).
    """
    base = np.asarray(input_ids if labels is None else labels)
    base = base.astype(label_dtype(base.dtype), copy=False)
    if mask is None:
        return base
    mask = np.asarray(mask)
    if mask.shape != base.shape:
        raise ValueError(f"a loss mask of shape {mask.shape} for labels of shape {base.shape}: they must match")
    return np.where(mask != 0, base, np.asarray(IGNORE_INDEX, base.dtype))


def first_bad_mask(values) -> int | None:
    """Flat index of the first loss-mask value that is neither 0 nor 1 (booleans are fine), or None.

    ``first_bad_mask([0, 1, 2]) -> 2``; ``first_bad_mask([True, False]) -> None``. The collators reject
    such values too: a mask of 2 or -1 is more likely a column mix-up than a loss weight.
    """
    values = np.asarray(values)
    if values.size == 0 or values.dtype.kind == "b":
        return None
    bad = (values != 0) & (values != 1)
    return int(np.argmax(bad)) if bad.any() else None


def first_bad_label(values) -> int | None:
    """Flat index of the first label that is neither a token id (>= 0) nor ``IGNORE_INDEX``, or None.

    ``first_bad_label([3, -100, -5]) -> 2``; ``first_bad_label([3, -100]) -> None``. Vectorised, with a
    fast path for labels without negatives.
    """
    values = np.asarray(values)
    if values.size == 0 or values.dtype.kind in "ub" or values.min() >= 0:
        return None
    neg = values < 0
    if np.count_nonzero(neg) == np.count_nonzero(values == IGNORE_INDEX):  # every negative is -100
        return None
    return int(np.argmax(neg & (values != IGNORE_INDEX)))


def gather_index(plan: Plan, offsets) -> tuple[np.ndarray, np.ndarray]:
    """Flat source index of every packed token, and the CSR offsets of the packed rows.

    Args:
        plan: the plan of the examples.
        offsets: ``(num_examples + 1,)`` int, example ``i``'s tokens are ``values[offsets[i]:offsets[i+1]]``.

    Returns:
        ``index``: ``(T,)`` int64, ``values[index]`` is the packed token stream, window after window;
        ``row_offsets``: ``(num_windows + 1,)`` int64, window ``w`` is ``index[row_offsets[w]:row_offsets[w+1]]``.
    """
    offsets = check_offsets(plan, offsets)
    seg_length = plan.seg_length
    out_start = np.cumsum(seg_length) - seg_length
    src_start = offsets[plan.seg_example] + plan.seg_start
    total = int(seg_length.sum())
    index = np.repeat(src_start - out_start, seg_length) + np.arange(total, dtype=np.int64)
    row_offsets = np.zeros(plan.num_windows + 1, np.int64)
    np.cumsum(plan.window_loads, out=row_offsets[1:])
    return index, row_offsets


def gather_segments(values, src_start, seg_length, *, num_threads: int = 1, bar=None) -> np.ndarray:
    """Concatenate ``values[s : s + l]`` for every ``(s, l)`` pair, with one numpy copy per length group.

    ``gather_segments(np.arange(10), [7, 0, 4], [2, 3, 1]) -> [7, 8, 0, 1, 2, 4]``

    Args:
        values: (N,) flat token array (any dtype; e.g. the ``.values`` of an Arrow list column).
        src_start: (S,) int, first index of each segment in ``values``.
        seg_length: (S,) int >= 1, tokens of each segment.
        num_threads: copy length groups on this many threads (numpy releases the GIL while copying).
        bar: optional progress bar, advanced by tokens copied.
    Returns:
        (sum(seg_length),) array of ``values.dtype``, the segments back to back.
    """
    values = np.ascontiguousarray(values)
    src_start = np.asarray(src_start, np.int64)
    seg_length = np.asarray(seg_length, np.int64)
    if src_start.shape != seg_length.shape or src_start.ndim != 1:
        raise ValueError(f"src_start {src_start.shape} and seg_length {seg_length.shape} must be equal 1-D shapes")
    dst_start = np.cumsum(seg_length) - seg_length
    total = int(seg_length.sum())
    out = np.empty(total, values.dtype)
    if total == 0:
        return out
    if seg_length.min() < 1 or src_start.min() < 0 or int((src_start + seg_length).max()) > values.size:
        raise ValueError("every segment must have length >= 1 and lie inside values")
    # Group segments by length (a radix sort when lengths fit in 16 bits).
    key = seg_length.astype(np.uint16) if seg_length.max() < 1 << 16 else seg_length
    order = np.argsort(key, kind="stable")
    sorted_len = seg_length[order]
    cuts = np.flatnonzero(sorted_len[1:] != sorted_len[:-1]) + 1
    tasks = []
    for a, b in zip(np.concatenate(([0], cuts)).tolist(), np.concatenate((cuts, [order.size])).tolist()):
        length = int(sorted_len[a])
        step = max(1, GROUP_TOKENS // length)
        tasks.extend((lo, min(lo + step, b), length) for lo in range(a, b, step))
    item = values.itemsize

    def copy(task) -> int:
        lo, hi, length = task
        idx = order[lo:hi]
        # Row r of these views is values[r : r + length] (resp. out[r : r + length]): rows overlap as
        # views, but the rows picked are disjoint segments, so the writes never collide.
        src = as_strided(values, shape=(values.size - length + 1, length), strides=(item, item),
                         writeable=False)
        dst = as_strided(out, shape=(out.size - length + 1, length), strides=(item, item))
        dst[dst_start[idx]] = src[src_start[idx]]
        return (hi - lo) * length

    if num_threads > 1 and len(tasks) > 1:
        with ThreadPoolExecutor(num_threads) as pool:
            for n in pool.map(copy, tasks):
                if bar is not None:
                    bar.update(n)
    else:
        for task in tasks:
            n = copy(task)
            if bar is not None:
                bar.update(n)
    return out


def log_overflow(who: str, *, overflow: str, over: int, examples: int, window: int, cut_tokens: int,
                 tokens: int) -> None:
    """Say what an overflow policy touched: a warning when tokens were cut, a note for ``split``.

    Offline packing never drops a token without counting it; this is where the count is told.
    """
    if not over:
        return
    if overflow in ("truncate", "drop"):
        what = "truncated" if overflow == "truncate" else "dropped"
        logger.warning("%s: overflow=%r %s %d of %d examples longer than window=%d, cutting %d of %d tokens "
                       "(%.2f%%)", who, overflow, what, over, examples, window, cut_tokens, tokens,
                       100.0 * cut_tokens / max(tokens, 1))
    else:
        logger.info("%s: split %d of %d examples longer than window=%d into pieces", who, over, examples, window)


@dataclasses.dataclass(frozen=True)
class PackedColumns:
    """Packed windows of several list columns as flat arrays (the layout of Arrow list columns).

    Fields:
        columns:     name -> (T,) flat values of every window, window after window; the token column
                     first, then ``labels`` (when there were labels or a loss mask), then the rest
        row_offsets: (R + 1,) int64, window ``r`` is ``values[row_offsets[r]:row_offsets[r+1]]``
        seq_lengths: (S,) int64, segment lengths, window after window
        seq_offsets: (R + 1,) int64, window ``r`` has segments ``seq_lengths[seq_offsets[r]:seq_offsets[r+1]]``
        seg_example: (S,) int64, the source example of every segment
    """

    columns: dict
    row_offsets: np.ndarray
    seq_lengths: np.ndarray
    seq_offsets: np.ndarray
    seg_example: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.row_offsets.size - 1)

    @property
    def input_ids(self) -> np.ndarray:
        """(T,) the token column (the first one), window after window."""
        return next(iter(self.columns.values()))

    @property
    def labels(self) -> np.ndarray | None:
        """(T,) the labels, ``IGNORE_INDEX`` on every segment's first token, or None without labels."""
        return self.columns.get("labels")


#: :func:`pack_arrays`' result: the same type, with ``input_ids`` and ``labels`` read as attributes.
PackedRows = PackedColumns


def pack_columns(plan: Plan, columns, *, loss_mask: str | None = None, keep_mask: bool = False,
                 mask_first_label: bool = True, num_threads: int = 1, bar=None) -> PackedColumns:
    """Gather every column of ``plan``'s examples into packed rows: one strided copy per length group.

    Args:
        plan: the plan of the examples (its ``lengths`` are the examples' lengths in every column).
        columns: ``{name: (values, starts)}``, the token column first: ``values`` ``(N,)`` flat array,
            ``starts`` ``(num_examples,)`` int, example ``i`` is ``values[starts[i] : starts[i] + plan.lengths[i]]``
            (``offsets[:-1]`` of a CSR column; any order, so a selection of an Arrow table works).
        loss_mask: the name of a column holding a loss mask (:data:`MASK_KEYS`): ``labels`` (the
            ``labels`` column, else the token ids) become ``IGNORE_INDEX`` where it is 0
            (:func:`loss_labels`). The mask column itself is returned only with ``keep_mask``.
        mask_first_label: ``labels[first token of every segment] = IGNORE_INDEX`` (models shift labels).
        num_threads, bar: as in :func:`gather_segments`.

    Returns:
        :class:`PackedColumns`; ``labels`` in :func:`label_dtype` of their source, the other columns
        in their own dtype.
    """
    names = list(columns)
    if not names:
        raise ValueError("pack_columns needs at least the token column")
    if loss_mask is not None and loss_mask not in columns:
        raise KeyError(f"loss_mask {loss_mask!r} is not one of the columns {names}")
    seg_first = segment_starts(plan.seg_length)
    out = {}
    for name in names:
        values, starts = columns[name]
        values = np.asarray(values)
        if values.ndim != 1:
            raise ValueError(f"column {name!r}: values must be 1-D, got shape {values.shape}")
        starts = _check_starts(plan, starts, values.size, name)
        out[name] = gather_segments(values, starts[plan.seg_example] + plan.seg_start, plan.seg_length,
                                    num_threads=num_threads, bar=bar)
    token = names[0]
    if loss_mask is not None or "labels" in out:
        mask = out[loss_mask] if loss_mask is not None else None
        labels = loss_labels(out[token], out.get("labels"), mask)
        if mask_first_label:
            labels[seg_first] = IGNORE_INDEX  # a fresh array: gathered, cast or masked here
        out["labels"] = labels
        if loss_mask is not None and not keep_mask:
            del out[loss_mask]
        order = [token, "labels"] + [n for n in names if n not in (token, "labels") and n in out]
        out = {n: out[n] for n in order}
    row_offsets = np.zeros(plan.num_windows + 1, np.int64)
    np.cumsum(plan.window_loads, out=row_offsets[1:])
    return PackedColumns(columns=out, row_offsets=row_offsets, seq_lengths=plan.seg_length.copy(),
                         seq_offsets=plan.window_ptr.copy(), seg_example=plan.seg_example.copy())


def pack_arrays(plan: Plan, input_ids, offsets, labels=None, *, mask_first_label: bool = True) -> PackedColumns:
    """Gather the tokens (and labels) of ``plan`` into packed rows (:func:`pack_columns` for two columns).

    ``offsets``: ``(num_examples + 1,)`` int, example ``i`` is ``input_ids[offsets[i]:offsets[i+1]]``;
    checked against ``plan.lengths`` (:func:`check_offsets`). ``labels`` defaults to None (no labels
    column). When given it is a flat array aligned with ``input_ids``. With ``mask_first_label`` (the
    default, for models that shift labels inside, as Hugging Face's do) the first label of every
    segment becomes ``IGNORE_INDEX``, so no loss term predicts a document's first token from the
    previous document.
    """
    input_ids = np.asarray(input_ids)
    offsets = check_offsets(plan, offsets, size=input_ids.size)
    columns = {"input_ids": (input_ids, offsets[:-1])}
    if labels is not None:
        labels = np.asarray(labels)
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels have shape {labels.shape}, input_ids {input_ids.shape}: they must match")
        columns["labels"] = (labels, offsets[:-1])
    rows = pack_columns(plan, columns, mask_first_label=mask_first_label)
    if rows.labels is not None and rows.labels.dtype != np.int64:  # labels leave pack_arrays as int64
        rows = dataclasses.replace(rows, columns={**rows.columns, "labels": rows.labels.astype(np.int64)})
    return rows
