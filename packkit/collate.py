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
For mRoPE vision-language models (Qwen2-VL and kin) and hybrid linear-attention models, wrap one in
:mod:`packkit.model_inputs` (``VisionLanguageCollator``, ``HybridCollator``).

An example is a mapping with ``input_ids`` (a list, numpy array or tensor of non-negative integers),
optionally ``labels`` (same length; ``-100`` where no loss is wanted) and/or a loss mask
(``completion_mask`` / ``assistant_masks``: loss only where it is 1); each example's own keys decide its
labels, under the rules of :mod:`packkit.rules` (``mask_first_label`` and ``loss_mask``: see
:class:`PaddingFreeCollator`). A collator also takes the columnar batch of
:class:`packkit.columnar.ColumnarDataset` directly (no Python object per token); its errors then name
the dataset row. Tensors leave through ``torch.from_numpy`` (no copy). A batch that holds no loss token (every
label -100) is said once a process, a :class:`LossFreeBatchWarning`: a Hugging Face model's mean loss over it is NaN.
"""

from __future__ import annotations

import collections.abc
import numbers
import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch

from .batch import PackedBatch
from .binpack import check_overflow, check_seed, check_strategy, check_window, overflow_error, pack
from .cp import plan_batch
from .cp_layouts import check_cp_window, cp_multiples
from .errors import check_int
from .examples import ExampleBatch, int_arrays, read_batch, read_column
from .packer import gather_index
from .located import ExampleValueError, location
from .row_rules import example_values, row_segments
from .rules import MASK_KEYS, PACKED_FIX, check_loss_mask_mode, segment_key
from .segments import (IGNORE_INDEX, lengths_to_cu_seqlens, lengths_to_offsets, lengths_to_position_ids,
                       range_index)
from .weighting import CallableWeighting, ColumnWeighting, resolve, segment_factors

__all__ = ["PaddingFreeCollator", "FixedWindowCollator", "PackedRowsCollator", "PaddedCollator", "LossFreeBatchWarning"]


class LossFreeBatchWarning(UserWarning):
    """A collated batch holds no loss token (every label ``-100``: completions all masked, a window of prompts
    only). A Hugging Face model's mean loss over it is NaN (0 / 0), and a NaN loss backpropagated makes every weight
    NaN; :mod:`packkit.loss` and ``Trainer``'s ``num_items_in_batch`` count it as 0. Said in one line, once a
    process (a DataLoader worker prints its own to stderr). Where such batches are meant (their loss counted by
    :mod:`packkit.loss`): ``warnings.filterwarnings("ignore", category=LossFreeBatchWarning)``."""


LOSS_FREE_BATCH = ("this batch holds no loss token (every label is -100), so its mean loss in a Hugging Face model's "
                   "forward is NaN (0 / 0) and backpropagated makes every weight NaN; packkit.loss and Trainer's "
                   "num_items_in_batch count it as 0. Leave such examples out (pack with drop_loss_free=True), or "
                   "check the labels / loss mask (a completion all masked, a window of prompts only)")


def _refuse_packed_rows(examples, who: str) -> None:
    """Refuse a packed row (one carrying ``seq_lengths``) given to ``who``, a collator of examples."""
    if isinstance(examples, ExampleBatch):
        col = examples.columns.get("seq_lengths")
        i = None if col is None else next((i for i, v in enumerate(col) if v is not None), None)
        rows = examples.rows
    else:
        i = next((i for i, ex in enumerate(examples)
                  if isinstance(ex, collections.abc.Mapping) and ex.get("seq_lengths") is not None), None)
        rows = None
    if i is not None:
        raise ExampleValueError(f"{location(i, rows)} is a packed row (it has 'seq_lengths'); {who} would read it "
                                f"as one example and let its documents attend to each other: {PACKED_FIX}")


# ----------------------------------------------------------------------------------------------
# building batches
# ----------------------------------------------------------------------------------------------


_tensor = torch.from_numpy


def padding_free_batch(input_ids, labels, lengths, *, mask_first_label: bool = True) -> PackedBatch:
    """One ``[1, T]`` row, every example a segment. ``labels`` is modified in place (first labels).
    ``padding_free_batch([5, 6, 7], [5, 6, 7], [2, 1])`` -> ``cu_seqlens [0, 2, 3]``, labels
    ``[-100, 6, -100]``, ``num_loss_tokens 1``.
    """
    n, total = lengths.size, input_ids.size
    cu, position_ids = lengths_to_cu_seqlens(lengths), lengths_to_position_ids(lengths)
    if mask_first_label:
        labels[cu[:-1]] = IGNORE_INDEX
    ignored = int(np.count_nonzero(labels == IGNORE_INDEX))
    shape = (1, total)
    return PackedBatch._trusted(
        input_ids=_tensor(input_ids.reshape(shape)),
        labels=_tensor(labels.reshape(shape)),
        position_ids=_tensor(position_ids.reshape(shape)),
        cu_seqlens=_tensor(cu),
        max_seqlen=int(lengths.max()),
        num_loss_tokens=total - ignored,
        num_tokens=total,
        num_examples=n,
        num_real_segments=n,
        labels_shifted=not mask_first_label,
        attention_mask=None,
    )


def row_destinations(loads, width: int) -> np.ndarray:
    """Where every real token lands in a row-major flattened ``[R, width]`` batch whose row ``r`` holds
    ``loads[r]`` tokens from its start (the rest of the row is padding): ``(sum(loads),)`` int64.

    ``row_destinations([2, 1], 3) -> [0, 1, 3]``. The one home of the rows' layout: :func:`rows_batch`
    puts tokens there, :mod:`packkit.model_inputs` the per-token inputs that travel with them.
    """
    return range_index(np.arange(len(loads), dtype=np.int64) * width, loads)


def rows_batch(input_ids, labels, seg_lengths, seg_ptr, *, width: int, num_rows: int | None = None,
               pad_token_id: int = 0, mask_first_label: bool = True, static_shape: bool = False,
               max_segments: int | None = None, attention_mask: bool = False) -> PackedBatch:
    """Lay segments out in ``[B, width]`` rows, each row's padding tail its own segment
    (:func:`rows_batch_spans`, without the documents' spans)."""
    return rows_batch_spans(input_ids, labels, seg_lengths, seg_ptr, width=width, num_rows=num_rows,
                            pad_token_id=pad_token_id, mask_first_label=mask_first_label, static_shape=static_shape,
                            max_segments=max_segments, attention_mask=attention_mask)[0]


def rows_batch_spans(input_ids, labels, seg_lengths, seg_ptr, *, width: int, num_rows: int | None = None,
                     pad_token_id: int = 0, mask_first_label: bool = True, static_shape: bool = False,
                     max_segments: int | None = None, attention_mask: bool = False,
                     spans: bool = False) -> tuple[PackedBatch, np.ndarray | None]:
    """``(batch, doc_cu)``: segments laid out in ``[B, width]`` rows, each row's padding tail its own segment,
    and with ``spans=True`` the documents' spans over the flattened labels (else None).

    Args:
        input_ids, labels: ``(T,)`` int64, the tokens of the rows, row after row.
        seg_lengths: ``(S,)`` int64, segment lengths, row after row (``>= 1``).
        seg_ptr: ``(R + 1,)`` int64, row ``r`` holds segments ``seg_ptr[r]:seg_ptr[r+1]``.
        width: ``W``, tokens per row; num_rows: ``B`` (default ``R``; extra rows are all padding).
        static_shape: ``cu_seqlens`` padded to ``max_segments + 1`` entries, ``max_seqlen = W``.
        attention_mask: also return the ``[B, W]`` int64 mask of real tokens (padded fallback).
        spans: also return ``doc_cu`` ``(S + 1,)`` int64, every segment's start over the flattened ``[B * W]``
            labels, then ``B * W``: the padding after a segment lies in its span (its labels are -100), so a
            loss weighting counts each document's loss tokens there without finding the padding tails.

    Example: tokens ``[a a b c]``, ``seg_lengths=[2, 1, 1]``, ``seg_ptr=[0, 2, 3]``, ``width=3``:
    rows ``[a a b]`` and ``[c pad pad]``, ``cu_seqlens=[0, 2, 3, 4, 6]``, ``doc_cu=[0, 2, 3, 6]``.
    """
    num_content = seg_ptr.size - 1
    num_rows = num_content if num_rows is None else num_rows
    if num_content > num_rows:
        raise ValueError(f"this batch needs {num_content} windows of {width} tokens > num_windows={num_rows}; "
                         "raise num_windows, lower the batch size, or batch with packkit.sampler."
                         "PackedBatchSampler")
    csum = lengths_to_offsets(seg_lengths)
    loads = csum[seg_ptr[1:]] - csum[seg_ptr[:-1]]
    # every row's segments, then its padding tail (rows without content are one tail of W)
    tails = np.full(num_rows, width, np.int64)
    tails[:num_content] -= loads
    tail_at = np.full(num_rows, seg_ptr[-1], np.int64)
    tail_at[:num_content] = seg_ptr[1:]
    all_lengths = np.insert(seg_lengths, tail_at, tails)
    all_lengths = all_lengths[all_lengths > 0]
    cu, position_ids = lengths_to_cu_seqlens(all_lengths), lengths_to_position_ids(all_lengths)
    # where every real token lands in the flattened [B, W] batch
    total = int(csum[-1])
    dest = row_destinations(loads, width)
    out_ids = np.full(num_rows * width, pad_token_id, np.int64)
    out_ids[dest] = input_ids
    out_labels = np.full(num_rows * width, IGNORE_INDEX, np.int64)
    out_labels[dest] = labels
    # every document's first token; with spans, then the batch's end (csum's last entry, clipped, overwritten)
    if spans:
        doc_cu = dest.take(csum, mode="clip") if total else np.zeros(csum.size, np.int64)
        doc_cu[-1] = num_rows * width
        starts = doc_cu[:-1]
    else:
        doc_cu, starts = None, dest[csum[:-1]] if mask_first_label else None
    if mask_first_label:
        out_labels[starts] = IGNORE_INDEX
    max_seqlen = width if static_shape else int(all_lengths.max())
    num_real = int(all_lengths.size)
    if static_shape:
        cu = _static_cu(cu, max_segments)
    shape = (num_rows, width)
    mask = None
    if attention_mask:
        mask = np.zeros(num_rows * width, np.int64)
        mask[dest] = 1
        mask = _tensor(mask.reshape(shape))
    batch = PackedBatch(
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
    return batch, doc_cu


def _static_cu(cu: np.ndarray, max_segments: int | None) -> np.ndarray:
    """``cu`` padded to ``max_segments + 1`` entries (zero-length segments at the end): every batch one shape."""
    if max_segments is None:
        raise ValueError("static_shape=True needs max_segments (the fixed number of segments of every batch)")
    if cu.size - 1 > max_segments:
        raise ValueError(f"this batch has {cu.size - 1} segments (padding tails included) > "
                         f"max_segments={max_segments}; raise max_segments")
    return np.concatenate([cu, np.full(max_segments + 1 - cu.size, cu[-1], np.int32)])


# ----------------------------------------------------------------------------------------------
# batches crossing from DataLoader workers
# ----------------------------------------------------------------------------------------------

#: A batch whose CPU tensors hold at most this many bytes crosses processes by value (see below).
SHIP_BY_VALUE_BYTES = 16 << 20


def _reduce_by_value(batch):
    """How a :class:`PackedBatch` crosses a ``multiprocessing`` queue (a DataLoader worker's result):
    its own ``__reduce__``, with every CPU tensor pickled by value (as a numpy array) and turned back
    into a tensor by ``torch.from_numpy`` (no copy) on arrival.

    torch's own reducer moves every tensor into a new shared-memory segment and passes its file
    descriptor: a fixed cost per tensor that, for the few hundred kilobytes of a collated batch, costs
    more than collating it and capped a DataLoader with workers (``benchmarks/bench_loader.py``: the
    columnar path with 2 workers went from 2.1x to 36.5x of the baseline in one quick run). Batches over
    :data:`SHIP_BY_VALUE_BYTES`, or with a tensor off the CPU or of a dtype numpy lacks, keep torch's
    way. Registered with ``multiprocessing``'s ``ForkingPickler`` only: ``pickle`` and ``torch.save``
    are unchanged.
    """
    rv = batch.__reduce__()
    wrapped = {}  # id -> one wrapper per tensor: shared ones stay shared
    args = _swap(rv[1:], wrapped)
    tensors = [w.tensor for w in wrapped.values()]
    if not all(t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES for t in tensors) or \
            sum(t.nbytes for t in tensors) > SHIP_BY_VALUE_BYTES:
        return rv
    return (rv[0], *args)


class _ByValue:
    """A CPU tensor pickled as its numpy array (by value) and rebuilt with ``torch.from_numpy``."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    def __reduce__(self):
        return torch.from_numpy, (self.tensor.numpy(),)


def _swap(obj, wrapped: dict):
    """``obj`` with every tensor inside its tuples, lists and dicts wrapped in a :class:`_ByValue`, the
    wrappers kept in ``wrapped`` by tensor id."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in wrapped:
            wrapped[id(obj)] = _ByValue(obj)
        return wrapped[id(obj)]
    if isinstance(obj, tuple):
        return tuple(_swap(x, wrapped) for x in obj)
    if isinstance(obj, list):
        return [_swap(x, wrapped) for x in obj]
    if type(obj) is dict:
        return {k: _swap(v, wrapped) for k, v in obj.items()}
    return obj


_NUMPY_DTYPES = frozenset((torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                           torch.float32, torch.float64, torch.float16))
ForkingPickler.register(PackedBatch, _reduce_by_value)


def _check_static(static_shape: bool, num_windows, max_segments):
    if num_windows is not None:
        num_windows = check_int(num_windows, "num_windows")
    if max_segments is not None:
        if not static_shape:
            raise ValueError("max_segments only applies with static_shape=True")
        max_segments = check_int(max_segments, "max_segments")
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


class _Collator:
    """What every collator shares: it reads its examples' labels under ``mask_first_label`` and
    ``loss_mask``, and warns once per collator and process when none carries labels or a mask; it finishes
    every batch in :meth:`_finish` (a :class:`LossFreeBatchWarning` when it holds no loss token, and the
    loss tokens weighed under ``loss_weighting``, :mod:`packkit.weighting`: ``"token"``, the default, adds
    nothing; any other notes ``batch.loss_weight`` and ``batch.loss_norm``)."""

    def __init__(self, *, mask_first_label: bool = True, loss_mask: str = "auto", loss_weighting="token"):
        self.mask_first_label = bool(mask_first_label)
        self.loss_mask = check_loss_mask_mode(loss_mask)
        self.loss_weighting = resolve(loss_weighting)
        self._warned = [False]  # LossMaskWarning given

    def _finish(self, batch: PackedBatch, examples, num_docs: int, *, doc_cu=None, seg_doc=None,
                whole=None) -> PackedBatch:
        """``batch``, its labels final, said in a :class:`LossFreeBatchWarning` when it holds no loss token (every
        collator's batch passes here once; the count was noted when the batch was built, so the check reads a
        note, no tensor), and with its loss weights noted (nothing under the token mean): one factor per document
        (:func:`packkit.weighting.segment_factors`), nothing per token. The documents are the ``num_docs``
        spans of ``doc_cu`` (:func:`rows_batch_spans`: a row's padding lies in its last document's span)
        or, without it, the segments of ``batch.cu_seqlens`` (padding-free: every segment a document);
        ``seg_doc`` ``(D,)`` the example of each (a split example's pieces share its ``|O_c|``); ``whole``
        ``(D,)`` the loss tokens of each one's whole example (pieces split offline). A few calls on
        per-document arrays a batch, none per row or token: the collate overhead of a weighting
        (``benchmarks/bench_weighting.py``)."""
        if batch.num_loss_tokens == 0:  # shown once a process by Python's default filter (a DataLoader worker: its own)
            warnings.warn(LOSS_FREE_BATCH, LossFreeBatchWarning)
        weighting = self.loss_weighting
        if weighting.is_token_mean:
            return batch
        # what is noted stays numpy: made tensors on first use (:func:`packkit.batch.loss_factors`), not here, where a
        # torch.from_numpy costs about as much as the weights' own arithmetic (benchmarks/bench_weighting.py)
        cu = batch.cu_seqlens if doc_cu is None else doc_cu
        values = None
        if isinstance(weighting, ColumnWeighting):
            values = _column_values(examples, weighting.key)
            if seg_doc is None and values.size != num_docs:
                raise ValueError(f"loss_weighting=Column({weighting.key!r}) weighs examples; these rows hold "
                                 f"{num_docs} documents for {values.size} values: collate examples, not packed rows")
        if isinstance(weighting, CallableWeighting):  # made here: the callable may not cross processes
            factors, z = segment_factors(weighting, batch.labels.numpy().reshape(-1), np.asarray(cu), seg_doc=seg_doc,
                                         values=values, whole=whole)
            return batch._weigh(weighting, cu=cu, seg_factor=_tensor(factors), z=z)
        # seg_doc (a plan's, read-only) copied: the note is the batch's own
        return batch._weigh(weighting, cu=cu, seg_doc=None if seg_doc is None else seg_doc.copy(), values=values,
                            whole=whole, num_docs=None if seg_doc is None else len(examples))

    def _read(self, examples, *, packed_rows: bool = False):
        """``(input_ids, labels, lengths)`` (:func:`packkit.examples.read_batch`); a packed row (one with
        ``seq_lengths``) is refused unless ``packed_rows``: read as one example, its documents would attend
        to each other, so the error names the row and the fix."""
        if not packed_rows:
            _refuse_packed_rows(examples, type(self).__name__)
        return read_batch(examples, need_labels=not self.mask_first_label, loss_mask=self.loss_mask,
                          warned=self._warned)


class PaddingFreeCollator(_Collator):
    """Examples -> one ``[1, T]`` packed row (no padding), as a :class:`PackedBatch`.

    ``PaddingFreeCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])`` gives
    ``input_ids [[5, 6, 7, 8, 9]]``, ``position_ids [[0, 1, 2, 0, 1]]``,
    ``labels [[-100, 6, 7, -100, 9]]``, ``cu_seqlens [0, 3, 5]``, ``max_seqlen 3``.

    Args:
        mask_first_label: ``True`` (default): labels are shifted by the model, the first label of
            every example becomes -100. ``False``: labels are pre-shifted and used as given.
        loss_mask: ``"auto"`` (default): a ``completion_mask`` / ``assistant_masks`` is honoured on
            every example that carries one; a batch in which no example carries labels or a mask
            trains on every token and warns once (a ``LossMaskWarning`` naming
            ``remove_unused_columns=False``: ``transformers.Trainer`` drops mask columns by default).
            ``"required"``: every example must carry a mask, else an error names the example and that
            setting. ``"none"``: no mask expected, every token a target (pretraining; no warning, and
            a mask that does arrive is an error).
        loss_weighting: how much each loss token weighs in the optimiser step's loss
            (:mod:`packkit.weighting`): ``"token"`` (default: every loss token ``1 / N``), ``"sample"``
            (each document counts once), ``"sqrt"``, verl's and TRL's modes, ``Column(key)`` (a weight per
            example), a callable of ``|O_c|``. The batch then carries ``loss_weight`` (float32, the shape
            of ``labels``) and ``loss_norm``; :func:`packkit.loss.accumulation_step` (or
            :func:`packkit.loss.hf_compute_loss_func` under ``Trainer``) divides by the step's ``Z``.
    """

    def __call__(self, examples) -> PackedBatch:
        input_ids, labels, lengths = self._read(examples)
        batch = padding_free_batch(input_ids, labels, lengths, mask_first_label=self.mask_first_label)
        return self._finish(batch, examples, lengths.size)

    def __repr__(self) -> str:
        return (f"PaddingFreeCollator(mask_first_label={self.mask_first_label}, loss_mask={self.loss_mask!r}, "
                f"loss_weighting={self.loss_weighting.name!r})")


class FixedWindowCollator(_Collator):
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
        mask_first_label, loss_mask, loss_weighting: as in :class:`PaddingFreeCollator` (apply to every
            segment; a split example's pieces share one ``|O_c|`` and one weight).
        seed: the order of ``"shuffle_ff"``.
        group_key: the key of an example holding its group id (a pair, a prompt's completions): a
            group's examples share one window, adjacent, in batch order
            (:func:`packkit.binpack.pack_groups`; ``overflow`` then applies to whole groups).
    """

    def __init__(self, *, window: int, strategy: str = "bfd", overflow: str = "error",
                 num_windows: int | None = None, static_shape: bool = False,
                 max_segments: int | None = None, pad_token_id: int = 0,
                 mask_first_label: bool = True, seed: int = 0, loss_mask: str = "auto",
                 group_key: str | None = None, loss_weighting="token"):
        if group_key is not None and not isinstance(group_key, str):
            raise TypeError(f"group_key must be the name of an example's key, got {group_key!r}")
        self.group_key = group_key
        self.window = check_window(window)
        self.strategy, self.overflow = check_strategy(strategy), check_overflow(overflow)
        self.seed = check_seed(seed, allow_none=False)
        self.static_shape = bool(static_shape)
        self.num_windows, self.max_segments = _check_static(self.static_shape, num_windows, max_segments)
        self.pad_token_id = check_int(pad_token_id, "pad_token_id", low=0)
        super().__init__(mask_first_label=mask_first_label, loss_mask=loss_mask, loss_weighting=loss_weighting)
        self.cut_tokens = 0

    def __call__(self, examples) -> PackedBatch:
        return self._pack(examples)[0]

    def _pack(self, examples):
        """``(batch, plan)``: the batch and the :class:`~packkit.binpack.Plan` that laid it out (which
        example's tokens went to which window, in order), for :mod:`packkit.model_inputs`, which lays out
        the inputs that travel with the tokens (positions, images) the same way."""
        input_ids, labels, lengths = self._read(examples)
        groups = None if self.group_key is None else _group_ids(examples, self.group_key)
        if self.overflow == "error" and int(lengths.max()) > self.window and groups is None:
            rows = _rows_of(examples)
            if rows is None:
                raise overflow_error(lengths, self.window)
            i = int(np.argmax(lengths > self.window))  # named by its dataset row
            raise overflow_error(lengths[i: i + 1], self.window, first=int(rows[i]))
        plan = pack(lengths, window=self.window, strategy=self.strategy, overflow=self.overflow,
                    seed=self.seed, groups=groups)
        self.cut_tokens += plan.cut_tokens
        if plan.num_windows == 0:
            raise ValueError(f"overflow='drop' dropped all {lengths.size} examples of this batch (each longer "
                             f"than window={self.window}); raise window or use overflow='split'")
        index, _ = gather_index(plan, lengths_to_offsets(lengths))
        batch, doc_cu = rows_batch_spans(input_ids[index], labels[index], plan.seg_length, plan.window_ptr,
                                         width=self.window, num_rows=self.num_windows,
                                         pad_token_id=self.pad_token_id, mask_first_label=self.mask_first_label,
                                         static_shape=self.static_shape, max_segments=self.max_segments,
                                         spans=not self.loss_weighting.is_token_mean)
        batch = self._finish(batch, examples, plan.seg_length.size, doc_cu=doc_cu, seg_doc=plan.seg_example)
        return batch, plan

    def __repr__(self) -> str:
        return (f"FixedWindowCollator(window={self.window}, strategy={self.strategy!r}, "
                f"overflow={self.overflow!r}, num_windows={self.num_windows}, "
                f"static_shape={self.static_shape}, loss_mask={self.loss_mask!r})")


class PackedRowsCollator(_Collator):
    """Rows packed offline -> ``[B, W]``. A row has ``input_ids`` (at most ``W`` tokens), optional
    ``labels``, and its segments as ``seq_lengths`` (summing to the row length) or ``position_ids``
    (a segment starts at every 0).

    ``PackedRowsCollator(window=4)([{"input_ids": [5, 6, 7], "seq_lengths": [2, 1]}])`` gives
    ``input_ids [[5, 6, 7, 0]]``, ``position_ids [[0, 1, 0, 0]]``, ``cu_seqlens [0, 2, 3, 4]``.

    Options as in :class:`FixedWindowCollator` (``num_windows``, ``static_shape``, ``max_segments``,
    ``pad_token_id``, ``mask_first_label``, ``loss_mask``, ``loss_weighting``: each document of a row its
    own; a piece of an example split offline weighs as its whole example where the rows record its
    ``example_loss``, as ``pack_dataset`` / ``packkit pack`` write them: :func:`packkit.weighting.piece_factors`). Labels of offline rows already carry -100
    on every segment's first token; masking again changes nothing.

    ``transformers.Trainer`` drops ``seq_lengths`` by default (its model's forward does not name it):
    pass ``TrainingArguments(remove_unused_columns=False)``; the error says so.

    ``cp_size`` / ``cp_layout``: the rows go to a context-parallel group (:func:`packkit.cp.shard`); a
    row whose documents, padded as the layout needs (zigzag: to a multiple of ``2 * cp_size``), no longer
    fit ``window`` was packed for another CP size, and is refused naming the row and how to repack. Each
    batch is planned for the group here (:func:`packkit.cp.plan_batch`, in the DataLoader worker), so a
    rank's ``shard(batch, cp_size=..., rank=..., cp_layout=...)`` reads the plan instead of making it.
    """

    def __init__(self, *, window: int, num_windows: int | None = None, static_shape: bool = False,
                 max_segments: int | None = None, pad_token_id: int = 0, mask_first_label: bool = True,
                 loss_mask: str = "auto", cp_size: int = 1, cp_layout: str = "hybrid", loss_weighting="token"):
        self.window = check_cp_window(check_window(window), cp_size=cp_size, cp_layout=cp_layout)
        self.cp_size, self.cp_layout = int(cp_size), cp_layout
        self._doc_multiple = cp_multiples(cp_size=cp_size, cp_layout=cp_layout)[0]
        self.static_shape = bool(static_shape)
        self.num_windows, self.max_segments = _check_static(self.static_shape, num_windows, max_segments)
        self.pad_token_id = check_int(pad_token_id, "pad_token_id", low=0)
        super().__init__(mask_first_label=mask_first_label, loss_mask=loss_mask, loss_weighting=loss_weighting)

    def __call__(self, rows) -> PackedBatch:
        input_ids, labels, lengths = self._read(rows, packed_rows=True)
        where = _rows_of(rows)
        over = np.flatnonzero(lengths > self.window)
        if over.size:
            i = int(over[0])
            raise ValueError(f"{location(i, where)} is a packed row of {int(lengths[i])} tokens > "
                             f"window={self.window}; collate with the window it was packed for")
        weighted = not self.loss_weighting.is_token_mean
        seg_lengths, seg_ptr, whole = _row_segments(rows, lengths, where, whole=weighted)
        if whole is not None and self.loss_weighting.count_empty and whole.size and not whole.all():
            whole = _first_pieces_count(rows, whole, seg_ptr, where)
        if self._doc_multiple > 1:
            self._check_cp(seg_lengths, seg_ptr, where)
        batch, doc_cu = rows_batch_spans(input_ids, labels, seg_lengths, seg_ptr, width=self.window,
                                         num_rows=self.num_windows, pad_token_id=self.pad_token_id,
                                         mask_first_label=self.mask_first_label, static_shape=self.static_shape,
                                         max_segments=self.max_segments, spans=weighted)
        batch = self._finish(batch, rows, seg_lengths.size, doc_cu=doc_cu, whole=whole)
        if self.cp_size > 1:  # planned here (a DataLoader worker), not by every rank's shard
            plan_batch(batch, cp_size=self.cp_size, cp_layout=self.cp_layout)
        return batch

    def _check_cp(self, seg_lengths: np.ndarray, seg_ptr: np.ndarray, where) -> None:
        """Every row's documents, padded to the layout's multiple, fit the window (else: packed for
        another CP size)."""
        m = self._doc_multiple
        padded = np.zeros(seg_ptr.size - 1, np.int64)
        np.add.at(padded, np.repeat(np.arange(seg_ptr.size - 1), np.diff(seg_ptr)), -(-seg_lengths // m) * m)
        over = np.flatnonzero(padded > self.window)
        if over.size:
            i = int(over[0])
            raise ValueError(f"{location(i, where)} holds documents of {int(padded[i]):,} tokens once padded to "
                             f"multiples of {m} for cp_size={self.cp_size} cp_layout={self.cp_layout!r} > "
                             f"window={self.window}: the rows were packed for another CP size; repack with "
                             f"pack_dataset(..., cp_size={self.cp_size}, cp_layout={self.cp_layout!r}) (packkit pack "
                             f"--cp {self.cp_size} --cp-layout {self.cp_layout})")

    def __repr__(self) -> str:
        return (f"PackedRowsCollator(window={self.window}, num_windows={self.num_windows}, "
                f"static_shape={self.static_shape}, loss_mask={self.loss_mask!r})")


def _group_ids(examples, key: str) -> np.ndarray:
    """The group id of every example (``examples[i][key]``, a scalar), or an error naming the example.
    ``_group_ids([{"g": 3}, {"g": 3}], "g") -> [3, 3]``."""
    where = _rows_of(examples)
    out = []
    for i, ex in enumerate(examples):
        value = ex.get(key) if hasattr(ex, "get") else None
        if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # a 0-d tensor or numpy scalar
            value = value.item()
        if value is None or isinstance(value, (bool, float)) or not isinstance(value, (numbers.Integral, str)):
            raise ValueError(f"{location(i, where)} has no group id under {key!r} (got {value!r}): every example "
                             f"needs one (an int or a string) with group_key={key!r} (transformers.Trainer drops "
                             "columns its model does not name unless remove_unused_columns=False)")
        out.append(value)
    return np.asarray(out)


def _rows_of(examples):
    """The dataset rows of a columnar batch (errors name them), or None."""
    return examples.rows if isinstance(examples, ExampleBatch) else None


_SEGMENTS_MISSING = ("a packed row needs its segments (transformers.Trainer drops 'seq_lengths' unless "
                     "TrainingArguments(remove_unused_columns=False); PaddingFreeCollator or FixedWindowCollator "
                     "take examples that are not packed rows)")


def _row_segments(rows, lengths: np.ndarray, where=None, *, whole: bool = False):
    """``(seg_lengths, seg_ptr, whole)``: the segment lengths ``(S,)`` and row pointers ``(R + 1,)`` of packed
    rows, from their ``seq_lengths`` or ``position_ids`` (:func:`packkit.row_rules.row_segments`), checked against the
    row lengths; with ``whole``, each document's whole example's loss tokens ``(S,)`` where the rows record them
    (:func:`_example_loss`), else None. Every row must carry the same one of the two keys.

    The usual rows (``seq_lengths`` and ``example_loss`` 1-D integer arrays, as many of each in every row) are
    read in one join of both columns (:func:`packkit.examples.int_arrays`): ``example_loss`` adds a list of the
    rows' arrays and a comparison of their lengths, not a second join with its own checks (what a weighting adds
    to the collate, ``benchmarks/bench_weighting.py``); the join's least value checks both columns at once where it
    is >= 1 (the checks that name a row, and allow a count of 0, run only where it is not). Any other rows take the
    checked readers, which refuse naming the row."""
    keys = set(rows.columns) if isinstance(rows, ExampleBatch) else set().union(*rows)
    key = segment_key(keys)
    if key is None:
        raise ValueError(f"{location(0, where)} has no 'seq_lengths' or 'position_ids'; {_SEGMENTS_MISSING}")
    if whole and key == "seq_lengths" and "example_loss" in keys:
        seq, loss = _column_parts(rows, key), _column_parts(rows, "example_loss")
        flat = None if seq is None or loss is None else int_arrays(seq + loss)
        counts = None if flat is None else list(map(len, seq))
        if counts is not None and counts == list(map(len, loss)):
            half = flat.size // 2
            counts = np.fromiter(counts, np.int64, len(counts))  # (numpy finds a list's dtype element by element)
            # the join's least value: >= 1, every length is >= 1 and no count negative, both checks in one argmin (a
            # fifth of a comparison and .any()'s cost); else (a count of 0 among them, or a bad value) one by one
            if not flat.size or flat[flat.argmin()] < 1:
                segments = row_segments(key, flat[:half], counts, lengths, rows=where)
                return (*segments, _whole_counts(flat[half:], segments[1], where))
            return (*row_segments(key, flat[:half], counts, lengths, rows=where, positive=True), flat[half:])
    flat, counts = read_column(rows, key, missing=_SEGMENTS_MISSING, rows=where)
    seg_lengths, seg_ptr = row_segments(key, flat, counts, lengths, rows=where)
    return seg_lengths, seg_ptr, _example_loss(rows, seg_ptr, where) if whole else None


def _column_parts(rows, key: str) -> list | None:
    """Every row's ``key`` as given (``[row[key] for row in rows]``), or None when a row lacks it."""
    if isinstance(rows, ExampleBatch):
        return rows.columns.get(key)
    try:
        return [row[key] for row in rows]
    except (KeyError, TypeError):
        return None


def _example_loss(rows, seg_ptr: np.ndarray, where=None):
    """Each document's whole example's loss tokens, where packed rows record them (``example_loss``,
    :func:`packkit.outputs.packed_schema`), else None; one per document (``seg_ptr``), or refused naming the row."""
    keys = set(rows.columns) if isinstance(rows, ExampleBatch) else set().union(*rows)
    if "example_loss" not in keys:
        return None
    flat, counts = read_column(rows, "example_loss", missing="packed rows record it on every row or none (a "
                               "row's documents' whole examples' loss tokens)", rows=where)
    bad = counts != seg_ptr[1:] - seg_ptr[:-1]
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{location(i, where)} has {int(counts[i])} example_loss for {int(seg_ptr[i + 1] - seg_ptr[i])} "
                         "documents (seq_lengths); they must match")
    return _whole_counts(flat, seg_ptr, where)


def _first_pieces_count(rows, whole: np.ndarray, seg_ptr: np.ndarray, where=None) -> np.ndarray:
    """``whole`` with -1 (no document: no weight, no ``z_c``) on the later pieces of examples without loss tokens,
    read off the rows' ``piece_offsets`` (0 on an example's first piece). Under a weighting that counts such
    examples in ``|B|`` (TRL's ``grpo``, ``dr_grpo``: :attr:`~packkit.weighting.LossWeighting.count_empty`), an
    example split into k rows is one completion, counted once: each piece counted, it weighed as k (the pieces'
    ``example_loss`` alone does not say which is the first). Rows without ``piece_offsets`` are refused."""
    flat, counts = read_column(rows, "piece_offsets", missing="packed rows whose example_loss has a 0 record "
                               "piece_offsets too under a weighting that counts examples without loss tokens "
                               "(grpo, dr_grpo: a split one counts once): write them with packkit pack or "
                               "pack_dataset(example_ids=True)", rows=where)
    if flat.size != whole.size:
        i = int(np.argmax(counts != seg_ptr[1:] - seg_ptr[:-1]))
        raise ValueError(f"{location(i, where)} has {int(counts[i])} piece_offsets for {int(seg_ptr[i + 1] - seg_ptr[i])} "
                         "documents (seq_lengths); they must match")
    return np.where((whole == 0) & (flat != 0), -1, whole)


def _whole_counts(whole: np.ndarray, seg_ptr: np.ndarray, where=None) -> np.ndarray:
    """``whole`` (each document's whole example's loss tokens), refused naming the row where one is negative:
    a negative count would weigh its tokens negatively, silently (rows edited or written outside packkit)."""
    d = whole.argmin() if whole.size else None  # argmin: a fifth of min()'s cost on a batch's few documents
    if d is not None and whole[d] < 0:
        d = int(np.argmax(whole < 0))
        i = int(np.searchsorted(seg_ptr, d, side="right")) - 1
        raise ValueError(f"{location(i, where)} records example_loss {int(whole[d])} for its document "
                         f"{d - int(seg_ptr[i])}: a count of loss tokens is never negative; write the rows again "
                         "with packkit pack (or pack_dataset(example_ids=True))")
    return whole


class PaddedCollator(_Collator):
    """Examples -> ``[B, L]`` right-padded rows with an ``attention_mask`` (the fallback when varlen
    attention is not available). ``L`` is the longest example, rounded up to ``pad_to_multiple_of``.

    ``PaddedCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])`` gives
    ``input_ids [[5, 6, 7], [8, 0, 0]]``, ``labels [[-100, 6, 7], [-100, -100, -100]]``,
    ``attention_mask [[1, 1, 1], [1, 0, 0]]``.

    With ``return_attention_mask=False`` the batch has no mask and its HF view is the packed one: each
    row's padding tail is then its own segment, which is also correct. ``mask_first_label`` and
    ``loss_mask`` as in :class:`PaddingFreeCollator`.
    """

    def __init__(self, *, pad_token_id: int = 0, pad_to_multiple_of: int | None = None,
                 return_attention_mask: bool = True, mask_first_label: bool = True, loss_mask: str = "auto",
                 loss_weighting="token"):
        self.pad_token_id = check_int(pad_token_id, "pad_token_id", low=0)
        self.pad_to_multiple_of = (None if pad_to_multiple_of is None
                                   else check_int(pad_to_multiple_of, "pad_to_multiple_of"))
        self.return_attention_mask = bool(return_attention_mask)
        super().__init__(mask_first_label=mask_first_label, loss_mask=loss_mask, loss_weighting=loss_weighting)

    def __call__(self, examples) -> PackedBatch:
        input_ids, labels, lengths = self._read(examples)
        width = int(lengths.max())
        if self.pad_to_multiple_of is not None:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        seg_ptr = np.arange(lengths.size + 1, dtype=np.int64)
        batch, doc_cu = rows_batch_spans(input_ids, labels, lengths, seg_ptr, width=width,
                                         pad_token_id=self.pad_token_id, mask_first_label=self.mask_first_label,
                                         attention_mask=self.return_attention_mask,
                                         spans=not self.loss_weighting.is_token_mean)
        return self._finish(batch, examples, lengths.size, doc_cu=doc_cu)

    def __repr__(self) -> str:
        return (f"PaddedCollator(pad_token_id={self.pad_token_id}, pad_to_multiple_of={self.pad_to_multiple_of}, "
                f"return_attention_mask={self.return_attention_mask}, loss_mask={self.loss_mask!r})")


def _column_values(examples, key: str) -> np.ndarray:
    """``(n,)`` float64, every example's ``key`` (one finite number each, :func:`packkit.row_rules.example_values`),
    or an error naming the key and ``remove_unused_columns=False`` when no example carries it."""
    where = _rows_of(examples)
    if isinstance(examples, ExampleBatch):
        raw = examples.columns.get(key, [None] * len(examples.rows if where is not None else examples))
    else:
        raw = [ex.get(key) if hasattr(ex, "get") else None for ex in examples]
    values = example_values(raw, [1] * len(raw), key=key, rows=where, what="example")
    if values is None:
        raise ValueError(f"loss_weighting=Column({key!r}) weighs each example by its {key!r}, and no example carries "
                         "one (transformers.Trainer drops columns its model does not name unless "
                         "TrainingArguments(remove_unused_columns=False))")
    if (values < 0).any():
        i = int(np.argmax(values < 0))
        raise ExampleValueError(f"{location(i, where)} has {key}={float(values[i])!r} < 0; loss weights are finite numbers >= 0")
    return values
