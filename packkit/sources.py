"""Where offline packing reads tokens from: record batches in order, seen as flat numpy views.

A dataset arrives as Arrow record batches in dataset order (a ``datasets.Dataset``, a memory-mapped
Arrow file, a parquet file read a row group at a time). :func:`scan` turns its list columns into
:class:`~packkit.packer.FlatColumn`\\ s *without copying a token* wherever the batches are views of
memory that stays valid, and checks every batch as it passes::

    memory-mapped Arrow file (datasets cache, save_to_disk shard, .arrow)
    +--------+--------------------+--------+--------------------+------
    | batch0 | input_ids values 0 | batch1 | input_ids values 1 | ...      one mmap: one region
    +--------+--------------------+--------+--------------------+------
               ^ starts[i] = (address of example i's first token - address of the map) / itemsize

Every record batch of one file is a slice of one memory map (pyarrow's ``Buffer.parent`` chain ends
there), so all its batches become one numpy array over the map (a *region*) and an example is a start
inside it. A gather then reads only the pages its segments touch: the tokens stay in the page cache
(file-backed memory, which the kernel can drop), not in the process's anonymous memory.

Batches that are copies (rows taken through a ``select`` / ``shuffle`` view of a dataset, parquet
decoded a row group at a time) or columns numpy cannot view (Arrow's bit-packed booleans) are
*staged*: appended to a temporary Arrow file beside the output (``.staged.packkit-tmp-XXXXXXXX``, the
name pattern of every temporary file, :data:`packkit.fileio.TMP_PATTERN`), which is memory-mapped and
unlinked once the scan ends (so nothing is left behind, even if the process is killed later). An error
or a stop signal while staging removes it (a full disk included: its removal needs no space). Either way the
anonymous memory the scan holds is a few arrays of one entry per example, plus one batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from pathlib import Path

import numpy as np

from .arrow import pyarrow, replay
from .readers import parquet_batches, parquet_schema
from .errors import DataError
from .atomic import name_max, named_os_error, temp_name
from .interrupts import deferred, join
from .listcolumns import check_float_culprit, list_chunks
from .packer import FlatColumn
from .row_rules import row_segments
from .rules import ATTENTION_MASK_KEY, FLAG_KINDS, check_column, check_not_null, check_values, segment_key
from .segments import lengths_to_offsets

__all__ = ["ArrowSource", "Scan", "scan", "scan_documents", "prefetch", "DEFAULT_BATCH_ROWS"]

#: Rows per record batch read from a ``datasets.Dataset`` or a parquet file (bounds a staged batch).
DEFAULT_BATCH_ROWS = 4096


def _root(buf):
    """The buffer ``buf`` is a slice of, at the top of its ``parent`` chain (a memory map, or an allocation)."""
    while buf.parent is not None:
        buf = buf.parent
    return buf


@dataclasses.dataclass
class ArrowSource:
    """Record batches of a dataset in dataset order, and which of them stay valid without a copy.

    Fields:
        schema: the ``pyarrow.Schema`` of the batches (all columns).
        batches: ``batches(columns) -> iterator of (pyarrow.RecordBatch, is_view)``: ``is_view`` is
            True when the batch's buffers are views of memory that outlives the scan (a memory map,
            an in-memory table kept alive by the source); False batches are staged.
        stage_dir: folder for the staging file (default: the system's temporary folder).
        describe: words for messages (``"'data.parquet'"``).
        keep: objects the views depend on (kept alive with the source).
        nbytes: about how many bytes the source holds (to decide whether a progress bar is worth it).
    """

    schema: object
    batches: object
    stage_dir: Path | None = None
    describe: str = "the dataset"
    keep: list = dataclasses.field(default_factory=list)
    nbytes: int = 0

    @property
    def names(self) -> list:
        return list(self.schema.names)

    @classmethod
    def from_table(cls, table, *, stage_dir=None, describe: str = "the table") -> "ArrowSource":
        """A ``pyarrow.Table`` (in memory or memory-mapped): every batch is a view of it."""

        def batches(columns):
            for batch in table.select(list(columns)).to_batches():
                yield batch, True

        return cls(table.schema, batches, stage_dir, describe, [table], table.nbytes)

    @classmethod
    def from_parquet(cls, path, *, batch_rows: int = DEFAULT_BATCH_ROWS, stage_dir=None) -> "ArrowSource":
        """A parquet file, decoded ``batch_rows`` rows at a time (:func:`packkit.readers.parquet_batches`)
        on a thread, a few batches ahead of the scan (decoding overlaps staging); every batch is a
        fresh copy, so all of it is staged to a memory-mapped file."""
        path = Path(path)

        def batches(columns):
            for batch in prefetch(parquet_batches(path, columns=list(columns), batch_rows=batch_rows)):
                yield batch, False

        return cls(parquet_schema(path), batches, stage_dir if stage_dir is not None else path.parent,
                   repr(str(path)), nbytes=path.stat().st_size)

    @classmethod
    def from_tables(cls, make, *, stage_dir=None, describe: str = "the data", nbytes: int = 0) -> "ArrowSource | None":
        """Tables made a bounded chunk at a time by ``make()`` (an iterator of ``pyarrow.Table``, all of the first
        one's schema: JSON lines parsed, text tokenized), on a thread ahead of the scan; every batch is staged,
        so memory holds a chunk or two, never the data. The first table is made here, for the schema, and the
        first pass continues from it; a later pass calls ``make()`` again. None when ``make()`` yields nothing."""
        tables = make()
        first = next(tables, None)
        if first is None:
            return None
        again = replay(first, tables, make)

        def batches(columns):
            for table in prefetch(again()):
                for batch in table.select(list(columns)).to_batches():
                    yield batch, False

        return cls(first.schema, batches, stage_dir, describe, nbytes=nbytes)

    @classmethod
    def of(cls, rows, *, stage_dir=None) -> "ArrowSource":
        """The source of an input's rows as the door in read them (:meth:`packkit.datafiles.Input.rows`): a
        dataset's or an in-memory table's views, a Parquet file decoded, or chunks made a chunk at a time (staged
        beside ``stage_dir``, else beside the input)."""
        near = stage_dir if stage_dir is not None else rows.path.parent
        if rows.dataset is not None:
            return cls.from_dataset(rows.dataset, stage_dir=stage_dir)
        if rows.parquet is not None:
            return cls.from_parquet(rows.parquet, stage_dir=near)
        if rows.make is not None:
            return cls.from_tables(rows.make, stage_dir=near, describe=repr(str(rows.path)), nbytes=rows.nbytes)
        return cls.from_table(rows.table, stage_dir=stage_dir, describe=repr(str(rows.path)))

    @classmethod
    def from_dataset(cls, ds, *, batch_rows: int = DEFAULT_BATCH_ROWS, stage_dir=None) -> "ArrowSource":
        """A ``datasets.Dataset``, read through its public API (``with_format("arrow").iter``).

        A batch whose buffers belong to ``ds.data`` (the Arrow table backing the dataset: memory-mapped
        cache files, or an in-memory table) is a view; rows gathered through a selection or shuffle
        (an indices mapping) are copies, and are staged.
        """
        if stage_dir is None and ds.cache_files:
            stage_dir = Path(ds.cache_files[0]["filename"]).parent

        def batches(columns):
            columns = list(columns)
            backing = set()
            for c in columns:
                for chunk in ds.data.column(c).chunks:
                    buf = chunk.values.buffers()[1] if chunk.values.buffers()[1:] else None
                    if buf is not None:
                        backing.add(_root(buf).address)
            view = ds.with_format("arrow", columns=columns)
            for table in view.iter(batch_size=batch_rows):
                for batch in table.to_batches():
                    yield batch, all(_is_view_of(batch.column(c), backing) for c in columns)

        return cls(ds.features.arrow_schema, batches, stage_dir, "the dataset", [ds], ds.data.nbytes)


def prefetch(iterable, depth: int = 2):
    """Iterate ``iterable`` on a thread, at most ``depth`` items ahead; errors arrive in order.

    ``list(prefetch(range(5))) -> [0, 1, 2, 3, 4]``. For sources whose next item is made without the
    GIL (pyarrow decoding a parquet page), so that making it overlaps the consumer's work.
    """
    import queue
    import threading

    items: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce():
        try:
            for item in iterable:
                while not stop.is_set():
                    try:
                        items.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            items.put((done, None))
        except BaseException as exc:  # handed to the consumer, in order
            items.put((done, exc))

    thread = threading.Thread(target=produce, name="packkit-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            with deferred():  # Queue.get takes a lock: a signal's exception inside it would leave the lock held
                try:
                    item, exc = items.get(timeout=0.1)  # a signal waits at most this long (the producer may hang)
                except queue.Empty:
                    continue
            if item is done:
                if exc is not None:
                    raise exc
                return
            yield item
    finally:
        stop.set()
        with deferred():  # a signal here waits for the producer: pyarrow must not decode during exit
            while thread.is_alive():  # let a blocked producer see the stop
                try:
                    items.get_nowait()
                except queue.Empty:
                    pass
                thread.join(timeout=0.05)
            join(thread)


def _is_view_of(arr, roots: set) -> bool:
    bufs = arr.values.buffers() if hasattr(arr, "values") else []
    return len(bufs) > 1 and bufs[1] is not None and _root(bufs[1]).address in roots


# ----------------------------------------------------------------------------------------------
# the scan
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Scan:
    """What :func:`scan` found: the columns as flat views, the example lengths, the value types.

    Fields:
        columns: name -> :class:`~packkit.packer.FlatColumn` (staged booleans read as uint8)
        lengths: (num_examples,) int64, examples' lengths (the token column's)
        types:   name -> the pyarrow value type of the source column
        staged_rows: rows that went through the staging file (0 when every batch was a view)
        packed_rows: rows of packed input read as their documents (None: examples)
        doc_ids: (num_examples,) int64, each document's ``example_ids`` in packed input that has them (the
                 examples it was packed from; a repeated id is an example split into pieces), else None
        doc_starts: (num_examples,) int64, each document's ``piece_offsets`` there (where it starts in its
                 example), else None
    """

    columns: dict
    lengths: np.ndarray
    types: dict
    staged_rows: int = 0
    packed_rows: int | None = None
    doc_ids: np.ndarray | None = None
    doc_starts: np.ndarray | None = None

    def documents(self, seg_lengths: np.ndarray, seg_ptr: np.ndarray) -> "Scan":
        """The scan with every packed row read as its documents: ``seg_lengths (S,)`` lengths, row ``r``
        holding ``seg_lengths[seg_ptr[r]:seg_ptr[r + 1]]`` (:func:`packkit.row_rules.row_segments`). Each
        column becomes a view per document (its row's region, the row's start plus the document's offset
        inside the row): no token is copied. ``packed_rows`` keeps the row count.

        Rows ``[[1, 2, 3]]`` with ``seq_lengths [[2, 1]]``: documents ``[1, 2]`` and ``[3]``.
        """
        seg_lengths = np.asarray(seg_lengths, np.int64)
        counts = np.diff(np.asarray(seg_ptr, np.int64))
        row = np.repeat(np.arange(counts.size), counts)
        seg_off = lengths_to_offsets(seg_lengths)[:-1]
        within = seg_off - seg_off[np.asarray(seg_ptr[:-1])][row] if seg_lengths.size else seg_off
        columns = {name: FlatColumn(col.regions, None if col.region is None else col.region[row],
                                    col.starts[row] + within, col.dtype)
                   for name, col in self.columns.items()}
        return dataclasses.replace(self, columns=columns, lengths=seg_lengths, packed_rows=int(counts.size))


class _Regions:
    """Numpy views over the root buffers of one column, one per (root, dtype)."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self.index: dict = {}
        self.views: list = []

    def locate(self, buf) -> tuple[int, int]:
        """``(region, element offset of buf inside it)`` for a values buffer ``buf``."""
        item = self.dtype.itemsize
        root = _root(buf)
        delta = buf.address - root.address
        if delta % item or root.address % item:  # not viewable as this dtype from the root: alone
            root, delta = buf, 0
        key = (root.address, root.size)
        r = self.index.get(key)
        if r is None:
            r = self.index[key] = len(self.views)
            self.views.append(np.frombuffer(root, self.dtype, count=root.size // item))
        return r, delta // item


def scan(source: ArrowSource, columns, *, kinds=None, check=None, progress=None) -> Scan:
    """Read ``columns`` of ``source`` once, batch by batch, into flat views (module docstring).

    Args:
        source: an :class:`ArrowSource`.
        columns: list column names, the token column first.
        kinds: name -> ``"ids"``, ``"labels"``, ``"mask"`` or ``"other"`` (:mod:`packkit.rules`'
            kinds; default: the first column ids, the rest other). Each batch's column is read by
            :func:`packkit.listcolumns.list_chunks` (types checked, errors naming the dataset row). A
            null row of a ``labels`` column reads the example's token ids, one of a ``mask`` column
            reads ones (the example does not have that key), without a copy.
        check: ``check(name, values, offsets, valid, row, token_lengths)`` called on every batch's
            column (flat ``values`` with ``(n + 1,)`` ``offsets`` from 0, ``valid`` the non-null mask
            or None, ``row`` the dataset row of its first example); it raises on bad values.
        progress: a bar advanced by rows scanned, or None.

    A source's ``attention_mask`` that ``columns`` do not name is read too, for its rule only (a 0 is a pad token
    of ``padding=True``: refused naming the row, :func:`packkit.rules.padded_example`), and not packed.
    """
    pa = pyarrow()
    columns = list(columns)
    kinds = dict(kinds or {}) or {c: "ids" if i == 0 else "other" for i, c in enumerate(columns)}
    types = {c: _list_value_type(source.schema.field(c).type, c) for c in columns}
    _blame_floats(source, [c for c in columns if pa.types.is_floating(types[c])], kinds)
    checked = [ATTENTION_MASK_KEY] if ATTENTION_MASK_KEY in source.names and ATTENTION_MASK_KEY not in columns \
        and segment_key(source.names) is None else []  # packed rows (any packer's) hold their documents elsewhere
    regions: dict = {}
    parts = {c: [] for c in columns}  # per column: (region, starts) or ("staged", batch index)
    valid_parts = {c: [] for c in columns}
    length_parts: list = []
    row = staged_rows = 0
    with _Stage(source, columns, types) as stage:
        for batch, is_view in source.batches(columns + checked):
            if batch.num_rows == 0:
                continue
            length_parts.append(_read_batch(batch, columns, kinds, check, row, valid_parts, checked))
            if is_view and all(not pa.types.is_boolean(types[c]) for c in columns):
                for c in columns:
                    parts[c].append(_locate(regions, c, batch.column(c)))
            else:
                k = stage.write(batch, row)
                for c in columns:
                    parts[c].append(("staged", k))
            row += batch.num_rows
            if progress is not None:
                progress.update(batch.num_rows)
        if stage.open is not None:
            batches = stage.mapped()
            for c in columns:
                parts[c] = [_locate(regions, c, batches[p[1]].column(c)) if isinstance(p[0], str) else p
                            for p in parts[c]]
            staged_rows = sum(b.num_rows for b in batches)
    lengths = np.concatenate(length_parts) if length_parts else np.zeros(0, np.int64)
    out = {c: _flat_column(regions.get(c), parts[c], types.get(c)) for c in columns}
    for c in columns[1:]:
        valid = np.concatenate(valid_parts[c]) if valid_parts[c] else np.ones(0, bool)
        if not valid.all():
            out[c] = _fill_nulls(out[c], ~valid, out[columns[0]], lengths, ones=kinds.get(c) in FLAG_KINDS)
    return Scan(out, lengths, types, staged_rows)


def _blame_floats(source: ArrowSource, floats: list, kinds: dict) -> None:
    """Float columns are refused at their first value; first the value to blame is looked for in every batch
    (:func:`packkit.listcolumns.check_float_culprit`: a ``2.5`` on row 900, not the ``1.0`` of row 0)."""
    row = 0
    for batch, _ in source.batches(floats) if floats else ():
        for c in floats:
            check_float_culprit(batch.column(c), key=c, kind=kinds.get(c, "other"), rows=row)
        row += batch.num_rows


def _read_batch(batch, columns: list, kinds: dict, check, row: int, valid_parts: dict, checked=()) -> np.ndarray:
    """One batch's columns read by the rules (:func:`packkit.listcolumns.list_chunks`, then ``check``), each
    column's non-null mask kept in ``valid_parts``, and the columns ``checked`` (an ``attention_mask`` not packed) by
    their own rule (:func:`packkit.rules.check_column`); the examples' lengths (the token column's)."""
    lengths = None
    for c in columns:
        ((values, offsets, valid, _),) = list_chunks(batch.column(c), key=c, kind=kinds.get(c, "other"), rows=row)
        if lengths is None:
            lengths = np.diff(offsets)
        if check is not None:
            check(c, values, offsets, valid, row, lengths)
        valid_parts[c].append(np.ones(batch.num_rows, bool) if valid is None else valid)
    for c in checked:
        ((values, offsets, valid, _),) = list_chunks(batch.column(c), key=c, kind="attention", rows=row)
        check_column(values, offsets, kind="attention", key=c, rows=row, valid=valid, ref_lengths=lengths,
                     ref_key=columns[0])
    return lengths


def _flat_column(reg, parts: list, vtype) -> FlatColumn:
    """The :class:`~packkit.packer.FlatColumn` of one column's ``(region, starts)`` parts over its regions."""
    reg = reg or _Regions(_numpy_type(vtype))
    if not reg.views:
        reg.views.append(np.zeros(0, reg.dtype))
    region = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int32)
    starts = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
    return FlatColumn(reg.views, region if len(reg.views) > 1 else None, starts)


class _Stage:
    """The staging file of one scan (module docstring): opened at the first batch that is not a view, memory-mapped
    back and unlinked when the scan ends (:meth:`mapped`), removed whatever happens (an error or a stop signal while
    staging; a full disk included, its removal needs no space), an error of the system naming its folder."""

    def __init__(self, source: ArrowSource, columns: list, types: dict):
        self.source, self.columns, self.types = source, columns, types
        self.open = None  # (path, file, writer) while staging
        self.rows: list = []  # the dataset row of every staged batch

    def write(self, batch, row: int) -> int:
        """Stage ``batch`` (its first example is dataset row ``row``); its index among the staged batches."""
        import pyarrow.compute as pc

        if self.open is None:
            with deferred():  # a signal waits until the new file is named in `open` (then removed)
                self.open = _open_stage(self.source, self.columns, self.types)
        self.open[2].write_batch(_stageable(batch, self.columns, self.types, pc))
        self.rows.append(row)
        return len(self.rows) - 1

    def mapped(self) -> list:
        """The staged batches, read back from the memory-mapped file, which is unlinked (the map keeps the data;
        nothing is left on disk) and kept alive by the source."""
        pa = pyarrow()
        import pyarrow.ipc as ipc

        path, fh, writer = self.open
        writer.close()
        fh.close()
        try:
            mapped = ipc.open_stream(pa.memory_map(str(path))).read_all()
        finally:
            with deferred(), contextlib.suppress(OSError):
                os.unlink(path)
            self.open = None
        self.source.keep.append(mapped)
        batches = mapped.to_batches()
        if len(batches) != len(self.rows):  # pragma: no cover - one write_batch, one batch
            raise RuntimeError("the staging file does not hold the batches written to it")
        return batches

    def __enter__(self) -> "_Stage":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        stage, self.open = self.open, None
        if stage is None:
            return
        with deferred():
            _close_stage(stage)
        if isinstance(exc, OSError):
            raise named_os_error(exc, f"{stage[0].parent} (staging {self.source.describe} there)") from exc


def scan_documents(source: ArrowSource, found: Scan, *, progress=None) -> Scan:
    """``found`` (:func:`scan` of ``source``) with packed rows read as their documents when ``source`` has
    a ``seq_lengths`` or ``position_ids`` column (:data:`packkit.rules.SEGMENT_KEYS`): one more pass over
    that column only, checked against the rows' lengths (errors name the dataset row); ``found`` as it
    is when it has neither. A packed row is never one example: its documents would attend to each other.
    """
    key = segment_key(source.names)
    if key is None:
        return found
    flat, counts, row = [], [], 0
    for batch, _ in source.batches([key]):
        for values, off, valid, first in list_chunks(batch.column(key), key=key, kind="ids", rows=row):
            check_not_null(valid, key=key, rows=first)
            check_values(values, off, kind="ids", key=key, rows=first)
            flat.append(np.array(values, np.int64))
            counts.append(np.diff(off))
        row += batch.num_rows
        if progress is not None:
            progress.update(batch.num_rows)
    flat = np.concatenate(flat) if flat else np.zeros(0, np.int64)
    counts = np.concatenate(counts) if counts else np.zeros(0, np.int64)
    seg_lengths, seg_ptr = row_segments(key, flat, counts, found.lengths, rows=0)
    docs = found.documents(seg_lengths, seg_ptr)
    for key, field in (("example_ids", "doc_ids"), ("piece_offsets", "doc_starts")):
        if key in source.names:  # packkit's own ids and piece offsets, one per document: carried, not dropped
            docs = dataclasses.replace(docs, **{field: _document_values(source, np.diff(seg_ptr), key)})
    return docs


def _document_values(source: ArrowSource, counts: np.ndarray, key: str) -> np.ndarray:
    """The column ``key`` of packed rows (``example_ids``, ``piece_offsets``), flat: one value per document,
    ``counts`` documents a row (checked row by row: a row whose values do not match its documents is refused
    naming it)."""
    flat, row = [], 0
    for batch, _ in source.batches([key]):
        for values, off, valid, first in list_chunks(batch.column(key), key=key, kind="ids", rows=row):
            check_not_null(valid, key=key, rows=first)
            n = np.diff(off)
            bad = np.flatnonzero(n != counts[first:first + n.size])
            if bad.size:
                i = first + int(bad[0])
                raise DataError(f"dataset row {i} has {int(n[bad[0]])} {key} for {int(counts[i])} documents "
                                "(seq_lengths); they must match")
            flat.append(np.array(values, np.int64))
        row += batch.num_rows
    return np.concatenate(flat) if flat else np.zeros(0, np.int64)


def _fill_nulls(col: FlatColumn, null: np.ndarray, tokens: FlatColumn, lengths: np.ndarray, *,
                ones: bool) -> FlatColumn:
    """``col`` with its null rows reading the example's token ids (labels) or ones (a loss mask), as
    :mod:`packkit.rules` says an example without that key reads: extra regions, no copy of a token."""
    n = col.starts.size
    region = np.zeros(n, np.int32) if col.region is None else col.region.astype(np.int32, copy=True)
    starts = col.starts.copy()
    rows = np.flatnonzero(null)
    if ones:
        fill = [np.ones(int(lengths[rows].max(initial=0)), col.dtype)]
        region[rows] = len(col.regions)
        starts[rows] = 0
        return FlatColumn(col.regions + fill, region, starts)
    tok_region = np.zeros(n, np.int32) if tokens.region is None else tokens.region
    region[rows] = len(col.regions) + tok_region[rows]
    starts[rows] = tokens.starts[rows]
    dtype = np.result_type(col.dtype, tokens.dtype)
    return FlatColumn(col.regions + tokens.regions, region, starts, dtype=dtype)


def _list_value_type(t, name: str):
    pa = pyarrow()
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        raise TypeError(f"column {name!r} holds {t}, not lists of token ids: it cannot be packed")
    return t.value_type


def _numpy_type(vtype):
    pa = pyarrow()
    if vtype is None or pa.types.is_boolean(vtype):
        return np.uint8 if vtype is not None else np.int64
    return vtype.to_pandas_dtype()


def _locate(regions: dict, name: str, arr) -> tuple[np.ndarray, np.ndarray]:
    """(region, starts) of every example of list array ``arr`` (a view: no copy)."""
    off = arr.offsets.to_numpy().astype(np.int64, copy=False)
    child = arr.values
    reg = regions.get(name)
    if reg is None:
        reg = regions[name] = _Regions(child.type.to_pandas_dtype())
    buf = child.buffers()[1]
    if buf is None:  # no values at all (every list empty): an empty region, nothing is read there
        key = ("empty", reg.dtype.str)
        if key not in reg.index:
            reg.index[key] = len(reg.views)
            reg.views.append(np.zeros(0, reg.dtype))
        r, base = reg.index[key], 0
    else:
        r, base = reg.locate(buf)
    n = len(arr)
    return np.full(n, r, np.int32), base + child.offset + off[:-1]


def _open_stage(source: ArrowSource, columns, types):
    """A temporary Arrow stream file beside the output (``.staged.packkit-tmp-XXXXXXXX``), for batches
    that are not views: ``(path, file, writer)``."""
    pa = pyarrow()
    import pyarrow.ipc as ipc

    folder = Path(source.stage_dir) if source.stage_dir is not None else Path(tempfile.gettempdir())
    while True:
        path = folder / temp_name("staged", limit=name_max(folder))
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            break
        except FileExistsError:  # pragma: no cover - 2**32 names
            continue
    stage = (path, None, None)
    try:
        fields = [pa.field(c, pa.list_(pa.uint8() if pa.types.is_boolean(types[c]) else types[c])) for c in columns]
        fh = pa.OSFile(str(path), "wb")
        stage = (path, fh, None)
        return path, fh, ipc.new_stream(fh, pa.schema(fields))
    except BaseException:
        with deferred():
            _close_stage(stage)
        raise


def _close_stage(stage) -> None:
    """Close and remove a staging file whatever happened (closing on a full disk fails; removing does not)."""
    path, fh, writer = stage
    for closer in (writer, fh):
        if closer is not None:
            with contextlib.suppress(Exception):
                closer.close()
    with contextlib.suppress(OSError):
        os.unlink(path)


def _stageable(batch, columns, types, pc):
    """The batch with boolean lists as uint8 lists (numpy cannot view Arrow's packed bits)."""
    pa = pyarrow()
    arrays = []
    for c in columns:
        arr = batch.column(c)
        if pa.types.is_boolean(types[c]):
            arr = pc.cast(arr, pa.list_(pa.uint8()))
        elif pa.types.is_large_list(arr.type):
            arr = pc.cast(arr, pa.list_(types[c]))  # one staging schema (a batch stays under 2**31 values)
        arrays.append(arr)
    return pa.RecordBatch.from_arrays(arrays, names=list(columns))
