"""A columnar path into the DataLoader: batches that stay Arrow buffers, no Python object per token.

``datasets.Dataset.__getitems__`` turns every row into Python lists before any collator runs, which
costs more than the collation itself. :class:`ColumnarDataset` wraps a ``datasets.Dataset`` (or a
pyarrow ``Table``) so that a DataLoader fetches a batch in one call, as numpy views of the Arrow
buffers (flat values + offsets per column), and hands the collator an
:class:`~packkit.examples.ExampleBatch`, which every packkit collator takes directly::

    from torch.utils.data import DataLoader
    from packkit.collate import PaddingFreeCollator
    from packkit.columnar import ColumnarDataset

    loader = DataLoader(ColumnarDataset(ds), batch_size=32, shuffle=True, num_workers=2,
                        collate_fn=PaddingFreeCollator())

It works with packkit's samplers (``batch_sampler=PackedBatchSampler(dataset=cds, ...)`` reads the
lengths from the list offsets), with workers (it pickles as the dataset it wraps, so a memory-mapped
dataset stays memory-mapped in every worker), and as ``transformers.Trainer(train_dataset=...)``.

Two things come with it:

* **Errors name the dataset row.** The batch carries the indices it was fetched with, so a bad example
  deep in an epoch, in any worker, is reported as ``dataset row 81204 has label -7 in 'labels'; ...``.
* **Trainer keeps the loss mask.** ``transformers.Trainer`` (``remove_unused_columns=True``, its
  default) drops the columns its model's ``forward`` does not name from a ``datasets.Dataset`` (a
  ``completion_mask`` / ``assistant_masks`` among them, which silently trains on prompts) and from
  every ``dict`` example. A ``ColumnarDataset`` is not a ``datasets.Dataset`` and its rows are not
  dicts, so the mask reaches the collator and is honoured.

Labels and loss masks follow :mod:`packkit.rules` as on every path. The columns read are
``input_ids``, ``labels``, the loss masks, an ``attention_mask`` (a 0 in it, padding, is refused), and the
packed-row columns ``seq_lengths`` / ``position_ids`` when present (``columns=`` to choose). The Arrow types are
checked once here; values per batch by the collator (vectorised).
"""

from __future__ import annotations

import numpy as np

from .examples import ExampleBatch
from .listcolumns import list_chunks
from .rules import ATTENTION_MASK_KEY, MASK_KEYS, column_kind

__all__ = ["ColumnarDataset", "DEFAULT_COLUMNS"]

#: Columns a :class:`ColumnarDataset` reads by default (those present): what the collators use (an
#: ``attention_mask`` for its rule: padding is refused, :data:`packkit.rules.ATTENTION_MASK_KEY`).
DEFAULT_COLUMNS = ("input_ids", "labels", *MASK_KEYS, ATTENTION_MASK_KEY, "seq_lengths", "position_ids")


def _kind(key: str) -> str:
    """The rule a column's Arrow type is checked under: its :func:`~packkit.rules.column_kind`; the
    packed-row columns (``seq_lengths``, ``position_ids``) under the token ids' rule, as the collators
    read them (:func:`~packkit.examples.read_column`)."""
    kind = column_kind(key, "input_ids")
    return "ids" if kind == "other" else kind


class _Column:
    """One list column as chunks of numpy: ``values[c]``, ``offsets[c]`` (``(n_c + 1,)`` int64) and
    ``valid[c]`` (None: no nulls), ``row0`` the ``(C + 1,)`` first row of every chunk."""

    __slots__ = ("values", "offsets", "valid", "row0", "single")

    def __init__(self, column, key: str):
        self.values, self.offsets, self.valid, rows = [], [], [], [0]
        for values, offsets, valid, _ in list_chunks(column, key=key, kind=_kind(key)):
            self.values.append(values)
            self.offsets.append(offsets)
            self.valid.append(valid)
            rows.append(rows[-1] + offsets.size - 1)
        self.row0 = np.array(rows, np.int64)
        self.single = len(self.values) == 1

    def take(self, index: np.ndarray):
        """The rows ``index`` as ``(parts, lengths)``: one numpy view per row (None for a null row)."""
        if self.single:
            values, offsets, valid = self.values[0], self.offsets[0], self.valid[0]
            starts, ends = offsets[index], offsets[index + 1]
            parts = list(map(values.__getitem__, map(slice, starts.tolist(), ends.tolist())))
            if valid is not None:
                parts = [p if ok else None for p, ok in zip(parts, valid[index].tolist())]
            return parts, ends - starts
        chunk = np.searchsorted(self.row0, index, side="right") - 1
        local = index - self.row0[chunk]
        parts, lengths = [], np.empty(index.size, np.int64)
        for j, (c, r) in enumerate(zip(chunk.tolist(), local.tolist())):
            offsets, valid = self.offsets[c], self.valid[c]
            s, e = int(offsets[r]), int(offsets[r + 1])
            lengths[j] = e - s
            parts.append(None if valid is not None and not valid[r] else self.values[c][s:e])
        return parts, lengths

    def lengths(self) -> np.ndarray:
        return np.concatenate([np.diff(o) for o in self.offsets]) if self.offsets else np.zeros(0, np.int64)


class ColumnarDataset:
    """A map-style dataset over a ``datasets.Dataset`` or pyarrow ``Table`` whose batches stay columnar.

    ``cds[[3, 9]]`` / ``cds.__getitems__([3, 9])`` is an :class:`~packkit.examples.ExampleBatch` of rows 3
    and 9 (numpy views, dataset rows attached); ``cds[3]`` one example as a dict of numpy arrays (for
    other collators). ``len(cds)`` is the number of rows.

    Args:
        data: a ``datasets.Dataset`` (read through its public Arrow format; a ``select``/``shuffle`` view
            is gathered into memory once: ``ds.flatten_indices()`` first keeps it on disk), or a
            ``pyarrow.Table``.
        columns: the list columns to read (default: those of :data:`DEFAULT_COLUMNS` present);
            ``input_ids`` is required.
    """

    def __init__(self, data, *, columns=None):
        self._data, self._columns = data, None if columns is None else tuple(columns)
        self._build()

    def _build(self) -> None:
        table = _arrow_table(self._data)
        names = table.column_names
        if self._columns is None:
            keys = [k for k in DEFAULT_COLUMNS if k in names]
        else:
            missing = [k for k in self._columns if k not in names]
            if missing:
                raise KeyError(f"no column {missing[0]!r}; the columns are {names}")
            keys = list(self._columns)
        if "input_ids" not in keys:
            raise KeyError(f"no 'input_ids' column; the columns are {names}: tokenize first (packkit tokenize IN "
                           "OUT --tokenizer T, or packkit.chat.tokenize_dataset for chat data), or rename the token "
                           "column to 'input_ids'")
        if table.num_rows and max(table.column(k).num_chunks for k in keys) > max(64, table.num_rows // 256):
            table = table.combine_chunks()  # a gathered view (one chunk per row): one copy, then views
        self._n = table.num_rows
        self._cols = {k: _Column(table.column(k), k) for k in keys}

    def __len__(self) -> int:
        return self._n

    @property
    def column_names(self) -> list:
        """The columns this dataset hands to collators."""
        return list(self._cols)

    def example_lengths(self, key: str = "input_ids") -> np.ndarray:
        """``(len(self),)`` int64 list lengths of ``key`` from the Arrow offsets (what samplers need)."""
        if key not in self._cols:
            raise KeyError(f"no column {key!r}; the columns are {self.column_names}")
        return self._cols[key].lengths()

    def _index(self, indices) -> np.ndarray:
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        if index.size and (index.min() < -self._n or index.max() >= self._n):
            bad = int(index[(index < -self._n) | (index >= self._n)][0])
            raise IndexError(f"row {bad} is outside a dataset of {self._n} rows")
        return np.where(index < 0, index + self._n, index)

    def __getitems__(self, indices) -> ExampleBatch:
        """The rows ``indices`` as one columnar batch (what a DataLoader calls with a batch's indices)."""
        index = self._index(indices)
        columns, lengths = {}, None
        for key, col in self._cols.items():
            parts, n = col.take(index)
            columns[key] = parts
            if key == "input_ids":
                lengths = n
        return ExampleBatch._trusted(columns, index, lengths)

    def __getitem__(self, i):
        if isinstance(i, (slice, list, tuple, np.ndarray)):
            index = np.arange(self._n)[i] if isinstance(i, slice) else i
            return self.__getitems__(index)
        index = self._index([i])
        out = {}
        for key, col in self._cols.items():
            part = col.take(index)[0][0]
            if part is not None:  # a null: the example does not have this key
                out[key] = part
        return out

    def __getstate__(self):
        return {"data": self._data, "columns": self._columns}  # numpy views are rebuilt, not pickled

    def __setstate__(self, state):
        self._data, self._columns = state["data"], state["columns"]
        self._build()

    def __repr__(self) -> str:
        return f"ColumnarDataset({self._n} rows, columns {self.column_names})"


def _arrow_table(data):
    """The Arrow table of ``data`` (a ``datasets.Dataset`` or a pyarrow ``Table`` / ``RecordBatch``)."""
    if hasattr(data, "with_format") and hasattr(data, "column_names"):  # a datasets.Dataset
        if not hasattr(data, "__len__"):
            raise TypeError("ColumnarDataset needs a map-style datasets.Dataset, not an IterableDataset; "
                            "pack it with packkit.offline.pack_dataset or feed the stream to a collator directly")
        return data.with_format("arrow")[:]
    import pyarrow as pa

    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, pa.Table):
        return data
    raise TypeError(f"ColumnarDataset takes a datasets.Dataset or a pyarrow Table, got {type(data).__name__}")
