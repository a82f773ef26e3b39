"""Offline packing of Hugging Face ``datasets``: Arrow in, Arrow out, in bounded memory.

:func:`pack_dataset` plans windows over the *whole* dataset's lengths (:func:`packkit.binpack.pack`, on the Arrow
offsets of ``input_ids``), copies each window's tokens with numpy and returns one row per window::

    >>> import datasets
    >>> ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]],
    ...                                  "labels":    [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]})
    >>> packed = pack_dataset(ds, window=5, shuffle=False)
    >>> packed[:]
    {'input_ids': [[6, 7, 8, 9, 10], [1, 2, 3, 4, 5]], 'labels': [[-100, 7, 8, 9, -100], [-100, 2, 3, -100, 5]], 'seq_lengths': [[4, 1], [3, 2]]}

The rows are unpadded; the fixed-window collator pads them to ``W`` and turns ``seq_lengths`` into
``cu_seqlens`` and ``position_ids`` (a token attends to its own document's earlier tokens: 10 sees neither 6 nor 9)::

    input_ids     6    7    8    9   10
    labels     -100    7    8    9 -100      first label of each document masked (labels are shifted)
    position_ids  0    1    2    3    0
    seq_lengths  [4, 1]  ->  cu_seqlens [0, 4, 5]
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from . import arrow
from .binpack import DEFAULT_OVERFLOW, check_overflow, check_seed, check_strategy, check_window
from .chat import chat_format
from .errors import ArgumentError, DataError, MissingError, arg, check_int, with_keywords
from .cp_plan import plan_for_cp
from .epoch import trains_on_nothing
from .packer import log_overflow, logger, resolve_columns
from .outputs import DEFAULT_BUFFER_BYTES, PackedTable, packed_batch, packed_schema
from .mediarows import media_options
from .progress import progress_bar
from .rules import check_column, column_kind
from .sources import ArrowSource, scan, scan_documents
from . import outputs
from .fileio import check_output

__all__ = ["pack_dataset", "PackOptions", "plan_source", "PackedTable", "packed_schema", "packed_batch",
           "DEFAULT_BUFFER_BYTES"]


#: Show progress bars by default for sources of this many bytes on (and when ``datasets`` shows its own).
PROGRESS_BYTES = 1 << 28


def check_planning(window, strategy, overflow, seed, num_proc=None) -> int:
    """The plan's knobs checked before anything is read (pack_dataset, plan_source, packkit pack): ``window``."""
    window = check_window(window)
    check_strategy(strategy)
    check_overflow(overflow)
    check_seed(seed)
    if num_proc is not None:
        check_int(num_proc, "num_proc")
    return window


@dataclasses.dataclass(frozen=True)
class PackOptions:
    """What :func:`pack_dataset` and :func:`plan_source` do beyond the plan's knobs (``window``, ``strategy``,
    ``overflow``, ``seed``, ``shuffle``): ``options=PackOptions(...)``, or any field as a keyword of those functions
    (``pack_dataset(ds, window=W, example_ids=True)``). A new knob is a field here.

    Fields:
        columns: list columns to pack, the token column first; default ``input_ids``, ``labels`` and the first of
            ``completion_mask`` / ``assistant_masks`` present. A loss mask becomes ``labels`` (-100 where it is 0),
            as in the collators, and is written too only when named. Other columns (text, ids) are not carried over.
        mask_first_label: ``labels`` -100 on every segment's first token (models shift labels).
        example_ids: also write each segment's ``example_ids`` (source row), ``piece_offsets`` (start in it) and
            ``example_loss`` (its example's loss tokens over all pieces): the collators weigh a piece as its whole
            example. On whenever an example is split, or the input is packed rows carrying them (a document keeps
            its example's); an ``IterableDataset`` writes them when asked (unasked, its pieces weigh as examples).
        group_column: a column of group ids (int or string): a group's rows (a preference pair, a prompt's
            completions) stay adjacent in one window, in row order (:func:`packkit.binpack.pack_groups`; ``overflow``
            applies to whole groups; the plan reports the windows it costs).
        cp_size, cp_layout: rows a context-parallel group will shard (:func:`packkit.cp_plan.plan_for_cp`):
            ``"zigzag"`` plans each example padded to a multiple of ``2 * cp_size`` (a row still fits ``window`` once
            padded for TE), the other layouts need ``window`` a multiple of ``cp_size``.
        drop_loss_free: leave out the pieces (examples after ``overflow``) with no loss token, counted and logged;
            without it, windows with no loss token (a step of loss 0) are counted and logged with this fix (TRL's
            ``SFTTrainer`` drops such rows without a word).
        num_proc: threads for the token copy (numpy releases the GIL), default 1.
        progress: tqdm bars; default :func:`show_progress`.
        buffer_size: examples buffered for an ``IterableDataset``.
        buffer_bytes: bound on the packed rows in flight while a file is written (a result kept in memory is
            gathered whole).
        cache_file_name: the packed rows' Arrow stream file (it must not exist); default
            ``cache-packkit-<random>.arrow`` beside ``ds``'s first cache file (``ds.cleanup_cache_files()``).
        keep_in_memory: build the result in memory, not in a cache file; default when ``ds`` has no cache file.
        output_format: the format of ``output=`` (:data:`packkit.outputs.FORMATS`) when its suffix does not say.
    """

    columns: object = None
    mask_first_label: bool = True
    example_ids: bool = False
    group_column: str | None = None
    cp_size: int = 1
    cp_layout: str = "hybrid"
    drop_loss_free: bool = False
    num_proc: int | None = None
    progress: bool | None = None
    buffer_size: int = 1000
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    cache_file_name: object = None
    keep_in_memory: bool | None = None
    output_format: str | None = None


def show_progress(source) -> bool:
    """Progress bars by default (:data:`PROGRESS_BYTES`); ``datasets.disable_progress_bars()`` turns them off too."""
    if source.nbytes < PROGRESS_BYTES:  # asked first: a small source imports no datasets (1 s) to ask it
        return False
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets comes with pyarrow in the extras
        return True
    return datasets.utils.logging.is_progress_bar_enabled()


def plan_source(source, *, window: int, strategy: str = "bfd", overflow: str = DEFAULT_OVERFLOW,
                seed: int | None = 0, shuffle: bool = True, options: PackOptions | None = None,
                who: str = "pack_dataset", groups=None, **option_keywords) -> PackedTable:
    """Plan an Arrow source (:class:`packkit.sources.ArrowSource`) into a :class:`~packkit.outputs.PackedTable`, its
    rows checked, without holding its tokens. The arguments are :func:`pack_dataset`'s (:class:`PackOptions`);
    ``groups``: a group id per row, each group kept whole in one window (:func:`packkit.binpack.pack_groups`)."""
    o = with_keywords(PackOptions, options, option_keywords, "plan_source")
    window = check_planning(window, strategy, overflow, seed, o.num_proc)
    spec = resolve_columns(source.names, o.columns)
    progress = show_progress(source) if o.progress is None else o.progress
    # each column's kind (ids, labels, mask or other), checked a batch at a time (errors name the dataset row); a null
    # labels or loss-mask row is a key that example lacks (labels: its token ids; no mask: loss on every token)
    kinds = {c: column_kind(c, spec.read[0]) for c in spec.read}

    def check(name, values, offsets, valid, row, token_lengths):
        check_column(values, offsets, kind=kinds[name], key=name, rows=row, valid=valid, ref_lengths=token_lengths,
                     ref_key=spec.read[0])

    with progress_bar(total=None, unit="rows", enabled=progress, desc=f"{who}: reading") as bar:
        found = scan(source, spec.read, kinds=kinds, check=check, progress=bar)
        found = scan_documents(source, found)  # packed rows are read as their documents
    if groups is not None and len(found.lengths) != len(groups):
        raise DataError(f"{who}: the rows are packed rows ({len(groups):,} rows, {len(found.lengths):,} documents); "
                        "groups name examples: pack the unpacked examples with their group column")
    plan = plan_for_cp(found.lengths, window=window, cp_size=o.cp_size, cp_layout=o.cp_layout, strategy=strategy,
                       overflow=overflow, seed=seed, groups=groups)
    if shuffle:
        plan = plan.shuffled(seed)
    log_overflow(who, overflow=plan.overflow, over=int(plan.overflow_examples.size), examples=plan.num_examples,
                 window=plan.window, cut_tokens=plan.cut_tokens, tokens=int(plan.lengths.sum()))
    table = PackedTable(found, spec, plan, mask_first_label=o.mask_first_label, example_ids=o.example_ids,
                        num_threads=o.num_proc or 1)
    table.options = {"strategy": strategy, "overflow": overflow, "seed": seed, "shuffle": bool(shuffle),
                     "cp_size": o.cp_size, "cp_layout": o.cp_layout}
    table.groups, table.scan_source = groups, source.describe
    return table


def pack_dataset(ds, *, window: int, strategy: str = "bfd", overflow: str = DEFAULT_OVERFLOW, seed: int | None = 0,
                 shuffle: bool = True, output=None, split: str | None = None, return_report: bool = False,
                 options: PackOptions | None = None, **option_keywords):
    """Pack a ``datasets.Dataset`` of tokenized examples into windows of at most ``window`` tokens, one row per
    window; tokenize conversations first (:func:`packkit.chat.tokenize_dataset`; ``packkit pack`` does both).
    Out of core (:class:`~packkit.outputs.PackedTable`): the rows go to a cache file beside the dataset's own, as
    ``datasets.map``'s do; peak memory is the plan (about 40 bytes an example) plus ``buffer_bytes``, whatever the
    dataset's size (rows seen through a ``select`` / ``shuffle`` / ``filter`` are staged to a memory-mapped file first).

    Args:
        ds: a ``datasets.Dataset``; a ``DatasetDict`` (``split`` packs that split, else every split into a
            ``DatasetDict``, with a dict of plans under ``return_report``); or an ``IterableDataset``, packed in one
            stream into an ``IterableDataset`` (:func:`packkit.streaming.pack_iterable_dataset`): no ``output``,
            ``return_report``, ``num_proc`` or whole-plan option (:class:`PackOptions`).
        window: tokens per window (``W``).
        strategy: ``"bfd"`` (default), ``"ffd"``, ``"shuffle_ff"`` or ``"next_fit"`` over the whole dataset.
        overflow: examples longer than ``W``: ``"split"`` (default, as on the command line: the example continues
            in the next window), ``"truncate"``, ``"drop"``, ``"error"``; cut tokens are counted and logged.
        seed: seeds ``"shuffle_ff"`` and the order of the rows.
        shuffle: rows in a seeded random order (default), not in the planner's (length-sorted) order.
        output: write the rows to the new file or folder ``output`` and return its path, in the format
            ``output_format`` names or its suffix chooses (:data:`packkit.outputs.FORMATS`).
        split: the split of a ``DatasetDict`` to pack (default: all of them).
        return_report: return ``(result, plan)``, the :class:`~packkit.binpack.Plan` in row order
            (``plan.summary()``: windows, fill, lower bound, what the overflow policy touched).
        options: :class:`PackOptions`; each of its fields is also a keyword of this function.

    Returns:
        A ``datasets.Dataset`` (memory-mapped from the cache file, or in memory) with ``input_ids`` (length <= W,
        the source dtype), ``labels`` (when the source has labels or a loss mask), any other packed column,
        ``seq_lengths`` (int32, summing to the row length) and the documents' examples (``example_ids``); with
        ``output``, its ``pathlib.Path``.

    Raises ValueError / TypeError / KeyError naming the example (its index in ``ds``): empty or null example,
    negative token id, a label neither a token id nor -100, columns of different lengths, an example longer
    than ``window`` under ``overflow="error"``, a column missing.
    """
    import datasets

    o = with_keywords(PackOptions, options, option_keywords, "pack_dataset")
    planning = dict(window=window, strategy=strategy, overflow=overflow, seed=seed, shuffle=shuffle)
    streamed = isinstance(ds, (datasets.IterableDataset, datasets.IterableDatasetDict))
    if streamed:
        _refuse_streamed(o, strategy=strategy, return_report=return_report, output=output)
    window = check_planning(window, strategy, overflow, seed, o.num_proc)  # before any data is read or tokenized
    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        return _pack_splits(ds, split, return_report=return_report, output=output, options=o, **planning)
    if split is not None:
        raise ArgumentError("{arg} picks a split of a DatasetDict; this is a single {kind}: drop it",
                            arg=arg("split", split), kind=type(ds).__name__)
    if isinstance(ds, (datasets.Dataset, datasets.IterableDataset)):
        fmt = chat_format(ds.features.arrow_schema) if ds.features is not None else None
        if fmt is not None and o.columns is None and "input_ids" not in ds.column_names:
            raise DataError("the dataset is conversational ({fmt}): tokenize it first with "
                            "packkit.chat.tokenize_dataset(ds, tokenizer), then pack", fmt=fmt)
    out_format, inputs = None, [f["filename"] for f in getattr(ds, "cache_files", None) or []]
    if output is not None:  # before any data is read; an existing output, or one of ds's files, is refused
        out_format = outputs.output_format(output, o.output_format)
        check_output(output, kind=out_format.kind, inputs=inputs)
    o, media = media_options(ds, o, streamed=streamed, out_format=out_format)  # None, or packkit.mediarows.MediaRows
    if streamed:
        from .streaming import pack_iterable_dataset  # lazy: torch, which iterating an IterableDataset imports anyway
        return pack_iterable_dataset(ds, window=window, overflow=overflow, seed=seed, shuffle=shuffle,
                                     buffer_size=o.buffer_size, columns=o.columns, mask_first_label=o.mask_first_label,
                                     example_ids=o.example_ids, progress=bool(o.progress))
    if not isinstance(ds, datasets.Dataset):
        raise TypeError(f"pack_dataset takes a datasets.Dataset or IterableDataset, got {type(ds).__name__}; "
                        "use pack_stream for another iterable of examples")
    result, plan = _pack_table(ds, o, out_format, output=output, inputs=inputs, media=media, **planning)
    return (result, plan) if return_report else result


def _group_ids(ds, column: str) -> np.ndarray:
    """Integer codes of the group ids in ``column`` (int or string, one a row; no Python object a row)."""
    import pyarrow as pa

    if column not in ds.column_names:
        raise MissingError("no group column {got!r}; the columns are {names}", got=column, names=ds.column_names)
    col = ds.with_format("arrow")[column]
    if col.null_count:
        raise DataError(f"column {column!r} has a null group id (row {col.to_pylist().index(None)})")
    if not (pa.types.is_integer(col.type) or pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        raise DataError(f"column {column!r} holds {col.type}: a group id is an integer or a string")
    return col.combine_chunks().dictionary_encode().indices.to_numpy(zero_copy_only=False)


def _pack_table(ds, o: PackOptions, out_format, *, output, inputs, media=None, **planning):
    """:func:`pack_dataset` on a ``datasets.Dataset`` (``media``: :class:`packkit.mediarows.MediaRows` or None):
    ``(the dataset or OUT's path, the plan)``."""
    source = ArrowSource.from_dataset(ds)
    progress = show_progress(source) if o.progress is None else o.progress
    groups = None if o.group_column is None else _group_ids(ds, o.group_column)
    packed = plan_source(source, options=dataclasses.replace(o, progress=progress), groups=groups, **planning)
    on_disk = o.cache_file_name is not None or (bool(ds.cache_files) if o.keep_in_memory is None
                                                else not o.keep_in_memory)
    written = out_format or outputs.CACHE  # OUT, or the cache file
    max_tokens = (packed.chunk_tokens(o.buffer_bytes, encoding=written.encoding, in_flight=2,
                                      media_per_token=media.bytes_per_token(packed.plan) if media else 0.0)
                  if on_disk or out_format is not None else arrow.MAX_LIST_VALUES)
    if o.drop_loss_free:
        packed.drop_loss_free(max_tokens)
    total = packed.plan.total_tokens * len(packed.spec.written())
    with progress_bar(total=total, unit="tok", enabled=progress, desc="pack_dataset") as bar:
        if out_format is not None and media:  # the same rows and media as in memory, streamed to OUT atomically
            batches = media.batches(packed.record_batches(max_tokens=max_tokens, bar=bar), packed.plan)
            out = outputs.write_batches(output, media.schema(packed.schema), batches, format=out_format, inputs=inputs)
        elif out_format is not None:
            out = outputs.write_packed(output, packed, format=out_format, max_tokens=max_tokens, bar=bar, inputs=inputs)
        else:
            out = _dataset(ds, packed, o, on_disk=on_disk, max_tokens=max_tokens, bar=bar, **planning)
            out = media.dataset(out, packed.plan) if media else out
    for said in trains_on_nothing(dropped=(packed.dropped_pieces, packed.dropped_tokens),
                                  rows=(packed.loss_free_windows, packed.plan.num_windows)):  # counted as written
        logger.warning("pack_dataset: %s", said)
    return out, packed.plan


def _dataset(ds, packed: PackedTable, o: PackOptions, *, on_disk: bool, max_tokens: int, bar, **planning):
    """The packed rows as a ``datasets.Dataset``: a memory-mapped cache file written beside ``ds``'s own, or in
    memory. Its fingerprint names the input and the arguments when the input is files on disk (``datasets``
    hashes their paths, not their tokens); an in-memory table would be hashed whole: a random one."""
    import datasets
    import pyarrow as pa
    from datasets.fingerprint import generate_fingerprint, generate_random_fingerprint, update_fingerprint

    fingerprint = generate_random_fingerprint()
    if ds.cache_files:
        fingerprint = update_fingerprint(generate_fingerprint(ds), "packkit.pack_dataset", dict(
            **planning, columns=packed.spec.read, mask_first_label=o.mask_first_label, example_ids=o.example_ids,
            group_column=o.group_column, cp_size=o.cp_size, cp_layout=o.cp_layout, drop_loss_free=o.drop_loss_free))
    if not on_disk:
        # The rows stay in memory whole, so chunks would bound nothing and only cost CPU
        # (benchmarks/RESULTS.md, "The offline regression"): one gather, record batches as int32 list offsets need.
        batches = list(packed.record_batches(max_tokens=max_tokens, bar=bar))
        return datasets.Dataset(pa.Table.from_batches(batches, schema=packed.schema), fingerprint=fingerprint)
    from datasets.table import MemoryMappedTable

    name = o.cache_file_name
    if name is None:
        folder = Path(ds.cache_files[0]["filename"]).parent if ds.cache_files else datasets.config.HF_DATASETS_CACHE
        name = outputs.cache_file(folder, generate_random_fingerprint())
    outputs.write_packed(name, packed, format=outputs.CACHE, max_tokens=max_tokens, bar=bar)
    return datasets.Dataset(MemoryMappedTable.from_file(str(name)), fingerprint=fingerprint)


def _refuse_streamed(o: PackOptions, *, strategy, return_report, output) -> None:
    """What :func:`pack_dataset` refuses for an ``IterableDataset`` (one stream inside a bounded buffer, no plan)."""
    for bad, name, why in (
            (strategy != "bfd", arg("strategy"), "must be 'bfd' (best fit inside the buffer)"),
            (return_report, arg("return_report"), "reports the whole plan"),
            (output is not None, arg("output"), "writes a plan of the whole dataset"),
            (o.num_proc not in (None, 1), arg("num_proc", o.num_proc), "copies a whole plan's tokens in threads; "
             "leave it unset (or shard the source and pack each shard)"),
            (o.group_column is not None, arg("group_column"), "needs the whole dataset to keep groups whole"),
            (o.cp_size != 1, arg("cp_size", o.cp_size), "plans the whole dataset for a CP group"),
            (o.drop_loss_free, arg("drop_loss_free", True), "reads every piece's loss first (or ds.filter the "
             "examples without a loss token)")):
        if bad:
            raise ArgumentError("{arg} " + why + "; an IterableDataset is packed in one stream inside a bounded "
                                "buffer: pack a datasets.Dataset", arg=name)


def _pack_splits(dd, split, *, return_report: bool, **kwargs):
    """:func:`pack_dataset` on a ``DatasetDict``: the ``split`` named, or every split into a ``DatasetDict``."""
    import datasets

    names = list(dd)
    if split is not None:
        if split not in dd:
            raise ArgumentError("the DatasetDict has no split {got!r}; it has {names}: pass {arg}", got=split,
                                names=names, arg=arg("split", metavar="NAME"))
        return pack_dataset(dd[split], return_report=return_report, **kwargs)
    if not names:
        raise ValueError("the DatasetDict has no splits")
    for name, value in (("output", kwargs.get("output")), ("cache_file_name", kwargs["options"].cache_file_name)):
        if value is not None and len(names) > 1:
            raise ArgumentError("{arg} names one file, and the DatasetDict has splits {names}: pack one split ({split}), "
                                "or leave it unset", arg=arg(name), names=names, split=arg("split", metavar="NAME"))
    packed = {name: pack_dataset(dd[name], return_report=return_report, **kwargs) for name in names}
    kind = datasets.DatasetDict if isinstance(dd, datasets.DatasetDict) else datasets.IterableDatasetDict
    if return_report:
        return kind({n: p[0] for n, p in packed.items()}), {n: p[1] for n, p in packed.items()}
    return kind(packed)
