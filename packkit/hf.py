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
:func:`pack_stream` packs any iterable of examples (or a ``datasets.IterableDataset``) with a bounded
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

import bisect
import collections
import dataclasses
import numbers

import numpy as np

from .binpack import (Plan, check_overflow, check_seed, check_strategy, check_window,
                      overflow_error, pack)
from .io import list_array, progress_bar
from .packer import MASK_KEYS, first_bad_label, first_bad_mask, log_overflow, loss_labels, pack_columns
from .segments import IGNORE_INDEX, segment_starts

__all__ = [
    "pack_dataset",
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
    before = np.concatenate(([0], np.cumsum(bad)))
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


@dataclasses.dataclass(frozen=True)
class _Columns:
    """The columns to read, the loss-mask column among them (or None), and whether it is also written."""

    read: list
    mask: str | None
    keep_mask: bool

    def written(self) -> list:
        """Output list columns in order: tokens, labels (given or from the mask), then the rest."""
        has_labels = "labels" in self.read or self.mask is not None
        rest = [c for c in self.read[1:] if c != "labels" and (c != self.mask or self.keep_mask)]
        return [self.read[0]] + (["labels"] if has_labels else []) + rest


def _resolve_columns(names, columns) -> _Columns:
    """The list columns to pack: ``None`` -> input_ids (+ labels, + the first of MASK_KEYS, if present).

    A loss mask becomes labels (-100 where it is 0), so a mask is never dropped in silence; it is
    written too only when ``columns`` names it.
    """
    if columns is None:
        if "input_ids" not in names:
            raise KeyError(f"no 'input_ids' column; the columns are {list(names)}: pass columns=(NAME, ...)")
        mask = next((k for k in MASK_KEYS if k in names), None)
        read = ["input_ids"] + (["labels"] if "labels" in names else []) + ([mask] if mask else [])
        return _Columns(read, mask, keep_mask=False)
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
    for reserved in ("seq_lengths", "example_ids"):
        if reserved in columns:
            raise ValueError(f"column {reserved!r} is written by packing; it cannot be packed itself")
    if columns[0] in MASK_KEYS:
        raise ValueError(f"the first column is the token column; {columns[0]!r} is a loss mask")
    mask = next((c for c in columns if c in MASK_KEYS), None)
    return _Columns(columns, mask, keep_mask=True)


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
                 progress: bool | None = None, return_plan: bool = False):
    """Pack a ``datasets.Dataset`` into windows of at most ``window`` tokens, one row per window.

    Args:
        ds: a ``datasets.Dataset``, or a ``datasets.IterableDataset``: that one is packed with
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
    spec = _resolve_columns(ds.column_names, columns)
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


def _pack_iterable(ds, *, window, buffer_size, overflow, columns, seed, shuffle, mask_first_label, example_ids,
                   progress):
    """:func:`pack_dataset` on a ``datasets.IterableDataset``: :func:`pack_stream` as an IterableDataset.

    ``shuffle`` shuffles the packed rows with ``IterableDataset.shuffle(seed=seed, buffer_size=buffer_size)``
    (seeded; ``set_epoch`` changes the order per epoch); ``progress`` counts packed tokens (no total:
    a stream has no known length).
    """
    import datasets

    if ds.column_names:
        names = _resolve_columns(ds.column_names, columns).written()
    elif columns is not None:
        names = _resolve_columns(list(columns) if not isinstance(columns, str) else [columns], columns).written()
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


# ----------------------------------------------------------------------------------------------
# streaming
# ----------------------------------------------------------------------------------------------


def stream_windows(items, *, window: int, buffer_size: int = 1000):
    """Windows from a stream of ``(payload, length)`` items, best fit inside a bounded buffer.

    Each window starts with the oldest buffered item, then repeatedly takes the longest buffered item
    that fits the room left (the oldest of that length), refilling the buffer after every take, until
    nothing fits. At most ``buffer_size`` items are held; ``buffer_size=1`` is next fit.
    ``[(a, 3), (b, 4), (c, 1)]`` with ``window=4``, ``buffer_size=3`` -> ``[a, c], [b]``.

    Args:
        items: iterable of ``(payload, length)`` with ``1 <= length <= window``.
    Yields:
        lists of payloads, one list per window.
    """
    window = check_window(window)
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, numbers.Integral) or buffer_size < 1:
        raise ValueError(f"buffer_size must be a positive integer, got {buffer_size!r}")
    it = iter(items)
    by_length: dict[int, collections.deque] = {}
    present: list[int] = []  # sorted distinct lengths in the buffer
    arrivals: collections.deque = collections.deque()  # (seq, length), oldest first; taken ones skipped
    held: dict[int, object] = {}  # seq -> payload
    state = {"seq": 0, "done": False}

    def fill():
        while not state["done"] and len(held) < buffer_size:
            try:
                payload, length = next(it)
            except StopIteration:
                state["done"] = True
                return
            length = int(length)
            if not 1 <= length <= window:
                raise ValueError(f"item {state['seq']} has length {length}, outside [1, window={window}]")
            seq = state["seq"]
            state["seq"] += 1
            held[seq] = payload
            arrivals.append((seq, length))
            q = by_length.get(length)
            if q is None:
                by_length[length] = collections.deque([seq])
                bisect.insort(present, length)
            else:
                q.append(seq)

    def take(length: int):
        q = by_length[length]
        seq = q.popleft()
        if not q:
            del by_length[length]
            del present[bisect.bisect_left(present, length)]
        return held.pop(seq)

    fill()
    while held:
        while arrivals[0][0] not in held:
            arrivals.popleft()
        _, length = arrivals.popleft()
        win = [take(length)]
        room = window - length
        fill()
        while room and present:
            j = bisect.bisect_right(present, room) - 1
            if j < 0:
                break
            length = present[j]
            win.append(take(length))
            room -= length
            fill()
        yield win


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


class PackedStream:
    """Iterator of packed rows from an iterable of examples (see :func:`pack_stream`)."""

    def __init__(self, examples, *, window, buffer_size, overflow, columns, mask_first_label, example_ids):
        self.window = check_window(window)
        check_overflow(overflow)
        if isinstance(columns, str):
            columns = [columns]
        self._columns = self._mask = self._written = None
        if columns is not None:
            self._set_columns(_resolve_columns(list(columns), columns))
        self._examples = examples
        self._buffer_size = buffer_size
        self._overflow = overflow
        self._mask_first_label = mask_first_label
        self._example_ids = example_ids
        self._counts = dict(examples=0, tokens=0, windows=0, packed_tokens=0, cut_tokens=0,
                            truncated_examples=0, dropped_examples=0, split_examples=0)
        self._rows = stream_windows(self._items(), window=self.window, buffer_size=buffer_size)

    @property
    def stats(self) -> StreamStats:
        return StreamStats(window=self.window, **self._counts)

    def _set_columns(self, spec: _Columns) -> None:
        self._columns, self._mask, self._written = spec.read, spec.mask, spec.written()

    def _example_arrays(self, i: int, ex) -> dict:
        if not hasattr(ex, "keys"):
            raise TypeError(f"example {i} is a {type(ex).__name__}, not a mapping with 'input_ids'")
        if self._columns is None:
            if "input_ids" not in ex:
                raise KeyError(f"example {i} has no 'input_ids'; its keys are {list(ex.keys())}")
            self._set_columns(_resolve_columns(list(ex.keys()), None))
        out = {}
        for j, c in enumerate(self._columns):
            if c not in ex:
                raise KeyError(f"example {i} has no {c!r}; its keys are {list(ex.keys())}")
            v = ex[c]
            if hasattr(v, "detach"):
                v = v.detach().cpu().numpy()
            arr = np.asarray(v)
            if arr.ndim != 1:
                raise ValueError(f"example {i}: {c!r} must be 1-D, got shape {arr.shape}")
            # Token ids and labels are integers; a mask (or another column) may be boolean.
            kinds = "iu" if j == 0 or c == "labels" else "iub"
            if arr.size and arr.dtype.kind not in kinds:
                raise TypeError(f"example {i}: {c!r} must hold integers, got {arr.dtype}")
            if arr.size == 0:
                arr = arr.astype(np.int64)
            if j == 0:
                if arr.size == 0:
                    raise ValueError(f"example {i} has no tokens; filter empty examples out before packing")
                if arr.dtype.kind == "i" and int(arr.min()) < 0:
                    raise ValueError(f"example {i} has a negative token id; token ids must be >= 0")
            elif c == "labels" and (t := first_bad_label(arr)) is not None:
                raise ValueError(f"example {i} has label {int(arr[t])} in 'labels'; labels are token ids "
                                 f"(>= 0) or {IGNORE_INDEX} (no loss)")
            elif c == self._mask and first_bad_mask(arr) is not None:
                raise ValueError(f"example {i} has a value other than 0 or 1 in the loss mask {c!r}; "
                                 "a loss mask marks the tokens that carry the loss with 1")
            if j and arr.size != out[self._columns[0]].size:
                raise ValueError(f"example {i} has {arr.size} {c!r} but {out[self._columns[0]].size} "
                                 f"{self._columns[0]!r}; they must have the same length")
            out[c] = arr
        return out

    def _items(self):
        W, counts = self.window, self._counts
        for i, ex in enumerate(self._examples):
            arrays = self._example_arrays(i, ex)
            n = arrays[self._columns[0]].size
            counts["examples"] += 1
            counts["tokens"] += n
            if n <= W:
                yield (i, 0, arrays), n
                continue
            if self._overflow == "error":
                lengths = np.zeros(i + 1, np.int64)  # the error path only: binpack's text names example i
                lengths[i] = n
                raise overflow_error(lengths, W)
            if self._overflow == "truncate":
                counts["truncated_examples"] += 1
                counts["cut_tokens"] += n - W
                yield (i, 0, {c: a[:W] for c, a in arrays.items()}), W
            elif self._overflow == "drop":
                counts["dropped_examples"] += 1
                counts["cut_tokens"] += n
            else:
                counts["split_examples"] += 1
                for s in range(0, n, W):
                    piece = {c: a[s: s + W] for c, a in arrays.items()}
                    yield (i, s, piece), min(W, n - s)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        win = next(self._rows)
        cols = self._columns
        lengths = np.array([p[2][cols[0]].size for p in win], np.int32)
        row = {c: np.concatenate([p[2][c] for p in win]) for c in cols}
        if "labels" in row or self._mask is not None:
            # The same rule as packer.pack_columns: -100 where the mask is 0, then on each segment's first token.
            labels = loss_labels(row[cols[0]], row.get("labels"),
                                 None if self._mask is None else row[self._mask])
            if self._mask_first_label:
                labels[segment_starts(lengths)] = IGNORE_INDEX  # a fresh array (concatenated or masked)
            row["labels"] = labels
            row = {c: row[c] for c in self._written}
        row["seq_lengths"] = lengths
        if self._example_ids:
            row["example_ids"] = np.array([p[0] for p in win], np.int64)
        self._counts["windows"] += 1
        self._counts["packed_tokens"] += int(lengths.sum())
        return row


def pack_stream(examples, *, window: int, buffer_size: int = 1000, overflow: str = "error", columns=None,
                mask_first_label: bool = True, example_ids: bool = False) -> PackedStream:
    """Pack an iterable of examples as it streams, holding at most ``buffer_size`` examples.

    Args:
        examples: iterable of mappings with ``input_ids`` (list, numpy array or tensor) and optionally
            ``labels`` (or the ``columns`` named), e.g. a ``datasets.IterableDataset``.
        window: tokens per window.
        buffer_size: examples held for best fit (module docstring: fill against buffer size).
        overflow: ``"error"`` (default), ``"truncate"``, ``"split"`` or ``"drop"``; counted in ``.stats``.
    Returns:
        A :class:`PackedStream`: iterate it for row dicts with ``input_ids``, ``labels`` (when present),
        ``seq_lengths`` (int32) and optionally ``example_ids`` (the index of each segment's example in the
        stream), all numpy arrays; ``.stats`` counts what happened.

    Example: ``list(pack_stream([{"input_ids": [1, 2]}, {"input_ids": [3]}], window=4))`` ->
    ``[{"input_ids": [1, 2, 3], "seq_lengths": [2, 1]}]`` (as numpy arrays).
    """
    return PackedStream(examples, window=window, buffer_size=buffer_size, overflow=overflow, columns=columns,
                        mask_first_label=mask_first_label, example_ids=example_ids)
