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

import torch.utils.data

from .binpack import DEFAULT_OVERFLOW
from .errors import ArgumentError, arg, check_int
from .packer import pack_stream

__all__ = ["PackedIterable", "shard_states"]


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
