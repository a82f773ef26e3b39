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

Streams: :func:`pack_stream` packs an iterable of examples as it arrives (the windows planned by
:func:`packkit.streamplan.stream_windows`, best fit inside a bounded buffer), with the same label rule. Its
state (:meth:`PackedStream.state_dict`, between two rows) holds where its buffered pieces are in the source
and a check of their values (XXH64 or CRC-32), not their tokens: :meth:`~PackedStream.load_state_dict` reads the
source again from its start (as it must to find its place) and takes the pieces back from it, checked, so it
resumes exactly once: the same rows on the same shards, every example once on another number of shards
(:mod:`packkit.streaming` runs it behind a DataLoader)::

    >>> src = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6]}, {"input_ids": [7, 8, 9]}]
    >>> stream = pack_stream(src, window=4, buffer_size=2)
    >>> next(stream)["input_ids"].tolist()
    [1, 2, 3, 6]
    >>> again = pack_stream(src, window=4, buffer_size=2)
    >>> again.load_state_dict(stream.state_dict())      # e.g. after a restart, from a checkpoint
    >>> [row["input_ids"].tolist() for row in again]
    [[4, 5], [7, 8, 9]]
"""

from __future__ import annotations

import collections.abc
import dataclasses
import itertools
import logging
import numbers
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .binpack import DEFAULT_OVERFLOW, Plan, apply_overflow, check_overflow, check_window
from .errors import ArgumentError, DataError, MissingError, arg, check_int
from .examples import example_arrays
from .located import ExampleValueError
from .row_rules import row_segments
from .rules import DOCUMENT_KEYS, MASK_KEYS, first_bad_label, first_bad_mask, segment_key
from .segments import IGNORE_INDEX, lengths_to_offsets, segment_starts
from .states import StateError, StateFields, StateTypeError
from .streamplan import StreamBuffer, check_buffer_size, stream_windows

__all__ = [
    "MASK_KEYS",
    "check_offsets",
    "first_bad_label",
    "first_bad_mask",
    "label_dtype",
    "loss_labels",
    "gather_index",
    "gather_segments",
    "copy_segments",
    "FlatColumn",
    "PackedColumns",
    "pack_columns",
    "PackedRows",
    "pack_arrays",
    "ColumnSpec",
    "resolve_columns",
    "PackedStream",
    "StreamStats",
    "pack_stream",
]

logger = logging.getLogger("packkit")

#: Tokens copied per numpy call at most (bounds the temporary of one copy: 4M tokens).
GROUP_TOKENS = 1 << 22
#: A length group is copied as one strided block when it has at least this many segments of at most
#: this length; other segments are copied one slice each (:func:`copy_segments`).
STRIDED_MIN_SEGMENTS = 32
STRIDED_MAX_LENGTH = 512


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
    out_off = lengths_to_offsets(seg_length)
    src_start = offsets[plan.seg_example] + plan.seg_start
    index = np.repeat(src_start - out_off[:-1], seg_length) + np.arange(int(out_off[-1]), dtype=np.int64)
    return index, lengths_to_offsets(plan.window_loads)


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
    values = np.asarray(values)
    seg_length = np.asarray(seg_length, np.int64)
    dst = lengths_to_offsets(seg_length)
    out = np.empty(int(dst[-1]), values.dtype)
    copy_segments(out, dst[:-1], values, src_start, seg_length, num_threads=num_threads, bar=bar)
    return out


def copy_tasks(seg_length: np.ndarray) -> tuple[np.ndarray, list]:
    """How :func:`copy_segments` cuts its work: ``(order, tasks)``, ``order`` the segments sorted by length
    (stable), a task either ``(lo, hi, length)``, the strided copy of segments ``order[lo:hi]`` of one length,
    or an index array of up to 4,096 segments copied slice by slice (rare or long lengths).

    ``copy_tasks(np.array([5, 2]))[1] -> [array([1, 0])]`` (two lengths of one segment each: slices).
    """
    # Group segments by length (a radix sort when lengths fit in 16 bits).
    key = seg_length.astype(np.uint16) if seg_length.max() < 1 << 16 else seg_length
    order = np.argsort(key, kind="stable")
    sorted_len = seg_length[order]
    cuts = np.flatnonzero(sorted_len[1:] != sorted_len[:-1]) + 1
    tasks, singles = [], []
    for a, b in zip(np.concatenate(([0], cuts)).tolist(), np.concatenate((cuts, [order.size])).tolist()):
        length = int(sorted_len[a])
        if b - a < STRIDED_MIN_SEGMENTS or length > STRIDED_MAX_LENGTH:
            singles.append(order[a:b])
            continue
        step = max(1, GROUP_TOKENS // length)
        tasks.extend((lo, min(lo + step, b), length) for lo in range(a, b, step))
    if singles:
        # one batch of slice copies a few thousand segments long (a unit for threads and the bar)
        flat = np.concatenate(singles)
        tasks.extend(flat[i: i + 4096] for i in range(0, flat.size, 4096))
    return order, tasks


def copy_segments(out, dst_start, values, src_start, seg_length, *, num_threads: int = 1, bar=None) -> None:
    """``out[d : d + l] = values[s : s + l]`` for every ``(d, s, l)``, with few numpy calls.

    ``out = np.zeros(6, int); copy_segments(out, [3, 0], np.arange(10), [7, 4], [2, 3])`` -> ``out``
    is ``[4, 5, 6, 7, 8, 0]``.

    How: segments are grouped by length. A group of ``k`` segments of one short length ``L`` is one
    numpy copy between two strided ``(rows, L)`` views of the flat arrays (row ``r`` starts at element
    ``r``): about 20 us of overhead, then two passes over its tokens (a fancy-indexed gather, then the
    scatter). A segment of a rare or long length is one slice copy instead (about 1 us, one pass).
    Measured on SFT-like lengths in chunks of 22M tokens, the mix costs 0.8x the slice copies alone
    and 0.6x the strided groups alone, and neither needs an index of every token (which costs more
    than the copy it drives).

    Args:
        out: (M,) writable array; the destinations must not overlap.
        dst_start, src_start: (S,) int, first index of each segment in ``out`` / ``values``.
        seg_length: (S,) int >= 1.
        values: (N,) the source; it may be a view of a memory map (only the segments' pages are read).
        num_threads: copy length groups on this many threads (numpy releases the GIL while copying).
        bar: optional progress bar, advanced by tokens copied.
    """
    values = np.asarray(values)
    if values.ndim != 1 or not values.flags.c_contiguous:
        values = np.ascontiguousarray(values).reshape(-1)
    src_start = np.asarray(src_start, np.int64)
    dst_start = np.asarray(dst_start, np.int64)
    seg_length = np.asarray(seg_length, np.int64)
    if not (src_start.shape == seg_length.shape == dst_start.shape) or src_start.ndim != 1:
        raise ValueError(f"src_start {src_start.shape}, dst_start {dst_start.shape} and seg_length "
                         f"{seg_length.shape} must be equal 1-D shapes")
    if seg_length.size == 0:
        return
    if (seg_length.min() < 1 or src_start.min() < 0 or int((src_start + seg_length).max()) > values.size
            or dst_start.min() < 0 or int((dst_start + seg_length).max()) > out.size):
        raise ValueError("every segment must have length >= 1 and lie inside values and out")
    order, tasks = copy_tasks(seg_length)
    item = values.itemsize

    def copy(task) -> int:
        lo, hi, length = task
        idx = order[lo:hi]
        # Row r of these views is values[r : r + length] (resp. out[r : r + length]): rows overlap as
        # views, but the rows picked are disjoint segments, so the writes never collide.
        src = as_strided(values, shape=(values.size - length + 1, length), strides=(item, item),
                         writeable=False)
        dst = as_strided(out, shape=(out.size - length + 1, length), strides=(out.itemsize, out.itemsize))
        dst[dst_start[idx]] = src[src_start[idx]]
        return (hi - lo) * length

    def copy_singles(idx) -> int:
        d, s, n = dst_start[idx].tolist(), src_start[idx].tolist(), seg_length[idx].tolist()
        for d_, s_, n_ in zip(d, s, n):
            out[d_: d_ + n_] = values[s_: s_ + n_]
        return sum(n)

    run = lambda t: copy(t) if isinstance(t, tuple) else copy_singles(t)  # noqa: E731
    if num_threads > 1 and len(tasks) > 1:
        with ThreadPoolExecutor(num_threads) as pool:
            for n in pool.map(run, tasks):
                if bar is not None:
                    bar.update(n)
    else:
        for task in tasks:
            n = run(task)
            if bar is not None:
                bar.update(n)


@dataclasses.dataclass(frozen=True, eq=False)
class FlatColumn:
    """A list column as flat values that may live in several buffers (regions), without a copy.

    Example ``i`` is ``regions[region[i]][starts[i] : starts[i] + length_i]`` (``region=None``: every
    example is in ``regions[0]``). A region is any 1-D numpy array, e.g. a view of a memory-mapped
    Arrow file that spans all its record batches, so a column of a thousand record batches is one
    region and a gather reads only the pages its segments touch.

    Fields:
        regions: list of (N_r,) arrays
        region:  (num_examples,) integer region of every example, or None
        starts:  (num_examples,) int64, first element of every example inside its region
        dtype:   the gathered values' dtype (default: the first region's; other regions are cast)

    ``FlatColumn.single(np.arange(5), [0, 3]).gather([1, 0], [0, 1], [2, 2]) -> [3, 4, 1, 2]``.
    """

    regions: list
    region: np.ndarray | None
    starts: np.ndarray
    dtype: np.dtype | None = None

    def __post_init__(self):
        if self.dtype is None:
            object.__setattr__(self, "dtype", self.regions[0].dtype)

    @classmethod
    def single(cls, values, starts) -> "FlatColumn":
        """One flat array and the start of every example in it."""
        return cls([np.asarray(values)], None, np.asarray(starts, np.int64))

    def gather(self, seg_example, seg_start, seg_length, *, num_threads: int = 1, bar=None) -> np.ndarray:
        """The segments back to back: ``(sum(seg_length),)`` of :attr:`dtype` (one copy per region and
        length group, :func:`copy_segments`)."""
        seg_example = np.asarray(seg_example, np.int64)
        seg_length = np.asarray(seg_length, np.int64)
        dst = lengths_to_offsets(seg_length)
        out = np.empty(int(dst[-1]), self.dtype)
        src = self.starts[seg_example] + np.asarray(seg_start, np.int64)
        if self.region is None or len(self.regions) == 1:
            copy_segments(out, dst[:-1], self.regions[0], src, seg_length, num_threads=num_threads, bar=bar)
            return out
        reg = self.region[seg_example]
        order = np.argsort(reg, kind="stable")
        bounds = np.searchsorted(reg[order], np.arange(len(self.regions) + 1))
        for r in np.flatnonzero(np.diff(bounds)).tolist():
            idx = order[bounds[r]: bounds[r + 1]]
            copy_segments(out, dst[idx], self.regions[r], src[idx], seg_length[idx], num_threads=num_threads,
                          bar=bar)
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
        logger.warning("%s: split %d of %d examples longer than window=%d into pieces of at most the window "
                       "(every token kept; a piece sees only its own window)", who, over, examples, window)


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


def _with_labels(packed: dict, *, mask: str | None = None, keep_mask: bool = False, other_masks=(),
                first=None) -> dict:
    """The packed columns of some windows (token column first), with ``labels`` made as every packer makes them.

    ``labels`` are the ``labels`` column, else the token ids; ``IGNORE_INDEX`` where the loss-mask
    column ``mask`` is 0 (where any of ``mask`` and ``other_masks`` is 0: both of :data:`MASK_KEYS`
    given) and at the flat positions ``first`` (each segment's first token, for models that shift
    labels; None: none). ``other_masks`` are dropped, and ``mask`` too unless ``keep_mask``. Returns
    the columns in the written order: tokens, labels, then the rest as given; ``packed`` as it is when
    it has neither labels nor a mask. ``packed``'s arrays must be fresh (gathered or concatenated): the
    labels may be written in place.

    ``_with_labels({"input_ids": [5, 6, 7, 8], "completion_mask": [0, 1, 1, 1]}, mask="completion_mask",
    first=[0, 2])`` -> ``{"input_ids": [5, 6, 7, 8], "labels": [-100, 6, -100, 8]}``.
    """
    if mask is None and "labels" not in packed:
        return packed
    out = dict(packed)
    token = next(iter(out))
    loss = out[mask] if mask is not None else None
    for name in other_masks:  # both masks: the loss where both are 1
        loss = (loss != 0) & (out.pop(name) != 0)
    labels = loss_labels(out[token], out.get("labels"), loss)
    if first is not None:
        labels[first] = IGNORE_INDEX  # a fresh array: gathered, concatenated, cast or masked
    out["labels"] = labels
    if mask is not None and not keep_mask:
        del out[mask]
    return {n: out[n] for n in [token, "labels"] + [n for n in out if n not in (token, "labels")]}


def pack_columns(plan: Plan, columns, *, loss_mask: str | None = None, keep_mask: bool = False,
                 extra_masks=(), mask_first_label: bool = True, num_threads: int = 1, bar=None) -> PackedColumns:
    """Gather every column of ``plan``'s examples into packed rows: one strided copy per length group.

    Args:
        plan: the plan of the examples (its ``lengths`` are the examples' lengths in every column).
        columns: ``{name: (values, starts)}``, the token column first: ``values`` ``(N,)`` flat array,
            ``starts`` ``(num_examples,)`` int, example ``i`` is ``values[starts[i] : starts[i] + plan.lengths[i]]``
            (``offsets[:-1]`` of a CSR column; any order, so a selection of an Arrow table works);
            or ``{name: FlatColumn}`` (values in several buffers, e.g. memory-mapped record batches;
            trusted to match ``plan.lengths``).
        loss_mask: the name of a column holding a loss mask (:data:`MASK_KEYS`): ``labels`` (the
            ``labels`` column, else the token ids) become ``IGNORE_INDEX`` where it is 0
            (:func:`loss_labels`). The mask column itself is returned only with ``keep_mask``.
        extra_masks: more loss-mask columns (both of :data:`MASK_KEYS` given): the loss is taken where
            every mask is 1; they are not returned.
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
    seg_first = segment_starts(plan.seg_length) if mask_first_label else None
    out = {}
    for name in names:
        col = columns[name]
        if not isinstance(col, FlatColumn):
            values, starts = col
            values = np.asarray(values)
            if values.ndim != 1:
                raise ValueError(f"column {name!r}: values must be 1-D, got shape {values.shape}")
            col = FlatColumn([values], None, _check_starts(plan, starts, values.size, name))
        out[name] = col.gather(plan.seg_example, plan.seg_start, plan.seg_length, num_threads=num_threads, bar=bar)
    out = _with_labels(out, mask=loss_mask, keep_mask=keep_mask, other_masks=extra_masks, first=seg_first)
    return PackedColumns(columns=out, row_offsets=lengths_to_offsets(plan.window_loads), seq_lengths=plan.seg_length.copy(),
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


# ----------------------------------------------------------------------------------------------
# which columns move together
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ColumnSpec:
    """The list columns to pack (token column first), the loss-mask column among them (or None), and
    whether the mask is also written (else it only turns into labels)."""

    read: list
    mask: str | None
    keep_mask: bool

    @property
    def other_masks(self) -> list:
        """Loss masks read besides ``mask`` (both of MASK_KEYS present): ANDed into ``mask``, not written."""
        return [c for c in self.read if c in MASK_KEYS and c != self.mask]

    def written(self) -> list:
        """Output list columns in order: tokens, labels (given or from the mask), then the rest."""
        has_labels = "labels" in self.read or self.mask is not None
        rest = [c for c in self.read[1:] if c != "labels" and c not in self.other_masks
                and (c != self.mask or self.keep_mask)]
        return [self.read[0]] + (["labels"] if has_labels else []) + rest


def resolve_columns(names, columns) -> ColumnSpec:
    """The list columns to pack: ``None`` -> input_ids (+ labels, + every one of MASK_KEYS present).

    A loss mask becomes labels (-100 where it is 0; where either is 0 when both masks are present), so a
    mask is never dropped in silence; it is written too only when ``columns`` names it (then only one).
    """
    if columns is None:
        if "input_ids" not in names:
            raise MissingError("no 'input_ids' column; the columns are {names}: pass {columns}", names=list(names),
                               columns=arg("columns", metavar="NAME,..."))
        masks = [k for k in MASK_KEYS if k in names]
        read = ["input_ids"] + (["labels"] if "labels" in names else []) + masks
        return ColumnSpec(read, masks[0] if masks else None, keep_mask=False)
    if isinstance(columns, str):
        columns = [columns]
    columns = list(columns)
    if not columns:
        raise ValueError("columns must name at least the token column")
    for c in columns:
        if c not in names:
            raise KeyError(f"column {c!r} is not in the dataset; the columns are {list(names)}")
    if len(set(columns)) != len(columns):
        raise ValueError(f"columns {columns} name a column twice")
    for reserved in ("seq_lengths", *DOCUMENT_KEYS):
        if reserved in columns:
            raise ValueError(f"column {reserved!r} is written by packing; it cannot be packed itself")
    if columns[0] in MASK_KEYS:
        raise ValueError(f"the first column is the token column; {columns[0]!r} is a loss mask")
    masks = [c for c in columns if c in MASK_KEYS]
    if len(masks) > 1:
        raise ValueError(f"columns name two loss masks {masks}; name one (with columns=None both are read "
                         "and the loss is taken where both are 1)")
    return ColumnSpec(columns, masks[0] if masks else None, keep_mask=True)


# ----------------------------------------------------------------------------------------------
# streams: windows packed as examples arrive (streamplan.stream_windows plans them)
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StreamStats:
    """What a stream packer has done so far.

    Fields: ``examples`` read, ``tokens`` read, ``windows`` emitted, ``packed_tokens`` emitted,
    ``cut_tokens`` (truncate/drop), ``truncated_examples``, ``dropped_examples``, ``split_examples``,
    ``fill`` (packed tokens over windows x W, 1.0 before any window).
    """

    window: int
    examples: int
    tokens: int
    windows: int
    packed_tokens: int
    cut_tokens: int
    truncated_examples: int
    dropped_examples: int
    split_examples: int

    @property
    def fill(self) -> float:
        return self.packed_tokens / (self.windows * self.window) if self.windows else 1.0


#: The version of the state :meth:`PackedStream.state_dict` writes. :meth:`~PackedStream.load_state_dict` reads it and
#: version 2 (its values checked by CRC-32, before the field ``check``); version 1 held the pieces' tokens, as base64.
STREAM_STATE_VERSION = 3
#: The checks a stream state may keep of the values it points at (its field ``check``), and their widths in bits:
#: XXH64 (the xxhash package, a dependency), 0.45 us a 1,400-token int32 piece, or, in an install without it,
#: zlib's CRC-32, 1.1-1.3 us (most of what a state every 100 rows cost), which sees any one value changed (XXH64
#: misses a change with a chance of 2**-64, CRC-32 one of several with 2**-32). Not XXH3 (0.3 us): a state every
#: row made the whole stream 1.07x slower with it on a Xeon, most likely its AVX-512 code.
STATE_CHECK_BITS = {"xxh64": 64, "crc32": 32}
#: What :class:`StreamStats` counts (and a stream state carries).
STREAM_COUNTS = ("examples", "tokens", "windows", "packed_tokens", "cut_tokens", "truncated_examples",
                 "dropped_examples", "split_examples")


def _check_function(name: str):
    """The function ``(bytes, seed) -> int`` of the state check ``name`` (:data:`STATE_CHECK_BITS`), None for
    ``"xxh64"`` where xxhash is not installed (imported here, not on the command line's path)."""
    if name == "crc32":
        return zlib.crc32
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash.xxh64_intdigest


def _digest(digest, a: np.ndarray, seed: int = 0) -> int:
    """``digest`` (a state check's function) of an array's bytes in its dtype, continuing ``seed``; no copy (nor
    numpy call, 0.3 us) for a contiguous array: ``_digest(zlib.crc32, np.int32([1, 2])) ==
    zlib.crc32(np.int32([1, 2]).tobytes())``."""
    return digest(a if a.flags.c_contiguous else np.ascontiguousarray(a), seed)


#: Buffered pieces a group of a stream state's buffer holds at most (:meth:`PackedStream._buffer_entries`).
STATE_GROUP = 32
#: The count an overflow policy adds an example it cut or dropped to.
_OVERFLOW_COUNT = {"truncate": "truncated_examples", "drop": "dropped_examples", "split": "split_examples"}


def _popped(queue: collections.deque):
    """The items of ``queue``, each taken out as it is given: ``list(_popped(deque([1, 2]))) -> [1, 2]``."""
    while queue:
        yield queue.popleft()


def _dataset_rows(ds, batch_size: int = 256):
    """The rows of a ``datasets.IterableDataset`` through its public ``iter`` (read whole in a DataLoader
    worker too, where iterating it directly yields only that worker's files)."""
    for batch in ds.iter(batch_size=batch_size):
        keys = list(batch)
        for r in range(len(batch[keys[0]]) if keys else 0):
            yield {k: batch[k][r] for k in keys}


class PackedStream:
    """Iterator of packed rows from an iterable of examples (see :func:`pack_stream`), with a state.

    Shards: a stream that is shard ``s`` of ``S`` (ranks x DataLoader workers) packs the examples whose
    index in the source is ``s`` modulo ``S``; every shard reads the source from its start.

    State (:meth:`state_dict`, taken between two rows): the options, the examples read (everything before
    ``position`` of this shard's share, and the indices in ``skip``), the buffer of pieces read and not yet
    packed and the pieces of an example cut but not yet buffered (``pending``), each as where it is in the
    source and a check of its values (``check``: :data:`STATE_CHECK_BITS`), the counts, and the check of the
    last example read's tokens.
    :meth:`load_state_dict` restores it; a list of every shard's state resumes on any number of shards.
    """

    def __init__(self, examples, *, window, buffer_size, overflow, columns, mask_first_label, example_ids,
                 shard: int = 0, num_shards: int = 1):
        self.window = check_window(window)
        check_overflow(overflow)
        self._buffer_size = check_buffer_size(buffer_size)
        self._num_shards = check_int(num_shards, "num_shards")
        self._shard = check_int(shard, "shard", low=0, high=self._num_shards - 1)
        if isinstance(columns, str):
            columns = [columns]
        self._columns_arg = None if columns is None else list(columns)
        self._columns = self._mask = None
        self._keep_mask = False
        self._other_masks = []
        if columns is not None:
            self._set_columns(resolve_columns(list(columns), columns))
        self._examples = examples
        self._one_shot = isinstance(examples, collections.abc.Iterator)
        self._overflow = overflow
        self._mask_first_label = mask_first_label
        self._example_ids = example_ids
        check = "xxh64" if _check_function("xxh64") else "crc32"
        self._restore(_StreamPosition(start=0, skip=(), position=0, checks={}, items=[], pending=[],
                                      counts=dict.fromkeys(STREAM_COUNTS, 0), check=check))

    def _restore(self, pos: "_StreamPosition") -> None:
        """Start from ``pos``: the source is read again from its start when the next row is asked for."""
        self._start, self._skip, self._position = pos.start, frozenset(pos.skip), pos.position
        self._begin = pos.position  # examples before it (but those in skip) were read before this resume
        self._checks = dict(pos.checks)
        self._check, self._digest = pos.check, _check_function(pos.check)  # what checks the values pointed at
        self._counts = dict(pos.counts)
        self._pending = collections.deque(pos.pending)
        self._buffer = StreamBuffer(pos.items)
        self._groups, self._group_lists, self._entries_seen = {}, {}, 0  # the buffer's state entries (_buffer_entries)
        self._unread = {}  # example index -> the restored pieces of it whose tokens are to be read again
        for p, _ in (*pos.items, *pos.pending):
            if p[2] is None:
                self._unread.setdefault(p[0], []).append(p)
        self._last = None  # (index, token ids or their digest) of the last example read
        self._read_any = False
        self._reader = None  # enumerate(source), shared by _refill and _items (made by the first of them)
        self._ahead = collections.deque()  # (index, example) read by _refill that this shard packs
        self._rows = stream_windows(self._items(), window=self.window, buffer_size=self._buffer_size,
                                    buffer=self._buffer)

    @property
    def stats(self) -> StreamStats:
        return StreamStats(window=self.window, **self._counts)

    def _set_columns(self, spec: ColumnSpec) -> None:
        self._columns, self._mask, self._keep_mask = spec.read, spec.mask, spec.keep_mask
        self._other_masks = spec.other_masks

    def _example_arrays(self, i: int, ex) -> dict:
        """Example ``i``'s columns, checked by :func:`packkit.examples.example_arrays`. The stream's
        columns are ``columns=`` or its first example's: an example without labels or a loss mask is
        honoured (its token ids are its labels, loss on every token); one that carries a labels or
        loss-mask key the stream does not read is an error (its rows so far have no room for it)."""
        if self._columns is None:
            if not isinstance(ex, collections.abc.Mapping) or ex.get("input_ids") is None:
                example_arrays(ex, ["input_ids"], index=i)  # raises, naming example i
            self._set_columns(resolve_columns([k for k in ex.keys() if ex[k] is not None], None))
        out = example_arrays(ex, self._columns, index=i)
        if isinstance(ex, collections.abc.Mapping):
            extra = [k for k in ("labels", *MASK_KEYS) if k not in self._columns and ex.get(k) is not None]
            if extra:
                raise ValueError(f"example {i} has {extra[0]!r}, which this stream's first example did not "
                                 f"have; pass columns={[*self._columns, extra[0]]!r} to read it on every example")
        ids = out[self._columns[0]]
        for c in self._columns[1:]:
            if c not in out:
                if c == "labels":
                    out[c] = ids
                elif c in MASK_KEYS:
                    out[c] = np.ones(ids.size, np.int8)
                else:
                    raise ValueError(f"example {i} has no {c!r}; every example of the stream needs the columns "
                                     f"{self._columns}")
        return out

    def _documents(self, i: int, ex, arrays: dict) -> tuple[list, list]:
        """Example ``i`` as its documents and what each records of its whole example's loss tokens:
        ``([arrays], [None])``, or for a packed row (``seq_lengths`` or restarting ``position_ids``,
        :func:`packkit.row_rules.row_segments`) one dict of views per document, and the row's ``example_loss``
        where it has one (a piece of an example split when it was packed keeps its example's count)."""
        if not isinstance(ex, collections.abc.Mapping):
            return [arrays], [None]
        key = segment_key(k for k, v in ex.items() if v is not None)
        if key is None:
            return [arrays], [None]
        n = arrays[self._columns[0]].size
        flat = np.asarray(ex[key]).reshape(-1)
        try:
            seg, _ = row_segments(key, flat, [flat.size], [n])
        except ExampleValueError as exc:
            raise ExampleValueError(f"example {i} {exc.text}", i, exc.text) from None
        starts = lengths_to_offsets(seg)[:-1].tolist()
        docs = [{c: a[s: s + m] for c, a in arrays.items()} for s, m in zip(starts, seg.tolist())]
        recorded = ex.get("example_loss")
        if recorded is None or not self._example_ids:
            return docs, [None] * len(docs)
        recorded = np.asarray(recorded).reshape(-1)
        if recorded.size != len(docs) or recorded.dtype.kind not in "iu" or (recorded < 0).any():
            raise ExampleValueError(f"example {i} records example_loss {recorded.tolist()} for its {len(docs)} documents "
                                    f"({key}): one loss-token count >= 0 a document, as packkit pack writes it", i)
        return docs, recorded.tolist()

    def _source(self):
        """The source from its start (a ``datasets.IterableDataset`` read whole, see :func:`_dataset_rows`)."""
        datasets = sys.modules.get("datasets")
        if datasets is not None and isinstance(self._examples, datasets.IterableDataset):
            return _dataset_rows(self._examples)
        return iter(self._examples)

    def _check_digest(self, j: int, ex) -> None:
        """Example ``j`` must be the one the state was saved after (the same source, from its start)."""
        want = self._checks.pop(j)
        got = _digest(self._digest, example_arrays(ex, self._columns[:1], index=j)[self._columns[0]])
        if got != want:
            raise DataError(f"example {j} of the source is not the example {j} the stream state was saved after "
                            "(its tokens differ): resume over the same source, iterated from its start")

    def _read(self):
        """The source's ``(index, example)`` from its start, once per stream (see :meth:`_source`)."""
        if self._reader is None:
            self._read_any = True
            self._reader = enumerate(self._source())
        return self._reader

    def _mine(self, j: int) -> bool:
        """Whether this shard packs example ``j`` now: not read before this resume, not another shard's."""
        return j >= self._begin and j % self._num_shards == self._shard and j not in self._skip

    def _source_ended(self):
        """Refuse a source that ended before an example the state was saved after or holds a piece of."""
        j = min([*self._checks, *self._unread])
        what = "was saved after" if j in self._checks else "holds a piece of"
        raise DataError(f"the source ended before example {j}, which the stream state {what}: resume over the same "
                        "source, iterated from its start")

    def _refill(self) -> None:
        """Give the pieces a loaded state holds their tokens, read again from the source (from its start, up
        to the last example they come from), each checked against the check it was saved with. The examples this
        shard packs that are read on the way (a resume on other shards) wait for :meth:`_items`."""
        checks, unread = self._checks, self._unread
        for j, ex in self._read():
            if checks and j in checks:
                self._check_digest(j, ex)
            if self._mine(j):
                self._ahead.append((j, ex))
            waiting = unread.pop(j, None)
            if waiting:
                arrays = self._example_arrays(j, ex)
                docs = self._documents(j, ex, arrays)[0]
                for p in waiting:
                    _, d, start, n, crc = p[3][:5]
                    piece = None
                    if d < len(docs) and start + n <= docs[d][self._columns[0]].size:
                        piece = {c: a[start: start + n] for c, a in docs[d].items()}
                    if piece is None or _piece_check(piece, self._digest) != crc:
                        raise DataError(f"example {j} of the source is not the example {j} the stream state holds a "
                                        f"piece of (its tokens {start} to {start + n} of document {d} differ): "
                                        "resume over the same source, iterated from its start")
                    p[2] = piece
            if not unread:
                return
        self._source_ended()

    def _items(self):
        """``(payload, length)`` of every piece of this shard's examples, the ``pending`` pieces first.

        A payload is ``[example index, start in the document, {column: array}, cached state entry, whole
        example's loss tokens, document in the example]`` (the loss tokens None unless the example is split
        into several pieces and ``example_ids``; the document 0 unless the example is a packed row)."""
        W, counts, pending, checks, mine = self.window, self._counts, self._pending, self._checks, self._mine
        while pending:
            yield pending.popleft()
        for j, ex in itertools.chain(_popped(self._ahead), self._read()):
            if checks and j in checks:
                self._check_digest(j, ex)
            if not mine(j):  # read before this resume, or another shard's
                continue
            arrays = self._example_arrays(j, ex)
            self._position, self._last = j + 1, (j, arrays[self._columns[0]])
            got = []
            for d, (arrays, recorded) in enumerate(zip(*self._documents(j, ex, arrays))):  # a packed row: documents
                n = arrays[self._columns[0]].size
                counts["examples"] += 1
                counts["tokens"] += n
                if n <= W:
                    got.append(([j, 0, arrays, None, recorded, d], n))
                    continue
                pieces = apply_overflow([n], window=W, overflow=self._overflow, in_order=True, first=j)
                counts["cut_tokens"] += pieces.cut_tokens
                counts[_OVERFLOW_COUNT[self._overflow]] += 1
                starts, lengths = pieces.start.tolist(), pieces.length.tolist()
                whole = None  # split: its pieces' loss tokens (for a recorded example's piece, its count less the piece's)
                if self._example_ids and starts and (len(starts) > 1 or recorded is not None):
                    whole = self._whole_loss(arrays, starts, lengths) + (
                        0 if recorded is None else recorded - self._whole_loss(arrays, [0], [n]))
                for p, length in zip(starts, lengths):
                    got.append(([j, p, {c: a[p: p + length] for c, a in arrays.items()}, None, whole, d], length))
            if len(got) == 1:
                yield got[0]
            else:  # pieces not yet buffered are part of the state while the buffer takes them one by one
                pending.extend(got)
                while pending:
                    yield pending.popleft()
        if checks:
            self._source_ended()

    def _whole_loss(self, arrays: dict, starts: list, lengths: list) -> int:
        """The loss tokens of an example split into pieces at ``starts`` (``lengths`` tokens each), as its rows
        will carry them (each piece's labels made as :meth:`__next__` makes a row's, its first masked under
        ``mask_first_label``), summed over its pieces: every piece records it (``example_loss``)."""
        labels = _with_labels({c: a.copy() for c, a in arrays.items()}, mask=self._mask, keep_mask=False,
                              other_masks=self._other_masks).get("labels")
        return int(_segment_loss(labels, np.array(lengths), self._mask_first_label, starts=np.array(starts)).sum())

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._unread:
            self._refill()
        win = next(self._rows)
        cols = self._columns
        lengths = np.array([p[2][cols[0]].size for p in win], np.int32)
        row = _with_labels({c: np.concatenate([p[2][c] for p in win]) for c in cols}, mask=self._mask,
                          keep_mask=self._keep_mask, other_masks=self._other_masks,
                          first=segment_starts(lengths) if self._mask_first_label else None)
        row["seq_lengths"] = lengths
        if self._example_ids:  # each document's example, where it starts in it, and the whole example's loss tokens
            row["example_ids"] = np.array([p[0] for p in win], np.int64)
            row["piece_offsets"] = np.array([p[1] for p in win], np.int32)
            own = _segment_loss(row.get("labels"), lengths, False)  # the row's labels: first labels masked already
            row["example_loss"] = np.array([own[k] if p[4] is None else p[4] for k, p in enumerate(win)], np.int32)
        self._counts["windows"] += 1
        self._counts["packed_tokens"] += int(lengths.sum())
        return row

    # -- state ---------------------------------------------------------------------------------

    def _options(self) -> dict:
        return {"window": self.window, "buffer_size": self._buffer_size, "overflow": self._overflow,
                "columns": self._columns_arg, "mask_first_label": self._mask_first_label,
                "example_ids": self._example_ids}

    def state_dict(self) -> dict:
        """Where this shard of the stream is, between two rows: JSON-safe, loaded by :meth:`load_state_dict`.

        Holds where each piece buffered (at most ``buffer_size``) or pending is in the source and the check of
        its columns, not its tokens (:func:`_item_entry`): a few integers a piece whatever its length, built
        once, in groups (:meth:`_buffer_entries`) so that saving after every row, as torchdata's
        ``StatefulDataLoader`` does, builds (and sends) the groups that changed only.
        """
        checks = dict(self._checks)
        if self._last is not None:
            j, ids = self._last
            if not isinstance(ids, int):  # keep the digest, not the tokens
                ids = _digest(self._digest, ids)
                self._last = (j, ids)
            checks[j] = ids
        return {
            "version": STREAM_STATE_VERSION,
            **self._options(),
            "check": self._check,
            "read": None if self._columns is None else list(self._columns),
            "shard": self._shard,
            "num_shards": self._num_shards,
            "start": self._start,
            "skip": sorted(self._skip),
            "position": self._position,
            "checks": [[j, c] for j, c in sorted(checks.items())],
            "buffer": self._buffer_entries(),
            "pending": [_item_entry(p, self._digest) for p, _ in self._pending],
            "stats": dict(self._counts),
        }

    def _buffer_entries(self) -> dict:
        """``{group: [entry, ...]}`` of the buffer: a group holds the pieces whose arrival numbers have the same
        quotient by ``STATE_GROUP`` (its key), oldest first. The entries are kept between calls and brought
        up to date from what the buffer took (:attr:`StreamBuffer.taken`) and received since; a group that
        changed is a new list, one that did not is the list the last state held. So a state costs the groups
        that changed (three or so a row) and a copy of about ``buffer_size / STATE_GROUP`` keys, not of the
        buffer (a dict of 1,000 entries: 38,000 instructions a copy, 15% of a row's packing), and torchdata's
        incremental worker state walks that many values, not one a piece (0.7 ms a step at 1,000 pieces)."""
        buf, groups, lists = self._buffer, self._groups, self._group_lists
        changed = set()
        if buf.taken is None:  # the first state of this buffer: every entry
            buf.taken = []
            seen = min(buf.held, default=buf.seq)
        else:
            for seq in buf.taken:
                g = seq // STATE_GROUP
                if groups.get(g, {}).pop(seq, None) is not None:
                    changed.add(g)
            buf.taken.clear()
            seen = self._entries_seen
        held = buf.held
        for seq in range(seen, buf.seq):
            p = held.get(seq)
            if p is not None:
                g = seq // STATE_GROUP
                groups.setdefault(g, {})[seq] = _item_entry(p, self._digest)
                changed.add(g)
        self._entries_seen = buf.seq
        for g in changed:
            if groups[g]:
                lists[str(g)] = list(groups[g].values())
            else:
                del groups[g], lists[str(g)]
        return dict(lists)

    def load_state_dict(self, state) -> None:
        """Resume from :meth:`state_dict`'s dict (this shard's), or from the list of every shard's states of
        a run on any number of shards (ranks x workers).

        Same shards: the rows that follow are exactly those the saved stream would have given next (the
        buffer and the pieces not yet buffered are restored). Another number of shards: the examples read
        and not yet packed are dealt to the new shards (index modulo shards), the examples not read are
        read once by their new shard; every example is packed once, in other windows.

        Every field is checked first (type, range, consistency with this stream's options and shard); a
        refused state leaves the stream as it was. The source is read again from its start up to the
        position (not packed): the example the state was saved after is checked by its check then, and the
        pieces the state holds take their tokens from it again before the first row, each checked by its check.
        """
        states = state if isinstance(state, (list, tuple)) else None
        if states is not None:
            if not states:
                raise StateError("stream state: the list of shard states is empty; pass every shard's state_dict()")
            parsed = [self._parse(st) for st in states]
            pos = _share(parsed, shard=self._shard, num_shards=self._num_shards)
        else:
            parsed = [self._parse(state)]
            p = parsed[0]
            if p.num_shards == 1 and self._num_shards != 1:
                pos = _share(parsed, shard=self._shard, num_shards=self._num_shards)
            elif (p.shard, p.num_shards) != (self._shard, self._num_shards):
                raise StateError(f"stream state field 'shard': the state is shard {p.shard} of {p.num_shards}, this "
                                 f"stream is shard {self._shard} of {self._num_shards}: pass the list of every "
                                 "shard's state to resume on another number of ranks or workers")
            else:
                pos = p.pos
        if self._one_shot and self._read_any:
            raise ArgumentError("load_state_dict on a stream that has read from its one-shot iterator: build a new "
                                "pack_stream over a fresh iterator of the source, then load the state")
        read = next((p.read for p in parsed if p.read is not None), None)
        if read is not None and self._columns is None:
            self._set_columns(resolve_columns(read, None))
        self._restore(pos)

    def _parse(self, state) -> "_ParsedState":
        """Every field of ``state`` checked against this stream's options; nothing assigned."""
        f = StateFields(state, owner="stream", versions=(2, STREAM_STATE_VERSION))
        for name, mine in self._options().items():
            f.equal(name, mine, "the state was saved by a stream with other options: build pack_stream with "
                    "the options it was saved with")
        check = "crc32" if f.version == 2 else f.get("check")  # version 2 checked by CRC-32, without the field
        if not isinstance(check, str) or check not in STATE_CHECK_BITS:
            f.fail("check", f"{check!r} is not one of the checks {list(STATE_CHECK_BITS)}")
        if _check_function(check) is None:
            f.fail("check", f"{check!r} needs the xxhash package, not installed here: pip install xxhash")
        bits = STATE_CHECK_BITS[check]
        read = f.get("read")
        if read is not None and not (isinstance(read, list) and read and all(isinstance(c, str) for c in read)):
            f.fail("read", f"must be a list of column names or None, got {read!r}", StateTypeError)
        if read is not None and self._columns is not None and read != list(self._columns):
            f.fail("read", f"the state's stream read the columns {read}, this one reads {list(self._columns)}")
        if read is not None and self._columns is None and "input_ids" not in read:  # what resolve_columns reads
            f.fail("read", f"{read} lacks 'input_ids', which a stream given no columns reads first: pass the dict "
                   "state_dict() returned")
        num_shards = f.int("num_shards", low=1)
        shard = f.int("shard", low=0, high=num_shards - 1)
        start = f.int("start")
        position = f.int("position", low=start)
        skip = _int_list(f, "skip", low=start)
        if any(b <= a for a, b in zip(skip, skip[1:])):
            f.fail("skip", "must be sorted, without repeats")
        checks = {}
        raw = f.get("checks")
        if not isinstance(raw, list):
            f.fail("checks", f"must be a list of [example, {check}] pairs, got {type(raw).__name__}", StateTypeError)
        for pair in raw:
            ok = (isinstance(pair, (list, tuple)) and len(pair) == 2
                  and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in pair))
            if not ok or not (0 <= pair[0] < max(position, 1 + max(skip, default=-1))) or not 0 <= pair[1] < 2**bits:
                f.fail("checks", f"{pair!r} is not an [example read, {check}] pair")
            checks[int(pair[0])] = int(pair[1])
        raw = f.get("buffer")
        if not isinstance(raw, collections.abc.Mapping):
            f.fail("buffer", f"must be a dict of groups of buffered pieces, got {type(raw).__name__}", StateTypeError)
        try:
            order = sorted(raw, key=int)
        except (TypeError, ValueError):
            f.fail("buffer", "its keys must be the group numbers state_dict() wrote")
        for k in order:
            if not isinstance(raw[k], list) or not raw[k]:
                f.fail("buffer", f"group {k} must be a list of pieces, got {raw[k]!r:.40}", StateTypeError)
        items = [_parse_item(f, "buffer", f"{k}.{i}", x, self.window, check)
                 for k in order for i, x in enumerate(raw[k])]
        raw = f.get("pending")
        if not isinstance(raw, list):
            f.fail("pending", f"must be a list of pieces, got {type(raw).__name__}", StateTypeError)
        pending = [_parse_item(f, "pending", k, x, self.window, check) for k, x in enumerate(raw)]
        skipped = set(skip)
        for name, group in (("buffer", items), ("pending", pending)):
            for k, (p, _) in enumerate(group):
                j = p[0]
                if j % num_shards != shard or not (j < position or j in skipped):
                    f.fail(name, f"entry {k}: example {j} is not one shard {shard} of {num_shards} has read "
                           f"(position {position})")
        if (items or pending) and read is None:
            f.fail("read", "None, but the state buffers examples: pass the dict state_dict() returned")
        raw = f.get("stats")
        if not isinstance(raw, collections.abc.Mapping) or sorted(raw) != sorted(STREAM_COUNTS):
            f.fail("stats", f"must be a dict of the counts {list(STREAM_COUNTS)}", StateTypeError)
        counts = {}
        for name in STREAM_COUNTS:
            v = raw[name]
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                f.fail("stats", f"count {name!r} must be an integer of at least 0, got {v!r}")
            counts[name] = int(v)
        f.done()
        pos = _StreamPosition(start=start, skip=tuple(skip), position=position, checks=checks, items=items,
                              pending=pending, counts=counts, check=check)
        return _ParsedState(shard=shard, num_shards=num_shards, read=read, pos=pos)


@dataclasses.dataclass(frozen=True)
class _StreamPosition:
    """What a stream resumes from: examples before ``start`` and those in ``skip`` were read; a shard has
    read its share of ``[start, position)``; ``items`` (buffered) and ``pending`` as ``(payload, length)``."""

    start: int
    skip: tuple
    position: int
    checks: dict
    items: list
    pending: list
    counts: dict
    check: str  # the state check of the values in checks, items and pending (STATE_CHECK_BITS)


@dataclasses.dataclass(frozen=True)
class _ParsedState:
    shard: int
    num_shards: int
    read: list | None
    pos: _StreamPosition


def _segment_loss(labels, lengths: np.ndarray, mask_first_label: bool, *, starts=None) -> np.ndarray:
    """``(S,)`` loss tokens of segments of ``lengths`` tokens laid end to end over ``labels`` (or starting at
    ``starts``): labels other than -100, less each segment's first under ``mask_first_label``; with no labels every
    token but the first, as a collator takes a row without labels. The one count of it: the stream's rows here and
    the rows :meth:`packkit.outputs.PackedTable.segment_loss` writes.
    ``_segment_loss(np.array([-100, 5, 6, 7]), np.array([2, 2]), True) -> [1, 1]``."""
    lengths = np.asarray(lengths, np.int64)
    if labels is None:
        return np.maximum(lengths - 1, 0)
    starts = lengths_to_offsets(lengths)[:-1] if starts is None else np.asarray(starts, np.int64)
    csum = lengths_to_offsets(labels != IGNORE_INDEX)
    first = np.minimum(starts + 1, starts + lengths) if mask_first_label else starts
    return csum[starts + lengths] - csum[first]


def _piece_check(arrays: dict, digest) -> int:
    """A state check (``digest``, :func:`_check_function`'s) of a piece's columns, their bytes one after the other
    in their dtypes: what a state keeps of the piece's values, to check them by when they are read again.
    ``_piece_check({"input_ids": np.int32([1, 2])}, zlib.crc32) == zlib.crc32(np.int32([1, 2]).tobytes())``."""
    h = 0
    for a in arrays.values():
        h = _digest(digest, a, h)
    return h


def _item_entry(payload, digest) -> list:
    """The state entry of a buffered or pending piece, built once per piece: ``[example, document, start,
    length, check]`` (the document 0 but in a packed row; the check :func:`_piece_check`'s), and a sixth item for a
    piece of an example split into several, its whole example's loss tokens (``example_loss``). Where the piece
    is in the source, not its tokens: :meth:`PackedStream._refill` reads them again and checks them.
    JSON-safe, a few integers whatever the piece's length (base64 of the tokens, version 1, cost 11 us a
    1,400-token piece)."""
    if payload[3] is None:
        arrays = payload[2]
        n = next(iter(arrays.values())).size
        payload[3] = [payload[0], payload[5], payload[1], n, _piece_check(arrays, digest)] + (
            [] if payload[4] is None else [payload[4]])
    return payload[3]


def _parse_item(f, name: str, k, raw, window: int, check: str):
    """One state entry back to ``(payload, length)``, every part checked (errors name ``name`` and the entry);
    the payload's columns are None until :meth:`PackedStream._refill` reads them from the source."""
    where = f"entry {k}"
    if not isinstance(raw, (list, tuple)) or len(raw) not in (5, 6):
        f.fail(name, f"{where} must be [example, document, start, length, {check}] and, for a piece of an example "
               "split in several, its example's loss tokens", StateTypeError)
    for what, v in zip(("example", "document", "start", "length", check, "example loss"), raw):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            f.fail(name, f"{where}: {what} must be an integer of at least 0, got {v!r}")
    j, d, p, n, crc = (int(v) for v in raw[:5])
    if not 1 <= n <= window:
        f.fail(name, f"{where}: the piece has {n} tokens; a piece has 1 to window={window}")
    if crc >= 2**STATE_CHECK_BITS[check]:
        f.fail(name, f"{where}: {check} {crc} is wider than its {STATE_CHECK_BITS[check]} bits")
    whole = int(raw[5]) if len(raw) == 6 else None
    return [j, p, None, [j, d, p, n, crc] + ([] if whole is None else [whole]), whole, d], n


def _int_list(f, name: str, *, low: int) -> list:
    v = f.get(name)
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in v):
        f.fail(name, f"must be a list of integers, got {type(v).__name__}", StateTypeError)
    if any(x < low for x in v):
        f.fail(name, f"must hold integers of at least {low}")
    return [int(x) for x in v]


def _share(parsed: list, *, shard: int, num_shards: int) -> _StreamPosition:
    """Shard ``shard`` of ``num_shards``'s part of a run saved on the shards of ``parsed`` (every one of them).

    The examples read: before ``start``, in ``skip``, and each old shard's share of ``[start, position)``.
    The new ``start`` is the first example no shard read; ``skip`` the examples read past it. The pieces
    read and not yet packed go to the shard of their example (index modulo ``num_shards``), in example
    order; the counts go to shard 0."""
    S = parsed[0].num_shards
    if len(parsed) != S or sorted(p.shard for p in parsed) != list(range(S)):
        got = sorted(p.shard for p in parsed)
        raise StateError(f"stream state field 'shard': {len(parsed)} states with shards {got}, of a run on "
                         f"{S} shards: pass the state of every shard once (a shard left out would be read again)")
    first = parsed[0]
    for p in parsed[1:]:
        for name in ("num_shards", "read"):
            a, b = getattr(p, name), getattr(first, name)
            if a != b and not (name == "read" and None in (a, b)):  # a shard that read nothing yet has no columns
                raise StateError(f"stream state field {name!r}: the shard states differ ({a!r}, {b!r}): they are not "
                                 "from one run")
        for name in ("start", "skip", "check"):
            if getattr(p.pos, name) != getattr(first.pos, name):
                raise StateError(f"stream state field {name!r}: the shard states differ: they are not from one run")
    parsed = sorted(parsed, key=lambda p: p.shard)
    if S == num_shards:
        return parsed[shard].pos
    start, skip = first.pos.start, set(first.pos.skip)
    ends = []
    for p in parsed:  # each old shard's first example not read
        s, j = p.shard, p.pos.position
        j += (s - j) % S
        while j in skip:
            j += S
        ends.append(j)
    new_start = min(ends)
    new_skip = {j for j in skip if j >= new_start}
    for p in parsed:
        a = new_start + (p.shard - new_start) % S
        new_skip.update(range(a, p.pos.position, S))
    pieces = sorted((item for p in parsed for item in (*p.pos.items, *p.pos.pending)),
                    key=lambda it: (it[0][0], it[0][5], it[0][1]))
    mine = [it for it in pieces if it[0][0] % num_shards == shard]
    counts = {k: sum(p.pos.counts[k] for p in parsed) if shard == 0 else 0 for k in STREAM_COUNTS}
    checks = {j: c for p in parsed for j, c in p.pos.checks.items()}
    return _StreamPosition(start=new_start, skip=tuple(sorted(new_skip)), position=new_start, checks=checks,
                           items=mine, pending=[], counts=counts, check=first.pos.check)


def pack_stream(examples, *, window: int, buffer_size: int = 1000, overflow: str = DEFAULT_OVERFLOW, columns=None,
                mask_first_label: bool = True, example_ids: bool = False, shard: int = 0,
                num_shards: int = 1) -> PackedStream:
    """Pack an iterable of examples as it streams, holding at most ``buffer_size`` examples.

    Args:
        examples: iterable of mappings with ``input_ids`` (list, numpy array or tensor) and optionally
            ``labels`` (or the ``columns`` named), e.g. a ``datasets.IterableDataset``.
        window: tokens per window.
        buffer_size: examples held for best fit (fill against it below).
        overflow: ``"split"`` (default), ``"truncate"``, ``"drop"`` or ``"error"``; counted in ``.stats``.
        shard, num_shards: pack only the examples whose index in ``examples`` is ``shard`` modulo
            ``num_shards`` (one rank or DataLoader worker of many; :class:`packkit.streaming.PackedIterable`
            picks them itself).
    Returns:
        A :class:`PackedStream`: iterate it for row dicts with ``input_ids``, ``labels`` (when present),
        ``seq_lengths`` (int32) and, with ``example_ids=True``, what a row records of each document's
        example (:data:`packkit.rules.DOCUMENT_KEYS`): ``example_ids`` (int64, its index in the stream),
        ``piece_offsets`` (int32, where the document starts in it) and ``example_loss`` (int32, the whole
        example's loss tokens over all its pieces, as the rows carry them), so that a collator's
        ``loss_weighting`` weighs a piece of a split example as its whole example; all numpy arrays; ``.stats`` counts what happened; ``state_dict()`` / ``load_state_dict()``
        save and resume it (the buffer with it), exactly once.

    Example: ``list(pack_stream([{"input_ids": [1, 2]}, {"input_ids": [3]}], window=4))`` ->
    ``[{"input_ids": [1, 2, 3], "seq_lengths": [2, 1]}]`` (as numpy arrays).

    Planned by :func:`~packkit.streamplan.stream_windows`: each window starts with the oldest buffered example,
    then takes the longest buffered example that still fits, until none fits (best fit inside the buffer;
    ``buffer_size=1`` is next fit). Fill against buffer size, measured on 200,000 SFT-like lengths (lognormal, median 250, sigma 1, clipped to
    [8, 4096], truncated to ``W = 2048``; ``benchmarks/bench_offline.py --stream-table`` reprints it):

        ============== ======== ===================
        buffer           fill    windows over bound
        ============== ======== ===================
        1 (next fit)    0.8262   +21.0%
        10              0.9916   +0.85%
        100             0.9981   +0.19%
        1,000 (default) 0.9989   +0.11%
        10,000          0.9992   +0.08%
        offline BFD     0.99993  +0.005%
        ============== ======== ===================

    (About 5 us per example in Python, whatever the buffer size.)
    """
    return PackedStream(examples, window=window, buffer_size=buffer_size, overflow=overflow, columns=columns,
                        mask_first_label=mask_first_label, example_ids=example_ids, shard=shard, num_shards=num_shards)
