"""Arrow at the bottom floor: the pyarrow import, list arrays from flat values and offsets (and back, and joined), and
the byte-level tokenizer. Imports nothing from packkit, so every floor can use it (Arrow list columns read
under the rules of an example: :mod:`packkit.listcolumns`)::

    >>> byte_tokenize(["hi", "é"]).to_pylist()
    [[104, 105], [195, 169]]
    >>> list_array([0, 2, 3], np.array([5, 6, 7])).to_pylist()
    [[5, 6], [7]]
"""

from __future__ import annotations

import itertools

import numpy as np

__all__ = ["pyarrow", "list_array", "list_parts", "flat_lists", "chunked_lists", "byte_tokenize", "MAX_LIST_VALUES",
           "replay"]


def pyarrow(what: str = "reading Arrow data"):
    """The ``pyarrow`` module, imported when first needed (it comes with the datasets extra); without it, the
    one-line error names ``what`` needs it: ``pyarrow("reading JSON lines")``."""
    try:
        import pyarrow  # lazy: pyarrow is an optional dependency
    except ImportError:  # pragma: no cover - pyarrow comes with the datasets extra
        raise ModuleNotFoundError(f"{what} needs pyarrow: pip install 'packkit[datasets]'", name="pyarrow") from None
    return pyarrow



#: Past this many values a list array needs 64-bit offsets (``large_list``): int32's maximum.
MAX_LIST_VALUES = 2**31 - 1


def list_array(offsets, values, *, max_tokens: int | None = None):
    """A pyarrow list array with rows at ``offsets`` over flat ``values``; ``large_list`` when the last
    offset passes ``max_tokens`` (default :data:`MAX_LIST_VALUES`, so int32 offsets never wrap).

    ``list_array([0, 2, 3], np.array([5, 6, 7])).to_pylist() -> [[5, 6], [7]]``.

    Args:
        offsets: (n + 1,) int, starting at 0, non-decreasing.
        values: (offsets[-1],) numpy array or pyarrow array.
    """
    pa = pyarrow()
    offsets = np.asarray(offsets, np.int64)
    limit = MAX_LIST_VALUES if max_tokens is None else max_tokens
    values = values if isinstance(values, pa.Array) else pa.array(values)
    if offsets[-1] <= limit:
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)
    return pa.LargeListArray.from_arrays(pa.array(offsets), values)


def list_parts(column) -> tuple[np.ndarray, np.ndarray]:
    """:func:`list_array`'s inverse: an Arrow list column (a slice too) -> ``(offsets (n + 1,) int64 from 0, flat
    values)`` (numpy, zero-copy where Arrow allows)."""
    offsets = np.asarray(column.offsets, np.int64)
    return offsets - offsets[0], column.flatten().to_numpy(zero_copy_only=False)


def flat_lists(lists):
    """:func:`list_parts` of Python lists of ints: ``(offsets (n + 1,) int64 from 0, values (T,) int64)``, through
    Arrow (no per-token Python). ``flat_lists([[5, 6], [7]]) -> ([0, 2, 3], [5, 6, 7])``."""
    pa = pyarrow()
    return list_parts(pa.array(lists, type=pa.list_(pa.int64())))


def chunked_lists(chunks: list, value_type):
    """One column of list arrays (:func:`list_array`'s, a batch each) as a chunked array: ``list<value_type>``, or
    ``large_list`` for every chunk when one of them needed 64-bit offsets."""
    pa = pyarrow()
    large = any(pa.types.is_large_list(c.type) for c in chunks)
    typ = (pa.large_list if large else pa.list_)(value_type)
    return pa.chunked_array([c.cast(typ) if large else c for c in chunks], type=typ)


def _binary_parts(arr):
    """Offsets ``(n + 1,)`` int64 (starting at 0) and bytes ``(total,)`` uint8 of a binary/utf8 array."""
    pa = pyarrow()
    if arr.null_count:
        raise ValueError(f"example {int(np.argmax(~np.asarray(arr.is_valid())))} has no text (null)")
    large = pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type)
    _, off_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(off_buf, np.int64 if large else np.int32)[arr.offset: arr.offset + len(arr) + 1]
    data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    data = data[offsets[0]: offsets[-1]]
    return offsets.astype(np.int64) - offsets[0], data


def byte_tokenize(texts):
    """The byte-level tokenizer: the UTF-8 bytes of each text, as int32 token ids in ``[0, 256)``.

    ``["hi", "é"] -> [[104, 105], [195, 169]]``. Needs no vocabulary and downloads nothing; a
    byte count is roughly 3-4x a subword tokenizer's token count on English text.

    Args:
        texts: a list of str, or a pyarrow string array / chunked array.
    Returns:
        pyarrow ``ListArray`` (or ``LargeListArray`` past 2**31 - 1 bytes: :func:`list_array`) of int32.
    """
    pa = pyarrow()
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks() if texts.num_chunks != 1 else texts.chunk(0)
    if not isinstance(texts, pa.Array):
        texts = pa.array(list(texts), type=pa.string())
    if not (pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type)
            or pa.types.is_binary(texts.type) or pa.types.is_large_binary(texts.type)):
        raise TypeError(f"byte_tokenize needs text, got {texts.type}")
    offsets, data = _binary_parts(texts)
    return list_array(offsets, data.astype(np.int32))


def replay(first, rest, again):
    """``make()``: its first call yields ``first`` then ``rest`` (a read of tables begun by the caller, continued), a
    later call ``again()`` (the read from the start). Here, at the bottom, so that the door in replays a JSON lines
    read without importing the other formats' readers (:mod:`packkit.readers` lends it under its old address)."""
    pending = [itertools.chain([first], rest)]
    return lambda: pending.pop() if pending else again()
