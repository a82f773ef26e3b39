"""Multimodal rows packed offline: the media of each document kept with it in its packed row, and read back
into documents for :class:`~packkit.model_inputs.VisionLanguageCollator` (numpy and pyarrow only; the tensors
are made by :mod:`packkit.media` when a batch is collated).

``pack_dataset`` of rows with media columns (``pixel_values``, ``image_sizes``, ``input_features``, ...) packs
their tokens as any rows (with ``token_type_ids`` / ``mm_token_type_ids`` laid out like ``input_ids``), and
writes each media column as a list over the row's documents, in ``seq_lengths`` order, null for a document
without media::

    input_ids       [a0 i0 i1 a1 | b0 b1 | c0 i2 c1]
    seq_lengths     [4, 2, 3]
    pixel_values    [a's images, null, c's images]

``pack_dataset(..., output="packed.parquet")`` (or an Arrow stream or file: :data:`MEDIA_FORMATS`) writes the
same rows, their media added a record batch at a time as they are written (:meth:`MediaRows.batches`), through
:func:`packkit.outputs.write_batches` (beside the file, renamed when complete); the other formats hold tokens
only and refuse media rows by name. ``packkit pack`` packs a Parquet or Arrow file with its media the same way
(:func:`kept_media` tells such a file by its schema, :func:`media_dataset` reads it for ``pack_dataset``).

A document is never cut from its media: an example split or truncated by the overflow policy is refused by
name. ``VisionLanguageCollator(PackedRowsCollator(window=W), config=model.config)`` reads the rows back
(:func:`row_documents`), every document checked against its media as online; for Qwen-VL (mRoPE) rows,
``rope_index=model.model.get_rope_index`` makes each document's positions from its packed ``mm_token_type_ids``
and its grids.
"""

from __future__ import annotations

import numpy as np

from .readers import parquet_dataset, parquet_schema, read_arrow
from .row_rules import row_segments
from .rules import MASK_KEYS, segment_key

__all__ = ["MEDIA_PREFIXES", "MEDIA_KEYS", "TOKEN_TYPE_KEYS", "MEDIA_FORMATS", "MEDIA_SUFFIXES", "MEDIA_INPUTS",
           "media_columns", "media_options",
           "refuse_media", "file_columns", "kept_media", "media_dataset", "media_pack_columns", "check_whole",
           "MediaRows", "take_rows", "row_documents", "row_lengths"]

#: Columns that carry media (by prefix), and the ones that do without the prefix.
MEDIA_PREFIXES = ("pixel_values", "input_features", "image_", "video_", "audio_")
MEDIA_KEYS = ("pixel_attention_mask", "feature_attention_mask", "second_per_grid_ts")
#: Per-token columns of multimodal rows (which tokens are an image's), packed with the tokens.
TOKEN_TYPE_KEYS = ("token_type_ids", "mm_token_type_ids")


def media_columns(names) -> list[str]:
    """The media columns among ``names``: ``media_columns(["input_ids", "pixel_values"]) -> ["pixel_values"]``."""
    return [n for n in names if n.startswith(MEDIA_PREFIXES) or n in MEDIA_KEYS]


#: The output formats that carry nested media columns (Arrow's own lists; the others hold tokens only), as messages
#: name them, by suffix too, and the door in's formats of their files, which :func:`kept_media` reads media from. The
#: fact is :attr:`packkit.outputs.Format.media` (and ``input_format``): this module reads rows for the collators on a
#: floor below the door out, so it decides by the Format it is handed and names these, which tests/test_formats.py
#: holds to the door out's table.
MEDIA_FORMATS = ("parquet", "arrow", "feather")
MEDIA_SUFFIXES = ", ".join(f".{name}" for name in MEDIA_FORMATS)
MEDIA_INPUTS = ("parquet", "arrow")


def media_options(ds, options, *, streamed: bool, out_format=None):
    """``(options, media)`` for ``pack_dataset`` of ``ds``: without media ``media`` is None; with media, the
    token type columns packed too (:func:`media_pack_columns`), ``example_ids`` written, and ``media`` a
    :class:`MediaRows` that adds the media to the packed rows; a stream, or an output format
    (:class:`packkit.outputs.Format`) outside :data:`MEDIA_FORMATS`, is refused (its media would be dropped)."""
    import dataclasses

    media = media_columns(getattr(ds, "column_names", None) or [])
    if not media:
        return options, None
    if streamed:
        refuse_media(media, "load the dataset (not streaming)")
    if out_format is not None and not out_format.media:
        refuse_media(media, f"the {out_format.name} format holds tokens only: write OUT as {MEDIA_SUFFIXES}")
    columns = media_pack_columns(ds.column_names, options.columns)
    return (dataclasses.replace(options, columns=columns, example_ids=True),
            MediaRows(ds, media, example_ids=options.example_ids))


def refuse_media(names, fix: str) -> None:
    """Where media columns would be dropped (a stream, a format of tokens only, ``packkit pack``): refused,
    naming them. ``fix``: what to do instead."""
    media = media_columns(names)
    if media:
        raise ValueError(f"the rows carry media ({', '.join(media)}), which only pack_dataset keeps (in the "
                         f"datasets.Dataset it returns, or an output= file of {'/'.join(MEDIA_FORMATS)}: "
                         f"packkit.mediarows); {fix}")


def file_columns(path, *, parquet: bool) -> list[str]:
    """The columns of a Parquet file (its footer alone) or, ``parquet`` false, an Arrow IPC file or stream
    (memory-mapped), whatever its name ends with; a damaged file is one line naming it."""
    return (parquet_schema(path) if parquet else read_arrow(path).schema).names


def kept_media(path, in_format: str, out_format: str) -> list[str]:
    """The media columns ``packkit pack`` keeps from the file ``path`` (of ``in_format``, as
    :func:`packkit.datafiles.input_format` names it) to an OUT of ``out_format``: those of a Parquet or Arrow IPC
    file (its schema alone) to one of :data:`MEDIA_FORMATS`; ``[]`` otherwise (rows packed as tokens, where media
    columns are refused by name, :func:`refuse_media`)."""
    if out_format not in MEDIA_FORMATS or in_format not in MEDIA_INPUTS:
        return []
    return media_columns(file_columns(path, parquet=in_format == "parquet"))


def media_dataset(path, *, parquet: bool, cache_dir, progress: bool):
    """The rows of a Parquet or Arrow IPC file with media (:func:`kept_media`) as the ``datasets.Dataset``
    ``pack_dataset`` packs them from, every media column a memory-mapped Arrow column :class:`MediaRows` gathers
    from: a Parquet file converted once into ``cache_dir`` (:func:`packkit.readers.parquet_dataset`), an Arrow
    file memory-mapped as it is. ``progress`` false: no ``datasets`` bars while it converts, nor after."""
    import datasets

    if not progress:
        datasets.disable_progress_bars()
    return parquet_dataset(path, cache_dir=cache_dir) if parquet else datasets.Dataset(read_arrow(path))


def media_pack_columns(names, columns):
    """``pack_dataset``'s ``columns`` for rows with media: as given, or (None) the token column, labels and a loss
    mask as by default, and the token type columns present (without them an image's tokens would be lost)."""
    if columns is not None:
        return columns
    masks = [k for k in MASK_KEYS if k in names]
    return (["input_ids"] + (["labels"] if "labels" in names else []) + masks[:1]
            + [k for k in TOKEN_TYPE_KEYS if k in names])


def check_whole(plan) -> None:
    """Every packed segment is a whole example: one split or cut by the overflow policy would part its
    placeholder tokens from its media. Refused naming the example."""
    lengths = np.asarray(plan.lengths)[plan.seg_example]
    cut = np.flatnonzero((plan.seg_start != 0) | (plan.seg_length != lengths))
    if cut.size:
        i = int(plan.seg_example[cut[0]])
        raise ValueError(f"example {i} has {int(plan.lengths[i]):,} tokens > window={plan.window:,} and media: cutting "
                         "it would part its placeholder tokens from its images; pass overflow='drop', or raise window")


class MediaRows:
    """The media columns ``keys`` of ``ds``, added to its packed rows (with ``example_ids``; every segment a
    whole example, :func:`check_whole`): each a list over a row's documents, ``ds``'s value of each of its
    ``example_ids`` (null for none), gathered by Arrow ``take``; ``example_ids`` kept only when asked for."""

    def __init__(self, ds, keys, *, example_ids: bool):
        source = ds.with_format("arrow")
        self.keys, self.example_ids = list(keys), example_ids
        self.cols = {k: source[k] for k in self.keys}

    def bytes_per_token(self, plan) -> float:
        """Bytes of media a packed token brings on average: the media columns' Arrow buffers over the tokens of
        ``plan`` (what :meth:`packkit.outputs.PackedTable.chunk_tokens` bounds a batch by, images included)."""
        return sum(col.nbytes for col in self.cols.values()) / max(1, int(plan.total_tokens))

    def schema(self, schema):
        """The packed rows' ``pyarrow.Schema`` with the media columns (and without ``example_ids`` unless kept)."""
        import pyarrow as pa

        for k in self.keys:
            schema = schema.append(pa.field(k, pa.list_(self.cols[k].type)))
        return schema if self.example_ids else schema.remove(schema.get_field_index("example_ids"))

    def add(self, batch, *, drop: bool = False):
        """``batch`` (a ``pyarrow.RecordBatch`` or ``Table`` of packed rows) with the media columns; ``drop``:
        without ``example_ids`` unless kept."""
        import pyarrow as pa
        import pyarrow.compute as pc

        ids = batch.column("example_ids")
        ids = ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
        offsets = pc.subtract(ids.offsets, ids.offsets[0])
        flat = ids.flatten()
        rows = np.asarray(flat.to_numpy(zero_copy_only=False), np.int64)
        for k in self.keys:
            batch = batch.append_column(k, pa.ListArray.from_arrays(offsets, take_rows(self.cols[k], rows)))
        return batch.drop_columns("example_ids") if drop and not self.example_ids else batch

    def batches(self, batches, plan):
        """The record ``batches`` of the rows ``plan`` packed, as they come, with their media (what
        ``pack_dataset(..., output=)`` writes: ``buffer_bytes`` bounds a batch's tokens and media together,
        :meth:`bytes_per_token`)."""
        check_whole(plan)  # before OUT is begun
        return (self.add(batch, drop=True) for batch in batches)

    def dataset(self, packed, plan):
        """``packed`` (a ``datasets.Dataset`` of the rows ``plan`` packed) with the media, batch by batch."""
        check_whole(plan)
        out = packed.with_format("arrow").map(self.add, batched=True, desc="packkit: media").with_format(None)
        return out if self.example_ids else out.remove_columns("example_ids")


def take_rows(col, rows: np.ndarray):
    """``col.take(rows)`` as one ``pyarrow.Array`` (``col`` a ``ChunkedArray``, ``rows`` ``(n,)`` int64 over its
    rows), gathered chunk by chunk: pyarrow's ``ChunkedArray.take`` first concatenates every chunk (measured: the
    whole memory-mapped pixel column, 337 MB, copied for each record batch of 86 windows), this copies only the
    rows asked for, then puts them in ``rows``' order. ``take_rows(chunked([[a, b], [c]]), [2, 0]) -> [c, a]``."""
    import pyarrow as pa

    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    if len(chunks) == 1:
        return chunks[0].take(pa.array(rows))
    starts = np.cumsum([0] + [len(c) for c in chunks])
    which = np.searchsorted(starts, rows, side="right") - 1
    by_chunk = np.argsort(which, kind="stable")
    bounds = np.searchsorted(which[by_chunk], np.arange(len(chunks) + 1))
    parts = [chunks[c].take(pa.array(rows[by_chunk[a:b]] - starts[c]))
             for c, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b > a]
    if not parts:
        return chunks[0].slice(0, 0)
    gathered = pa.concat_arrays(parts)  # the rows grouped by chunk, then back in their order
    return gathered.take(pa.array(np.argsort(by_chunk, kind="stable")))


def row_lengths(row, where: int = 0) -> np.ndarray:
    """The lengths of a packed row's documents: its ``seq_lengths``, or where its ``position_ids`` restart at 0
    (:func:`packkit.row_rules.row_segments`, which names the row ``where`` when they do not fit its tokens)."""
    key = segment_key(set(row))
    if key is None:
        raise ValueError(f"packed row {where} has no 'seq_lengths' or 'position_ids': its documents (and so their "
                         "media) cannot be told apart; keep the seq_lengths column pack_dataset writes")
    values = np.asarray(row[key], np.int64).reshape(-1)
    return row_segments(key, values, [values.size], [len(row["input_ids"])], rows=[where])[0]


def row_documents(rows, token_keys=("labels",) + TOKEN_TYPE_KEYS) -> list[dict]:
    """Packed rows back into their documents, in row order: ``input_ids`` and the per-token ``token_keys`` cut
    at ``seq_lengths`` (or where ``position_ids`` restart), each media column's entry of that document (left out
    where null)."""
    docs = []
    for r, row in enumerate(rows):
        cut = np.concatenate(([0], np.cumsum(row_lengths(row, r))))
        media = media_columns(row)
        for j, (a, b) in enumerate(zip(cut[:-1].tolist(), cut[1:].tolist())):
            doc = {k: row[k][a:b] for k in ("input_ids", *token_keys) if row.get(k) is not None}
            doc.update({k: row[k][j] for k in media if row[k] is not None and row[k][j] is not None})
            docs.append(doc)
    return docs
