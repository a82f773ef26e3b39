"""Packed rows to files, one record batch at a time: parquet, Arrow, a ``datasets`` folder, JSON lines.

Each writer takes record batches as the packer produces them and writes them as they come, so
memory holds one batch (plus what the format's encoder keeps for it) whatever the dataset's size.
Every file or folder is written through :func:`packkit.fileio.atomic_output`: beside the target,
flushed, renamed into place only when complete.

==============  ========================================================  ==========================
format          written as                                                 read back with
==============  ========================================================  ==========================
``parquet``     one row group per batch, no dictionary encoding (token     ``datasets.load_dataset(
                ids barely repeat: dictionaries cost time and save          "parquet", ...)``, pyarrow
                little), snappy as pyarrow's default, a CRC32
                checksum on every page
``arrow``       Arrow IPC stream, one record batch per batch (the format   ``datasets.Dataset.from_file``,
                of ``datasets``' cache files)                              ``pyarrow.ipc.open_stream``
``feather``     Arrow IPC file (random access)                            ``pyarrow.ipc.open_file``
``folder``     a ``save_to_disk`` folder: IPC stream shards of at most    ``datasets.load_from_disk``
                ``max_shard_bytes`` (500 MB, ``datasets``' default)
``jsonl``       one JSON object a line, numbers formatted by Arrow         ``datasets.load_dataset(
                                                                            "json", ...)``
==============  ========================================================  ==========================

The ``folder`` folder's metadata (``state.json``, ``dataset_info.json``) is written by ``datasets``
itself: ``save_to_disk`` of an empty dataset with the same features and as many shards, whose empty
shard files (named by ``datasets``, read back with ``load_from_disk(...).cache_files``) are then
replaced by the written ones; the folder is loaded once before it is renamed into place.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np

from .errors import ArgumentError
from .fileio import atomic_output
from .interrupts import deferred, join

__all__ = ["FORMATS", "output_format", "write_batches", "MAX_SHARD_BYTES", "ENCODING_FACTOR"]

#: Output formats by suffix (lower case); no suffix is a ``save_to_disk`` folder.
FORMATS = {".parquet": "parquet", ".pq": "parquet", ".arrow": "arrow", ".feather": "feather", ".ipc": "feather",
           ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", "": "folder"}

#: Shards of a ``folder`` folder hold at most this many bytes (``datasets``' own default, 500 MB).
MAX_SHARD_BYTES = 500 * 10**6

#: Bytes the writer holds per byte of a batch while it writes it, by format (measured, rounded up:
#: parquet keeps the encoded row group until it closes; JSON text is ~6 bytes a token, built in steps).
ENCODING_FACTOR = {"parquet": 1.0, "arrow": 0.0, "feather": 0.0, "folder": 0.0, "jsonl": 8.0}


def output_format(path) -> str:
    """The format of an output path: ``output_format("out.parquet") -> "parquet"``; a name without a
    suffix is a ``save_to_disk`` folder (``"folder"``); an unknown suffix is a usage error."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ArgumentError(f"cannot write {str(path)!r}: unknown output format {suffix!r}; name OUT .parquet, "
                            ".jsonl, .arrow, .feather, or a folder without a suffix (save_to_disk)")
    return FORMATS[suffix]


# ----------------------------------------------------------------------------------------------
# sinks: open, write(batch), close
# ----------------------------------------------------------------------------------------------


class _ParquetSink:
    def __init__(self, path: Path, schema, *, compression="snappy"):
        import pyarrow.parquet as pq

        # page checksums: a page damaged on disk fails its CRC when read (README, "Parquet page checksums")
        self.writer = pq.ParquetWriter(str(path), schema, use_dictionary=False, compression=compression,
                                       write_page_checksum=True)

    def write(self, batch) -> None:
        self.writer.write_batch(batch, row_group_size=batch.num_rows or None)

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


def _sink(fmt: str, path: Path, schema, **options):
    if fmt == "parquet":
        return _ParquetSink(path, schema, **options)
    if fmt in ("arrow", "feather"):
        return _IpcSink(path, schema, stream=fmt == "arrow")
    if fmt == "jsonl":
        return _JsonlSink(path, schema)
    if fmt == "folder":
        return _DatasetSink(path, schema, **options)
    raise ArgumentError(f"unknown output format {fmt!r}; choose one of {', '.join(sorted(set(FORMATS.values())))}")


def write_batches(target, schema, batches, *, format: str | None = None, inputs=(), overwrite: bool = False,
                  overwrite_hint: str | None = None, background: bool = True, **options) -> Path:
    """Write record ``batches`` (all of ``schema``) to ``target`` as they come, atomically.

    Args:
        target: the file or folder to write (:data:`FORMATS` by suffix unless ``format`` is given).
        schema: the ``pyarrow.Schema`` of the batches.
        batches: an iterable of ``pyarrow.RecordBatch``; consumed once. With ``background`` (default)
            a thread writes batch ``k`` while the next is made, and at most two batches exist at once:
            the next is asked for only once batch ``k - 1`` is written (size batches for two).
        format: ``"parquet"``, ``"arrow"``, ``"feather"``, ``"jsonl"`` or ``"folder"``.
        inputs, overwrite, overwrite_hint: :func:`packkit.fileio.check_output`'s (the target is never
            an input, and an existing one is replaced only when asked).
        options: ``compression=`` for parquet, ``max_shard_bytes=`` for a folder.
    Returns:
        the target's path.
    """
    fmt = format or output_format(target)
    kind = "dir" if fmt == "folder" else "file"
    with atomic_output(target, kind=kind, inputs=inputs, overwrite=overwrite, overwrite_hint=overwrite_hint) as tmp:
        sink = _sink(fmt, Path(tmp), schema, **options)
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
