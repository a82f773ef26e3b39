"""Parquet, Arrow IPC, text lines, numpy arrays of lengths and ``save_to_disk`` folders, each read with its damage
named in one line: the back of the house behind the door in (:mod:`packkit.datafiles` decides which format an input
is and what its rows are; this module names no suffix but numpy's own, nor columns, tokenizers or examples)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np

from .arrow import pyarrow, replay  # noqa: F401 - replay's home is packkit.arrow, lent here
from .errors import DataError, MissingError, arg

__all__ = ["load_dataset", "parquet_batches", "parquet_dataset", "parquet_schema", "read_arrow", "read_npy",
           "read_parquet", "read_text", "replay", "text_byte_lengths", "text_lines", "text_tables"]

def _unreadable(exc: BaseException) -> bool:
    """An error of pyarrow reading a damaged or foreign file (not a missing file or a permission)."""
    missing = (FileNotFoundError, PermissionError, IsADirectoryError, MemoryError)
    return isinstance(exc, (pyarrow().ArrowException, OSError)) and not isinstance(exc, missing)


@contextlib.contextmanager
def _damaged(path, what: str):
    """Inside, an error that is :func:`_unreadable` becomes the one line ``cannot read PATH as WHAT: ...``
    (without the control bytes thrift can put in pyarrow's text); other errors pass as they are."""
    try:
        yield
    except Exception as exc:
        if not _unreadable(exc):
            raise
        said = " ".join("".join(c if c.isprintable() else " " for c in str(exc)).split())
        raise DataError(f"cannot read {str(path)!r} as {what}: {said}") from None


PARQUET = "Parquet (damaged, truncated, or not Parquet)"


def parquet_schema(path):
    """The ``pyarrow.Schema`` of a Parquet file (its footer only); a damaged file is one line."""
    import pyarrow.parquet as pq
    with _damaged(path, PARQUET):
        return pq.ParquetFile(str(path)).schema_arrow


def parquet_dataset(path, *, cache_dir=None):
    """A Parquet file as a ``datasets.Dataset`` (``Dataset.from_parquet``: converted once into ``datasets``' Arrow
    cache, ``cache_dir`` or its own, then memory-mapped); a damaged file is one line naming it (``datasets`` wraps
    pyarrow's error in its ``DatasetGenerationError``)."""
    import datasets
    with _damaged(path, PARQUET):
        try:
            return datasets.Dataset.from_parquet(str(path), cache_dir=None if cache_dir is None else str(cache_dir))
        except datasets.exceptions.DatasetGenerationError as exc:
            if exc.__cause__ is None or not _unreadable(exc.__cause__):
                raise
            raise exc.__cause__ from None


def parquet_batches(path, *, columns=None, batch_rows: int = 4096):
    """Record batches of a Parquet file in order, ``batch_rows`` rows at a time (memory: one batch and its pages,
    never a whole row group); damage is one line wherever it is. One thread: on 1M SFT-like rows this took 2.3 s
    of CPU, whole row groups on two threads 3.3 to 4.6 s, ``pyarrow.parquet.read_table`` 6.8 to 7.7 s."""
    import pyarrow.parquet as pq
    with _damaged(path, PARQUET):
        pf = pq.ParquetFile(str(path), memory_map=True, pre_buffer=False, page_checksum_verification=True)
        yield from pf.iter_batches(batch_size=batch_rows, columns=columns, use_threads=False)


def read_parquet(path: Path):
    import pyarrow.parquet as pq
    with _damaged(path, PARQUET):
        return pq.read_table(str(path), memory_map=True, page_checksum_verification=True)


def read_arrow(path: Path):
    pa = pyarrow()
    import pyarrow.ipc as ipc
    try:
        return ipc.open_file(pa.memory_map(str(path))).read_all()
    except Exception as exc:
        if not _unreadable(exc):
            raise
    with _damaged(path, "an Arrow IPC file or stream (damaged, truncated, or not Arrow)"):
        return ipc.open_stream(pa.memory_map(str(path))).read_all()


def text_lines(path):
    """The examples of a text file, one a line, read a line at a time (no pyarrow): blank lines hold none, a UTF-8
    byte-order mark is not text, ``\n`` and ``\r\n`` end lines. ``"\ufeffhi\n\nthere\r\n" -> ["hi", "there"]``;
    bytes that are not UTF-8 are an error naming the line."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            raw = raw.removesuffix(b"\n").removesuffix(b"\r")
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{str(path)!r} is not UTF-8 text: line {number:,} holds "
                                f"{exc.object[exc.start:exc.end]!r} ({exc.reason})") from None
            if line.strip():
                yield line


def text_table(lines):
    pa = pyarrow()
    return pa.table({"text": pa.array(lines, pa.string())})


def read_text(path: Path):
    return text_table(list(text_lines(path)))


def text_byte_lengths(path: Path) -> np.ndarray:
    """``(num_lines,) int64``: the UTF-8 bytes of each example line of a text file (what the byte-level tokenizer
    makes of it), a line at a time, without pyarrow."""
    return np.fromiter((len(line.encode("utf-8")) for line in text_lines(path)), np.int64)


def _damaged_folder(path: Path) -> DataError | None:
    """The one line naming what is damaged in a ``save_to_disk`` folder ``datasets`` could not load (a cut
    ``state.json``, a truncated shard, no shard at all), or None when every file reads. The error path only."""
    pa = pyarrow()
    metas = sorted(p for name in ("dataset_dict.json", "state.json", "dataset_info.json") for p in path.rglob(name))
    states = []
    for meta in metas:
        try:
            parsed = json.loads(meta.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            return DataError(f"cannot read {str(meta)!r}, part of the datasets folder {str(path)!r} (damaged or cut: "
                             f"{exc}); save the dataset again")
        if meta.name == "state.json":
            states.append((meta.parent, parsed))
    shards = [folder / f["filename"] for folder, state in states for f in state.get("_data_files", [])]
    if states and not shards:
        return DataError(f"{str(path)!r} holds no examples (its datasets folder lists no data files)")
    for shard in shards:
        try:
            with pa.memory_map(str(shard)) as source:
                pa.ipc.open_stream(source).read_all()
        except Exception as exc:  # pyarrow's errors, or a shard that is missing
            return DataError(f"cannot read {str(shard)!r}, part of the datasets folder {str(path)!r}, as an Arrow "
                             f"IPC stream (damaged, truncated, or missing: {exc}); save the dataset again")
    return None


def load_dataset(path, *, split: str | None = None):
    """A ``datasets.Dataset`` from a ``save_to_disk`` folder (memory-mapped), choosing ``split`` of a
    ``DatasetDict`` (default ``"train"``, or its only split)."""
    try:
        import datasets
    except ImportError:
        raise ModuleNotFoundError("reading a saved dataset needs datasets: pip install 'packkit[datasets]'",
                                  name="datasets") from None
    try:
        obj = datasets.load_from_disk(str(path))
    except Exception as exc:
        named = _damaged_folder(Path(path))
        if named is None:
            raise
        raise named from exc
    if isinstance(obj, datasets.DatasetDict):
        names = list(obj)
        if split is None and "train" not in obj and len(names) != 1:
            raise DataError("{path!r} has splits {names}: pass {split}", path=str(path), names=names,
                            split=arg("split", metavar="NAME"))
        split = ("train" if "train" in obj else names[0]) if split is None else split
        if split not in obj:
            raise MissingError(f"{str(path)!r} has no split {split!r}; it has {names}")
        obj = obj[split]
    elif split is not None:
        raise DataError("{path!r} is a single dataset, not a DatasetDict: drop {split}", path=str(path),
                        split=arg("split"))
    return obj


def text_tables(path, *, size: int):
    """The examples of a text file (:func:`text_lines`) as one-column tables (``text``) of about ``size``
    characters each (a longer line whole): memory holds one."""
    pyarrow(f"reading text ({Path(path).name!r})")
    lines, held = [], 0
    for line in text_lines(path):
        lines.append(line)
        held += len(line)
        if held >= size:
            yield text_table(lines)
            lines, held = [], 0
    if lines:
        yield text_table(lines)


def read_npy(path) -> np.ndarray:
    """The array of a ``.npy`` file, its header checked first: numpy sizes its array from the header alone (40 bytes
    saying ``shape (2**40,)`` ask for 8 TiB) and advises pickle, which runs the file's code. Refused naming the file:
    no numpy header, Python objects (a pickle: never loaded), fewer bytes than the header's shape needs."""
    from numpy.lib import format as npy

    name = str(path)
    with open(path, "rb") as f:
        try:
            # 2.0's header reader takes 3.0's too (3.0 only allows utf-8 field names, which a lengths file has none of)
            read_header = npy.read_array_header_1_0 if npy.read_magic(f) == (1, 0) else npy.read_array_header_2_0
            shape, _, dtype = read_header(f)
        except (ValueError, SyntaxError, EOFError) as exc:
            raise DataError(f"{name!r} is not a .npy file ({str(exc).split(';')[0].rstrip('.')}): save the lengths "
                            "with numpy.save(path, lengths), one integer per example") from None
        if dtype.hasobject:
            raise DataError(f"{name!r} holds Python objects (a pickle), not integers: packkit never loads a pickle "
                            "(it runs the file's code); save the lengths as integers: "
                            "numpy.save(path, numpy.asarray(lengths, dtype='int64'))")
        need = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
        have = os.fstat(f.fileno()).st_size - f.tell()
    if need > have:
        raise DataError(f"{name!r} is truncated or damaged: its header says {shape} values of {dtype} "
                        f"({need:,} bytes), and it holds {have:,} bytes after the header")
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise DataError(f"cannot read {name!r} as a numpy array of lengths: {str(exc).split('. ')[0]}") from None
