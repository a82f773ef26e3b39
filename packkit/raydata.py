"""Offline packing past one machine, on Ray Data: the same packed rows as ``pack_dataset``.

A ``ray.data.Dataset`` of tokenized examples (``input_ids``, optional ``labels``: list columns)
becomes a ``ray.data.Dataset`` of packed rows, one per window, unpadded, in the offline row format
that :class:`packkit.collate.PackedRowsCollator` reads (and ``.write_parquet(path)`` writes)::

    input_ids    list<int>   tokens of the window, length <= W (the input's integer type)
    labels       list<int>   only when the input has labels (their type, int64 if unsigned or 8-bit);
                             -100 on the first token of every segment
    seq_lengths  list<int32> segment lengths of the row, summing to len(input_ids)

A loss mask column (``completion_mask`` / ``assistant_masks``, as the collators read it) becomes
``labels``: -100 where the mask is 0 (on the given labels, or on the token ids), so prompt tokens are
not trained on.

Two plans, one engine (:func:`packkit.binpack.pack` plans, :func:`packkit.packer.pack_columns` gathers):

``mode="local"`` (default, for scale)
    Pass 1, one task per block, next to the block: best fit over the block's lengths, then the
    block's full windows are gathered into an output block (their tokens move once). A block keeps
    its fullest windows and hands the rest to pass 2, emptiest first, until the windows it keeps
    waste at most ``tail_slack`` of its tokens (default 0.05 %). Pass 2, one task: the handed-over
    segments of all blocks are packed together with best fit. The result stays within 0.1 % of the
    lower bound with many blocks, and pass 2 sees only the few under-filled windows of each block.

``mode="global"``
    One plan over every length of the dataset (the lengths, 8 bytes an example, are the only thing
    that travels to the driver), exactly the plan ``pack`` makes on one machine; then a map/reduce
    moves each token once, from its source block to the output block of its window.

Both runs are deterministic for a fixed block layout and seed. Output blocks come in block order;
in local mode the pass-2 windows are cut into near-equal pieces, one small block after each input
block's windows, so they are not all trained last. ``shuffle=True`` (default) puts each output
block's windows in a seeded random order, so that training order is not sorted by length. Over-long examples follow ``overflow``
(``"error"``, ``"truncate"``, ``"split"``, ``"drop"``), and :class:`RayPackReport` counts what the
policy touched.

Ray stays optional: this module imports without it; the entry point asks for
``pip install 'packkit[ray]'``.

Why Ray tasks over the dataset's blocks rather than ``map_batches``: a block's pass-1 task has two
outputs (full windows, and the segments for pass 2) and must know which block it is (errors name
the example's index in the whole dataset; per-block seeds). Tasks over ``Dataset.to_arrow_refs()``
give both, keep Arrow in and Arrow out, and build the result with ``ray.data.from_arrow_refs``.
"""

from __future__ import annotations

import logging
import dataclasses

import numpy as np

from .binpack import (DEFAULT_OVERFLOW, Plan, apply_overflow, as_lengths, check_overflow, check_seed, check_strategy,
                      check_window, pack)
from .arrow import list_array
from .errors import ArgumentError, arg, check_choice
from .listcolumns import list_chunks, packed_segments, table_labels, token_lengths
from .outputs import packed_batch, packed_schema
from .packer import gather_segments, label_dtype, log_overflow, pack_columns
from .located import ExampleTypeError, ExampleValueError, relocate
from .rules import MASK_KEYS
from .segments import lengths_to_offsets

__all__ = ["pack_dataset", "RayPackReport", "tail_windows", "MODES"]

MODES = ("local", "global")
_INSTALL = "packkit.raydata needs Ray Data: pip install 'packkit[ray]'"


def _require_ray():
    """Import ray and ray.data, or raise ImportError with the install command."""
    try:
        import pyarrow  # noqa: F401
        import ray
        import ray.data  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"{_INSTALL} ({exc})") from None
    return ray


# ----------------------------------------------------------------------------------------------
#: Ray's rows record no document columns (:data:`packkit.rules.DOCUMENT_KEYS`), said once when examples are split
PIECES_UNRECORDED = ("raydata.pack_dataset: its rows do not record example_ids, piece_offsets and example_loss, so under "
                     "a per-example loss_weighting each piece of a split example counts as an example; pack with "
                     "packkit.offline.pack_dataset to keep them")

# small pure pieces (numpy / Arrow, no Ray): each is tested on its own
# ----------------------------------------------------------------------------------------------


def tail_windows(loads, *, window: int, tokens: int, slack: float) -> np.ndarray:
    """Windows a block hands to pass 2: emptiest first, until the kept ones waste <= ``slack * tokens``.

    Args:
        loads: (num_windows,) int, tokens in each window of the block's plan.
        window: ``W``.
        tokens: tokens of the block (the waste budget is ``slack * tokens``).
        slack: fraction of the block's tokens its kept windows may waste.

    Returns:
        (k,) int64, sorted indices of the windows handed over.

    Example: ``tail_windows([8, 5, 8, 3], window=8, tokens=24, slack=0.0) -> [1, 3]``;
    with ``slack=0.2`` (budget 4.8 tokens) only window 3 (waste 5) goes.
    """
    loads = np.asarray(loads, dtype=np.int64)
    waste = window - loads
    budget = slack * tokens
    order = np.argsort(-waste, kind="stable")  # emptiest first; ties by window index
    kept_waste = int(waste.sum()) - np.cumsum(waste[order])  # after handing over order[:k+1]
    if waste.sum() <= budget:
        return np.zeros(0, np.int64)
    k = int(np.argmax(kept_waste <= budget)) + 1
    return np.sort(order[:k])


def _list_column(table, name: str):
    """An Arrow list column -> ``(values, offsets, nulls)``: flat numpy values, (n+1,) int64 offsets.

    ``[[5, 6], [7]] -> values [5, 6, 7], offsets [0, 2, 3]``; ``nulls`` is the (n,) bool null mask or
    None. :func:`packkit.listcolumns.list_chunks` reads (and checks the type of) each chunk; a block is
    usually one chunk, used as it is; several are joined.
    """
    chunks = list(list_chunks(table.column(name), key=name))
    if len(chunks) == 1:
        values, offsets, valid, _ = chunks[0]
    else:
        values = np.concatenate([c[0] for c in chunks]) if chunks else np.zeros(0, np.int64)
        offsets = lengths_to_offsets(np.concatenate([np.diff(c[1]) for c in chunks]) if chunks else [])
        valid = None
        if any(c[2] is not None for c in chunks):
            valid = np.concatenate([np.ones(c[1].size - 1, bool) if c[2] is None else c[2] for c in chunks])
    return values, offsets, None if valid is None else ~valid


def _documents(table, key: str, offsets: np.ndarray) -> np.ndarray:
    """The example offsets of a block: its rows' ``offsets``, or where the rows are packed (a
    ``seq_lengths`` or restarting ``position_ids`` column) the offsets of their documents, over the same
    flat values (:func:`packkit.listcolumns.packed_segments`): a packed row is never one example."""
    segments = packed_segments(table, np.diff(offsets), key=key)
    return offsets if segments is None else lengths_to_offsets(segments[0])


def _block_lengths(table, input_key: str, label_key: str | None, mask_keys=MASK_KEYS) -> dict:
    """Lengths of a block's examples, and the first problem found (a local example index), if any.

    Returns ``{"lengths": (n,) int64, "has_labels": bool, "mask_key": str | None,
    "error": None | (exception, local_index | None, text), "value_type", "label_type"}``: the exception
    itself travels (:func:`_block_error` raises it on the driver, located in the whole dataset).
    ``mask_key`` is the first of ``mask_keys`` that the block has.
    Every rule is :mod:`packkit.rules`' (token ids, labels, loss masks, lengths; a null label or mask
    row is an example without that key).
    """
    n = table.num_rows
    out = {"lengths": np.zeros(n, np.int64), "has_labels": False, "error": None, "value_type": None,
           "label_type": None, "mask_key": None}
    if input_key not in table.column_names:
        text = f"no column {input_key!r} (columns: {table.column_names})"
        out["error"] = (KeyError(text), None, text)
        return out
    try:
        lengths = token_lengths(table.column(input_key), key=input_key)
        out["lengths"] = np.diff(_documents(table, input_key, lengths_to_offsets(lengths)))
        out["value_type"] = _value_type(table, input_key)
        if label_key is not None and label_key in table.column_names:
            out["has_labels"] = True
            out["label_type"] = _value_type(table, label_key)
        out["mask_key"] = next((k for k in mask_keys if k in table.column_names), None)
        if out["has_labels"] or out["mask_key"] is not None:
            table_labels(table, key=input_key)  # checks labels and masks
    except (TypeError, ValueError) as exc:
        if isinstance(exc, (ExampleValueError, ExampleTypeError)) and exc.index is not None:
            out["error"] = (exc, exc.index, exc.text)  # an example's error: the driver locates it
        else:
            out["error"] = (exc, None, str(exc))
    return out


def _token_column(columns) -> str:
    """``columns=`` as :func:`packkit.offline.pack_dataset` takes it, for Ray: the token column first, then
    optionally ``labels`` (loss masks are found by name): ``_token_column(None) -> "input_ids"``."""
    if columns is None:
        return "input_ids"
    columns = [columns] if isinstance(columns, str) else list(columns)
    if not columns or any(c != "labels" for c in columns[1:]):
        raise ArgumentError("{arg} on Ray names the token column, then optionally 'labels' (a loss mask is read "
                            "by its name); got {got}", arg=arg("columns"), got=columns)
    return columns[0]


def _block_labels(table, opts: dict, values: np.ndarray) -> np.ndarray | None:
    """A block's flat labels (:func:`packkit.listcolumns.table_labels`: its labels, or token ids where an
    example has none, -100 where a loss mask is 0), in the label dtype; None when the run has no labels."""
    if not opts["has_labels"]:
        return None
    labels = table_labels(table, key=opts["input_key"])
    if labels is None:  # this block has no label or mask column: its token ids are its labels
        labels = values
    return labels.astype(label_dtype(values.dtype), copy=False)


def _block_error(error, start: int, block: int) -> Exception:
    """The error a block's pass-0 task found, as the driver raises it: an example's error located in the
    whole dataset (:func:`packkit.located.relocate`: "dataset row 812 ..."), its type kept (a
    :class:`~packkit.errors.DataError` stays one); any other, of its own type, prefixed ``block b:``."""
    exc, i, text = error
    if i is not None:
        return relocate(exc, rows=start)
    return type(exc)(f"block {block}: {text}")


def _segments_table(values, labels, offsets):
    """Flat tokens (and labels) with (k+1,) row offsets -> an Arrow table with one row per segment."""
    import pyarrow as pa

    cols = {"input_ids": list_array(offsets, values)}
    if labels is not None:
        cols["labels"] = list_array(offsets, np.asarray(labels, np.int64))
    return pa.table(cols)


def _rows_table(rows, has_labels: bool, value_type, label_type=None):
    """:class:`PackedColumns` -> the offline row format (input_ids, labels?, seq_lengths), one row a
    window: :func:`packkit.outputs.packed_schema` / :func:`packkit.outputs.packed_batch`, as on one machine."""
    import pyarrow as pa

    columns = [("input_ids", value_type)] + ([("labels", label_type or value_type)] if has_labels else [])
    return pa.Table.from_batches([packed_batch(rows, packed_schema(columns))])


def _block_seed(seed: int | None, block: int) -> int | None:
    """A per-block seed from the run's seed: ``_block_seed(0, 3)`` is fixed, and differs per block."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([int(seed), int(block)]).generate_state(1)[0])


def _value_type(table, input_key: str):
    import pyarrow as pa

    t = table.schema.field(input_key).type.value_type
    return pa.int64() if pa.types.is_null(t) else t


# ----------------------------------------------------------------------------------------------
# the tasks (plain functions; wrapped with ray.remote at call time)
# ----------------------------------------------------------------------------------------------


def _columns(values, labels, offsets) -> dict:
    """The ``columns`` argument of :func:`pack_columns` for flat tokens (and labels) at CSR ``offsets``."""
    columns = {"input_ids": (values, offsets[:-1])}
    if labels is not None:
        columns["labels"] = (labels, offsets[:-1])
    return columns


def _pass1_block(table, block: int, opts: dict):
    """Local plan of one block: (full windows table, handed-over segments, stats)."""
    key = opts["input_key"]
    values, offsets, _ = _list_column(table, key)
    offsets = _documents(table, key, offsets)
    has_labels = opts["has_labels"]
    labels = _block_labels(table, opts, values)
    columns = _columns(values, labels, offsets)
    lengths = np.diff(offsets)
    seed = _block_seed(opts["seed"], block)
    plan = pack(lengths, window=opts["window"], strategy=opts["strategy"], overflow=opts["overflow"], seed=seed)
    tail = tail_windows(plan.window_loads, window=plan.window, tokens=plan.total_tokens, slack=opts["tail_slack"])
    keep = np.setdiff1d(np.arange(plan.num_windows), tail)
    full = plan.select(keep)
    if opts["shuffle"]:
        full = full.shuffled(seed)
    rows = pack_columns(full, columns, mask_first_label=opts["mask_first_label"])
    out = _rows_table(rows, has_labels, _value_type(table, key), opts["label_type"])
    # The handed-over segments travel with their first labels unmasked; pass 2 masks them.
    handed = plan.select(tail)
    seg = pack_columns(handed, columns, mask_first_label=False)
    segments = _segments_table(seg.columns["input_ids"], seg.columns.get("labels"), lengths_to_offsets(seg.seq_lengths))
    stats = {
        "windows": full.num_windows,
        "tokens": full.total_tokens,
        "handed_windows": handed.num_windows,
        "handed_tokens": handed.total_tokens,
        "handed_segments": handed.num_segments,
    }
    return out, segments, stats


def _pass2_tail(opts: dict, value_type, block: int, *segment_tables):
    """Best fit over the segments handed over by every block, in block order: (table, stats)."""
    import pyarrow as pa

    tables = [t for t in segment_tables if t.num_rows]
    if tables:
        table = pa.concat_tables(tables, promote_options="permissive")  # a block's may be large_list
        values, offsets, _ = _list_column(table, "input_ids")
        labels = _list_column(table, "labels")[0] if opts["has_labels"] else None
        lengths = np.diff(offsets)
    else:
        values, offsets, labels = np.zeros(0, np.int64), np.zeros(1, np.int64), None
        lengths = np.zeros(0, np.int64)
        if opts["has_labels"]:
            labels = np.zeros(0, np.int64)
    # every segment is at most W already; the plan's own strategy (bfd by default) repacks them
    plan = pack(lengths, window=opts["window"], strategy=opts["strategy"], overflow="error",
                seed=_block_seed(opts["seed"], block))
    if opts["shuffle"]:
        plan = plan.shuffled(plan.seed)
    rows = pack_columns(plan, _columns(values, labels, offsets), mask_first_label=opts["mask_first_label"])
    return _rows_table(rows, opts["has_labels"], value_type, opts["label_type"]), {"windows": plan.num_windows,
                                                              "tokens": plan.total_tokens}


def _pass2_spread(opts: dict, value_type, block: int, parts: int, *segment_tables):
    """:func:`_pass2_tail`, its rows cut into ``parts`` contiguous, near-equal tables: ``(*tables, stats)``.

    The driver puts table ``b`` after input block ``b``'s windows, so the pass-2 windows are spread
    through the output rather than trained last. ``np.array_split`` sizes: the first ones one larger.
    """
    table, stats = _pass2_tail(opts, value_type, block, *segment_tables)
    cuts = lengths_to_offsets([a.size for a in np.array_split(np.arange(table.num_rows), parts)])
    return (*[table.slice(int(a), int(b - a)) for a, b in zip(cuts[:-1], cuts[1:])], stats)


def _scatter_block(table, opts: dict, seg_local, seg_start, seg_length, chunk_ptr):
    """Global mode, map side: the tokens of one block's segments, cut into one piece per output chunk.

    The segments arrive sorted by output chunk (and by plan order within one); piece ``c`` holds
    the segments ``chunk_ptr[c]:chunk_ptr[c+1]``, tokens concatenated. Returns one
    ``(values, labels | None)`` per chunk.
    """
    values, offsets, _ = _list_column(table, opts["input_key"])
    offsets = _documents(table, opts["input_key"], offsets)
    labels = _block_labels(table, opts, values)
    src_start = offsets[seg_local] + seg_start
    tok_ptr = lengths_to_offsets(seg_length)[chunk_ptr]
    # One strided copy per group of equal-length segments (no per-token index), then a view per chunk.
    v = gather_segments(values, src_start, seg_length)
    lab = gather_segments(labels, src_start, seg_length) if labels is not None else None
    pieces = [(v[a:b], None if lab is None else lab[a:b]) for a, b in zip(tok_ptr[:-1], tok_ptr[1:])]
    return pieces[0] if len(pieces) == 1 else tuple(pieces)


def _gather_chunk(opts: dict, value_type, seg_block, seg_length, window_ptr, *pieces):
    """Global mode, reduce side: rows of one chunk of windows from the pieces of every block.

    ``seg_block``/``seg_length``: (S,) the source block and length of the chunk's segments in plan
    order; ``window_ptr``: (R+1,) the chunk's windows. Piece ``b`` holds block ``b``'s segments of
    this chunk in plan order, so the concatenated pieces list the segments sorted by block.
    """
    values = np.concatenate([p[0] for p in pieces]) if pieces else np.zeros(0, np.int64)
    labels = None
    if opts["has_labels"]:
        labels = np.concatenate([p[1] for p in pieces]) if pieces else np.zeros(0, np.int64)
    by_block = np.argsort(seg_block, kind="stable")  # concatenated order -> plan position
    concat_length = seg_length[by_block]
    concat_offsets = lengths_to_offsets(concat_length)
    position = np.empty_like(by_block)
    position[by_block] = np.arange(by_block.size)  # plan segment -> its place in the concatenation
    # a plan over the concatenated segments (each one an "example"), in the chunk's window order
    sub = Plan(
        window=opts["window"], lengths=concat_length.astype(np.int64), seg_example=position,
        seg_start=np.zeros(seg_length.size, np.int64), seg_length=seg_length.astype(np.int64),
        window_ptr=window_ptr, strategy="given", overflow="error", seed=None,
        overflow_examples=np.zeros(0, np.int64), dropped_examples=np.zeros(0, np.int64), cut_tokens=0,
    )
    rows = pack_columns(sub, _columns(values, labels, concat_offsets), mask_first_label=opts["mask_first_label"])
    return _rows_table(rows, opts["has_labels"], value_type, opts["label_type"])


# ----------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RayPackReport:
    """What a Ray packing run produced, and what the overflow policy touched.

    Fields:
        mode: ``"local"`` or ``"global"``; strategy, overflow, window: as passed.
        blocks: input blocks; examples: input rows; input_tokens: their tokens.
        windows: output rows; tokens: tokens in them (``input_tokens - cut_tokens``).
        lower_bound: ``ceil(tokens / window)``; no packing of these tokens uses fewer windows.
        overflow_examples: examples longer than ``window`` (whatever the policy did with them);
        dropped_examples: left out by ``"drop"``; cut_tokens: removed by ``"truncate"``/``"drop"``.
        handed_windows / handed_tokens: local mode: windows the blocks handed to pass 2, and their
            tokens; pass2_windows: the windows pass 2 made of them (0 in global mode).
    """

    mode: str
    strategy: str
    overflow: str
    window: int
    blocks: int
    examples: int
    input_tokens: int
    windows: int
    tokens: int
    lower_bound: int
    overflow_examples: int
    dropped_examples: int
    cut_tokens: int
    handed_windows: int = 0
    handed_tokens: int = 0
    pass2_windows: int = 0

    @property
    def fill(self) -> float:
        """Real tokens over window tokens (1.0 for no windows)."""
        return self.tokens / (self.windows * self.window) if self.windows else 1.0

    @property
    def windows_over_lower_bound(self) -> int:
        return self.windows - self.lower_bound

    def summary(self) -> dict:
        d = dataclasses.asdict(self)
        d["fill"] = self.fill
        d["windows_over_lower_bound"] = self.windows_over_lower_bound
        return d


def _same_in_every_block(infos, starts, key):
    """The column name ``key(info)`` that every non-empty block shares (None if none has it), or a
    KeyError naming the first block that differs (a column present in some blocks only)."""
    first = next((key(info) for info in infos if info["lengths"].size and key(info)), None)
    for b, info in enumerate(infos):
        got = key(info)
        if info["lengths"].size and got != first:
            where = f"block {b} (examples {int(starts[b])}..)"
            if got is None:
                raise KeyError(f"{where} has no {first!r} column, other blocks do")
            raise KeyError(f"{where} has a {got!r} column, other blocks {first!r}; give every block the same columns")
    return first


# ----------------------------------------------------------------------------------------------
# the entry point
# ----------------------------------------------------------------------------------------------


def pack_dataset(ds, *, window: int, mode: str = "local", strategy: str = "bfd", overflow: str = DEFAULT_OVERFLOW,
                 seed: int | None = 0, shuffle: bool = True, tail_slack: float = 0.0005,
                 columns=None, mask_first_label: bool = True, num_output_blocks: int | None = None,
                 return_report: bool = False):
    """Pack a ``ray.data.Dataset`` of tokenized examples into windows of ``window`` tokens.

    Args:
        ds: a ``ray.data.Dataset`` of tokenized examples (the module docstring's columns; rows packed
            already, with ``seq_lengths`` or restarting ``position_ids``, are read as their documents).
            Its blocks are the unit of work: repartition first for more parallelism (``ds.repartition(n)``).
        window: tokens per window (``W``).
        mode: ``"local"`` (default: per-block best fit, then one pass over the under-filled windows)
            or ``"global"`` (one plan over all lengths: the windows of ``packkit.binpack.pack``).
        strategy, overflow, seed: as in :func:`packkit.binpack.pack`, but ``overflow`` defaults to ``"split"``
            (:data:`packkit.binpack.DEFAULT_OVERFLOW`, as in :func:`packkit.offline.pack_dataset`).
        columns: as in :func:`packkit.offline.pack_dataset`: the token column first (default
            ``input_ids``), then optionally ``labels``.
        shuffle: put each output block's windows in a seeded random order (default True).
        tail_slack: local mode: the fraction of its tokens that a block's kept windows may waste; the
            rest of its windows go to pass 2.
        mask_first_label: set the first label of every segment to -100 (models that shift labels).
        num_output_blocks: global mode: output blocks (default: as many as input blocks).
        return_report: return ``(packed, report)`` with a :class:`RayPackReport` (windows, lower
            bound, what the overflow policy touched); the overflow counts are logged either way.

    Returns:
        A ``ray.data.Dataset`` of the packed rows of the module docstring. The work runs when this is
        called; the packed blocks are then in Ray's object store (``.write_parquet(path)``).

    Raises:
        ValueError / TypeError / KeyError naming the example's index in the whole dataset (its
        position in block order): empty or null example, negative token id, labels (or a loss mask)
        not aligned, a label that is neither a token id nor -100,
        an example longer than ``window`` under ``overflow="error"``, a column missing.
    """
    ray = _require_ray()
    window = check_window(window)
    input_key = _token_column(columns)
    check_choice(mode, "mode", MODES)
    check_strategy(strategy)
    check_overflow(overflow)
    seed = check_seed(seed)
    if not 0 <= float(tail_slack) < 1:
        raise ValueError(f"tail_slack must be in [0, 1), got {tail_slack!r}")
    if not hasattr(ds, "to_arrow_refs"):
        raise TypeError(f"ds must be a ray.data.Dataset, got {type(ds).__name__} (ray.data.from_items(...) makes one)")

    refs = ds.to_arrow_refs()
    lengths, starts, opts, value_type = _pass0(ray, refs, window=window, strategy=strategy, overflow=overflow,
                                               seed=seed, shuffle=shuffle, tail_slack=float(tail_slack),
                                               input_key=input_key, mask_first_label=mask_first_label)
    pieces = apply_overflow(lengths, window=window, overflow=overflow)  # raises under "error"
    if overflow == "split" and pieces.overflow_examples.size:
        logging.getLogger("packkit").warning(PIECES_UNRECORDED)
    common = dict(strategy=strategy, overflow=overflow, window=window, blocks=len(refs),
                  examples=int(lengths.size), input_tokens=int(lengths.sum()),
                  overflow_examples=pieces.overflow_examples.size, dropped_examples=pieces.dropped_examples.size,
                  cut_tokens=pieces.cut_tokens)
    if mode == "local":
        out_refs, report = _local(ray, refs, opts, value_type, common)
    else:
        out_refs, report = _global(ray, refs, lengths, starts, opts, value_type, common, num_output_blocks)
    return _finish(ray.data.from_arrow_refs(out_refs), report, return_report)


def _pass0(ray, refs, *, input_key: str, **options):
    """Pass 0: lengths only travel to the driver, which checks them and names bad examples. Returns
    ``(lengths, block starts, the options every block task reads, the value type of every block)``."""
    import pyarrow as pa

    label_key = "labels"
    lengths_task = ray.remote(num_cpus=1)(_block_lengths)
    infos = ray.get([lengths_task.remote(r, input_key, label_key) for r in refs])
    starts = lengths_to_offsets([info["lengths"].size for info in infos])
    for b, info in enumerate(infos):
        if info["error"] is not None:
            raise _block_error(info["error"], int(starts[b]), b)
    given_labels = _same_in_every_block(infos, starts, lambda info: label_key if info["has_labels"] else None)
    mask_key = _same_in_every_block(infos, starts, lambda info: info["mask_key"])
    lengths = as_lengths(np.concatenate([info["lengths"] for info in infos]) if infos else [])
    types = {info["value_type"] for info in infos if info["lengths"].size}
    value_type = max(types, key=lambda t: t.bit_width) if types else pa.int64()  # one schema for all blocks
    label_types = {info["label_type"] for info in infos if info["lengths"].size and info["label_type"]}
    label_type = max(label_types, key=lambda t: t.bit_width) if label_types else None
    if mask_key is not None and not given_labels:
        label_type = value_type  # labels are the masked token ids (packed_schema widens them if needed)
    opts = dict(options, input_key=input_key, label_key=label_key, mask_key=mask_key,
                has_labels=given_labels is not None or mask_key is not None, label_type=label_type)
    return lengths, starts, opts, value_type


def _local(ray, refs, opts: dict, value_type, common: dict):
    """Local mode: per-block best fit (pass 1), then one pass over the under-filled windows (pass 2)."""
    window = opts["window"]
    pass1 = ray.remote(num_cpus=1, num_returns=3)(_pass1_block)
    outs = [pass1.remote(r, b, opts) for b, r in enumerate(refs)]
    full_refs = [o[0] for o in outs]
    stats = ray.get([o[2] for o in outs])
    parts = max(1, len(refs))
    pass2 = ray.remote(num_cpus=1, num_returns=parts + 1)(_pass2_spread)
    *tail_refs, tail_stats_ref = pass2.remote(opts, value_type, len(refs), parts, *[o[1] for o in outs])
    tail_stats = ray.get(tail_stats_ref)
    # Pass-2 piece b goes after block b's windows (empty pieces left out): spread, not all last.
    sizes = [a.size for a in np.array_split(np.arange(tail_stats["windows"]), parts)]
    order = [r for b, r in enumerate(full_refs) for r in ([r, tail_refs[b]] if sizes[b] else [r])]
    if not full_refs:
        order = tail_refs[:1]
    tokens = sum(s["tokens"] for s in stats) + tail_stats["tokens"]
    report = RayPackReport(
        mode="local", windows=sum(s["windows"] for s in stats) + tail_stats["windows"], tokens=tokens,
        lower_bound=-(-tokens // window), handed_windows=sum(s["handed_windows"] for s in stats),
        handed_tokens=sum(s["handed_tokens"] for s in stats), pass2_windows=tail_stats["windows"],
        **common,
    )
    return order, report


def _global(ray, refs, lengths, starts, opts: dict, value_type, common: dict, num_output_blocks):
    """Global mode: one plan over every length, then map (per source block) / reduce (per chunk)."""
    plan = pack(lengths, window=opts["window"], strategy=opts["strategy"], overflow=opts["overflow"],
                seed=opts["seed"])
    if opts["shuffle"]:
        plan = plan.shuffled(opts["seed"])
    k = max(1, min(num_output_blocks or len(refs), plan.num_windows)) if plan.num_windows else 1
    chunk_of_window = np.repeat(np.arange(k), [a.size for a in np.array_split(np.arange(plan.num_windows), k)])
    seg_chunk = chunk_of_window[plan.seg_window]
    seg_block = np.searchsorted(starts, plan.seg_example, side="right") - 1
    seg_local = plan.seg_example - starts[seg_block]
    # map side: for each block, its segments sorted by chunk, plan order kept within a chunk
    by_block = np.lexsort((np.arange(plan.num_segments), seg_chunk, seg_block))
    block_ptr = np.searchsorted(seg_block[by_block], np.arange(len(refs) + 1))
    scatter = ray.remote(num_cpus=1, num_returns=k)(_scatter_block)
    pieces = []  # pieces[b][c]
    for b, r in enumerate(refs):
        s = by_block[block_ptr[b]:block_ptr[b + 1]]
        chunk_ptr = np.searchsorted(seg_chunk[s], np.arange(k + 1))
        got = scatter.remote(r, opts, seg_local[s], plan.seg_start[s], plan.seg_length[s], chunk_ptr)
        pieces.append([got] if k == 1 else list(got))
    gather = ray.remote(num_cpus=1)(_gather_chunk)
    win_ptr = np.searchsorted(chunk_of_window, np.arange(k + 1))
    out_refs = []
    for c in range(k):
        w0, w1 = int(win_ptr[c]), int(win_ptr[c + 1])
        s0, s1 = int(plan.window_ptr[w0]), int(plan.window_ptr[w1])
        out_refs.append(gather.remote(opts, value_type, seg_block[s0:s1], plan.seg_length[s0:s1],
                                      plan.window_ptr[w0:w1 + 1] - s0, *[p[c] for p in pieces]))
    report = RayPackReport(mode="global", windows=plan.num_windows, tokens=plan.total_tokens,
                           lower_bound=plan.lower_bound, **common)
    ray.get(out_refs)
    return out_refs, report




def _finish(packed, report: RayPackReport, return_report: bool):
    """Log what the overflow policy touched (as pack_dataset does), and return."""
    log_overflow("raydata.pack_dataset", overflow=report.overflow, over=report.overflow_examples,
                 examples=report.examples, window=report.window, cut_tokens=report.cut_tokens,
                 tokens=report.input_tokens)
    return (packed, report) if return_report else packed
