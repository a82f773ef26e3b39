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

A document is never cut from its media: an example split or truncated by the overflow policy is refused by
name. ``VisionLanguageCollator(PackedRowsCollator(window=W), config=model.config)`` reads the rows back
(:func:`row_documents`), every document checked against its media as online.
"""

from __future__ import annotations

import numpy as np

from .rules import MASK_KEYS

__all__ = ["MEDIA_PREFIXES", "MEDIA_KEYS", "TOKEN_TYPE_KEYS", "media_columns", "media_options", "refuse_media",
           "media_pack_columns", "check_whole",
           "attach_media", "row_documents"]

#: Columns that carry media (by prefix), and the ones that do without the prefix.
MEDIA_PREFIXES = ("pixel_values", "input_features", "image_", "video_", "audio_")
MEDIA_KEYS = ("pixel_attention_mask", "feature_attention_mask")
#: Per-token columns of multimodal rows (which tokens are an image's), packed with the tokens.
TOKEN_TYPE_KEYS = ("token_type_ids", "mm_token_type_ids")


def media_columns(names) -> list[str]:
    """The media columns among ``names``: ``media_columns(["input_ids", "pixel_values"]) -> ["pixel_values"]``."""
    return [n for n in names if n.startswith(MEDIA_PREFIXES) or n in MEDIA_KEYS]


def media_options(ds, options, *, streamed: bool, output):
    """``(options, hook)`` for ``pack_dataset`` of ``ds``: without media ``hook`` is None; with media, the token
    type columns packed too (:func:`media_pack_columns`), ``example_ids`` written, and ``hook(packed, plan)``
    adds the media to the packed rows (:func:`attach_media`); a stream or an ``output`` file with media is
    refused (their media would be dropped, silently)."""
    import dataclasses

    media = media_columns(getattr(ds, "column_names", None) or [])
    if not media:
        return options, None
    if streamed or output is not None:
        refuse_media(media, "load the dataset (not streaming)" if streamed else "drop output= and save the "
                     "returned dataset")
    columns = media_pack_columns(ds.column_names, options.columns)

    def hook(packed, plan):
        return attach_media(packed, ds, media, plan, example_ids=options.example_ids)

    return dataclasses.replace(options, columns=columns, example_ids=True), hook


def refuse_media(names, fix: str) -> None:
    """Where media columns would be dropped (a stream, a file written, ``packkit pack``): refused, naming them.
    ``fix``: what to do instead."""
    media = media_columns(names)
    if media:
        raise ValueError(f"the rows carry media ({', '.join(media)}), which pack_dataset keeps only in a "
                         f"datasets.Dataset it returns (packkit.mediarows); {fix}")


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


def attach_media(packed, ds, keys, plan, *, example_ids: bool):
    """``packed`` (a ``datasets.Dataset`` of packed rows with ``example_ids``, planned by ``plan``: every
    segment a whole example, :func:`check_whole`) with each media column of ``ds`` in ``keys`` as a list over
    every row's documents (``ds``'s value of each ``example_ids``, null for none), gathered by Arrow ``take``,
    batch by batch; ``example_ids`` kept only when asked for."""
    import pyarrow as pa
    import pyarrow.compute as pc

    check_whole(plan)
    source = ds.with_format("arrow")
    cols = {k: source[k] for k in keys}

    def add(batch):
        ids = batch.column("example_ids").combine_chunks()
        offsets = pc.subtract(ids.offsets, ids.offsets[0])
        flat = ids.flatten()
        for k in keys:
            batch = batch.append_column(k, pa.ListArray.from_arrays(offsets, cols[k].take(flat).combine_chunks()))
        return batch

    out = packed.with_format("arrow").map(add, batched=True, desc="packkit: media").with_format(None)
    return out if example_ids else out.remove_columns("example_ids")


def row_documents(rows, token_keys=("labels",) + TOKEN_TYPE_KEYS) -> list[dict]:
    """Packed rows back into their documents, in row order: ``input_ids`` and the per-token ``token_keys`` cut
    at ``seq_lengths``, each media column's entry of that document (left out where null)."""
    docs = []
    for row in rows:
        cut = np.concatenate(([0], np.cumsum(np.asarray(row["seq_lengths"], np.int64))))
        media = media_columns(row)
        for j, (a, b) in enumerate(zip(cut[:-1].tolist(), cut[1:].tolist())):
            doc = {k: row[k][a:b] for k in ("input_ids", *token_keys) if row.get(k) is not None}
            doc.update({k: row[k][j] for k in media if row[k] is not None and row[k][j] is not None})
            docs.append(doc)
    return docs
