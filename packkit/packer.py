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

Rows are not padded here: the collators pad windows to ``W`` at batch time.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .binpack import Plan
from .segments import IGNORE_INDEX

__all__ = ["gather_index", "gather_segments", "PackedRows", "pack_arrays"]

#: Tokens copied per numpy call at most (bounds the temporary of one copy: 4M tokens).
GROUP_TOKENS = 1 << 22


def gather_index(plan: Plan, offsets) -> tuple[np.ndarray, np.ndarray]:
    """Flat source index of every packed token, and the CSR offsets of the packed rows.

    Args:
        plan: the plan of the examples.
        offsets: ``(num_examples + 1,)`` int, example ``i``'s tokens are ``values[offsets[i]:offsets[i+1]]``.

    Returns:
        ``index``: ``(T,)`` int64, ``values[index]`` is the packed token stream, window after window;
        ``row_offsets``: ``(num_windows + 1,)`` int64, window ``w`` is ``index[row_offsets[w]:row_offsets[w+1]]``.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    if offsets.shape != (plan.num_examples + 1,):
        raise ValueError(
            f"offsets must have num_examples + 1 = {plan.num_examples + 1} entries, got {offsets.shape}"
        )
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


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Packed windows as flat arrays (the layout of an Arrow list column).

    Fields:
        input_ids:   (T,) tokens of every window, window after window (dtype of the input)
        labels:      (T,) int64 or None; ``IGNORE_INDEX`` on the first token of every segment
        row_offsets: (R + 1,) int64, window ``r`` is ``input_ids[row_offsets[r]:row_offsets[r+1]]``
        seq_lengths: (S,) int64, segment lengths, window after window
        seq_offsets: (R + 1,) int64, window ``r`` has segments ``seq_lengths[seq_offsets[r]:seq_offsets[r+1]]``
        seg_example: (S,) int64, the source example of every segment
    """

    input_ids: np.ndarray
    labels: np.ndarray | None
    row_offsets: np.ndarray
    seq_lengths: np.ndarray
    seq_offsets: np.ndarray
    seg_example: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.row_offsets.size - 1)


def pack_arrays(plan: Plan, input_ids, offsets, labels=None, *, mask_first_label: bool = True) -> PackedRows:
    """Gather the tokens (and labels) of ``plan`` into packed rows.

    ``labels`` defaults to None (no labels column). When given it is a flat array aligned with
    ``input_ids``. With ``mask_first_label`` (the default, for models that shift labels inside, as
    Hugging Face's do) the first label of every segment becomes ``IGNORE_INDEX``, so no loss term
    predicts a document's first token from the previous document.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    if offsets.shape != (plan.num_examples + 1,):
        raise ValueError(
            f"offsets must have num_examples + 1 = {plan.num_examples + 1} entries, got {offsets.shape}"
        )
    src_start = offsets[plan.seg_example] + plan.seg_start
    row_offsets = np.zeros(plan.num_windows + 1, np.int64)
    np.cumsum(plan.window_loads, out=row_offsets[1:])
    input_ids = np.asarray(input_ids)
    packed_labels = None
    if labels is not None:
        labels = np.asarray(labels)
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels have shape {labels.shape}, input_ids {input_ids.shape}: they must match")
        packed_labels = gather_segments(labels, src_start, plan.seg_length).astype(np.int64, copy=False)
        if mask_first_label:
            packed_labels[np.cumsum(plan.seg_length) - plan.seg_length] = IGNORE_INDEX
    return PackedRows(
        input_ids=gather_segments(input_ids, src_start, plan.seg_length),
        labels=packed_labels,
        row_offsets=row_offsets,
        seq_lengths=plan.seg_length.copy(),
        seq_offsets=plan.window_ptr.copy(),
        seg_example=plan.seg_example.copy(),
    )
