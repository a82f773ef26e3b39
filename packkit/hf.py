"""Offline packing of Hugging Face ``datasets``: Arrow in, Arrow out, one gather of every token.

:func:`pack_dataset` plans windows over the lengths of the *whole* dataset with
:func:`packkit.binpack.pack` (read from the Arrow offsets of ``input_ids``, no Python lists), copies
the tokens of each window with numpy, and returns a ``datasets.Dataset`` with one row per window::

    >>> import datasets
    >>> ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]],
    ...                                  "labels":    [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]})
    >>> packed = pack_dataset(ds, window=5, shuffle=False)
    >>> packed[:]
    {'input_ids': [[6, 7, 8, 9, 10], [1, 2, 3, 4, 5]], 'labels': [[-100, 7, 8, 9, -100], [-100, 2, 3, -100, 5]], 'seq_lengths': [[4, 1], [3, 2]]}

The rows are unpadded; the fixed-window collator pads them to ``W`` and turns ``seq_lengths`` into
``cu_seqlens`` and ``position_ids``. One window of that output, drawn::

    input_ids     6    7    8    9   10
    labels     -100    7    8    9 -100      first label of each document masked (labels are shifted)
    position_ids  0    1    2    3    0
    seq_lengths  [4, 1]  ->  cu_seqlens [0, 4, 5]

    block-causal mask (1 = may attend)
          6 7 8 9 10
       6  1 . . . .
       7  1 1 . . .
       8  1 1 1 . .
       9  1 1 1 1 .
      10  . . . . 1

How the tokens move
-------------------
Segments are grouped by length; each group of ``k`` segments of length ``L`` is one numpy copy between
two strided ``(k, L)`` views of the flat token arrays (rows starting at the segments' source and
destination offsets). So the cost is one pass over the tokens plus O(distinct lengths) numpy calls,
with no per-token index array (an index of every token costs more than the copy it drives).

Streaming
---------
:func:`~packkit.packer.pack_stream` (planned by :func:`~packkit.binpack.stream_windows`; both
re-exported here) packs any iterable of examples (or a ``datasets.IterableDataset``) with a bounded
buffer: each window starts with the oldest buffered example, then takes the longest buffered example
that still fits, until none fits (best fit inside the buffer; ``buffer_size=1`` is next fit). Fill
against buffer size, measured on 200,000 SFT-like lengths (lognormal, median 250, sigma 1, clipped to
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

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from .binpack import Plan, check_overflow, check_seed, check_strategy, check_window, pack, stream_windows
from .errors import ArgumentError, arg
from .io import list_array, progress_bar
from .examples import (MASK_KEYS, check_aligned, check_labels, check_mask, check_not_null, check_tokens,
                       list_chunks)
from .packer import (ColumnSpec, PackedStream, StreamStats, log_overflow, pack_columns, pack_stream,
                     resolve_columns)
from .segments import lengths_to_offsets

__all__ = [
    "pack_dataset",
    # re-exported from their homes (packkit.packer, packkit.binpack), where they are documented
    "pack_stream",
    "PackedStream",
    "StreamStats",
    "stream_windows",
]


#: Rows of an output list column: past this many tokens a column uses 64-bit (large_list) offsets.
MAX_LIST_TOKENS = 2**31 - 1
#: Show a progress bar by default from this many tokens on.
PROGRESS_TOKENS = 1 << 26


def _list_array(row_offsets: np.ndarray, values: np.ndarray):
    """A pyarrow list array over ``values`` with rows at ``row_offsets`` (large_list past 2**31 - 1)."""
    return list_array(row_offsets, values, max_tokens=MAX_LIST_TOKENS)


# ----------------------------------------------------------------------------------------------
# reading Arrow list columns without Python lists
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Column:
    """A list column as flat arrays: example ``i`` is ``values[starts[i] : starts[i] + lengths[i]]``;
    ``valid`` is the non-null mask of the examples (None: no nulls)."""

    values: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    valid: np.ndarray | None = None


def _read_column(table, name: str, indices: np.ndarray | None, *, kind: str) -> _Column:
    """Flat values, starts and lengths of list column ``name`` (rows picked by ``indices``); its type
    checked by :func:`packkit.examples.list_chunks` (``kind``: "ids", "labels", "mask" or "other")."""
    parts, starts, lengths, valids, base = [], [], [], [], 0
    for values, off, valid, first in list_chunks(table.column(name), key=name, kind=kind):
        parts.append(values)
        starts.append(off[:-1] + base)
        lengths.append(np.diff(off))
        valids.append(np.ones(off.size - 1, bool) if valid is None else valid)
        base += int(off[-1])
    if not parts:
        values = np.zeros(0, np.int64)
        starts_a = lengths_a = np.zeros(0, np.int64)
        valid_a = np.zeros(0, bool)
    else:
        values = parts[0] if len(parts) == 1 else np.concatenate(parts)
        starts_a, lengths_a, valid_a = np.concatenate(starts), np.concatenate(lengths), np.concatenate(valids)
    if indices is not None:
        starts_a, lengths_a, valid_a = starts_a[indices], lengths_a[indices], valid_a[indices]
    return _Column(values, starts_a, lengths_a, None if valid_a.all() else valid_a)


def _fill_nulls(col: _Column, tok: _Column, *, ones: bool) -> _Column:
    """A labels / loss-mask column whose null rows (examples without that key) are filled as the rule
    says (packkit.examples): labels with the example's token ids, a loss mask with ones."""
    if col.valid is None:
        return col
    dtype = np.result_type(col.values.dtype, tok.values.dtype) if not ones else col.values.dtype
    lengths = np.where(col.valid, col.lengths, tok.lengths)
    out = np.empty(int(lengths.sum()), dtype)
    starts = lengths_to_offsets(lengths)[:-1]
    for i in range(lengths.size):  # a copy row by row, only for columns that hold nulls
        s, n = int(starts[i]), int(lengths[i])
        if col.valid[i]:
            out[s: s + n] = col.values[col.starts[i]: col.starts[i] + n]
        else:
            out[s: s + n] = 1 if ones else tok.values[tok.starts[i]: tok.starts[i] + n]
    return _Column(out, starts, lengths)


def _check_tokens(col: _Column, name: str) -> None:
    """The token rules of :func:`packkit.examples.check_tokens`, errors naming the dataset row."""
    check_tokens(col.values, starts=col.starts, lengths=col.lengths, key=name, rows=0, valid=col.valid)


def _check_mask(col: _Column, name: str) -> None:
    """A loss mask holds 0 and 1 only (:func:`packkit.examples.check_mask`)."""
    check_mask(col.values, starts=col.starts, lengths=col.lengths, key=name, rows=0)


def _check_labels(col: _Column, name: str) -> None:
    """Labels are token ids (>= 0) or -100 (:func:`packkit.examples.check_labels`)."""
    check_labels(col.values, starts=col.starts, lengths=col.lengths, key=name, rows=0)


def _check_common(window, strategy, overflow, seed, num_proc):
    window = check_window(window)
    check_strategy(strategy)
    check_overflow(overflow)
    check_seed(seed)
    if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, numbers.Integral)
                                 or num_proc < 1):
        raise ValueError(f"num_proc must be a positive integer or None, got {num_proc!r}")
    return window


def _report_overflow(plan: Plan) -> None:
    log_overflow("pack_dataset", overflow=plan.overflow, over=int(plan.overflow_examples.size),
                 examples=plan.num_examples, window=plan.window, cut_tokens=plan.cut_tokens,
                 tokens=int(plan.lengths.sum()))


# ----------------------------------------------------------------------------------------------
# offline packing
# ----------------------------------------------------------------------------------------------


def pack_dataset(ds, *, window: int, strategy: str = "bfd", overflow: str = "error", columns=None,
                 seed: int | None = 0, shuffle: bool = True, num_proc: int | None = None,
                 mask_first_label: bool = True, example_ids: bool = False, buffer_size: int = 1000,
                 progress: bool | None = None, return_plan: bool = False, split: str | None = None,
                 tokenizer=None, chat_template=None, assistant_only_loss: bool | None = None,
                 completion_only_loss: bool = True, trust_remote_code: bool = False):
    """Pack a ``datasets.Dataset`` into windows of at most ``window`` tokens, one row per window.

    Args:
        ds: a ``datasets.Dataset``; a ``DatasetDict`` (``split`` packs that split and returns a
            ``Dataset``; without it every split is packed and a ``DatasetDict`` comes back, with a dict
            of plans under ``return_plan``); or a ``datasets.IterableDataset``: that one is packed with
            :func:`pack_stream` and an ``IterableDataset`` comes back; then ``strategy`` must be
            ``"bfd"`` (best fit inside ``buffer_size`` examples), ``shuffle`` shuffles the rows inside a
            seeded buffer of ``buffer_size`` rows, ``progress`` defaults to off, ``num_proc`` must be
            unset and ``return_plan`` is not available.
        window: tokens per window (``W``).
        strategy: ``"bfd"`` (default), ``"ffd"``, ``"shuffle_ff"`` or ``"next_fit"`` over the whole dataset.
        overflow: examples longer than ``W``: ``"error"`` (default), ``"truncate"``, ``"split"``,
            ``"drop"``. Cut tokens are counted and logged (``return_plan=True`` returns the counts).
        columns: list columns to pack, the token column first; default ``input_ids``, plus ``labels``
            and the first of ``completion_mask`` / ``assistant_masks`` when the dataset has them. A loss
            mask becomes ``labels`` (-100 where the mask is 0, on the given labels or the token ids),
            as the collators do; it is written as well only when ``columns`` names it. Other columns
            (text, ids) are not carried over.
        seed: seeds ``"shuffle_ff"`` and the order of the rows.
        shuffle: rows in a seeded random order (default), not in the planner's (length-sorted) order.
        num_proc: threads for the token copy (numpy releases the GIL), default 1.
        mask_first_label: set ``labels`` to -100 on the first token of every segment (models shift labels).
        example_ids: also write ``example_ids``, the source row of every segment.
        buffer_size: examples buffered when ``ds`` is an ``IterableDataset``.
        progress: a tqdm bar; default on from 2**26 tokens.
        return_plan: return ``(dataset, plan)``, the :class:`~packkit.binpack.Plan` in row order.
        split: the split of a ``DatasetDict`` to pack (default: all of them).
        tokenizer: conversational data (TRL's ``messages``, ``conversations``, or ``prompt`` +
            ``completion`` columns) is first tokenized through this tokenizer's chat template: a local
            folder, a ``tokenizer.json``, a model id, or a loaded tokenizer. Its loss mask becomes
            ``labels`` with -100 on prompt tokens (:func:`packkit.chat.tokenize_chat`, which
            ``chat_template``, ``assistant_only_loss``, ``completion_only_loss`` and ``trust_remote_code``
            are passed to).

    Returns:
        A ``datasets.Dataset`` (in memory) with columns ``input_ids`` (list of int, length <= W, the
        source dtype), ``labels`` (when the source has labels or a loss mask), any other packed column, ``seq_lengths`` (list of
        int32 segment lengths summing to the row length) and optionally ``example_ids`` (int64).
        ``save_to_disk`` / ``to_parquet`` it as usual.

    Raises:
        ValueError / TypeError / KeyError naming the example (its index in ``ds``): empty or null
        example, negative token id, a label that is neither a token id nor -100, columns of different
        lengths, an example longer than ``window`` under ``overflow="error"``, a column missing.
    """
    import datasets

    from .chat import prepare_dataset

    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        return _pack_splits(ds, split, return_plan=return_plan, window=window, strategy=strategy, overflow=overflow,
                            columns=columns, seed=seed, shuffle=shuffle, num_proc=num_proc,
                            mask_first_label=mask_first_label, example_ids=example_ids, buffer_size=buffer_size,
                            progress=progress, tokenizer=tokenizer, chat_template=chat_template,
                            assistant_only_loss=assistant_only_loss, completion_only_loss=completion_only_loss,
                            trust_remote_code=trust_remote_code)
    if split is not None:
        raise ArgumentError("{arg} picks a split of a DatasetDict; this is a single {kind}: drop it",
                            arg=arg("split", split), kind=type(ds).__name__)
    if isinstance(ds, (datasets.Dataset, datasets.IterableDataset)):
        ds = prepare_dataset(ds, tokenizer=tokenizer, columns=columns, chat_template=chat_template,
                             assistant_only_loss=assistant_only_loss, completion_only_loss=completion_only_loss,
                             trust_remote_code=trust_remote_code, progress=progress)
    if isinstance(ds, datasets.IterableDataset):
        if strategy != "bfd":
            raise ValueError(f"an IterableDataset is packed with best fit inside a buffer; strategy must be "
                             f"'bfd', got {strategy!r}")
        if return_plan:
            raise ValueError("return_plan is not available for an IterableDataset (there is no whole plan)")
        window = _check_common(window, strategy, overflow, seed, num_proc)
        if num_proc not in (None, 1):
            raise ValueError(f"num_proc={num_proc!r}: an IterableDataset is packed in one stream as it is "
                             "read; leave num_proc unset (or shard the source and pack each shard)")
        return _pack_iterable(ds, window=window, buffer_size=buffer_size, overflow=overflow, columns=columns,
                              seed=seed, shuffle=shuffle, mask_first_label=mask_first_label,
                              example_ids=example_ids, progress=bool(progress))
    if not isinstance(ds, datasets.Dataset):
        raise TypeError(f"pack_dataset takes a datasets.Dataset or IterableDataset, got {type(ds).__name__}; "
                        "use pack_stream for another iterable of examples")
    window = _check_common(window, strategy, overflow, seed, num_proc)
    spec = resolve_columns(ds.column_names, columns)
    cols = spec.read
    table = ds.data.table
    indices = None
    if getattr(ds, "_indices", None) is not None:  # a select / shuffle / filter view of the table
        indices = ds._indices.column(0).to_numpy().astype(np.int64)
    kinds = {c: "ids" if i == 0 else "labels" if c == "labels" else "mask" if c in MASK_KEYS else "other"
             for i, c in enumerate(cols)}
    sources = {c: _read_column(table, c, indices, kind=kinds[c]) for c in cols}
    tok = sources[cols[0]]
    _check_tokens(tok, cols[0])
    for c in cols[1:]:
        check_aligned(sources[c].lengths, tok.lengths, key=c, ref_key=cols[0], rows=0, valid=sources[c].valid)
        if kinds[c] in ("labels", "mask"):  # a null is a key the example lacks (packkit.examples)
            sources[c] = _fill_nulls(sources[c], tok, ones=kinds[c] == "mask")
        elif sources[c].valid is not None:
            check_not_null(sources[c].valid, key=c, rows=0)
    if "labels" in sources:
        _check_labels(sources["labels"], "labels")
    for c in cols:
        if kinds[c] == "mask":
            _check_mask(sources[c], c)
    for c in spec.other_masks:  # both masks: the loss where both are 1
        m, o = sources[spec.mask], sources.pop(c)
        both = _fill_nulls(_Column(m.values.copy(), m.starts, m.lengths), tok, ones=True)
        for i in range(both.lengths.size):  # rare: a row-wise AND keeps the code obvious
            s0, n = int(both.starts[i]), int(both.lengths[i])
            both.values[s0: s0 + n] &= o.values[o.starts[i]: o.starts[i] + n].astype(both.values.dtype)
        sources[spec.mask] = both
    cols = [c for c in cols if c in sources]
    plan = pack(tok.lengths, window=window, strategy=strategy, overflow=overflow, seed=seed)
    if shuffle:
        plan = plan.shuffled(seed)
    _report_overflow(plan)

    total = plan.total_tokens
    if progress is None:
        progress = total * len(cols) >= PROGRESS_TOKENS and datasets.utils.logging.is_progress_bar_enabled()
    with progress_bar(total=total * len(cols), unit="tok", enabled=progress, desc="pack_dataset") as bar:
        rows = pack_columns(plan, {c: (src.values, src.starts) for c, src in sources.items()},
                            loss_mask=spec.mask, keep_mask=spec.keep_mask, mask_first_label=mask_first_label,
                            num_threads=num_proc or 1, bar=bar)
    names = list(rows.columns)
    arrays = [_list_array(rows.row_offsets, rows.columns[c]) for c in names]
    arrays.append(_list_array(rows.seq_offsets, rows.seq_lengths.astype(np.int32)))
    names.append("seq_lengths")
    if example_ids:
        arrays.append(_list_array(rows.seq_offsets, rows.seg_example.astype(np.int64)))
        names.append("example_ids")
    import pyarrow as pa
    from datasets.fingerprint import update_fingerprint

    fingerprint = update_fingerprint(ds._fingerprint, "packkit.pack_dataset", dict(
        window=window, strategy=strategy, overflow=overflow, columns=cols, seed=seed, shuffle=shuffle,
        mask_first_label=mask_first_label, example_ids=example_ids))
    out = datasets.Dataset(pa.Table.from_arrays(arrays, names=names), fingerprint=fingerprint)
    return (out, plan) if return_plan else out


def _pack_splits(dd, split, *, return_plan: bool, **kwargs):
    """:func:`pack_dataset` on a ``DatasetDict``: the ``split`` named, or every split into a ``DatasetDict``."""
    import datasets

    names = list(dd)
    if split is not None:
        if split not in dd:
            raise ArgumentError("the DatasetDict has no split {got!r}; it has {names}: pass {arg}", got=split,
                                names=names, arg=arg("split", metavar="NAME"))
        return pack_dataset(dd[split], return_plan=return_plan, **kwargs)
    if not names:
        raise ValueError("the DatasetDict has no splits")
    packed = {name: pack_dataset(dd[name], return_plan=return_plan, **kwargs) for name in names}
    kind = datasets.DatasetDict if isinstance(dd, datasets.DatasetDict) else datasets.IterableDatasetDict
    if return_plan:
        return kind({n: p[0] for n, p in packed.items()}), {n: p[1] for n, p in packed.items()}
    return kind(packed)


def _pack_iterable(ds, *, window, buffer_size, overflow, columns, seed, shuffle, mask_first_label, example_ids,
                   progress):
    """:func:`pack_dataset` on a ``datasets.IterableDataset``: :func:`pack_stream` as an IterableDataset.

    ``shuffle`` shuffles the packed rows with ``IterableDataset.shuffle(seed=seed, buffer_size=buffer_size)``
    (seeded; ``set_epoch`` changes the order per epoch); ``progress`` counts packed tokens (no total:
    a stream has no known length).
    """
    import datasets

    if ds.column_names:
        names = resolve_columns(ds.column_names, columns).written()
    elif columns is not None:
        names = resolve_columns(list(columns) if not isinstance(columns, str) else [columns], columns).written()
    else:
        names = None
    features = None
    if names is not None:
        ids = datasets.Sequence(datasets.Value("int64"))
        features = datasets.Features({c: ids for c in names})
        features["seq_lengths"] = datasets.Sequence(datasets.Value("int32"))
        if example_ids:
            features["example_ids"] = ids

    def rows():
        stream = pack_stream(ds, window=window, buffer_size=buffer_size, overflow=overflow, columns=columns,
                             mask_first_label=mask_first_label, example_ids=example_ids)
        with progress_bar(total=None, unit="tok", enabled=progress, desc="pack_dataset (stream)") as bar:
            for row in stream:
                bar.update(int(row["seq_lengths"].sum()))
                # Unknown columns (no features to cast numpy arrays with): plain lists, as datasets gives.
                yield row if features is not None else {k: v.tolist() for k, v in row.items()}

    out = datasets.IterableDataset.from_generator(rows, features=features)
    return out.shuffle(seed=seed, buffer_size=buffer_size) if shuffle else out


