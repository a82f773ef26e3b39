"""From a :class:`~packkit.binpack.Plan` and token arrays to packed rows.

Tokens are moved with one numpy gather: every example's tokens live in one flat array
(``values``) with CSR ``offsets`` (Arrow's layout for a list column), and a plan turns into the
flat index of every token of every window, in window order::

    >>> from packkit.binpack import pack
    >>> plan = pack([3, 2, 2], window=4)          # windows: [ex 0], [ex 1, ex 2]
    >>> index, row_offsets = gather_index(plan, offsets=[0, 3, 5, 7])
    >>> index.tolist(), row_offsets.tolist()
    ([0, 1, 2, 3, 4, 5, 6], [0, 3, 7])

Rows are not padded here: the collators pad windows to ``W`` at batch time.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .binpack import Plan
from .segments import IGNORE_INDEX

__all__ = ["gather_index", "PackedRows", "pack_arrays"]


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
    index, row_offsets = gather_index(plan, offsets)
    input_ids = np.asarray(input_ids)
    packed_labels = None
    if labels is not None:
        labels = np.asarray(labels)
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels have shape {labels.shape}, input_ids {input_ids.shape}: they must match")
        packed_labels = labels[index].astype(np.int64, copy=False)
        if mask_first_label:
            packed_labels[np.cumsum(plan.seg_length) - plan.seg_length] = IGNORE_INDEX
    return PackedRows(
        input_ids=input_ids[index],
        labels=packed_labels,
        row_offsets=row_offsets,
        seq_lengths=plan.seg_length.copy(),
        seq_offsets=plan.window_ptr.copy(),
        seg_example=plan.seg_example.copy(),
    )
