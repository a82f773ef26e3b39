"""The door out: the one module that knows output formats, and writes packed rows in each.

A format is a :class:`Format` in :data:`FORMATS`: its name (``packkit pack --format NAME``,
``pack_dataset(..., output=PATH, output_format=NAME)``), the suffixes that choose it when no name is
given (:func:`output_format`), a file or a folder, and its sink. A sink takes the packed rows a record
batch at a time (:func:`packed_batch`, columns of :func:`packed_schema`: ``input_ids``, ``labels``, ...,
``seq_lengths``; :class:`PackedTable` gathers a planned source's) and writes them as they come, so memory holds
one batch whatever the dataset's size; every file or folder is written through
:func:`packkit.fileio.atomic_output` (beside the target, flushed, renamed into place only when complete; removed on
an error or a stop signal). Adding a format is a sink and a line of :data:`FORMATS` here, and its round trip in
``tests/test_formats*.py``.

==============  =====================  ===========================================  =======================
format          suffix                 written as                                    read back with
==============  =====================  ===========================================  =======================
``parquet``     ``.parquet`` ``.pq``   one row group per batch, no dictionary        ``datasets`` (parquet),
                                       encoding, a CRC32 checksum on every page      pyarrow
``arrow``       ``.arrow``             Arrow IPC stream (``datasets``' cache files)  ``Dataset.from_file``
``feather``     ``.feather`` ``.ipc``  Arrow IPC file (random access)                ``pyarrow.ipc.open_file``
``folder``      (none)                 a ``save_to_disk`` folder, IPC shards of at   ``datasets.load_from_disk``
                                       most ``max_shard_bytes`` (500 MB)
``jsonl``       ``.jsonl`` ``.json``   one JSON object a line                        ``datasets`` (json)
``megatron``    ``.megatron``          a folder: ``tokens.bin/.idx`` and             megatron-core's
                                       ``loss_mask.bin/.idx`` (:class:`_MegatronSink`) ``IndexedDataset``
``bridge``      ``.idx.parquet``       Megatron-Bridge packed parquet: ``input_ids``,  Bridge's
                ``.idx.pq``            ``loss_mask``, ``seq_start_id``                ``GPTSFTPackedParquetDataset``
``mds``         ``.mds``               a MosaicML MDS folder: ``index.json`` and      ``streaming.StreamingDataset``
                                       ``shard.NNNNN.mds`` (:class:`_MdsSink`)
``plan``        ``.packplan``          an index-only plan, no token                  :class:`packkit.planindex.PlanIndex`
                                       (:mod:`packkit.planindex`)                    (``PlannedDataset``)
==============  =====================  ===========================================  =======================

The Megatron and Bridge formats hold token ids and a loss mask, not labels: a packed row whose labels are
neither its token ids nor -100 (labels shifted by the user) is refused naming the row, never written as
something else. Each keeps every document boundary of every packed row (the test reads them back with
the format's own reader).

The ``folder`` folder's metadata (``state.json``, ``dataset_info.json``) is written by ``datasets``
itself: ``save_to_disk`` of an empty dataset with the same features and as many shards, whose empty
shard files (named by ``datasets``, read back with ``load_from_disk(...).cache_files``) are then
replaced by the written ones; the folder is loaded once before it is renamed into place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import struct
from pathlib import Path
from typing import Callable

import numpy as np

from .arrow import MAX_LIST_VALUES, list_array, list_parts
from .errors import ArgumentError, DataError, check_int
from .atomic import atomic_output
from .interrupts import deferred, join
from .binpack import Plan, pack
from .epoch import none_left
from .packer import ColumnSpec, _segment_loss, label_dtype, pack_columns
from .planindex import example_stats, write_plan
from .rules import DOCUMENT_KEYS, MASK_KEYS
from .segments import IGNORE_INDEX, lengths_to_offsets

__all__ = ["Format", "FORMATS", "CACHE", "cache_file", "documents_lost", "output_format", "example_suffixes",
           "write_batches", "write_packed", "MAX_SHARD_BYTES", "PackedTable", "packed_schema", "packed_batch",
           "DEFAULT_BUFFER_BYTES"]

#: Shards of a ``folder`` folder hold at most this many bytes (``datasets``' own default, 500 MB).
MAX_SHARD_BYTES = 500 * 10**6


@dataclasses.dataclass(frozen=True)
class Format:
    """One output format.

    Fields:
        name: what ``--format`` and ``output_format=`` call it.
        suffixes: lower-case name endings that choose it (the first is the one an error suggests);
            ``""``: a name without a suffix.
        kind: ``"file"`` or ``"dir"``.
        title: how a summary names it (``"wrote 'out.mds' as {title}"``).
        sink: ``(path, schema, **options) -> sink`` with ``write(batch)`` and ``close()``; None for the
            index-only plan, written from the plan itself (:func:`packkit.planindex.write_plan`).
        encoding: bytes the sink holds per byte of a batch while it writes it (measured, rounded up: parquet
            keeps the encoded row group until it closes; JSON text is ~6 bytes a token, built in steps).
        packed: the format holds packed rows only (their ``seq_lengths``), not examples (``packkit tokenize``).
        documents: the format keeps what a row records of its documents' examples
            (:data:`packkit.rules.DOCUMENT_KEYS`); one that cannot says so in one line when it is written.
        media: the format holds nested media columns beside the tokens (Arrow's own lists: images, audio;
            :mod:`packkit.mediarows`); the others hold tokens only and refuse media rows by name.
        input_format: how the door in reads a file of this format back (:func:`packkit.datafiles.input_format`,
            whatever the file's name ends with); ``""``: packkit does not read it as an input.
    """

    name: str
    suffixes: tuple
    kind: str
    title: str
    sink: Callable | None
    encoding: float = 0.0
    packed: bool = False
    documents: bool = True
    media: bool = False
    input_format: str = ""


# ----------------------------------------------------------------------------------------------
# sinks: open, write(batch), close
# ----------------------------------------------------------------------------------------------


class _ParquetSink:
    def __init__(self, path: Path, schema, *, compression="snappy", row_group_rows: int | None = None):
        import pyarrow.parquet as pq

        self.row_group_rows = row_group_rows  # None: one row group per batch

        # page checksums: a page damaged on disk fails its CRC when read (README, "Parquet page checksums")
        self.writer = pq.ParquetWriter(str(path), schema, use_dictionary=False, compression=compression,
                                       write_page_checksum=True)

    def write(self, batch) -> None:
        self.writer.write_batch(batch, row_group_size=self.row_group_rows or batch.num_rows or None)

    def close(self) -> None:
        self.writer.close()


class _IpcSink:
    def __init__(self, path: Path, schema, *, stream: bool = True):
        import pyarrow as pa
        import pyarrow.ipc as ipc

        self.file = pa.OSFile(str(path), "wb")
        self.writer = (ipc.new_stream if stream else ipc.new_file)(self.file, schema)
        self.bytes = 0

    def write(self, batch) -> None:
        self.writer.write_batch(batch)
        self.bytes += batch.nbytes

    def close(self) -> None:
        try:
            self.writer.close()
        finally:
            self.file.close()


class _JsonlSink:
    """JSON lines built by Arrow's compute functions (numbers formatted in C++, no Python per token)."""

    def __init__(self, path: Path, schema):
        self.file = open(path, "wb")
        self.schema = schema

    def write(self, batch) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        parts: list = []
        for i, field in enumerate(self.schema):
            key = json.dumps(field.name)
            parts.append(("{" if i == 0 else ",") + key + ":")
            col = batch.column(i)
            if pa.types.is_list(field.type) or pa.types.is_large_list(field.type):
                text = pc.cast(col.values, pa.string()) if len(col.values) else pa.array([], pa.string())
                lists = type(col).from_arrays(col.offsets, text)
                parts += ["[", pc.binary_join(lists, ","), "]"]
            else:
                parts.append(pc.cast(col, pa.string()))
        parts.append("}\n")
        if batch.num_rows == 0:
            return
        lines = pc.binary_join_element_wise(*[p if not isinstance(p, str) else pa.scalar(p) for p in parts], "")
        if isinstance(lines, pa.ChunkedArray):
            lines = lines.combine_chunks()
        offsets = np.frombuffer(lines.buffers()[1], np.int32 if pa.types.is_string(lines.type) else np.int64)
        start, end = int(offsets[lines.offset]), int(offsets[lines.offset + len(lines)])
        self.file.write(memoryview(lines.buffers()[2])[start:end])

    def close(self) -> None:
        self.file.close()


class _DatasetSink:
    """A ``save_to_disk`` folder: IPC stream shards rolled at ``max_shard_bytes``, metadata by datasets."""

    def __init__(self, path: Path, schema, *, max_shard_bytes: int = MAX_SHARD_BYTES):
        import datasets

        self.folder = Path(path)
        self.folder.mkdir()
        self.features = datasets.Features.from_arrow_schema(schema)
        self.schema = self.features.arrow_schema  # with the "huggingface" metadata datasets writes
        self.max_shard_bytes = max_shard_bytes
        self.shards: list[Path] = []
        self.sink = None
        self.rows = 0

    def write(self, batch) -> None:
        if self.sink is None or (self.sink.bytes and self.sink.bytes + batch.nbytes > self.max_shard_bytes):
            self._roll()
        self.sink.write(batch.cast(self.schema) if batch.schema != self.schema else batch)
        self.rows += batch.num_rows

    def _roll(self) -> None:
        if self.sink is not None:
            self.sink.close()
        path = self.folder / f".packed-{len(self.shards):05d}.arrow"
        self.shards.append(path)
        self.sink = _IpcSink(path, self.schema)

    def close(self) -> None:
        import datasets
        from datasets.fingerprint import generate_random_fingerprint

        if self.sink is None:
            self._roll()
        self.sink.close()
        empty = datasets.Dataset(self.schema.empty_table(), fingerprint=generate_random_fingerprint())
        enabled = datasets.utils.logging.is_progress_bar_enabled()
        datasets.disable_progress_bars()
        try:
            empty.save_to_disk(str(self.folder), num_shards=len(self.shards))
        finally:
            if enabled:
                datasets.enable_progress_bars()
        names = [Path(f["filename"]) for f in datasets.load_from_disk(str(self.folder)).cache_files]
        if len(names) != len(self.shards):
            raise RuntimeError(f"datasets wrote {len(names)} shard files for {len(self.shards)} shards; "
                               "this version of datasets lays out save_to_disk folders differently")
        for written, name in zip(self.shards, names):
            os.replace(written, self.folder / name.name)
        got = len(datasets.load_from_disk(str(self.folder)))
        if got != self.rows:
            raise RuntimeError(f"the saved dataset reads back {got:,} rows, {self.rows:,} were written")




def _tokens_and_targets(batch, row0: int, fmt: str):
    """The packed rows of ``batch`` as Megatron and Bridge see them: token ids, segments, and which tokens
    are trained on (``target``: a label other than -100; without labels every token but each segment's
    first, as the collators count them).

    Returns ``(row_offsets (R + 1,), ids (T,), seq_offsets (R + 1,), seq_lengths (S,), target (T,) bool)``.
    A label that is neither -100 nor its token id cannot be a loss mask: refused naming the packed row
    (``row0`` is the first row of ``batch`` in the output).
    """
    names = batch.schema.names
    row_offsets, ids = list_parts(batch.column(names.index("input_ids")))
    seq_offsets, seq_lengths = list_parts(batch.column(names.index("seq_lengths")))
    if "labels" in names:
        labels = list_parts(batch.column(names.index("labels")))[1]
        target = labels != IGNORE_INDEX
        bad = np.flatnonzero(target & (labels != ids))
        if bad.size:
            t = int(bad[0])
            row = int(np.searchsorted(row_offsets, t, side="right") - 1)
            raise DataError(f"packed row {row0 + row:,}: label {int(labels[t])} at token {t - int(row_offsets[row])} "
                            f"is not its token id {int(ids[t])}; the {fmt} format stores token ids and a loss mask, "
                            "not labels: give labels that are the token ids or -100, or write parquet or arrow")
    else:
        target = np.ones(ids.size, bool)
        target[lengths_to_offsets(seq_lengths)[:-1]] = False
    return row_offsets, ids, seq_offsets, seq_lengths, target


def _narrow(values: np.ndarray, dtype, fmt: str, row0: int) -> np.ndarray:
    """``values`` as ``dtype``, refused (not wrapped) where a token id does not fit."""
    dtype = np.dtype(dtype)
    if values.dtype == dtype:
        return values
    info = np.iinfo(dtype)
    if values.size and (int(values.max()) > info.max or int(values.min()) < info.min):
        raise DataError(f"a token id of {int(values.max()):,} in the packed rows from row {row0:,} does not fit the "
                        f"{dtype} ids of the {fmt} format; write parquet or arrow")
    return values.astype(dtype)


#: megatron-core's ``DType`` codes of the token types its ``IndexedDataset`` reads.
_MEGATRON_DTYPES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
                    np.dtype(np.int64): 5, np.dtype(np.uint16): 8}
_MEGATRON_HEADER = b"MMIDIDX\x00\x00"


def _write_megatron_index(path: Path, seq_lengths: np.ndarray, doc_index: np.ndarray, dtype) -> None:
    """megatron-core's ``.idx``: header, version 1, dtype code, sequence and document counts, then the
    sequence lengths (int32), their byte offsets in the ``.bin`` (int64) and the document index (int64,
    starting at 0: document ``d`` is sequences ``doc_index[d]:doc_index[d + 1]``)."""
    dtype = np.dtype(dtype)
    pointers = lengths_to_offsets(seq_lengths)[:-1] * dtype.itemsize
    with open(path, "wb") as f:
        f.write(_MEGATRON_HEADER + struct.pack("<Q", 1) + struct.pack("<B", _MEGATRON_DTYPES[dtype]))
        f.write(struct.pack("<Q", seq_lengths.size) + struct.pack("<Q", doc_index.size))
        for part in (seq_lengths.astype(np.int32), pointers.astype(np.int64), doc_index.astype(np.int64)):
            f.write(memoryview(np.ascontiguousarray(part)))


class _MegatronSink:
    """A folder of two megatron-core indexed datasets that share one index layout:

    - ``tokens.bin`` / ``tokens.idx``: every document (segment) of every packed row is one *sequence*, and
      every packed row one *document* (``IndexedDataset(prefix).document_indices``: row ``r`` is sequences
      ``document_indices[r]:document_indices[r + 1]``), so both the rows and the boundaries inside them
      are the reader's own index. Token ids keep the input's integer type where it is narrower than 32 bits
      (uint8, int8, int16, uint16) and are int32 otherwise, as Megatron's own preprocessing writes them (an
      id past int32 is refused, not wrapped).
    - ``loss_mask.bin`` / ``loss_mask.idx``: uint8, 1 where the token is trained on (a label other than
      -100), aligned with the token (Megatron's ``loss_mask`` goes with ``labels = tokens[1:]``, so it is
      this mask's ``[1:]`` within a document).
    - ``packkit.json``: the rows, documents and tokens written, and what the two files hold.

    Data prefixes for Megatron: ``OUT/tokens`` and ``OUT/loss_mask``. Megatron's own datasets (``GPTDataset``,
    the packed ``SFTDataset`` of Megatron-LM PR #5017, which re-packs conversations itself) take one sequence as
    one document, so they see every document whole; ``document_indices`` carries packkit's rows for a reader
    that trains on them as packed.
    """

    def __init__(self, path: Path, schema):
        self.folder = Path(path)
        self.folder.mkdir()
        token_type = np.dtype(schema.field("input_ids").type.value_type.to_pandas_dtype())
        self.dtype = token_type if token_type in _MEGATRON_DTYPES and token_type.itemsize < 4 else np.dtype(np.int32)
        self.tokens = open(self.folder / "tokens.bin", "wb")
        self.mask = open(self.folder / "loss_mask.bin", "wb")
        self.seq_lengths: list = []
        self.row_segments: list = []
        self.rows = 0

    def write(self, batch) -> None:
        _, ids, seq_offsets, seq_lengths, target = _tokens_and_targets(batch, self.rows, "megatron")
        self.tokens.write(memoryview(np.ascontiguousarray(_narrow(ids, self.dtype, "megatron", self.rows))))
        self.mask.write(memoryview(target.view(np.uint8)))
        self.seq_lengths.append(seq_lengths.astype(np.int32))
        self.row_segments.append(np.diff(seq_offsets))
        self.rows += batch.num_rows

    def close(self) -> None:
        self.tokens.close()
        self.mask.close()
        seq_lengths = np.concatenate(self.seq_lengths) if self.seq_lengths else np.zeros(0, np.int32)
        doc_index = lengths_to_offsets(np.concatenate(self.row_segments) if self.row_segments else [])
        _write_megatron_index(self.folder / "tokens.idx", seq_lengths, doc_index, self.dtype)
        _write_megatron_index(self.folder / "loss_mask.idx", seq_lengths, doc_index, np.uint8)
        about = {"format": "megatron", "rows": self.rows, "documents": int(seq_lengths.size),
                 "tokens": int(seq_lengths.sum(dtype=np.int64)), "token_dtype": self.dtype.name,
                 "prefixes": {"tokens": "tokens", "loss_mask": "loss_mask"},
                 "layout": "a sequence per document, a Megatron document per packed row; loss_mask is 1 on every "
                           "token trained on, aligned with the token"}
        (self.folder / "packkit.json").write_text(json.dumps(about, indent=1) + "\n")


#: Megatron-Bridge's packed parquet columns (``GPTSFTPackedParquetDataset``), and the rows of a row group
#: (its reader holds one row group in memory at a time; Bridge's own writer uses 500).
BRIDGE_COLUMNS = ("input_ids", "loss_mask", "seq_start_id")
BRIDGE_ROW_GROUP = 500


class _BridgeSink:
    """Megatron-Bridge packed parquet: ``input_ids: list<int32>``, ``loss_mask: list<int8>``,
    ``seq_start_id: list<int32>`` (the offset of each document in the row, from 0).

    Bridge trains document ``[s, e)`` on ``tokens = input_ids[s:e-1]``, ``labels = input_ids[s+1:e]`` with
    ``loss_mask[s:e-1]``: the mask says whether the *next* token is trained on, so a document's last
    position holds 0. A document's first token is never a label there; packkit masks it too
    (``mask_first_label``), and rows that train on it are refused.
    """

    def __init__(self, path: Path, schema, *, compression="snappy"):
        import pyarrow as pa

        self.schema = pa.schema([pa.field("input_ids", pa.list_(pa.int32())), pa.field("loss_mask", pa.list_(pa.int8())),
                                 pa.field("seq_start_id", pa.list_(pa.int32()))])
        self.parquet = _ParquetSink(path, self.schema, compression=compression, row_group_rows=BRIDGE_ROW_GROUP)
        self.rows = 0

    def write(self, batch) -> None:
        import pyarrow as pa

        row_offsets, ids, seq_offsets, seq_lengths, target = _tokens_and_targets(batch, self.rows, "bridge")
        starts = lengths_to_offsets(seq_lengths)
        first = starts[:-1][target[starts[:-1]]]
        if first.size:
            row = int(np.searchsorted(row_offsets, first[0], side="right") - 1)
            raise DataError(f"packed row {self.rows + row:,} trains on the first token of a document (offset "
                            f"{int(first[0] - row_offsets[row])}), which Megatron-Bridge cannot: pack with "
                            "mask_first_label=True")
        mask = np.zeros(ids.size, np.int8)
        mask[:-1] = target[1:]
        mask[starts[1:] - 1] = 0  # a document's last position predicts nothing
        row_of_seg = np.repeat(np.arange(batch.num_rows), np.diff(seq_offsets))
        seq_start = (starts[:-1] - row_offsets[row_of_seg]).astype(np.int32)
        arrays = [list_array(row_offsets, _narrow(ids, np.int32, "bridge", self.rows)), list_array(row_offsets, mask),
                  list_array(seq_offsets, seq_start)]
        self.parquet.write(pa.RecordBatch.from_arrays(arrays, schema=self.schema))
        self.rows += batch.num_rows

    def close(self) -> None:
        self.parquet.close()


#: MDS's ``ndarray`` value types (``streaming.base.format.mds.encodings.NDArray``); bool is written as uint8.
_MDS_TYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16", "float32",
              "float64")


class _MdsSink:
    """A MosaicML MDS folder (``mosaicml-streaming``'s format, version 2, uncompressed): ``index.json`` and
    shards ``shard.00000.mds``, ... of at most ``size_limit`` bytes (64 MiB, streaming's default).

    Every list column of the packed rows is an ``ndarray:<type>`` column of one-dimensional arrays (a
    sample is a packed row; ``seq_lengths`` holds its document lengths). A shard is the sample count
    (uint32), the samples' byte offsets (uint32, ``count + 1``), the shard's column config (JSON), then the
    samples; a sample is the byte size of each column (uint32, columns sorted by name), then each
    column's array: one byte ``ndim << 2 | shape type``, its shape, its values.
    """

    def __init__(self, path: Path, schema, *, size_limit: int = 1 << 26):
        self.folder = Path(path)
        self.folder.mkdir()
        self.names = sorted(schema.names)
        self.types = {}
        for name in self.names:
            vtype = np.dtype(schema.field(name).type.value_type.to_pandas_dtype())
            self.types[name] = np.dtype(np.uint8) if vtype == np.bool_ else vtype
            if self.types[name].name not in _MDS_TYPES:
                raise ArgumentError(f"column {name!r} holds {vtype}, which MDS has no array type for")
        self.size_limit = size_limit
        self.config = {"column_encodings": [f"ndarray:{self.types[n].name}" for n in self.names],
                       "column_names": self.names, "column_sizes": [None] * len(self.names), "compression": None,
                       "format": "mds", "hashes": [], "size_limit": size_limit, "version": 2}
        self.config_bytes = json.dumps(self.config, sort_keys=True).encode()
        self.samples: list = []
        self.bytes = 0
        self.shards: list = []

    @staticmethod
    def _array(values: np.ndarray) -> bytes:
        n = values.size
        shape = 0 if n < 1 << 8 else 1 if n < 1 << 16 else 2 if n < 1 << 32 else 3
        return bytes([1 << 2 | shape]) + np.array([n], f"<u{1 << shape}").tobytes() + values.tobytes()

    def write(self, batch) -> None:
        cols = {}
        for name in self.names:
            offsets, values = list_parts(batch.column(batch.schema.names.index(name)))
            cols[name] = (offsets, values.astype(self.types[name], copy=False))
        for r in range(batch.num_rows):
            parts = [self._array(values[offsets[r]:offsets[r + 1]]) for offsets, values in cols.values()]
            sample = np.array([len(p) for p in parts], "<u4").tobytes() + b"".join(parts)
            if self.samples and self.bytes + len(sample) + 4 > self.size_limit:
                self._flush()
            self.samples.append(sample)
            self.bytes += len(sample) + 4

    def _flush(self) -> None:
        count = len(self.samples)
        head = 4 + 4 * (count + 1) + len(self.config_bytes)
        offsets = head + lengths_to_offsets([len(s) for s in self.samples])
        if offsets[-1] >= 1 << 32:
            raise DataError(f"one MDS shard would hold {int(offsets[-1]):,} bytes (over 4 GiB, past its uint32 "
                            "offsets): pack with a smaller window")
        name = f"shard.{len(self.shards):05d}.mds"
        with open(self.folder / name, "wb") as f:
            f.write(np.array([count], "<u4").tobytes() + offsets.astype("<u4").tobytes() + self.config_bytes)
            for sample in self.samples:
                f.write(sample)
        self.shards.append({**self.config, "raw_data": {"basename": name, "bytes": int(offsets[-1]), "hashes": {}},
                            "samples": count, "zip_data": None})
        self.samples, self.bytes = [], 0

    def close(self) -> None:
        if self.samples:
            self._flush()
        (self.folder / "index.json").write_text(json.dumps({"shards": self.shards, "version": 2}, sort_keys=True))


# ----------------------------------------------------------------------------------------------
# the formats
# ----------------------------------------------------------------------------------------------

#: Every output format by name (:class:`Format`).
FORMATS = {f.name: f for f in (
    Format("parquet", (".parquet", ".pq"), "file", "parquet", _ParquetSink, encoding=1.0, media=True,
           input_format="parquet"),
    Format("arrow", (".arrow",), "file", "an Arrow IPC stream", lambda path, schema: _IpcSink(path, schema), media=True,
           input_format="arrow"),
    Format("feather", (".feather", ".ipc"), "file", "an Arrow IPC file",
           lambda path, schema: _IpcSink(path, schema, stream=False), media=True, input_format="arrow"),
    Format("jsonl", (".jsonl", ".json", ".ndjson"), "file", "JSON lines", _JsonlSink, encoding=8.0,
           input_format="json"),
    Format("folder", ("",), "dir", "a datasets folder (load with datasets.load_from_disk)", _DatasetSink,
           input_format="folder"),
    Format("megatron", (".megatron",), "dir", "a Megatron indexed dataset folder (prefixes OUT/tokens and "
           "OUT/loss_mask for megatron-core's IndexedDataset)", _MegatronSink, packed=True, documents=False),
    Format("bridge", (".idx.parquet", ".idx.pq"), "file", "Megatron-Bridge packed parquet (input_ids, loss_mask, "
           "seq_start_id)", _BridgeSink, encoding=1.0, packed=True, documents=False, input_format="parquet"),
    Format("mds", (".mds",), "dir", "a MosaicML MDS folder (streaming.StreamingDataset(local=OUT))", _MdsSink, packed=True),
    Format("plan", (".packplan",), "file", "an index-only plan (packkit.planindex.PlanIndex.load; no token "
           "written)", None, packed=True),
)}


#: The format of ``pack_dataset``'s cache files: ``datasets``' own, an Arrow stream it memory-maps.
CACHE = FORMATS["arrow"]


def cache_file(folder, tag: str) -> Path:
    """A new cache file of packed rows in ``folder``, named as ``datasets`` names its own:
    ``cache_file("/c", "ab12") -> Path("/c/cache-packkit-ab12.arrow")``."""
    return Path(folder) / f"cache-packkit-{tag}{CACHE.suffixes[0]}"


def example_suffixes() -> list:
    """The first suffix of every format that holds examples, not only packed rows (what ``packkit tokenize``
    writes): ``[".parquet", ".arrow", ".feather", ".jsonl"]``."""
    return [f.suffixes[0] for f in FORMATS.values() if f.suffixes[0] and not f.packed]


def output_format(path, format: str | None = None) -> Format:
    """The :class:`Format` of an output: the one named by ``format``, else the one whose suffix ends
    ``path``'s name (the longest such: ``out.idx.parquet`` is ``bridge``, ``out.parquet`` is ``parquet``);
    a name without a suffix is a ``save_to_disk`` folder. ``output_format("out.mds").name -> "mds"``.
    An unknown name or suffix is a usage error that lists the choices."""
    if format is not None:
        if isinstance(format, Format):
            return format
        if format not in FORMATS:
            raise ArgumentError(f"unknown output format {format!r}; choose one of {', '.join(FORMATS)}")
        return FORMATS[format]
    name = Path(path).name.lower()
    found = [(len(s), f) for f in FORMATS.values() for s in f.suffixes if s and name.endswith(s) and name != s]
    if found:
        return max(found, key=lambda x: x[0])[1]
    suffix = Path(path).suffix.lower()
    if suffix:
        named = ", ".join(f.suffixes[0] for f in FORMATS.values() if f.suffixes[0])
        raise ArgumentError(f"cannot write {str(path)!r}: unknown output format {suffix!r}; name OUT {named}, or a "
                            f"folder without a suffix (save_to_disk), or choose the format by name: one of "
                            f"{', '.join(FORMATS)}")
    return FORMATS["folder"]


def documents_lost(fmt: Format, names) -> str | None:
    """The line that says what ``fmt`` cannot keep of packed rows with columns ``names``
    (:data:`packkit.rules.DOCUMENT_KEYS`), or None."""
    if fmt.documents or "example_ids" not in names:
        return None
    return (f"the {fmt.name} format has no room for example_ids, piece_offsets and example_loss: the pieces of a split "
            "example are separate examples there (a per-example loss weighting counts each); write parquet or arrow to "
            "keep them")


def write_batches(target, schema, batches, *, format: str | Format | None = None, inputs=(), overwrite: bool = False,
                  overwrite_hint: str | None = None, background: bool = True, **options) -> Path:
    """Write record ``batches`` (all of ``schema``) to ``target`` as they come, atomically.

    Args:
        target: the file or folder to write (:func:`output_format` by suffix unless ``format`` is given).
        schema: the ``pyarrow.Schema`` of the batches.
        batches: an iterable of ``pyarrow.RecordBatch``; consumed once. With ``background`` (default)
            a thread writes batch ``k`` while the next is made, and at most two batches exist at once:
            the next is asked for only once batch ``k - 1`` is written (size batches for two).
        format: a name of :data:`FORMATS` (or a :class:`Format`) other than ``"plan"``.
        inputs, overwrite, overwrite_hint: :func:`packkit.fileio.check_output`'s (the target is never
            an input, and an existing one is replaced only when asked).
        options: the sink's: ``compression=`` for parquet, ``max_shard_bytes=`` for a folder,
            ``size_limit=`` for MDS.
    Returns:
        the target's path.
    """
    fmt = output_format(target, format)
    if fmt.sink is None:
        raise ArgumentError(f"the {fmt.name} format is written from a plan, not from rows: use write_packed")
    lost = documents_lost(fmt, schema.names)
    if lost:
        logging.getLogger("packkit").warning(lost)
    with atomic_output(target, kind=fmt.kind, inputs=inputs, overwrite=overwrite, overwrite_hint=overwrite_hint) as tmp:
        sink = fmt.sink(Path(tmp), schema, **options)
        ok = False
        try:
            (_write_behind if background else _write_inline)(sink, batches)
            ok = True
        finally:
            if ok:
                sink.close()
            else:
                with contextlib.suppress(Exception):
                    sink.close()
    return Path(target)


def write_packed(target, packed, *, format: str | Format | None = None, buffer_bytes: int | None = None,
                 max_tokens: int | None = None, inputs=(), overwrite: bool = False, overwrite_hint: str | None = None,
                 bar=None, through=None, **options) -> Path:
    """Write a planned source (:class:`packkit.outputs.PackedTable`) to ``target`` in its format.

    The rows are gathered and written a record batch of at most ``max_tokens`` tokens at a time (default:
    what ``buffer_bytes`` allows with the format's encoding, :meth:`~packkit.outputs.PackedTable.chunk_tokens`);
    the ``plan`` format writes the plan's indices, no token (:func:`packkit.planindex.write_plan`).
    ``through``: a generator function the record batches pass through on their way to the sink (``packkit
    pack`` checks its input between batches); for a plan it runs, over no batch, before the file is placed.
    The other arguments are :func:`write_batches`'.
    """
    fmt = output_format(target, format)
    through = through or iter
    if max_tokens is None:
        max_tokens = packed.chunk_tokens(buffer_bytes, encoding=fmt.encoding, in_flight=2)
    if fmt.sink is None:
        return write_plan(target, packed, max_tokens=max_tokens, inputs=inputs, overwrite=overwrite,
                          overwrite_hint=overwrite_hint, before_save=lambda: list(through(iter(()))))
    return write_batches(target, packed.schema, through(packed.record_batches(max_tokens=max_tokens, bar=bar)),
                         format=fmt, inputs=inputs, overwrite=overwrite, overwrite_hint=overwrite_hint, **options)


def _write_inline(sink, batches) -> None:
    for batch in batches:
        sink.write(batch)


def _write_behind(sink, batches) -> None:
    """``sink.write`` on a thread (pyarrow writes and encodes without the GIL) while ``batches`` makes
    the next batch; two batches at most: one being written, one being made.

    However the main thread leaves (an error making a batch, Ctrl-C), the thread has ended before this
    returns: it drops the batches not yet written, and the wait for it cannot be cut short by a signal
    (:func:`packkit.interrupts.join`), so the caller never closes the file under a write (which crashed
    the process in pyarrow).
    """
    import queue
    import threading

    todo: queue.Queue = queue.Queue()
    slots = threading.Semaphore(2)
    failed: list = []
    stop = threading.Event()

    def writer():
        while True:
            batch = todo.get()
            if batch is None:
                return
            try:
                if not failed and not stop.is_set():
                    sink.write(batch)
            except BaseException as exc:  # handed to the caller's thread below
                failed.append(exc)
            del batch
            slots.release()

    thread = threading.Thread(target=writer, name="packkit-writer", daemon=True)
    thread.start()
    try:
        it = iter(batches)
        while True:
            # the semaphore and the queue take a lock inside: a signal's exception raised there leaves it held,
            # and the put(None) below waited on it forever (a Ctrl-C that hung); the signal waits for them
            with deferred():
                slots.acquire()
            if failed:
                break
            try:
                batch = next(it)
            except StopIteration:
                break
            with deferred():
                todo.put(batch)
            del batch
    except BaseException:
        stop.set()
        raise
    finally:
        with deferred():
            todo.put(None)
        join(thread)
    if failed:
        raise failed[0]


#: Default bound on the buffer of packed rows in flight (gathered tokens, their Arrow arrays and the
#: writer's encoding of them), in bytes. The plan (about 40 bytes per example) comes on top.
DEFAULT_BUFFER_BYTES = 256 * 2**20

#: A buffer sized to the data (:meth:`PackedTable.chunk_tokens`): this fraction of the packed tokens' bytes,
#: between :data:`MIN_BUFFER_BYTES` and :data:`DEFAULT_BUFFER_BYTES`.
BUFFER_FRACTION = 1 / 16
MIN_BUFFER_BYTES = 8 * 2**20


def packed_schema(columns, *, example_ids: bool = False):
    """The offline row format's ``pyarrow.Schema``: the packed list columns, then ``seq_lengths``.

    ``columns``: ``[(name, pyarrow value type), ...]`` in row order, the token column first; ``labels`` takes
    :func:`~packkit.packer.label_dtype` of its type (-100 must fit). ``example_ids`` adds each document's source
    (:data:`packkit.rules.DOCUMENT_KEYS`: ``example_ids`` int64, ``piece_offsets`` and ``example_loss`` int32).
    ``packed_schema([("input_ids", pa.int32()), ("labels", pa.uint16())])`` ->
    ``input_ids: list<int32>, labels: list<int64>, seq_lengths: list<int32>``."""
    import pyarrow as pa

    fields = []
    for name, vtype in columns:
        if name == "labels":
            vtype = pa.from_numpy_dtype(label_dtype(vtype.to_pandas_dtype()))
        fields.append(pa.field(name, pa.list_(vtype)))
    fields.append(pa.field("seq_lengths", pa.list_(pa.int32())))
    if example_ids:
        fields += [pa.field(k, pa.list_(pa.int64() if k == "example_ids" else pa.int32())) for k in DOCUMENT_KEYS]
    return pa.schema(fields)


def packed_batch(rows, schema, documents: dict | None = None):
    """:class:`~packkit.packer.PackedColumns` -> one ``pyarrow.RecordBatch`` of ``schema``
    (:func:`packed_schema`), one row a window; values are cast to the schema's types where they differ.
    ``documents``: a ``(S,)`` array per document column of the schema (default ``example_ids``: the plan's)."""
    import pyarrow as pa

    if rows.row_offsets[-1] > MAX_LIST_VALUES:
        raise ValueError(f"one record batch would hold {int(rows.row_offsets[-1]):,} tokens (over 2**31 - 1, "
                         "past int32 list offsets): pack fewer windows a batch")
    per_doc = {"seq_lengths": rows.seq_lengths, "example_ids": rows.seg_example, **(documents or {})}
    arrays = []
    for field in schema:
        if field.name in per_doc:
            values = np.asarray(per_doc[field.name]).astype(field.type.value_type.to_pandas_dtype())
            arrays.append(list_array(rows.seq_offsets, values))
        else:
            values = pa.array(rows.columns[field.name])
            if values.type != field.type.value_type:  # e.g. a staged boolean mask, or a wider common type
                values = values.cast(field.type.value_type)
            arrays.append(list_array(rows.row_offsets, values))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


class PackedTable:
    """A plan over a source's examples, and its packed rows as Arrow record batches, a chunk at a time.

    Made by :func:`packkit.offline.plan_source`, which reads a source (:class:`packkit.sources.ArrowSource`) once:
    lengths from the list offsets, every batch checked, numpy *views* of the columns kept where the data lies.
    :meth:`record_batches` gathers consecutive windows of at most ``max_tokens`` tokens
    (:func:`packkit.packer.copy_segments`) into one ``pyarrow.RecordBatch`` (:func:`packed_batch`) that a writer (a
    sink of :data:`FORMATS`, or the cache file) writes and lets go before the next: memory holds one batch, never
    the token data::

        memory-mapped input ──scan──> lengths ──pack──> plan ──chunk 0──> batch 0 ──write──> OUT
        (page cache, not            (8 B an     (~32 B an     chunk 1──> batch 1 ──write──> OUT
         the process's memory)       example)    example)       ...        (one at a time)

    Attributes: ``plan`` (the :class:`~packkit.binpack.Plan`, rows in its window order), ``schema`` (the batches'
    ``pyarrow.Schema``), ``scan`` (:class:`packkit.sources.Scan`)."""

    def __init__(self, scan, spec: ColumnSpec, plan: Plan, *, mask_first_label: bool, example_ids: bool,
                 num_threads: int = 1):
        self.scan, self.spec, self.plan = scan, spec, plan
        # packed input with example_ids, or examples split into pieces: each document records its example
        example_ids = example_ids or scan.doc_ids is not None or plan.split_examples.size > 0
        self.mask_first_label, self.example_ids, self.num_threads = mask_first_label, example_ids, num_threads
        #: packed input with example_ids: documents that are pieces of an example split when it was packed
        #: (its id repeats), and those examples; they stay pieces (a piece's first label was masked then)
        self.split_pieces = self.split_examples = 0
        if scan.doc_ids is not None and scan.doc_ids.size:
            counts = np.unique(scan.doc_ids, return_counts=True)[1]
            self.split_pieces, self.split_examples = int(counts[counts > 1].sum()), int((counts > 1).sum())
        #: what the rows written so far train on (:meth:`record_batches`), what :meth:`drop_loss_free` left out
        self.loss_tokens = self.loss_free_windows = self.loss_free_pieces = 0
        self.dropped_pieces = self.dropped_tokens = 0
        #: how the plan was made (what an index-only plan records to plan again), the source's description
        self.options: dict = {}
        self.groups, self.scan_source = None, ""
        token = spec.read[0]
        self.schema = packed_schema([(name, scan.types.get(name, scan.types[token]) if name == "labels"
                                      else scan.types[name]) for name in spec.written()], example_ids=example_ids)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one packed token over every list column of a row (plus its label's temporaries)."""
        per = sum(f.type.value_type.bit_width // 8 for f in self.schema if f.name not in ("seq_lengths", *DOCUMENT_KEYS))
        return per + (8 if "labels" in self.schema.names else 0)

    def chunk_tokens(self, buffer_bytes: int | None = DEFAULT_BUFFER_BYTES, *, encoding: float = 0.0,
                     in_flight: int = 1, media_per_token: float = 0.0) -> int:
        """Tokens per record batch so that ``in_flight`` batches (2: a writer writes one while the next is
        gathered), their temporaries and a writer's ``encoding`` times their size
        (:attr:`packkit.outputs.Format.encoding`) fit in ``buffer_bytes``. ``None`` sizes the buffer to the data
        (:data:`BUFFER_FRACTION`; 40.7M int64 tokens: 19.4 MiB), so that a small input is not packed with a buffer
        larger than itself. ``media_per_token``: media bytes gathered per token on average
        (:meth:`packkit.mediarows.MediaRows.bytes_per_token`), in the data and in every batch (gathered, made
        contiguous, encoded): a batch of images is bounded as its tokens are."""
        if buffer_bytes is None:
            data = self.plan.total_tokens * (self.bytes_per_token + media_per_token)
            buffer_bytes = int(min(DEFAULT_BUFFER_BYTES, max(MIN_BUFFER_BYTES, data * BUFFER_FRACTION)))
        check_int(buffer_bytes, "buffer_bytes", unit=" byte")
        # gathered columns + their Arrow arrays (zero-copy) + labels' mask temporaries, then the writer's
        per_token = (self.bytes_per_token * (1.0 + encoding) + 8 + media_per_token * (2.0 + encoding)) * in_flight
        return max(1, min(int(buffer_bytes / per_token), MAX_LIST_VALUES))  # int32 list offsets per batch

    def _rows(self, sub: Plan, columns, bar=None, *, mask_first_label: bool | None = None):
        spec, first = self.spec, self.mask_first_label if mask_first_label is None else mask_first_label
        return pack_columns(sub, columns, loss_mask=spec.mask, keep_mask=spec.keep_mask, extra_masks=spec.other_masks,
                            mask_first_label=first, num_threads=self.num_threads, bar=bar)

    def _chunks(self, plan: Plan, max_tokens: int, columns, bar=None, **kw):
        """``(first window, sub-plan, its packed rows)`` of ``plan``'s ``columns``, ``max_tokens`` at a time."""
        for start, stop in plan.chunks(max_tokens):
            sub = plan.window_range(start, stop)
            yield start, sub, self._rows(sub, columns, bar, **kw)

    def _loss_columns(self) -> dict:
        """The token column and the columns that carry the loss (labels, a loss mask), as scanned."""
        token = self.spec.read[0]
        return {c: self.scan.columns[c] for c in self.spec.read if c in (token, "labels") or c in MASK_KEYS}

    def segment_loss(self, rows) -> np.ndarray:
        """``(S,)`` loss tokens of every segment of packed ``rows`` (:func:`packkit.packer._segment_loss`: never a
        segment's first under :attr:`mask_first_label`; with no labels, every token but the first, as collators)."""
        return _segment_loss(rows.columns.get("labels"), rows.seq_lengths, self.mask_first_label)

    def _segment_losses(self, plan: Plan, max_tokens: int) -> np.ndarray:
        """:meth:`segment_loss` of every segment of ``plan``, in a pass over the loss columns only."""
        parts = [self.segment_loss(rows) for _, _, rows in self._chunks(plan, max_tokens, self._loss_columns())]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _whole_loss(self, max_tokens: int) -> np.ndarray | None:
        """``(S,)`` each segment's whole example's loss tokens (its pieces' :meth:`segment_loss` summed, read
        first) where the example lies in several segments, -1 elsewhere; None if none does."""
        keys = self.plan.seg_example if self.scan.doc_ids is None else self.scan.doc_ids[self.plan.seg_example]
        _, inv, counts = np.unique(keys, return_inverse=True, return_counts=True)
        piece = counts[inv] > 1
        if not piece.any():
            return None
        whole = np.full(keys.size, -1, np.int64)
        loss = self._segment_losses(self.plan.keep_segments(piece), max_tokens)
        whole[piece] = np.bincount(inv[piece], weights=loss, minlength=counts.size).astype(np.int64)[inv[piece]]
        return whole

    def drop_loss_free(self, max_tokens: int, *, where: str = "") -> None:
        """Leave out every segment with no loss token (:meth:`segment_loss`, a first pass over the loss columns),
        counted in ``dropped_pieces`` / ``dropped_tokens`` and ``loss_free_pieces``; emptied windows go, the others
        keep their order (:meth:`packkit.binpack.Plan.keep_segments`). None left: :func:`packkit.epoch.none_left`."""
        keep = self._segment_losses(self.plan, max_tokens) > 0
        if not keep.any():
            raise none_left(where)
        self.dropped_pieces, self.dropped_tokens = int((~keep).sum()), int(self.plan.seg_length[~keep].sum())
        self.loss_free_pieces += self.dropped_pieces
        if self.dropped_pieces:
            self.plan = self.plan.keep_segments(keep)

    def example_stats(self, *, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Each example's loss tokens when whole and the sum of its tokens for a fingerprint
        (:func:`packkit.planindex.example_stats`), a pass over the token and loss columns, counting as
        :meth:`record_batches` does; where the plan cut or dropped examples, a second pass reads them whole (the
        source's fingerprint, not the plan's)."""
        plans = [self.plan]
        if self.plan.cut_tokens or self.plan.dropped_examples.size:
            lengths = self.plan.lengths
            plans.append(pack(lengths, window=max(int(lengths.max(initial=1)), 1), strategy="next_fit"))
        for plan in plans:
            loss, sums = np.zeros(plan.num_examples, np.int64), np.zeros(plan.num_examples, np.uint64)
            for _, sub, rows in self._chunks(plan, max_tokens, self._loss_columns(), mask_first_label=False):
                part = example_stats(sub, rows)
                loss += part[0]
                sums += part[1]
                if plan is self.plan:
                    self._count_loss(rows)
        return loss, sums

    def _count_loss(self, rows) -> np.ndarray:
        """Add packed ``rows``' loss tokens (:meth:`segment_loss`) to ``loss_tokens``, and their pieces and windows
        without one to ``loss_free_pieces`` / ``loss_free_windows``; returns the segments' loss tokens."""
        seg_loss = self.segment_loss(rows)
        self.loss_tokens += int(seg_loss.sum())
        self.loss_free_pieces += int((seg_loss == 0).sum())
        if rows.num_rows:
            self.loss_free_windows += int((np.add.reduceat(seg_loss, rows.seq_offsets[:-1]) == 0).sum())
        return seg_loss

    def record_batches(self, *, max_tokens: int, bar=None):
        """Yield the packed rows as ``pyarrow.RecordBatch``\\ es of whole windows, at most ``max_tokens`` tokens
        each (a longer window alone), in the plan's window order, counting their loss on the way (``loss_tokens``,
        ``loss_free_windows``, ``loss_free_pieces``)."""
        whole = self._whole_loss(max_tokens) if self.example_ids else None
        for start, sub, rows in self._chunks(self.plan, max_tokens, self.scan.columns, bar):
            seg_loss = self._count_loss(rows)
            docs = None
            if self.example_ids:  # each document's example (the input's ids where it was packed), start, loss
                ids, starts, scan = sub.seg_example, sub.seg_start, self.scan
                if whole is not None:
                    lo, hi = self.plan.window_ptr[start], self.plan.window_ptr[start + sub.num_windows]
                    seg_loss = np.where(whole[lo:hi] >= 0, whole[lo:hi], seg_loss)
                docs = {"example_ids": ids if scan.doc_ids is None else scan.doc_ids[ids], "example_loss": seg_loss,
                        "piece_offsets": starts if scan.doc_starts is None else starts + scan.doc_starts[ids]}
            batch = packed_batch(rows, self.schema, docs)
            del rows
            yield batch
            del batch  # not held while the next one is gathered (a writer may have let it go)
