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
from .packer import (ColumnSpec, PackedStream, StreamStats, first_bad_label, first_bad_mask, log_overflow,
                     pack_columns, pack_stream, resolve_columns)
from .segments import IGNORE_INDEX, lengths_to_offsets

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
    """A list column as flat arrays: example ``i`` is ``values[starts[i] : starts[i] + lengths[i]]``."""

    values: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray


def _read_column(table, name: str, indices: np.ndarray | None, *, tokens: bool) -> _Column:
    """Flat values, starts and lengths of list column ``name`` (rows picked by ``indices``)."""
    import pyarrow as pa

    col = table.column(name)
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        raise TypeError(f"column {name!r} holds {col.type}, not lists of token ids: it cannot be packed")
    vtype = col.type.value_type
    if not (pa.types.is_integer(vtype) or (not tokens and pa.types.is_boolean(vtype))):
        raise TypeError(f"column {name!r} holds lists of {vtype}; token ids and labels must be integers")
    parts, starts, lengths, base, row = [], [], [], 0, 0
    for chunk in col.chunks:
        if chunk.null_count:
            i = row + int(np.argmax(~np.asarray(chunk.is_valid())))
            raise ValueError(f"example {i} has no {name!r} (null); drop or fill it before packing")
        off = chunk.offsets.to_numpy().astype(np.int64)
        child = chunk.values.slice(int(off[0]), int(off[-1] - off[0]))
        if child.null_count:
            bad = np.flatnonzero(~np.asarray(child.is_valid()))[0] + off[0]
            i = row + int(np.searchsorted(off, bad, side="right") - 1)
            raise ValueError(f"example {i} has a null entry in {name!r}; every token needs a value")
        parts.append(child.to_numpy(zero_copy_only=False))
        starts.append(off[:-1] - off[0] + base)
        lengths.append(np.diff(off))
        base += int(off[-1] - off[0])
        row += len(chunk)
    if not parts:
        values = np.zeros(0, vtype.to_pandas_dtype() if pa.types.is_integer(vtype) else np.int64)
        starts_a = lengths_a = np.zeros(0, np.int64)
    else:
        values = parts[0] if len(parts) == 1 else np.concatenate(parts)
        starts_a, lengths_a = np.concatenate(starts), np.concatenate(lengths)
    if indices is not None:
        starts_a, lengths_a = starts_a[indices], lengths_a[indices]
    return _Column(values, starts_a, lengths_a)


def _first_example_with(col: _Column, bad: np.ndarray) -> int | None:
    """The first example (in dataset order) holding a flat position where ``bad`` is True, or None.

    The flat buffer may hold rows outside a selection, so a bad position there names no example.
    """
    # Count the bad positions before every start and every end: an example holds one iff they differ.
    before = lengths_to_offsets(bad)
    hit = np.flatnonzero(before[col.starts + col.lengths] > before[col.starts])
    return int(hit[0]) if hit.size else None


def _check_tokens(col: _Column, name: str) -> None:
    """Token ids must be >= 0; the error names the first example holding a negative one."""
    if col.values.size == 0 or col.values.dtype.kind == "u" or int(col.values.min()) >= 0:
        return
    i = _first_example_with(col, col.values < 0)
    if i is not None:
        raise ValueError(f"example {i} has a negative token id in {name!r}; token ids must be >= 0")


def _check_mask(col: _Column, name: str) -> None:
    """A loss mask holds 0 and 1 only; the error names the first example holding another value."""
    if first_bad_mask(col.values) is None:
        return
    i = _first_example_with(col, (col.values != 0) & (col.values != 1))
    if i is not None:
        raise ValueError(f"example {i} has a value other than 0 or 1 in the loss mask {name!r}; "
                         "a loss mask marks the tokens that carry the loss with 1")


def _check_labels(col: _Column, name: str) -> None:
    """Labels are token ids (>= 0) or -100; the error names the first example holding another value."""
    if first_bad_label(col.values) is None:  # the fast, usual path
        return
    bad = (col.values < 0) & (col.values != IGNORE_INDEX)
    i = _first_example_with(col, bad)
    if i is not None:
        s = int(col.starts[i])
        t = s + int(np.argmax(bad[s: s + int(col.lengths[i])]))
        raise ValueError(f"example {i} has label {int(col.values[t])} in {name!r}; labels are token ids "
                         f"(>= 0) or {IGNORE_INDEX} (no loss)")


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
    sources = {c: _read_column(table, c, indices, tokens=(i == 0 or c == "labels")) for i, c in enumerate(cols)}
    tok = sources[cols[0]]
    _check_tokens(tok, cols[0])
    if "labels" in sources:
        _check_labels(sources["labels"], "labels")
    if spec.mask is not None:
        _check_mask(sources[spec.mask], spec.mask)
    for c in cols[1:]:
        bad = np.flatnonzero(sources[c].lengths != tok.lengths)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"example {i} has {int(sources[c].lengths[i])} {c!r} but "
                             f"{int(tok.lengths[i])} {cols[0]!r}; they must have the same length")
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


