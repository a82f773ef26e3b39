"""Batch samplers: length-grouped batches, token budgets, and packed windows, across ranks.

Each sampler is a *batch sampler*: it yields lists of dataset indices, one list per step of this
rank, for ``torch.utils.data.DataLoader(dataset, batch_sampler=...)``::

    from torch.utils.data import DataLoader
    from packkit.collate import FixedWindowCollator, PaddedCollator
    from packkit.sampler import LengthGroupedSampler, PackedBatchSampler

    lengths = [len(x["input_ids"]) for x in ds]          # or lengths_from_dataset(ds)

    # varlen attention: k windows of W tokens per step, best fit over the dataset
    sampler = PackedBatchSampler(lengths, window=2048, windows_per_batch=4, seed=0)
    loader = DataLoader(ds, batch_sampler=sampler,
                        collate_fn=FixedWindowCollator(window=2048, strategy="next_fit", num_windows=4))

    # no varlen attention: batches of similar length, padded to their longest
    sampler = LengthGroupedSampler(lengths, batch_size=16, seed=0)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=PaddedCollator())

    for epoch in range(num_epochs):
        sampler.set_epoch(epoch)                         # seeded by (seed, epoch): same on every rank
        for step, batch in enumerate(loader):
            ...
            ckpt = {"sampler": sampler.state_dict()}     # resume: sampler.load_state_dict(ckpt["sampler"])

A small run, with the indices each step gets::

    >>> s = LengthGroupedSampler([5, 1, 4, 2, 3, 6], batch_size=2, seed=0)
    >>> len(s), sorted(i for b in s for i in b)
    (3, [0, 1, 2, 3, 4, 5])
    >>> p = PackedBatchSampler([5, 3, 4, 2], window=8, windows_per_batch=1, shuffle=False)
    >>> list(p)                                          # window after window (BFD: [5, 3], [4, 2])
    [[0, 1], [2, 3]]

Distributed
-----------
``rank`` and ``world_size`` are taken from the default process group when not given. Every rank builds
the same global epoch (same seed, same epoch) and takes its share: step ``s`` of rank ``r`` is global
batch ``s * world_size + r``, so **every rank gets exactly the same number of batches** (uneven counts
hang DDP). The tail that does not fill a whole step follows ``drop_last``:

- ``drop_last=False`` (default): nothing is lost. The tail is shared out among the ranks in one last,
  smaller step; where it cannot be shared evenly, the fewest examples (or windows) needed are repeated,
  and :meth:`epoch_stats` reports how many (``repeated``).
- ``drop_last=True``: only full steps; the tail (chosen at random each epoch) is left out and counted
  (``dropped``).

``balance="tokens"`` or ``"sqlen"`` groups batches of similar cost (tokens, or the sum of squared lengths,
which is what attention costs) into the same step, so no rank waits on a heavier one; steps are then
shuffled. :meth:`epoch_stats` reports the imbalance that remains.

Resuming
--------
``state_dict()`` stores the seed, the epoch and the number of batches this rank has yielded in the
epoch; ``load_state_dict()`` regenerates the epoch and the next pass yields exactly the batches that
were not yielded. A DataLoader with workers fetches ahead of the training loop: pass the number of
steps the loop actually consumed, ``state_dict(batches_consumed=step + 1)``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import numbers
from collections.abc import Mapping

import numpy as np

from .binpack import Plan, as_lengths, check_seed, check_window, pack
from .segments import lengths_to_offsets

__all__ = [
    "LengthGroupedSampler",
    "TokenBudgetBatchSampler",
    "PackedBatchSampler",
    "EpochStats",
    "lengths_from_dataset",
]

BALANCE = (None, "tokens", "sqlen")


# ----------------------------------------------------------------------------------------------
# input checking
# ----------------------------------------------------------------------------------------------


def _positive_int(value, name: str) -> int:
    """``_positive_int(16, "batch_size") -> 16``; a bool, a non-integer or a value < 1 raises."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return int(value)


def resolve_rank(rank, world_size) -> tuple[int, int]:
    """``(rank, world_size)``, from the arguments or from the default process group.

    ``resolve_rank(1, 4) -> (1, 4)``; ``resolve_rank(None, None) -> (0, 1)`` outside torch.distributed.
    """
    if rank is None and world_size == 1:
        rank = 0
    if rank is None or world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        elif rank is None and world_size is None:
            rank, world_size = 0, 1
        else:
            raise ValueError(
                f"got rank={rank!r} and world_size={world_size!r} with no process group: "
                "pass both, or neither (then the default process group is used when initialised)"
            )
    world_size = _positive_int(world_size, "world_size")
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, world_size={world_size}), got {rank!r}")
    return int(rank), world_size


def lengths_from_dataset(dataset, *, key: str = "input_ids") -> np.ndarray:
    """(len(dataset),) int64, the length of ``dataset[i][key]``.

    A Hugging Face ``datasets.Dataset`` or a :class:`packkit.columnar.ColumnarDataset` is read through
    Arrow (list lengths, no Python loop); any other
    map-style dataset is read item by item, so pass ``lengths`` yourself when you have them.
    """
    if hasattr(dataset, "example_lengths"):  # packkit.columnar.ColumnarDataset: from its Arrow offsets
        return dataset.example_lengths(key)
    if hasattr(dataset, "with_format") and hasattr(dataset, "column_names"):
        if key not in dataset.column_names:
            raise KeyError(f"dataset has no column {key!r} (columns: {', '.join(dataset.column_names)})")
        import pyarrow.compute as pc

        col = dataset.with_format("arrow")[:][key]
        return pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
    out = np.empty(len(dataset), np.int64)
    for i in range(len(dataset)):
        item = dataset[i]
        if not hasattr(item, "__getitem__") or isinstance(item, (str, bytes)) or key not in item:
            raise KeyError(f"dataset[{i}] has no {key!r}: pass lengths=... or key=...")
        out[i] = len(item[key])
    return out


def _lengths(lengths, dataset, key: str) -> np.ndarray:
    if lengths is None:
        if dataset is None:
            raise ValueError("pass lengths (one per example) or dataset=...")
        lengths = lengths_from_dataset(dataset, key=key)
    lengths = as_lengths(lengths)
    if lengths.size == 0:
        raise ValueError("the dataset is empty: a sampler needs at least one example")
    if dataset is not None and len(dataset) != lengths.size:
        raise ValueError(
            f"lengths has {lengths.size:,} entries but the dataset has {len(dataset):,} examples: "
            "pass one length per example, in dataset order"
        )
    return lengths


# ----------------------------------------------------------------------------------------------
# small pure pieces
# ----------------------------------------------------------------------------------------------


def sort_megabatches(order: np.ndarray, lengths: np.ndarray, size: int) -> np.ndarray:
    """``order`` cut into consecutive blocks of ``size``, each sorted longest first (stable).

    One row-wise argsort of ``top - length`` over the full blocks (a radix sort when the keys fit in
    16 bits, which is 10x faster than one sort over ``(block, -length)`` keys), then the last block:
    ``sort_megabatches([0, 1, 2, 3], [1, 3, 2, 4], 2) -> [1, 0, 3, 2]``.
    """
    order = np.asarray(order, np.int64)
    lengths = np.asarray(lengths, np.int64)
    if order.size == 0:
        return order
    seq = lengths[order]
    top = int(seq.max())
    key = top - seq  # ascending key = longest first
    key = key.astype(np.uint16 if top < 1 << 16 else np.int64)
    nfull = order.size // size * size
    out = np.empty_like(order)
    if nfull:
        rows = np.argsort(key[:nfull].reshape(-1, size), axis=1, kind="stable")
        rows += np.arange(0, nfull, size, dtype=np.int64)[:, None]
        out[:nfull] = order[rows.reshape(-1)]
    if nfull < order.size:
        out[nfull:] = order[nfull + np.argsort(key[nfull:], kind="stable")]
    return out


def budget_batch_bounds(sorted_lengths: np.ndarray, *, max_tokens: int, block: int,
                        max_batch_size: int | None = None) -> np.ndarray:
    """Batch boundaries over lengths sorted longest first inside blocks of ``block``.

    A batch starts at its longest item ``i`` and takes ``max_tokens // length[i]`` items (at most
    ``max_batch_size``), never crossing a block. One Python step per batch, not per example.
    ``budget_batch_bounds([4, 2, 2, 1], max_tokens=4, block=4) -> [0, 1, 3, 4]``.
    """
    sorted_lengths = np.asarray(sorted_lengths, np.int64)
    n = sorted_lengths.size
    cap = max_tokens // sorted_lengths
    if max_batch_size is not None:
        cap = np.minimum(cap, max_batch_size)
    pos = np.arange(n, dtype=np.int64)
    block_end = np.minimum((pos // block + 1) * block, n)
    nxt = np.minimum(pos + np.maximum(cap, 1), block_end).tolist()
    bounds = [0]
    i = 0
    while i < n:
        i = nxt[i]
        bounds.append(i)
    return np.asarray(bounds, np.int64)


def select_batches(flat: np.ndarray, ptr: np.ndarray, order) -> tuple[np.ndarray, np.ndarray]:
    """CSR batches ``flat[ptr[b]:ptr[b+1]]`` taken in ``order`` (repeats allowed), without a loop.

    ``select_batches([7, 8, 9], [0, 2, 3], [1, 0]) -> ([9, 7, 8], [0, 1, 3])``.
    """
    flat, ptr = np.asarray(flat), np.asarray(ptr, np.int64)
    order = np.asarray(order, np.int64)
    counts = ptr[order + 1] - ptr[order]
    out_ptr = lengths_to_offsets(counts)
    src = np.repeat(ptr[order] - out_ptr[:-1], counts) + np.arange(out_ptr[-1], dtype=np.int64)
    return flat[src], out_ptr


def batch_sums(values: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    """Sum of ``values`` over each CSR batch (empty batches give 0): ``([1, 2, 3], [0, 2, 3]) -> [3, 3]``."""
    csum = lengths_to_offsets(values)  # prefix sums: the offsets of runs of these sizes
    return csum[ptr[1:]] - csum[ptr[:-1]]


def arrange_steps(cost: np.ndarray, world_size: int, rng, *, shuffle: bool, balance: bool,
                  first=None) -> np.ndarray:
    """Order of ``len(cost)`` batches (a multiple of ``world_size``) so that step ``s`` is batches
    ``s * world_size ... + world_size - 1`` of the result.

    Steps are runs of ``world_size`` consecutive batches: in the order given, or, with ``balance``,
    after sorting by ``cost`` (so a step's ranks get similar work). Steps are then shuffled, and the
    step holding batch ``first`` goes first. ``arrange_steps([1, 5, 2, 6], 2, None, shuffle=False,
    balance=True) -> [3, 1, 2, 0]``.
    """
    cost = np.asarray(cost)
    ids = np.arange(cost.size, dtype=np.int64)
    if balance:
        ids = np.argsort(-cost, kind="stable")
    steps = ids.reshape(-1, world_size)
    if shuffle and steps.shape[0] > 1:
        steps = steps[rng.permutation(steps.shape[0])]
    if first is not None and steps.size:
        row = int(np.flatnonzero((steps == first).any(axis=1))[0])
        steps[[0, row]] = steps[[row, 0]]
    return steps.reshape(-1)


def share_tail(units: np.ndarray, world_size: int, pool: np.ndarray) -> tuple[np.ndarray, int]:
    """Pad ``units`` to a multiple of ``world_size`` with the first items of ``pool`` (cycled).

    Returns the padded units and how many were repeated: ``share_tail([4, 5, 6], 2, [0, 1]) -> ([4, 5, 6, 0], 1)``.
    """
    units = np.asarray(units, np.int64)
    need = -units.size % world_size
    extra = np.resize(np.asarray(pool, np.int64), need)
    return np.concatenate((units, extra)), need


# ----------------------------------------------------------------------------------------------
# what an epoch looks like
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EpochStats:
    """The figures of one epoch, over all ranks.

    Fields:
        epoch, world_size: which epoch, how many ranks.
        steps: batches per rank (the same on every rank).
        examples: distinct examples yielded over all ranks.
        repeated: extra yields of examples already in the epoch (``drop_last=False`` padding).
        dropped: examples not yielded this epoch (``drop_last=True`` tail, ``overflow="drop"``).
        tokens: real tokens yielded over all ranks (repeats counted; truncated tokens not).
        padded_tokens: tokens after padding: batch size x longest per batch (length-grouped, token
            budget), or windows x W (packed).
        padding_waste: ``1 - tokens / padded_tokens``.
        step_imbalance: ``sum over steps of the costliest rank / sum of the mean rank, - 1`` (0: every
            rank of every step has the same work), cost measured as ``balance`` says (tokens if None).
    """

    epoch: int
    world_size: int
    steps: int
    examples: int
    repeated: int
    dropped: int
    tokens: int
    padded_tokens: int
    padding_waste: float
    step_imbalance: float


@dataclasses.dataclass(frozen=True, eq=False)
class _Epoch:
    """Global batches of an epoch, step-major: batch ``s * world_size + r`` is step ``s`` of rank ``r``.

    ``flat``: (total,) int64 example indices; ``ptr``: (steps * world_size + 1,) int64 CSR offsets.
    """

    flat: np.ndarray
    ptr: np.ndarray
    steps: int
    stats: EpochStats
    plan: Plan | None = None  # packed samplers: the windows, in the order of ``flat``


# ----------------------------------------------------------------------------------------------
# the shared machinery: epochs, ranks, resuming
# ----------------------------------------------------------------------------------------------


class _BatchSampler:
    """Caches the global epoch, hands this rank its batches, and saves/restores the position."""

    def __init__(self, lengths, *, dataset, key, seed, rank, world_size, drop_last, balance, shuffle):
        self.lengths = _lengths(lengths, dataset, key)
        self.lengths.setflags(write=False)
        self.seed = check_seed(seed, allow_none=False)
        self.rank, self.world_size = resolve_rank(rank, world_size)
        if not isinstance(drop_last, bool):
            raise TypeError(f"drop_last must be True or False, got {drop_last!r}")
        if balance not in BALANCE:
            raise ValueError(f"balance must be one of {BALANCE}, got {balance!r}")
        self.drop_last, self.balance, self.shuffle = drop_last, balance, bool(shuffle)
        self._epoch_num = 0
        self._start = 0  # batches of this epoch already yielded before a resume
        self._yielded = 0
        self._cache: tuple[tuple[int, int], _Epoch] | None = None
        self._built(0)  # bad input fails here, not at the first step

    # -- subclasses build the global epoch ------------------------------------------------------

    def _build(self, rng, epoch: int) -> _Epoch:  # pragma: no cover - abstract
        raise NotImplementedError

    def _config(self) -> dict:
        return {"drop_last": self.drop_last, "balance": self.balance, "shuffle": self.shuffle}

    def _built(self, epoch: int, *, seed: int | None = None) -> _Epoch:
        """The global epoch for ``(seed, epoch)`` (``seed``: this sampler's by default), cached."""
        key = (self.seed if seed is None else seed, epoch)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._build(np.random.default_rng(key), epoch))
        return self._cache[1]

    def _stats(self, epoch: int, steps, repeated, dropped, tokens, padded, cost) -> EpochStats:
        R = self.world_size
        per_step = cost.reshape(steps, R) if steps else np.zeros((0, R))
        mean = float(per_step.mean(axis=1).sum()) if steps else 0.0
        imbalance = float(per_step.max(axis=1).sum()) / mean - 1.0 if mean > 0 else 0.0
        return EpochStats(
            epoch=epoch, world_size=R, steps=int(steps), examples=int(self.lengths.size - dropped),
            repeated=int(repeated), dropped=int(dropped), tokens=int(tokens), padded_tokens=int(padded),
            padding_waste=1.0 - tokens / padded if padded else 0.0, step_imbalance=imbalance,
        )

    def _cost(self, lengths: np.ndarray) -> np.ndarray:
        """Per-item cost for ``balance``: tokens, or squared lengths (attention)."""
        return lengths * lengths if self.balance == "sqlen" else lengths

    # -- the public protocol ----------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch_num

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch``: the order is a function of ``(seed, epoch)`` only, the same on every rank.

        Setting the epoch that :meth:`load_state_dict` restored keeps the resume position.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise TypeError(f"epoch must be a non-negative integer, got {epoch!r}")
        if int(epoch) != self._epoch_num:
            self._start = 0
            self._yielded = 0
        self._epoch_num = int(epoch)

    @property
    def batches_per_epoch(self) -> int:
        """Batches of a whole epoch on this rank (the same on every rank)."""
        return self._built(self._epoch_num).steps

    def __len__(self) -> int:
        """Batches the next pass yields: the epoch, less the batches already yielded before a resume."""
        return self.batches_per_epoch - self._start

    def epoch_stats(self) -> EpochStats:
        """Figures of the current epoch over all ranks: see :class:`EpochStats`."""
        return self._built(self._epoch_num).stats

    def __iter__(self):
        ep = self._built(self._epoch_num)
        start, self._start = self._start, 0
        self._yielded = start
        return self._iterate(ep, start)

    def _iterate(self, ep: _Epoch, start: int):
        flat, ptr, R, r = ep.flat, ep.ptr, self.world_size, self.rank
        for s in range(start, ep.steps):
            g = s * R + r
            self._yielded = s + 1  # counted before the consumer sees the batch
            yield flat[ptr[g]:ptr[g + 1]].tolist()

    def _fingerprint(self) -> str:
        h = hashlib.sha1(type(self).__name__.encode())
        h.update(repr(sorted(self._config().items())).encode())
        h.update(self.lengths.tobytes())
        return h.hexdigest()

    def state_dict(self, *, batches_consumed: int | None = None) -> dict:
        """Where this rank is: ``{"epoch", "seed", "batches_yielded", "world_size", "rank", ...}``.

        ``batches_consumed``: the number of this epoch's batches the training loop actually used, when
        that differs from what the sampler handed out (a DataLoader with workers prefetches).
        """
        done = self._yielded if batches_consumed is None else batches_consumed
        if isinstance(done, bool) or not isinstance(done, numbers.Integral) or not 0 <= done <= self.batches_per_epoch:
            raise ValueError(f"batches_consumed must be in [0, {self.batches_per_epoch}], got {done!r}")
        return {
            "sampler": type(self).__name__,
            "epoch": self._epoch_num,
            "seed": self.seed,
            "batches_yielded": int(done),
            "batches_per_epoch": self.batches_per_epoch,
            "world_size": self.world_size,
            "rank": self.rank,
            "fingerprint": self._fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore seed, epoch and position: the next pass yields exactly the batches not yet yielded.

        Every field is checked before anything is assigned, so a state that does not fit this sampler
        leaves it as it was; the error names the field (``sampler state field 'epoch': ...``).
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"sampler state must be the dict state_dict() returned, got {type(state).__name__}")
        missing = [k for k in ("sampler", "epoch", "seed", "batches_yielded", "world_size", "fingerprint")
                   if k not in state]
        if missing:
            raise KeyError(f"sampler state lacks {', '.join(missing)}: pass what state_dict() returned")

        def field_error(name: str, why: str, exc=ValueError):
            return exc(f"sampler state field {name!r}: {why}")

        if state["sampler"] != type(self).__name__:
            raise field_error("sampler", f"the state is from a {state['sampler']}, this is a {type(self).__name__}")
        if state["world_size"] != self.world_size:
            raise field_error(
                "world_size", f"the state was saved with world_size={state['world_size']}, this run has "
                f"{self.world_size}: the batches of a step depend on the world size; resume with the same "
                "number of ranks or start the epoch over")
        if state["fingerprint"] != self._fingerprint():
            raise field_error(
                "fingerprint", "the state was saved for other lengths or options (batch size, window, policy): "
                "build the sampler with the same dataset and arguments before loading")
        try:
            seed = check_seed(state["seed"], allow_none=False)
        except (TypeError, ValueError) as exc:
            raise field_error("seed", str(exc), type(exc)) from None
        epoch = state["epoch"]
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise field_error("epoch", f"must be a non-negative integer, got {epoch!r}",
                              ValueError if isinstance(epoch, numbers.Integral) else TypeError)
        done = state["batches_yielded"]
        if isinstance(done, bool) or not isinstance(done, numbers.Integral):
            raise field_error("batches_yielded", f"must be an integer, got {done!r}", TypeError)
        steps = self._built(int(epoch), seed=seed).steps  # the epoch the state describes; nothing assigned yet
        if not 0 <= done <= steps:
            raise field_error("batches_yielded", f"{int(done)} is outside [0, {steps}], the batches of epoch "
                              f"{int(epoch)}")
        # -- every field checked: assign --
        self.seed, self._epoch_num = seed, int(epoch)
        self._start = self._yielded = int(done)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return (f"{type(self).__name__}({self.lengths.size:,} examples, {opts}, seed={self.seed}, "
                f"epoch={self._epoch_num}, rank={self.rank}/{self.world_size}, batches={len(self)})")


def _default_mult(mult, full_steps: int) -> int:
    """Steps per megabatch: the given number, or min(50, a quarter of the steps) (Hugging Face's rule)."""
    if mult is None:
        return max(1, min(50, full_steps // 4))
    return _positive_int(mult, "megabatch_mult")


# ----------------------------------------------------------------------------------------------
# length-grouped batches (the padded fallback)
# ----------------------------------------------------------------------------------------------


class LengthGroupedSampler(_BatchSampler):
    """Batches of ``batch_size`` examples of similar length, in random order.

    Each epoch: a seeded permutation, cut into megabatches of ``megabatch_mult`` steps
    (``megabatch_mult x batch_size x world_size`` examples), each sorted longest first; consecutive
    runs of ``batch_size`` form batches, runs of ``world_size`` batches form steps, and steps are
    shuffled. ``longest_first`` puts the step holding the longest example first, so an out-of-memory
    error shows at step one.

    Args:
        lengths: (num_examples,) ints >= 1, or None with ``dataset=`` (read from ``dataset[i][key]``).
        batch_size: examples per batch on each rank.
        megabatch_mult: steps per megabatch; None: min(50, steps // 4), as Hugging Face's sampler.
        seed, rank, world_size, drop_last, balance, shuffle: see the module docstring.
        dataset: optional; checked against ``lengths``.
    """

    def __init__(self, lengths=None, *, batch_size: int, megabatch_mult: int | None = None,
                 seed: int = 0, rank: int | None = None, world_size: int | None = None,
                 drop_last: bool = False, longest_first: bool = False, balance: str | None = None,
                 shuffle: bool = True, dataset=None, key: str = "input_ids"):
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.megabatch_mult = None if megabatch_mult is None else _positive_int(megabatch_mult, "megabatch_mult")
        self.longest_first = bool(longest_first)
        super().__init__(lengths, dataset=dataset, key=key, seed=seed, rank=rank, world_size=world_size,
                         drop_last=drop_last, balance=balance, shuffle=shuffle)

    def _config(self):
        return {"batch_size": self.batch_size, "megabatch_mult": self.megabatch_mult,
                "longest_first": self.longest_first, **super()._config()}

    def _build(self, rng, epoch: int) -> _Epoch:
        L, R, B = self.lengths, self.world_size, self.batch_size
        n, step = L.size, R * B
        full = n // step * step
        if full == 0 and self.drop_last:
            raise ValueError(
                f"{n} examples do not fill one step of world_size x batch_size = {step}; "
                "pass drop_last=False or a smaller batch_size"
            )
        perm = rng.permutation(n) if self.shuffle else np.arange(n, dtype=np.int64)
        body, tail = perm[:full], perm[full:]  # the tail is a random subset
        mult = _default_mult(self.megabatch_mult, full // step)
        order = sort_megabatches(body, L, mult * step)
        ptr = np.arange(0, full + 1, B, dtype=np.int64)
        cost = batch_sums(self._cost(L[order]), ptr)
        first = None
        if self.longest_first and full:
            first = int(np.argmax(L[order])) // B
        arrangement = arrange_steps(cost, R, rng, shuffle=self.shuffle, balance=self.balance is not None,
                                    first=first)
        flat, ptr = select_batches(order, ptr, arrangement)
        repeated = dropped = 0
        if tail.size and self.drop_last:
            dropped = tail.size
        elif tail.size:
            units, repeated = share_tail(tail, R, perm)
            units = units[np.argsort(-L[units], kind="stable")]
            flat = np.concatenate((flat, units))
            ptr = np.concatenate((ptr, ptr[-1] + np.arange(1, R + 1) * (units.size // R)))
        steps = (ptr.size - 1) // R
        lens = L[flat]
        tokens = int(lens.sum())
        sizes = np.diff(ptr)
        longest = np.maximum.reduceat(lens, ptr[:-1]) if flat.size else np.zeros(0, np.int64)
        stats = self._stats(epoch, steps, repeated, dropped, tokens,
                            int((sizes * longest).sum()), batch_sums(self._cost(lens), ptr))
        return _Epoch(flat=flat, ptr=ptr, steps=steps, stats=stats)


# ----------------------------------------------------------------------------------------------
# token budgets
# ----------------------------------------------------------------------------------------------


class TokenBudgetBatchSampler(_BatchSampler):
    """Batches of variable size whose padded size (batch size x longest) is at most ``max_tokens``.

    Each epoch: a seeded permutation cut into megabatches of ``megabatch_size`` examples, each sorted
    longest first and cut greedily into batches (a batch takes ``max_tokens // its longest`` examples,
    at most ``max_batch_size``). Runs of ``world_size`` batches form steps, shuffled. With several ranks,
    the batches that do not fill a step (a random few) are split in halves, or as a last resort repeated,
    so every rank gets one (``drop_last=False``), or dropped (``drop_last=True``).

    Args:
        lengths: (num_examples,) ints >= 1 (each at most ``max_tokens``), or None with ``dataset=``.
        max_tokens: padded tokens per batch on each rank.
        max_batch_size: optional cap on examples per batch.
        megabatch_size: examples per sorted megabatch; None: about 50 steps' worth.
    """

    def __init__(self, lengths=None, *, max_tokens: int, max_batch_size: int | None = None,
                 megabatch_size: int | None = None, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, drop_last: bool = False, longest_first: bool = False,
                 balance: str | None = None, shuffle: bool = True, dataset=None, key: str = "input_ids"):
        self.max_tokens = _positive_int(max_tokens, "max_tokens")
        self.max_batch_size = None if max_batch_size is None else _positive_int(max_batch_size, "max_batch_size")
        self.megabatch_size = None if megabatch_size is None else _positive_int(megabatch_size, "megabatch_size")
        self.longest_first = bool(longest_first)
        lengths = _lengths(lengths, dataset, key)
        over = np.flatnonzero(lengths > self.max_tokens)
        if over.size:
            i = int(over[0])
            more = f" (and {over.size - 1} more)" if over.size > 1 else ""
            raise ValueError(
                f"example {i} has {int(lengths[i]):,} tokens > max_tokens={self.max_tokens:,}{more}; "
                "raise max_tokens, or truncate or filter long examples first"
            )
        super().__init__(lengths, dataset=dataset, key=key, seed=seed, rank=rank, world_size=world_size,
                         drop_last=drop_last, balance=balance, shuffle=shuffle)

    def _config(self):
        return {"max_tokens": self.max_tokens, "max_batch_size": self.max_batch_size,
                "megabatch_size": self.megabatch_size, "longest_first": self.longest_first,
                **super()._config()}

    def _block(self) -> int:
        if self.megabatch_size is not None:
            return self.megabatch_size
        per_batch = max(1, self.max_tokens // max(1, int(self.lengths.mean())))
        if self.max_batch_size is not None:
            per_batch = min(per_batch, self.max_batch_size)
        return 50 * per_batch * self.world_size

    def _build(self, rng, epoch: int) -> _Epoch:
        L, R = self.lengths, self.world_size
        n = L.size
        perm = rng.permutation(n) if self.shuffle else np.arange(n, dtype=np.int64)
        order = sort_megabatches(perm, L, self._block())
        bounds = budget_batch_bounds(L[order], max_tokens=self.max_tokens, block=self._block(),
                                     max_batch_size=self.max_batch_size)
        G = bounds.size - 1
        t = G % R
        # -- a random few batches make the tail; the rest keep their megabatch order --
        pick = rng.permutation(G) if self.shuffle else np.arange(G, dtype=np.int64)
        tail_ids, body_ids = pick[G - t:], np.sort(pick[: G - t])
        if body_ids.size == 0 and self.drop_last:
            raise ValueError(
                f"{n} examples make {G} batches of max_tokens={self.max_tokens:,}, fewer than "
                f"world_size={R}: pass drop_last=False or lower max_tokens"
            )
        flat, ptr = select_batches(order, bounds, body_ids)
        cost = batch_sums(self._cost(L[flat]), ptr)
        first = None
        if self.longest_first and flat.size:
            first = int(np.searchsorted(ptr, int(np.argmax(L[flat])), side="right") - 1)
        arrangement = arrange_steps(cost, R, rng, shuffle=self.shuffle, balance=self.balance is not None,
                                    first=first)
        flat, ptr = select_batches(flat, ptr, arrangement)
        repeated = dropped = 0
        if t:
            parts = [order[bounds[b]:bounds[b + 1]] for b in tail_ids.tolist()]  # fewer than R batches
            if self.drop_last:
                dropped = sum(p.size for p in parts)
            else:
                parts, repeated = _split_to(parts, R)
                flat = np.concatenate([flat, *parts])
                ptr = np.concatenate((ptr, ptr[-1] + lengths_to_offsets([p.size for p in parts])[1:]))
        steps = (ptr.size - 1) // R
        lens = L[flat]
        longest = np.maximum.reduceat(lens, ptr[:-1]) if flat.size else np.zeros(0, np.int64)
        stats = self._stats(epoch, steps, repeated, dropped,
                            int(lens.sum()), int((np.diff(ptr) * longest).sum()), batch_sums(self._cost(lens), ptr))
        return _Epoch(flat=flat, ptr=ptr, steps=steps, stats=stats)


def _split_to(parts: list[np.ndarray], count: int) -> tuple[list[np.ndarray], int]:
    """Split the largest batch in halves until there are ``count`` batches; repeat if all are single.

    Halves of a batch within the budget are within it too. Returns the batches and the repeats:
    ``_split_to([[3, 4, 5]], 2) -> ([[3], [4, 5]], 0)`` (order of the halves aside).
    """
    parts = list(parts)
    while len(parts) < count:
        j = max(range(len(parts)), key=lambda i: parts[i].size)
        if parts[j].size < 2:
            break
        p = parts.pop(j)
        h = p.size // 2
        parts += [p[:h], p[h:]]
    repeated = 0
    i = 0
    while len(parts) < count:
        parts.append(parts[i])
        repeated += parts[i].size
        i += 1
    return parts, repeated


# ----------------------------------------------------------------------------------------------
# packed windows
# ----------------------------------------------------------------------------------------------


class PackedBatchSampler(_BatchSampler):
    """``windows_per_batch`` windows of ``window`` tokens per batch, planned by the packing engine.

    Each epoch: :func:`packkit.binpack.pack` over the whole dataset (``"bfd"``: best fit, the fewest
    windows; ``"shuffle_ff"``: first fit in a seeded random order, windows not grouped by length),
    then the windows in a seeded random order (``plan.shuffled``), ``windows_per_batch`` per batch.
    A batch lists the example indices of its windows, window after window, so
    ``FixedWindowCollator(window=W, strategy="next_fit", num_windows=k)`` packs them back into at most
    ``k`` windows. With ``drop_last=False`` the windows left over after the last full step are shared
    out (the fewest windows repeated so every rank gets one); the last batch may hold fewer windows.

    Args:
        lengths: (num_examples,) ints >= 1, or None with ``dataset=``.
        window: tokens per window ``W``.
        windows_per_batch: ``k``, windows per batch on each rank.
        strategy: ``"bfd"`` (default), ``"ffd"`` or ``"shuffle_ff"``.
        overflow: examples longer than ``W``: ``"error"`` (default), ``"truncate"`` (collate with the
            same policy) or ``"drop"`` (counted in ``epoch_stats().dropped``). ``"split"`` is not
            offered: a batch sampler yields whole examples, so split long examples offline.
        groups, group_sizes: atoms that stay in one window, so on one rank and in one step (a
            preference pair, a prompt's completions): a group id per example, or consecutive group
            sizes (:func:`packkit.binpack.pack_groups`; ``overflow`` then applies to whole groups).
            A batch lists a group's examples adjacent; collate with
            ``FixedWindowCollator(..., group_key=...)`` so the collator keeps them together too.
    """

    def __init__(self, lengths=None, *, window: int, windows_per_batch: int = 1, strategy: str = "bfd",
                 overflow: str = "error", seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, drop_last: bool = False, balance: str | None = None,
                 shuffle: bool = True, dataset=None, key: str = "input_ids", groups=None, group_sizes=None):
        self.window = check_window(window)
        self.windows_per_batch = _positive_int(windows_per_batch, "windows_per_batch")
        self._groups = {"groups": groups, "group_sizes": group_sizes}
        grouped = groups is not None or group_sizes is not None
        if strategy not in ("bfd", "ffd", "shuffle_ff"):
            raise ValueError(f"strategy must be 'bfd', 'ffd' or 'shuffle_ff', got {strategy!r}")
        if overflow not in ("error", "truncate", "drop") and not (overflow == "split" and grouped):
            hint = (": a batch sampler yields whole examples; split long examples offline "
                    "(packkit pack) or use 'truncate'") if overflow == "split" else ""
            raise ValueError(f"overflow must be 'error', 'truncate' or 'drop', got {overflow!r}{hint}")
        self.strategy, self.overflow = strategy, overflow
        self._plan_cache: Plan | None = None
        super().__init__(lengths, dataset=dataset, key=key, seed=seed, rank=rank, world_size=world_size,
                         drop_last=drop_last, balance=balance, shuffle=shuffle)

    def _config(self):
        groups = {k: hashlib.sha1(np.asarray(v).tobytes()).hexdigest() for k, v in self._groups.items()
                  if v is not None}
        return {"window": self.window, "windows_per_batch": self.windows_per_batch,
                "strategy": self.strategy, "overflow": self.overflow, **groups, **super()._config()}

    def _plan(self, rng) -> Plan:
        if self.strategy == "shuffle_ff":  # a new random order each epoch
            return pack(self.lengths, window=self.window, strategy="shuffle_ff", overflow=self.overflow,
                        seed=int(rng.integers(1 << 62)), **self._groups)
        if self._plan_cache is None:  # best/first fit decreasing do not depend on the seed: plan once
            self._plan_cache = pack(self.lengths, window=self.window, strategy=self.strategy,
                                    overflow=self.overflow, **self._groups)
        return self._plan_cache

    def plan(self) -> Plan:
        """The plan of the current epoch, windows in training order (all ranks, step-major)."""
        return self._built(self._epoch_num).plan

    def _build(self, rng, epoch: int) -> _Epoch:
        R, k = self.world_size, self.windows_per_batch
        plan = self._plan(rng)
        if self.shuffle:
            plan = plan.shuffled(int(rng.integers(1 << 62)))
        nw = plan.num_windows
        full = nw // (R * k) * R * k
        if full == 0 and self.drop_last:
            raise ValueError(
                f"the plan has {nw} windows, fewer than one step of world_size x windows_per_batch = "
                f"{R * k}: pass drop_last=False or fewer windows_per_batch"
            )
        seg_sq = plan.seg_length * plan.seg_length if self.balance == "sqlen" else plan.seg_length
        win_cost = batch_sums(seg_sq, plan.window_ptr)
        bptr = np.arange(0, full + 1, k, dtype=np.int64)  # rank-batches of k windows, over windows
        arrangement = arrange_steps(batch_sums(win_cost, bptr), R, rng, shuffle=self.shuffle,
                                    balance=self.balance is not None)
        wins, bptr = select_batches(np.arange(nw, dtype=np.int64), bptr, arrangement)
        repeated_windows = 0
        dropped_windows = np.arange(0)
        if full < nw and self.drop_last:
            dropped_windows = np.arange(full, nw)
        elif full < nw:
            units, repeated_windows = share_tail(np.arange(full, nw), R, np.arange(nw))
            wins = np.concatenate((wins, units))
            bptr = np.concatenate((bptr, bptr[-1] + np.arange(1, R + 1) * (units.size // R)))
        sel = plan.select(wins, allow_repeats=True)  # repeats are the counted remainder policy
        flat = sel.seg_example
        ptr = sel.window_ptr[bptr]  # batch offsets, from windows to segments
        steps = (bptr.size - 1) // R
        dropped = int(plan.dropped_examples.size)
        if dropped_windows.size:
            dropped += int(plan.segments_per_window[dropped_windows].sum())
        repeated = int(plan.segments_per_window[wins[wins.size - repeated_windows:]].sum()) if repeated_windows else 0
        stats = self._stats(epoch, steps, repeated, dropped,
                            int(sel.seg_length.sum()), wins.size * self.window,
                            batch_sums(win_cost[wins], bptr))
        return _Epoch(flat=flat, ptr=ptr, steps=steps, stats=stats, plan=sel)
