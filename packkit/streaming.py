"""Streaming packing as a torch ``IterableDataset`` that saves and resumes exactly once.

:class:`PackedIterable` is :func:`packkit.packer.pack_stream` for a ``DataLoader``: every rank and every
DataLoader worker is one shard of the stream (example ``j`` of the source goes to shard ``j`` modulo
``world_size x num_workers``), and its state is that shard's :meth:`~packkit.packer.PackedStream.state_dict`
(the buffer and the pieces not yet buffered with it)::

    ds = PackedIterable(examples, window=2048, rank=rank, world_size=world_size)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)   # torchdata: every worker's state
    ckpt = {"loader": loader.state_dict()}                            # ... train, save
    loader.load_state_dict(ckpt["loader"])                            # resume: the rows not yet trained

Who holds the state: with ``num_workers=0`` the loop's process packs, and ``ds.state_dict()`` after a batch
is exact. With workers, each worker packs and prefetches; a plain ``DataLoader`` cannot say which rows the
loop took, so ``ds.state_dict()`` there refuses (one line naming the fix): torchdata's
``StatefulDataLoader`` saves every worker's state with each batch and resumes each worker exactly.

Another number of ranks or workers: pass the list of every shard's state (:func:`shard_states` pulls them
out of the ``StatefulDataLoader`` states of all ranks) to ``ds.load_state_dict`` before the loader starts:
the examples read and not yet packed are dealt to the new shards, those not read are read once. Every
example is packed once; the windows differ from an uninterrupted run (on the same shards they are the same).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
from collections.abc import Mapping

import numpy as np
import torch.utils.data

from .binpack import DEFAULT_OVERFLOW
from .errors import ArgumentError, arg, check_int
from .packer import pack_stream, resolve_columns
from .progress import progress_bar

__all__ = ["PackedIterable", "shard_states", "pack_iterable_dataset"]


class PackedIterable(torch.utils.data.IterableDataset):
    """Rows of :func:`~packkit.packer.pack_stream` over ``examples`` (a list, a ``datasets.IterableDataset``,
    any iterable the same each time it is iterated), one shard per rank and DataLoader worker, with
    ``state_dict`` / ``load_state_dict`` (the options are :func:`~packkit.packer.pack_stream`'s).

    ``rank``, ``world_size``: this process's place among the data-parallel ranks (each rank reads the
    source and packs its share of it).
    """

    def __init__(self, examples, *, window: int, buffer_size: int = 1000, overflow: str = DEFAULT_OVERFLOW,
                 columns=None, mask_first_label: bool = True, example_ids: bool = False, rank: int = 0,
                 world_size: int = 1):
        self.world_size = check_int(world_size, "world_size")
        self.rank = check_int(rank, "rank", low=0, high=self.world_size - 1)
        self._examples = examples
        self._options = dict(window=window, buffer_size=buffer_size, overflow=overflow, columns=columns,
                             mask_first_label=mask_first_label, example_ids=example_ids)
        pack_stream(examples, **self._options)  # the options checked now, not in a worker
        self._stream = None  # this process's shard of the current pass
        self._loaded = None  # a checked state, applied when the next pass starts (its shard is known then)
        # set by a DataLoader worker that packed this dataset: its state is not in this process
        self._in_workers = multiprocessing.RawValue("b", 0)

    def __getstate__(self):
        state = dict(self.__dict__)
        if multiprocessing.context.get_spawning_popen() is None:  # pickled, not sent to a worker
            state["_in_workers"] = None
        state["_stream"] = None
        return state

    def _shard(self):
        info = torch.utils.data.get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        return self.rank * workers + worker, self.world_size * workers, info

    def _new_stream(self, shard: int, num_shards: int):
        return pack_stream(self._examples, shard=shard, num_shards=num_shards, **self._options)

    def __iter__(self):
        shard, num_shards, info = self._shard()
        if self._in_workers is not None:
            self._in_workers.value = 0 if info is None else 1
        stream = self._new_stream(shard, num_shards)
        if self._loaded is not None:
            stream.load_state_dict(self._loaded)
            self._loaded = None
        self._stream = stream
        return _rows(stream)

    def state_dict(self):
        """This shard's stream state (:meth:`packkit.packer.PackedStream.state_dict`); refused in the process
        of a DataLoader whose workers pack (their buffers are not here)."""
        shard, num_shards, info = self._shard()
        if info is None and self._in_workers is not None and self._in_workers.value:
            raise ArgumentError(
                "PackedIterable.state_dict(): DataLoader workers pack this stream and prefetch its rows, so this "
                "process cannot tell which rows the loop used: save loader.state_dict() of torchdata's "
                "StatefulDataLoader (it keeps every worker's state), or pass {workers}",
                workers=arg("num_workers", 0))
        if self._stream is None:
            return self._loaded if self._loaded is not None else self._new_stream(shard, num_shards).state_dict()
        return self._stream.state_dict()

    def load_state_dict(self, state) -> None:
        """Resume from :meth:`state_dict`'s dict, or from the list of every shard's states (:func:`shard_states`)
        to resume on another number of ranks or workers. Checked now, applied when the next pass starts; a
        refused state leaves the dataset as it was."""
        shard, num_shards, info = self._shard()
        if info is None and isinstance(state, Mapping):  # the workers are not known yet: check it as saved
            try:
                shard, num_shards = int(state["shard"]), int(state["num_shards"])
            except (KeyError, TypeError, ValueError):
                pass  # the probe below names the field
            if not 0 <= shard < num_shards:
                shard, num_shards = self.rank, self.world_size
        self._new_stream(shard, num_shards).load_state_dict(state)  # every field checked: raises, nothing kept
        self._loaded = state
        self._stream = None


def _rows(stream):
    yield from stream


def shard_states(loader_states) -> list:
    """Every shard's stream state from the ``state_dict()`` of each rank's torchdata ``StatefulDataLoader``
    (or from :meth:`PackedIterable.state_dict` dicts), for :meth:`PackedIterable.load_state_dict` on another
    number of ranks or workers. ``shard_states([rank0_loader_state, rank1_loader_state])`` -> a list of dicts.
    """
    out = []
    for k, st in enumerate(loader_states):
        if not isinstance(st, Mapping):
            raise TypeError(f"loader state {k} must be a dict, got {type(st).__name__}")
        if "version" in st and "shard" in st:  # a PackedIterable's own state
            out.append(st)
            continue
        snap = st.get("_snapshot")
        workers = snap.get("_worker_snapshots") if isinstance(snap, Mapping) else None
        if workers:
            out += [w.get("dataset_state") for _, w in sorted(workers.items())]
        elif "dataset_state" in st:
            out.append(st["dataset_state"])
        else:
            raise ValueError(f"loader state {k} holds no PackedIterable state: pass StatefulDataLoader.state_dict() "
                             "of a loader over a PackedIterable")
    if any(s is None for s in out):
        raise ValueError("a loader state has no dataset state: its dataset was not a PackedIterable")
    return out


def pack_iterable_dataset(ds, *, window: int, overflow: str = DEFAULT_OVERFLOW, seed: int | None = 0,
                          shuffle: bool = True, buffer_size: int = 1000, columns=None, mask_first_label: bool = True,
                          example_ids: bool = False, progress: bool = False):
    """:func:`~packkit.packer.pack_stream`'s rows over a ``datasets.IterableDataset`` as a ``datasets.IterableDataset``
    of the offline row format (:func:`packkit.outputs.packed_schema`, every packed column int64), what
    :func:`packkit.offline.pack_dataset` returns for one: best fit and a seeded ``shuffle`` (one order every epoch)
    inside ``buffer_size``. Its ``state_dict()`` resumes exactly by packing again up to the rows yielded
    (``seed=None`` draws a seed: pass one for another process); :class:`PackedIterable` restores the buffer, behind
    workers and on other ranks.

    One stream reads the whole source (an ``IterableDataset`` read in a DataLoader worker yields that worker's files
    only; the output has one shard). :func:`_shuffled` makes the rows a function of the source and the options, so
    that the output's ``state_dict()`` (rows yielded) resumes exactly; ``datasets``' ``shuffle`` drops its buffer on
    a resume (11 to 14 of 364 rows lost in a test). ``progress`` counts packed tokens (a stream has no known total).
    """
    import datasets
    import pyarrow as pa

    from .outputs import packed_schema  # lazy: the door out, not in PackedIterable's DataLoader workers

    known = ds.column_names or (None if columns is None else [columns] if isinstance(columns, str) else list(columns))
    features = None
    if known is not None:  # the offline row format, every packed column int64 as pack_stream yields them
        written = [(c, pa.int64()) for c in resolve_columns(known, columns).written()]
        features = datasets.Features.from_arrow_schema(packed_schema(written, example_ids=example_ids))
    if shuffle and seed is None:
        seed = int(np.random.SeedSequence().entropy % 2**63)  # one order for this dataset, replayed on a resume

    def rows():
        stream = pack_stream(ds, window=window, buffer_size=buffer_size, overflow=overflow, columns=columns,
                             mask_first_label=mask_first_label, example_ids=example_ids)
        with progress_bar(total=None, unit="tok", enabled=progress, desc="pack_dataset (stream)") as bar:
            for row in _shuffled(stream, seed=seed, size=buffer_size) if shuffle else stream:
                bar.update(int(row["seq_lengths"].sum()))
                # Unknown columns (no features to cast numpy arrays with): plain lists, as datasets gives.
                yield row if features is not None else {k: v.tolist() for k, v in row.items()}

    return datasets.IterableDataset.from_generator(rows, features=features)


def _shuffled(rows, *, seed: int, size: int):
    """``rows`` in a seeded random order inside a buffer of ``size``: each row read replaces a random one
    of a full buffer, which is yielded; the rest in a random order at the end. The same rows and seed
    give the same order. ``list(_shuffled(range(5), seed=0, size=1)) -> [0, 1, 2, 3, 4]``."""
    rng = np.random.default_rng(seed)
    buf = []
    for row in rows:
        if len(buf) < size:
            buf.append(row)
            continue
        k = int(rng.integers(size))
        yield buf[k]
        buf[k] = row
    for k in rng.permutation(len(buf)).tolist():
        yield buf[k]
