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

    for epoch in range(sampler.epoch, num_epochs):       # a resumed run starts in its saved epoch
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
``rank`` and ``world_size`` are taken from the default process group when not given. An epoch is a
sequence of *units* (windows, or batches) cut into global steps of ``step_batches`` micro-batches
(default ``world_size``: one per rank; a multiple of it: each rank accumulates
``accumulation_steps = step_batches // world_size``). The sequence depends on the seed, the epoch and
``step_batches``, never on the world size; it is dealt to the ranks only when iterated, the same deal on
every rank with no collective, so **every rank gets exactly the same number of micro-batches** (uneven
counts hang DDP). :meth:`schedule` shows every rank's batches. The tail that does not fill a whole step
follows ``drop_last``:

- ``drop_last=False`` (default): nothing is lost. The tail makes one last, smaller step (the fewest rows
  of at most ``k`` units); where a row has fewer units than ranks, units are split by examples, and only
  where there are fewer examples than ranks are some repeated, counted in ``epoch_stats().repeated``: a
  repeat is a whole micro-batch dealt so that every rank runs one, and weighs 0 where the loop counts the step
  with ``accumulation_step(..., facts=sampler.step_facts())`` or ``repeats=sampler.step_repeats()`` (said once,
  :class:`RepeatWarning`), so the step's loss is its unique examples' on any world size.
- ``drop_last=True``: only full steps; the tail (chosen at random each epoch) is left out and counted
  (``dropped``).

``balance``: ``"tokens"`` or ``"sqlen"`` sort the epoch's micro-batches by cost (tokens, or the sum of
squared lengths) and cut steps from the sorted order, then shuffle the steps: balanced ranks, but what a
step holds is no longer random. ``"compute"`` keeps the steps random and deals each step's units to the
ranks that balance ``cost`` (``a * L + L**2 / cp_size`` per document, :mod:`packkit.balance`): LPT, then
swaps between the heaviest and the lightest rank; with one or two windows per rank the packed sampler
builds the windows to a cost target instead. :meth:`epoch_stats` reports, whatever the policy, the
compute imbalance and the spread of examples per step.

Resuming, on any number of ranks
--------------------------------
``state_dict()`` is the same small dict on every rank: the seed, the epoch, the step size the epoch was cut
with and the position in it (the first unit of the step in progress, the units of that step used before
it was dealt, the deal and its rows done). ``load_state_dict()`` on any world size yields every unit not
yet used, exactly once (under ``balance="compute"`` at one or two windows a rank, the state names the planner whose
windows it counts, :data:`packkit.balance.PLANNER`, and a run resumes on the windows it began with: a state
without the field is planner 1's). With the same ``step_batches`` and a world size dividing it, the global steps are
the ones the first run would have made (a step in progress on another world size ends as a step of its
own); otherwise step boundaries move from the resume point on, said once by a :class:`ResumeWarning`.
The state counts the batches the training loop consumed, not those the sampler handed out: a DataLoader
with workers (and accelerate's loader, one batch ahead) fetches ahead of the loop, so the sampler asks the
DataLoader iterator that drives it how many batches it gave the loop; torchdata's ``StatefulDataLoader``
saves the sampler's state as each batch is drawn. A pass starts at its first batch, not at ``iter()``
(a DataLoader with workers calls it twice), so a loaded state is the next pass behind any loader. Where the
loop cannot be told (a wrapper between the loader and the sampler, ``in_order=False``), a
:class:`ResumeWarning` says so and names ``state_dict(batches_consumed=...)``.
:meth:`merge_state_dicts` turns the per-rank states of an older packkit into one.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import warnings

import numpy as np

from .costs import compute_imbalance, cost_model, variation
from .binpack import Plan, as_lengths, check_seed, check_window, overflow_error, pack, windows_plan
from .choices import BALANCE
from .errors import ArgumentError, arg, check_choice, check_int, with_keywords
from .records import record
from .length_rules import check_loss_lengths
from .positions import STATE_VERSION, RepeatWarning, ResumeWarning  # noqa: F401 - their home, re-exported
from .positions import Point as _Point
from .segments import lengths_to_offsets
from .csr import arrange_steps, batch_sums, select_batches

__all__ = [
    "LengthGroupedSampler",
    "TokenBudgetBatchSampler",
    "PackedBatchSampler",
    "EpochStats",
    "ResumeWarning",
    "RepeatWarning",
    "Schedule",
    "lengths_from_dataset",
    "SamplerOptions",
]

CACHED = 8  # epochs (and resume points) a sampler keeps built: a resume and the epoch it left


def _resume():
    """:mod:`packkit.resume`, imported at the first pass, state saved or loaded: a sampler that only deals an epoch
    (``packkit plan``, ``packkit waste``) does not compile the resume code (20 KB)."""
    from . import resume  # lazy: the states saved and loaded and the loader's count, for a pass or a resume only
    return resume


def _orders():
    """:mod:`packkit.orders`, imported where a length-grouped or token-budget sampler builds an epoch: the packed
    sampler (``packkit plan``, ``packkit waste``) does not compile their sorts (8 KB)."""
    from . import orders  # lazy: the padded samplers' sorts, for LengthGroupedSampler and TokenBudgetBatchSampler
    return orders


def _short_steps():
    """:mod:`packkit.short_steps`, imported where a step of fewer units than a full one is dealt: an epoch of whole
    steps (``packkit plan`` at one window a step) does not compile it."""
    from . import short_steps  # lazy: the deal of a short step (an epoch's tail, a resume), where there is one
    return short_steps


#: Names lent under their old address (``packkit.sampler.longest_first``), by the room that holds them now.
_LENT = {"stable_argsort": _orders, "longest_first": _orders, "sort_megabatches": _orders,
         "budget_batch_bounds": _orders, "halve_pieces": _short_steps, "split_pieces": _short_steps,
         "_unpickle_pass": _resume}


def __getattr__(name: str):
    """The names of :mod:`packkit.orders`, :mod:`packkit.short_steps` and :mod:`packkit.resume` that lived here,
    lent under their old address (``packkit.sampler.longest_first``; a pass pickled by an older packkit)."""
    if name in _LENT:
        return getattr(_LENT[name](), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _balance():
    """:mod:`packkit.balance`, imported where ``balance="compute"`` deals: its planners (45 KB) are not compiled at the
    start of a sampler that never runs them (``packkit plan``, ``packkit waste``)."""
    from . import balance  # lazy: the cost-target planners and LPT, for balance="compute" only
    return balance


@record
class SamplerOptions:
    """How every sampler cuts an epoch into steps and deals them to the ranks (the module docstring tells
    the whole story). Pass ``options=SamplerOptions(...)``, or any field as a keyword of a sampler
    (``PackedBatchSampler(L, window=W, seed=3, world_size=2, rank=0)``): a new knob is a field here.

    Fields:
        seed: the epoch's order is seeded by ``(seed, epoch)``, the same on every rank.
        rank, world_size: this rank and the ranks (default: the default process group's, else 0 and 1).
        step_batches: micro-batches of a global step, a multiple of ``world_size`` (default ``world_size``).
        drop_last: leave the tail that does not fill a step out (counted) instead of a last, smaller step.
        balance: ``None``, ``"tokens"``, ``"sqlen"`` or ``"compute"``; cost, cp_size: the cost model of
            ``"compute"`` (:func:`packkit.balance.cost_model`).
        media_units: ``(n,)`` the media units (images, tiles, audio clips) each example runs through the
            model's encoder, for ``"compute"`` with a cost model that has ``per_unit`` (a vision-language
            ``model.config``, or ``CostModel(per_unit=...)``): their encoder work joins each example's cost.
        shuffle: the units (and steps) in a seeded random order.
        loss_weighting, loss_lengths: the collators' ``loss_weighting`` (:mod:`packkit.weighting`; a per-example
            column excepted) and each example's loss tokens as the collator counts them (labels other than -100,
            the first label not counted): every rank knows every step, so :meth:`_BatchSampler.step_facts`
            gives ``accumulation_step`` the step's normaliser with no collective.
    """

    seed: int = 0
    rank: int | None = None
    world_size: int | None = None
    step_batches: int | None = None
    drop_last: bool = False
    balance: str | None = None
    cost: object = None
    cp_size: int = 1
    shuffle: bool = True
    media_units: object = None
    loss_weighting: object = None
    loss_lengths: object = None

    @classmethod
    def of(cls, options: "SamplerOptions | None", keywords: dict, who: str) -> "SamplerOptions":
        """``options`` (default: the defaults) with ``keywords`` for its fields; another keyword is the
        ``TypeError`` Python raises for it: ``SamplerOptions.of(None, {"seed": 3}, "S").seed -> 3``."""
        return with_keywords(cls, options, keywords, who)


# ----------------------------------------------------------------------------------------------
# input checking
# ----------------------------------------------------------------------------------------------


def _example_weights(loss_weighting, loss_lengths, lengths: np.ndarray):
    """``(weighting, loss tokens, z)`` of every example (``z_c`` of :mod:`packkit.weighting`, float64), or None
    without a ``loss_weighting``."""
    if loss_weighting is None:
        if loss_lengths is not None:
            raise ArgumentError("{n} is read only with {w}: pass both, or neither", n=arg("loss_lengths"),
                                w=arg("loss_weighting"))
        return None
    from .weighting import resolve  # lazy: 5 dataclasses (3 ms of CPU) that packkit waste and plan do not use
    rule = resolve(loss_weighting)
    if rule.key is not None:
        raise ArgumentError("{w} weighs examples by their {k!r} values, which a sampler does not read: leave the "
                            "sampler's loss_weighting out (accumulation_step sums Z in its collective)",
                            w=arg("loss_weighting", f"Column({rule.key!r})"), k=rule.key)
    if loss_lengths is None:
        raise ArgumentError("{w} on a sampler needs {n}: each example's loss tokens as the collator counts them",
                            w=arg("loss_weighting", rule.name), n=arg("loss_lengths"))
    counts = check_loss_lengths(loss_lengths, lengths)
    return rule, counts, np.asarray(rule.factors(counts)[1], np.float64)


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
    world_size = check_int(world_size, "world_size")
    return check_int(rank, "rank", low=0, high=world_size - 1), world_size


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


def _media_units(units, n: int, balance, cost) -> np.ndarray | None:
    """``media_units`` checked: (n,) int64 counts >= 0, one per example, read by ``balance="compute"`` with a
    cost model that weighs them (else they would change nothing, silently: refused)."""
    if units is None:
        return None
    units = as_lengths(units, name="media_units", low=0)
    if units.size != n:
        raise ValueError(f"media_units has {units.size:,} entries for {n:,} examples: pass one count per example, "
                         "in dataset order")
    if balance != "compute" or not cost.per_unit:
        raise ArgumentError("{m} weigh only under balance='compute' with a cost model that has per_unit (got {b}, "
                            "per_unit={u}): pass cost=model.config (a vision-language config) or "
                            "CostModel(per_unit=...), and balance='compute'; or leave media_units out",
                            m=arg("media_units"), b=arg("balance", balance), u=cost.per_unit)
    units.setflags(write=False)
    return units


class _Lent:
    """Lengths lent to a sampler made for one figure (:func:`packkit.epoch.deal`, for ``packkit plan`` and ``waste``):
    it reads them through a read-only view rather than a copy (the caller does not change them meanwhile)."""

    __slots__ = ("lengths",)

    def __init__(self, lengths: np.ndarray):
        self.lengths = lengths.view()
        self.lengths.setflags(write=False)


def _lengths(lengths, dataset, key: str) -> np.ndarray:
    if lengths is None:
        if dataset is None:
            raise ValueError("pass lengths (one per example) or dataset=...")
        lengths = lengths_from_dataset(dataset, key=key)
    lent = isinstance(lengths, _Lent)
    given = lengths = lengths.lengths if lent else lengths
    lengths = as_lengths(lengths)
    if not lent and isinstance(given, np.ndarray) and np.may_share_memory(lengths, given):
        lengths = lengths.copy()  # the caller's array stays theirs (writable), and the epoch ours (read-only)
    if lengths.size == 0:
        raise ValueError("the dataset is empty: a sampler needs at least one example")
    if dataset is not None and len(dataset) != lengths.size:
        raise ValueError(
            f"lengths has {lengths.size:,} entries but the dataset has {len(dataset):,} examples: "
            "pass one length per example, in dataset order"
        )
    return lengths


# ----------------------------------------------------------------------------------------------
# what an epoch looks like
# ----------------------------------------------------------------------------------------------


@record
class EpochStats:
    """The figures of one epoch, over all ranks.

    Fields:
        epoch, world_size: which epoch, how many ranks.
        steps: batches per rank (the same on every rank).
        accumulation_steps: micro-batches per rank per optimiser step (``step_batches // world_size``).
        examples: distinct examples yielded over all ranks.
        repeated: extra yields of examples already in the epoch (``drop_last=False``, only when a last
            step holds fewer examples than ranks): whole micro-batches dealt so that every rank runs one, which
            weigh 0 under ``step_facts()`` / ``step_repeats()`` (:class:`RepeatWarning`).
        dropped: examples not yielded this epoch (``drop_last=True`` tail, ``overflow="drop"``).
        tokens: real tokens yielded over all ranks (repeats counted; truncated tokens not).
        padded_tokens: tokens after padding: batch size x longest per batch (length-grouped, token
            budget), or windows x W (packed).
        padding_waste: ``1 - tokens / padded_tokens``.
        step_imbalance: ``sum over optimiser steps of the costliest rank / sum of the mean rank, - 1``
            (0: every rank of every step has the same work), cost measured as ``balance`` says (tokens
            if None, the cost model under ``"compute"``).
        compute_imbalance: the same ratio under the cost model, whatever the policy, not less 1
            (:func:`packkit.balance.compute_imbalance`: 1.0 is perfect; a run takes this many times the
            time of a perfectly balanced one). A rank's cost in a step is the sum over its
            micro-batches of that step (accumulation) of ``cost.linear * L + L**2 / cp_size`` (plus
            ``cost.per_unit`` an image with ``media_units``).
        examples_per_step_cv: coefficient of variation (std / mean) of the examples an optimiser step
            holds over all ranks, the last, partial step left out (when there are others): how much
            the policy changed what a step holds (random steps set the reference).
        cut_tokens: tokens past the window of examples longer than it, left out of the epoch
            (``PackedBatchSampler(overflow="truncate")``; 0 otherwise).
        queued, deferred: ``balance="compute"`` with one or two windows per rank only
            (:func:`packkit.balance.pack_to_cost`): long documents held back until a step takes one per
            window, and moves of a document to a later step because it fitted no window of its own (a
            document moved twice counts twice); 0 otherwise.
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
    compute_imbalance: float = 1.0
    examples_per_step_cv: float = 0.0
    accumulation_steps: int = 1
    queued: int = 0
    deferred: int = 0
    cut_tokens: int = 0


@record(eq=False)
class _Sequence:
    """An epoch as a world-size-free sequence of *units* (windows, or batches), ``step`` units a step.

    ``flat``: (n,) int64 example indices; ``ptr``: (units + 1,) int64 CSR offsets of the units. The
    first ``full`` units make full steps; the rest (fewer than ``step``) a last, partial step.
    ``plan``: packed samplers' windows, unit ``i`` = window ``i``.
    """

    flat: np.ndarray
    ptr: np.ndarray
    step: int
    full: int
    plan: Plan | None = None
    dropped: int = 0
    queued: int = 0
    deferred: int = 0

    @property
    def units(self) -> int:
        return int(self.ptr.size - 1)


@record(eq=False)
class Schedule:
    """Batches of every rank from a position on, row-major: batch ``i * world_size + r`` is rank ``r``'s
    ``i``-th (a *row* is one micro-batch on every rank).

    ``flat``: (n,) int64 example indices; ``ptr``: (rows * world_size + 1,) int64 CSR offsets;
    ``step_row``: (steps + 1,) int64, the first row of each optimiser step (relative to this schedule;
    the first may be negative when the pass resumes inside a step); ``step_start``, ``step_span``:
    (steps,) int64 units of the sequence each step covers; ``mask0``: the units of the first step used
    before it was dealt; ``pieces``: (rows * world_size,) int64 units (windows) each batch holds;
    ``repeated``: examples yielded twice (a last step with fewer examples than ranks); ``moved``: the
    one-line notice when step boundaries moved, else ''; ``repeats``: (rows * world_size,) bool, the batches
    that only repeat examples of another batch of their step (dealt so that every rank runs a micro-batch:
    ``step_facts()`` and ``step_repeats()`` give them weight 0, so a step's loss is its unique examples').
    """

    flat: np.ndarray
    ptr: np.ndarray
    world_size: int
    accumulation_steps: int
    step_row: np.ndarray
    step_start: np.ndarray
    step_span: np.ndarray
    mask0: int
    pieces: np.ndarray
    repeated: int
    moved: str
    repeats: np.ndarray

    @property
    def rows(self) -> int:
        return int((self.ptr.size - 1) // self.world_size)

    def batches(self, rank: int) -> list[np.ndarray]:
        """Rank ``rank``'s batches: ``[flat[ptr[i*R + rank]:ptr[i*R + rank + 1]] for each row i]``."""
        R = self.world_size
        return [self.flat[self.ptr[i * R + rank]:self.ptr[i * R + rank + 1]] for i in range(self.rows)]

    @functools.cached_property
    def _steps_held(self) -> np.ndarray:
        """(steps,) bool, the optimiser steps that hold a row here (a resumed first step may not)."""
        return np.diff(np.clip(self.step_row, 0, None)) > 0

    def take(self, values: np.ndarray) -> np.ndarray:
        """``values[flat]``: one value an example read as one an entry (read-only), the last array read remembered
        (the sampler's figures and ``packkit plan``'s read the same lengths through the schedule once; the sums
        and maxima below remember the array they were taken of too)."""
        return self._remembered("take", values, lambda: np.take(values, self.flat))

    def _remembered(self, what: str, values, make):
        """``make()``, remembered (read-only) for the last read-only ``values`` asked ``what`` of, by identity: an
        array that can change is never remembered."""
        memo = self.__dict__.setdefault("_memo", {})
        if what in memo and memo[what][0] is values:
            return memo[what][1]
        out = make()
        if isinstance(values, np.ndarray) and not values.flags.writeable:
            out.setflags(write=False)
            memo[what] = (values, out)
        return out

    def longest(self, values) -> np.ndarray:
        """(batches,) the largest of ``values`` (one per entry of ``flat``) in each batch (none empty)."""
        return self._remembered("longest", values, lambda: np.maximum.reduceat(values, self.ptr[:-1]))

    def per_step(self, values) -> np.ndarray:
        """``(steps, world_size)``: ``values`` (one per entry of ``flat``) summed over each rank's batches of each
        optimiser step held here (the figures of :meth:`_BatchSampler.epoch_stats`, and of ``packkit plan`` and
        ``packkit waste``, which read the schedule a sampler deals)."""
        return self._cells(self._batch_sums(values))

    def _cells(self, per_batch: np.ndarray) -> np.ndarray:
        """``(steps, world_size)``: ``per_batch`` (one per batch) summed over each rank's batches of each step."""
        R = self.world_size
        cells = int(self._steps_held.sum()) * R
        return np.bincount(self._batch_cell, weights=per_batch, minlength=cells).reshape(-1, R)

    def _batch_sums(self, values) -> np.ndarray:
        """(batches,) ``values`` (one per entry of ``flat``) summed over each batch: one ``reduceat`` when no batch
        is empty, then the cells of :meth:`per_step` sum a few thousand batches, not every entry."""
        def make():
            if values.size and (self.ptr[1:] > self.ptr[:-1]).all():
                return np.add.reduceat(values, self.ptr[:-1])
            return batch_sums(values, self.ptr)

        return self._remembered("sums", values, make)

    @functools.cached_property
    def step_ptr(self) -> np.ndarray:
        """(steps + 1,) int64 offsets into ``flat`` of the optimiser steps held here: step ``s`` is
        ``flat[step_ptr[s]:step_ptr[s + 1]]``, every rank's batches of it (rows are row-major)."""
        return self.ptr[np.clip(self.step_row, 0, None)[np.append(self._steps_held, True)] * self.world_size]

    def counts(self) -> np.ndarray:
        """``(steps, world_size)`` entries of each rank's batches of each optimiser step held here (:meth:`per_step`
        of ones, as float64), summed over the batches rather than the entries."""
        return self._cells(self.sizes)

    @functools.cached_property
    def sizes(self) -> np.ndarray:
        """(batches,) int64 entries of each batch (``np.diff(ptr)``, made once: the figures read it three times)."""
        return self.ptr[1:] - self.ptr[:-1]

    def square_sums(self, values: np.ndarray) -> np.ndarray:
        """(batches,) float64 sums of ``values ** 2`` over each batch. The batches of one size at the head (all of a
        length-grouped epoch's but its tail) by ``einsum`` over the integers, with no array of squares (a fresh array
        of every entry); exact, so equal to float64 squares' sums to the bit where ``max ** 2 x size < 2 ** 53``."""
        sizes, b = self.sizes, int(self.sizes[0]) if self.sizes.size else 0
        if not b or values.dtype.kind not in "iu" or not (sizes > 0).all() or int(values.max()) ** 2 * b >= 1 << 53:
            squares = values.astype(np.float64)  # (an empty batch: the prefix sums of them all, as before)
            return self._batch_sums(np.multiply(squares, squares, out=squares))
        k = sizes.size if (sizes == b).all() else int(np.argmax(sizes != b))
        head, rest = values[:k * b].reshape(k, b), values[k * b:].astype(np.float64)
        rest = np.add.reduceat(np.multiply(rest, rest, out=rest), self.ptr[k:-1] - self.ptr[k]) if rest.size else rest
        return np.concatenate((np.einsum("ij,ij->i", head, head).astype(np.float64), rest))

    @functools.cached_property
    def step_entries(self) -> np.ndarray:
        """(steps held,) int64 entries of each optimiser step held here (``np.diff(step_ptr)``, made once)."""
        return self.step_ptr[1:] - self.step_ptr[:-1]

    @functools.cached_property
    def _batch_cell(self) -> np.ndarray:
        """(rows * world_size,) int64, ``step * world_size + rank`` of every batch, made once: each of
        :meth:`per_step`'s sums is one ``bincount`` over the batches (a cell of every entry, and prefix sums over
        them, were a third of ``packkit plan``'s time)."""
        R = self.world_size
        rows = np.diff(np.clip(self.step_row, 0, None))[self._steps_held]  # rows of each step held
        return np.repeat(np.arange(rows.size, dtype=np.int64) * R, rows * R) + np.arange(self.ptr.size - 1) % R

    @property
    def units_per_step(self) -> np.ndarray:
        """(steps,) int64 units (windows, or batches) of each optimiser step held here: a full step has
        ``step_batches x windows_per_batch`` (``step_batches`` batches for the other samplers)."""
        return self.step_span[self._steps_held]


def _end_to_end(parts: list[np.ndarray]) -> np.ndarray:
    """``np.concatenate(parts)``; where the parts lie end to end in one array (the batches of a schedule dealt in
    sequence order, slices of the sequence), a view of it rather than a copy: ``_end_to_end([a[:2], a[2:5]])`` is
    ``a[:5]``."""
    base = parts[0].base if parts[0].base is not None else parts[0]
    if base.ndim != 1 or not base.flags.c_contiguous or base.dtype != parts[0].dtype:
        return np.concatenate(parts)
    start = at = parts[0].__array_interface__["data"][0]
    for p in parts:
        if (p.base is not base and p is not base) or p.ndim != 1 or p.strides != base.strides or \
                p.__array_interface__["data"][0] != at:
            return np.concatenate(parts)
        at += p.nbytes
    first = (start - base.__array_interface__["data"][0]) // base.itemsize
    return base[first:first + (at - start) // base.itemsize]


def _remember(cache: dict, key, value):
    """``cache[key] = value``, the oldest entry forgotten past :data:`CACHED`; returns ``value``."""
    if len(cache) >= CACHED:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


# ----------------------------------------------------------------------------------------------
# the shared machinery: sequences, dealing to ranks, resuming
# ----------------------------------------------------------------------------------------------


class _BatchSampler:
    """Builds the world-size-free sequence of an epoch, deals its steps to the ranks, saves/restores
    the position."""

    _unit_name = "batches"

    def __init__(self, lengths, *, dataset, key, options: SamplerOptions):
        self.lengths = _lengths(lengths, dataset, key)
        self.lengths.setflags(write=False)
        o = options
        self.seed = check_seed(o.seed, allow_none=False)
        self.rank, self.world_size = resolve_rank(o.rank, o.world_size)
        if not isinstance(o.drop_last, bool):
            raise TypeError(f"drop_last must be True or False, got {o.drop_last!r}")
        check_choice(o.balance, "balance", BALANCE)
        self.drop_last, self.balance, self.shuffle = o.drop_last, o.balance, bool(o.shuffle)
        self.cost = cost_model(o.cost, cp_size=o.cp_size)
        self.media_units = _media_units(o.media_units, self.lengths.size, self.balance, self.cost)
        self._weights = _example_weights(o.loss_weighting, o.loss_lengths, self.lengths)
        R = self.world_size
        self.step_batches = R if o.step_batches is None else check_int(o.step_batches, "step_batches")
        if self.step_batches % R:
            lo = max(R, self.step_batches // R * R)
            raise ArgumentError("{sb} is not a multiple of world_size={R}: every rank takes the same number of "
                                "micro-batches a step; pass {fix} (a state saved with another step_batches "
                                "loads)", sb=arg("step_batches", self.step_batches),
                                R=R, fix=arg("step_batches", lo, lo + R))
        self._epoch_num = 0
        self._point = _Point()  # where the next pass starts
        self._loaded = False  # the position was loaded and its pass has not started
        self._active: tuple | None = None  # the pass in progress: (schedule, its start, rows before it, resume.Pass)
        self._offset = 0  # rows of the epoch before the next pass (a resume)
        # the cost-target planner (packkit.balance.PLANNER) of balance="compute" at k <= 2, None where there is none:
        # a state records it, and a run resumed from a state keeps the one it began with
        self._planner = _balance().PLANNER if self._plans_to_cost else None
        self._seq_cache: dict = {}  # (seed, epoch, units a step, planner) -> _Sequence, the last CACHED
        self._sched_cache: dict = {}  # (seed, epoch, _Point) -> Schedule, the last CACHED
        self._stats_cache: tuple | None = None
        self._said_repeats = False  # the RepeatWarning given
        self._sequence(0, self.seed, self._step_units)  # bad input fails here, not at the first step

    # -- subclasses build the sequence ----------------------------------------------------------

    _k = 1  # units per micro-batch
    _splittable = True  # a unit may be split by examples (groups may not)
    _plans_to_cost = False  # builds its windows to a cost target (packkit.balance.pack_to_cost)

    def _sequence_of(self, rng, step: int) -> _Sequence:  # pragma: no cover - abstract
        raise NotImplementedError

    def _config(self) -> dict:
        out = {"drop_last": self.drop_last, "balance": self.balance, "shuffle": self.shuffle,
               "cost": (self.cost.linear, self.cost.cp_size)}
        if self.media_units is not None:  # (a state saved without them keeps its fingerprint)
            out["media"] = (self.cost.per_unit, hashlib.sha1(self.media_units.tobytes()).hexdigest()[:12])
        return out

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches each rank takes per optimiser step: ``step_batches // world_size``."""
        return self.step_batches // self.world_size

    @property
    def _step_units(self) -> int:
        return self.step_batches * self._k

    def _sequence(self, epoch: int, seed: int, step: int) -> _Sequence:
        """The sequence for ``(seed, epoch)`` cut into steps of ``step`` units, cached."""
        key = (seed, epoch, step, self._planner)
        if key not in self._seq_cache:
            _remember(self._seq_cache, key, self._sequence_of(np.random.default_rng((seed, epoch)), step))
        return self._seq_cache[key]

    def _policy_cost(self, lengths: np.ndarray, examples: np.ndarray) -> np.ndarray:
        """Per-example cost for ``balance``: tokens, squared lengths (attention), or the cost model (with the
        media units of ``examples``, the example of each length)."""
        if self.balance == "sqlen":
            return lengths * lengths
        if self.balance == "compute":
            return self.cost.costs(lengths, None if self.media_units is None else self.media_units[examples])
        return lengths

    def _lengths_used(self) -> np.ndarray:
        """(n,) int64 the tokens of each example a batch carries (packed: at most W)."""
        return self.lengths

    def _cut_tokens(self) -> int:
        """Tokens an epoch leaves out of the examples it yields (packed, ``overflow="truncate"``)."""
        return 0

    # -- dealing steps to ranks ------------------------------------------------------------------

    def _deal_full(self, seq: _Sequence, units: np.ndarray, R: int, m: int) -> np.ndarray:
        """Units of full steps ``(steps, S)`` dealt to ``R`` ranks of ``m`` micro-batches, in batch order:
        ``(steps, m, R, k)`` flattened, batch ``b`` = ``k`` consecutive units, row-major (row = step * m + i,
        then rank).

        Under ``"compute"`` each rank gets the ``m * k`` units that :func:`lpt_assign` gives it (its
        micro-batches in sequence order); otherwise unit ``j`` of a step is micro-batch ``j // k``,
        dealt row after row.
        """
        k = self._k
        steps, S = units.shape
        if self.balance == "compute" and R > 1:
            unit_cost = batch_sums(self._example_cost()[seq.flat], seq.ptr)
            rank_of = _balance().lpt_assign(unit_cost[units], R)
            by_rank = np.argsort(rank_of * S + np.arange(S), axis=1, kind="stable")
            units = np.take_along_axis(units, by_rank, axis=1)
            return units.reshape(steps, R, m, k).transpose(0, 2, 1, 3).reshape(-1)
        return units.reshape(-1)

    def _deal_short(self, seq: _Sequence, units: np.ndarray, R: int,
                      m: int) -> tuple[list[np.ndarray], list[int], list[bool]]:
        """A step of fewer units than a full one, row by row (:func:`packkit.short_steps.deal_partial`): batches
        (row-major), units per batch, and whether each batch is a repeat (:attr:`Schedule.repeats`)."""
        return _short_steps().deal_partial(seq.flat, seq.ptr, units, R, m, self._k, splittable=self._splittable)

    def _example_cost(self) -> np.ndarray:
        """(n,) float64 cost of each example under ``cost`` (packed: its first ``W`` tokens), cached."""
        if getattr(self, "_ex_cost", None) is None:
            self._ex_cost = self.cost.costs(self._lengths_used(), self.media_units)
        return self._ex_cost

    def _schedule(self, point: _Point) -> Schedule:
        """The batches of every rank from ``point`` to the end of the epoch, cached."""
        key = (self.seed, self._epoch_num, point)
        if key in self._sched_cache:
            return self._sched_cache[key]
        R, m, k = self.world_size, self.accumulation_steps, self._k
        S = R * m * k
        seq_step = point.seq_step or S
        seq = self._sequence(self._epoch_num, self.seed, seq_step)
        U = seq.units
        parts: list = []  # ("list", batches, pieces) or ("vec", flat, ptr, pieces)
        rows_of: list[int] = []  # rows of each step
        starts: list[int] = []
        spans: list[int] = []
        skip, mask0 = 0, 0
        notes = []

        def add_step(batches, pieces, repeats, start: int, span: int) -> None:  # a step dealt batch by batch
            parts.append(("list", batches, pieces, repeats))
            rows_of.append(len(batches) // R)
            starts.append(start)
            spans.append(span)

        q = min(point.start, U)
        if not point.clean and point.span:  # a loaded position inside a step: packkit.resume deals what is left
            skip, mask0 = _resume().resumed_step(self, seq, point, S, add_step, notes)
            q = point.start + point.span
        if q < U:
            if S != seq_step or q % seq_step:
                notes.append(f"from here on a step is {S} {self._unit_name} ({self.step_batches} micro-batches); "
                             f"the epoch was cut into steps of {seq_step}")
            nfull = (U - q) // S
            if nfull:
                units = np.arange(q, q + nfull * S, dtype=np.int64).reshape(nfull, S)
                order = self._deal_full(seq, units, R, m)
                flat, uptr = select_batches(seq.flat, seq.ptr, order)
                parts.append(("vec", flat, uptr[::k], np.full(order.size // k, k, np.int64)))
                rows_of += [m] * nfull
                starts += list(range(q, q + nfull * S, S))
                spans += [S] * nfull
            if q + nfull * S < U:
                add_step(*self._deal_short(seq, np.arange(q + nfull * S, U, dtype=np.int64), R, m),
                         q + nfull * S, U - q - nfull * S)
        return _remember(self._sched_cache, key, self._assemble(parts, rows_of, starts, spans, skip, mask0,
                                                                "; ".join(notes)))

    def _assemble(self, parts, rows_of, starts, spans, skip, mask0, moved) -> Schedule:
        R = self.world_size
        flats, sizes, pieces, repeats = [], [], [], []
        for part in parts:
            if part[0] == "vec":
                flats.append(part[1])
                sizes.append(np.diff(part[2]))
                pieces.append(part[3])
                repeats.append(np.zeros(part[3].size, bool))
            else:
                flats += part[1]
                sizes.append(np.array([b.size for b in part[1]], np.int64))
                pieces.append(np.asarray(part[2], np.int64))
                repeats.append(np.asarray(part[3], bool))
        flat = _end_to_end(flats) if flats else np.zeros(0, np.int64)
        sizes = np.concatenate(sizes) if sizes else np.zeros(0, np.int64)
        pieces = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
        repeats = np.concatenate(repeats) if repeats else np.zeros(0, bool)
        ptr = lengths_to_offsets(sizes)
        step_row = lengths_to_offsets(np.asarray(rows_of, np.int64)) - skip
        if skip:  # resumed inside the first step: its first rows are done
            cut = int(ptr[skip * R])
            flat, ptr, pieces, repeats = flat[cut:], ptr[skip * R:] - cut, pieces[skip * R:], repeats[skip * R:]
        # repeats are whole pieces inside one row of a split step: count what this schedule yields twice
        repeated = int(flat.size - np.count_nonzero(np.bincount(flat))) if repeats.any() and flat.size else 0
        repeats.setflags(write=False)
        return Schedule(flat=flat, ptr=ptr, world_size=R, accumulation_steps=self.accumulation_steps,
                        step_row=step_row, step_start=np.asarray(starts, np.int64),
                        step_span=np.asarray(spans, np.int64), mask0=mask0, pieces=pieces,
                        repeated=int(repeated), moved=moved, repeats=repeats)

    # -- the figures --------------------------------------------------------------------------

    def _padded(self, sched: Schedule, lens: np.ndarray) -> int:
        """Tokens after padding: batch size x longest (packed samplers: windows x W); ``lens``: the lengths used of
        ``sched.flat``."""
        if not lens.size:
            return 0
        longest = sched.longest(lens) if sched.flat.size else np.zeros(0, np.int64)
        return int((sched.sizes * longest).sum())

    def _stats_of(self, sched: Schedule, seq: _Sequence) -> EpochStats:
        R = self.world_size
        lens = sched.take(self._lengths_used())
        tokens = int(lens.sum())
        padded = self._padded(sched, lens)
        # per optimiser step and rank, the sum over the rank's rows of that step: of the lengths (remembered, as
        # packkit plan reads them), their squares, and the cost model over both (not a cost per entry, then summed)
        tokens_at = sched.per_step(lens)
        squares_at = sched._cells(sched.square_sums(lens))
        compute = self.cost.of_sums(tokens_at, squares_at, None if self.media_units is None else
                                    sched.per_step(self.media_units[sched.flat]))
        policy = {"compute": compute, "sqlen": squares_at}.get(self.balance, tokens_at)
        per_step_examples = sched.counts().sum(axis=1)
        full = sched.units_per_step == self.world_size * self.accumulation_steps * self._k
        cv = variation(per_step_examples[full] if full.sum() >= 2 else per_step_examples)
        return EpochStats(
            epoch=self._epoch_num, world_size=R, steps=sched.rows, examples=int(self.lengths.size - seq.dropped),
            repeated=sched.repeated, dropped=int(seq.dropped), tokens=tokens, padded_tokens=padded,
            padding_waste=1.0 - tokens / padded if padded else 0.0,
            step_imbalance=compute_imbalance(policy) - 1.0, compute_imbalance=compute_imbalance(compute),
            examples_per_step_cv=cv, accumulation_steps=self.accumulation_steps,
            queued=int(seq.queued), deferred=int(seq.deferred),
            cut_tokens=self._cut_tokens())

    # -- the public protocol ----------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch_num

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch``: the order is a function of ``(seed, epoch)`` only, the same on every rank.

        Setting the epoch that :meth:`load_state_dict` restored keeps the resume position; another epoch
        before the resumed pass starts drops it, which trains an epoch again or skips the rest of one: a
        :class:`ResumeWarning` says so (start the loop at ``sampler.epoch``).
        """
        epoch = check_int(epoch, "epoch", low=0)
        if epoch != self._epoch_num:
            if self._loaded and (self._offset or not self._point.clean):
                warnings.warn(ResumeWarning(
                    f"{type(self).__name__}.set_epoch({epoch}) drops the position loaded for epoch "
                    f"{self._epoch_num} ({self._offset} batches done): start the loop at the loaded epoch, "
                    "for epoch in range(sampler.epoch, epochs)"), stacklevel=2)
            self._point, self._offset, self._active = _Point(), 0, None
        self._epoch_num, self._loaded = int(epoch), False

    def schedule(self) -> Schedule:
        """The batches of every rank that the next pass yields (all ranks, row-major): see :class:`Schedule`."""
        return self._schedule(self._point)

    @property
    def batches_per_epoch(self) -> int:
        """Batches of a whole epoch on this rank (the same on every rank), without a resume."""
        return self._schedule(_Point()).rows

    def __len__(self) -> int:
        """Batches the next pass yields: the epoch, less the batches already yielded before a resume."""
        return self.schedule().rows

    def epoch_stats(self) -> EpochStats:
        """Figures of the current epoch over all ranks, as this run deals it: see :class:`EpochStats`."""
        key = (self.seed, self._epoch_num)
        if self._stats_cache is None or self._stats_cache[0] != key:
            sched = self._schedule(_Point())
            seq = self._sequence(self._epoch_num, self.seed, self._step_units)
            self._stats_cache = (key, self._stats_of(sched, seq))
        return self._stats_cache[1]

    def __iter__(self):
        """A pass over the rest of the epoch, started by its first ``next()``: a DataLoader with workers calls
        ``iter()`` on its batch sampler twice and uses the second, so making an iterator spends nothing (it
        ends the pass before it: the state is where the new one starts)."""
        self._active = None
        resume = _resume()
        return resume.Pass(self, resume.asking_loader())

    def _fingerprint(self) -> str:
        """A hash of the sampler's class, options and lengths (fixed at build, so computed once)."""
        if getattr(self, "_fingerprint_cache", None) is None:
            h = hashlib.sha1(type(self).__name__.encode())
            h.update(repr(sorted(self._config().items())).encode())
            h.update(self.lengths.tobytes())
            self._fingerprint_cache = h.hexdigest()
        return self._fingerprint_cache

    def state_dict(self, *, batches_consumed: int | None = None) -> dict:
        """Where the run is, the same dict on every rank: ``{"epoch", "seed", "batches_yielded", ...}``.

        The position is global (units of the world-size-free sequence and the step in progress), so any
        world size can load it. The batches done are those the training loop received from the DataLoader
        iterating this sampler (its workers' prefetched batches are not done); ``batches_consumed``
        overrides that count: this epoch's batches the loop actually used.
        """
        return _resume().state_dict(self, batches_consumed, sys._getframe(1).f_globals.get("__name__", ""))

    @property
    def plans_steps(self) -> bool:
        """Whether :meth:`step_facts` knows every step's normaliser (``loss_weighting`` and ``loss_lengths``
        given): :class:`packkit.loss.WeightedLossMixin` then divides with no collective."""
        return self._weights is not None

    def step_facts(self, *, batches_consumed: int | None = None) -> StepFacts:
        """The optimiser step of the last batch the training loop received, as the plan knows it (every
        micro-batch of every rank): ``accumulation_step(micro_batches, facts=sampler.step_facts())`` normalises
        it with no collective. Needs ``loss_weighting`` and ``loss_lengths``. The batches received are counted
        as :meth:`state_dict` counts them (``batches_consumed``: this epoch's, where the loader cannot be asked).
        A pass resumed inside a step under the same deal takes the whole step, the rows done before included.
        The step's counts and ``Z`` are its unique examples': a micro-batch that repeats examples so that every
        rank runs one (:meth:`step_repeats`) is left out of them, and ``accumulation_step`` weighs it 0."""
        return _resume().step_facts(self, batches_consumed, sys._getframe(1).f_globals.get("__name__", ""))

    def step_repeats(self, *, batches_consumed: int | None = None) -> tuple:
        """This rank's micro-batches of the optimiser step of the last batch the loop received (counted as
        :meth:`step_facts` counts), True where one only repeats examples of another rank's: a step with fewer
        examples than ranks deals the ranks left without one a repeat, so that every rank runs a forward and
        backward (DDP). ``accumulation_step(micro_batches, repeats=sampler.step_repeats())`` weighs them 0 and
        leaves them out of the step's counts and ``Z`` (``facts=sampler.step_facts()`` carries the same), so the
        step's loss is its unique examples' on any world size. Needs no ``loss_weighting``: ``(False, False)``
        for a step of two micro-batches on this rank with no repeat."""
        _, _, _, mine = _resume().received_step(self, batches_consumed, sys._getframe(1).f_globals.get("__name__", ""),
                                                "step_repeats")
        return tuple(r for _, r in mine)

    def merge_state_dicts(self, states) -> dict:
        """One state from the per-rank states of a run: identical ones (this version) pass through;
        per-rank ones of an older packkit (each rank's own ``batches_yielded``) become the global position,
        the batches some ranks had taken beyond the others counted as used. Every rank must be there."""
        return _resume().merge_state_dicts(self, states)

    def load_state_dict(self, state: dict) -> None:
        """Restore the epoch and position: the next pass yields exactly the batches not yet yielded, on any
        world size (where the step boundaries move, a :class:`ResumeWarning` says so).

        A state is input (:mod:`packkit.states`): its version must be one this packkit writes (2; a
        state without one is an older packkit's, one rank's ``batches_yielded`` read as every rank's:
        give :meth:`merge_state_dicts` all ranks' states when they may differ), and every field is
        checked (type, range, and against this sampler: its class, lengths and options through the
        fingerprint, its seed, the epoch's length) before anything is assigned, so a refused state leaves
        the sampler as it was. The error is one line naming the field: ``sampler state field 'seed': ...``.
        """
        _resume().load_state_dict(self, state)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return (f"{type(self).__name__}({self.lengths.size:,} examples, {opts}, seed={self.seed}, "
                f"epoch={self._epoch_num}, rank={self.rank}/{self.world_size}, batches={len(self)})")


# ----------------------------------------------------------------------------------------------
# length-grouped batches (the padded fallback)
# ----------------------------------------------------------------------------------------------


class LengthGroupedSampler(_BatchSampler):
    """Batches of ``batch_size`` examples of similar length, in random order.

    Each epoch: a seeded permutation, cut into megabatches of ``megabatch_mult`` steps
    (``megabatch_mult x batch_size x step_batches`` examples), each sorted longest first; consecutive
    runs of ``batch_size`` form batches, runs of ``step_batches`` batches form steps, and steps are
    shuffled. ``longest_first`` puts the step holding the longest example first, so an out-of-memory
    error shows at step one. The last step holds what is left, in batches of at most ``batch_size``.

    Args:
        lengths: (num_examples,) ints >= 1, or None with ``dataset=`` (read from ``dataset[i][key]``).
        batch_size: examples per batch on each rank.
        megabatch_mult: steps per megabatch; None: min(50, steps // 4), as Hugging Face's sampler.
        options: a :class:`SamplerOptions` (seed, rank, world_size, step_batches, drop_last, balance, cost,
            cp_size, shuffle: see the module docstring), or any of its fields as a keyword.
        dataset: optional; checked against ``lengths``.
    """

    def __init__(self, lengths=None, *, batch_size: int, megabatch_mult: int | None = None,
                 longest_first: bool = False, dataset=None, key: str = "input_ids",
                 options: SamplerOptions | None = None, **option_keywords):
        self.batch_size = check_int(batch_size, "batch_size")
        self.megabatch_mult = None if megabatch_mult is None else check_int(megabatch_mult, "megabatch_mult")
        self.longest_first = bool(longest_first)
        super().__init__(lengths, dataset=dataset, key=key,
                         options=SamplerOptions.of(options, option_keywords, type(self).__name__))

    def _config(self):
        return {"batch_size": self.batch_size, "megabatch_mult": self.megabatch_mult,
                "longest_first": self.longest_first, **super()._config()}

    def _sequence_of(self, rng, step: int) -> _Sequence:
        return _Sequence(step=step, **_orders().length_grouped(self, rng, step))


# ----------------------------------------------------------------------------------------------
# token budgets
# ----------------------------------------------------------------------------------------------


class TokenBudgetBatchSampler(_BatchSampler):
    """Batches of variable size whose padded size (batch size x longest) is at most ``max_tokens``.

    Each epoch: a seeded permutation cut into megabatches of ``megabatch_size`` examples, each sorted
    longest first and cut greedily into batches (a batch takes ``max_tokens // its longest`` examples,
    at most ``max_batch_size``). Runs of ``step_batches`` batches form steps, shuffled; the batches that
    do not fill a step (a random few) make the last step, split in halves where there are fewer than
    ranks (``drop_last=False``), or are dropped (``drop_last=True``). ``balance="compute"`` deals each
    step's batches to the ranks by their cost under ``cost`` (a number, a CostModel or a model config).

    Args:
        lengths: (num_examples,) ints >= 1 (each at most ``max_tokens``), or None with ``dataset=``.
        max_tokens: padded tokens per batch on each rank.
        max_batch_size: optional cap on examples per batch.
        megabatch_size: examples per sorted megabatch; None: about 50 steps' worth.
        options: a :class:`SamplerOptions` (seed, ranks, steps, balance), or any of its fields as a keyword.
    """

    def __init__(self, lengths=None, *, max_tokens: int, max_batch_size: int | None = None,
                 megabatch_size: int | None = None, longest_first: bool = False, dataset=None,
                 key: str = "input_ids", options: SamplerOptions | None = None, **option_keywords):
        self.max_tokens = check_int(max_tokens, "max_tokens")
        self.max_batch_size = None if max_batch_size is None else check_int(max_batch_size, "max_batch_size")
        self.megabatch_size = None if megabatch_size is None else check_int(megabatch_size, "megabatch_size")
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
        super().__init__(lengths, dataset=dataset, key=key,
                         options=SamplerOptions.of(options, option_keywords, type(self).__name__))

    def _config(self):
        return {"max_tokens": self.max_tokens, "max_batch_size": self.max_batch_size,
                "megabatch_size": self.megabatch_size, "longest_first": self.longest_first,
                **super()._config()}

    def _sequence_of(self, rng, step: int) -> _Sequence:
        return _Sequence(step=step, **_orders().token_budget(self, rng, step))


# ----------------------------------------------------------------------------------------------
# packed windows
# ----------------------------------------------------------------------------------------------


class PackedBatchSampler(_BatchSampler):
    """``windows_per_batch`` windows of ``window`` tokens per batch, planned by the packing engine.

    Each epoch: :func:`packkit.binpack.pack` over the whole dataset (``"bfd"``: best fit, the fewest
    windows; ``"shuffle_ff"``: first fit in a seeded random order, windows not grouped by length),
    then the windows in a seeded random order (``plan.shuffled``), ``step_batches x windows_per_batch``
    a step. A batch lists the example indices of its windows, window after window, so
    ``FixedWindowCollator(window=W, strategy="next_fit", num_windows=k)`` packs them back into at most
    ``k`` windows. With ``drop_last=False`` the windows left over after the last full step make a last
    step (a batch may hold fewer windows; fewer windows than ranks are split by examples).

    ``balance="compute"``: each step's windows go to the ranks that balance the cost model
    (:func:`packkit.balance.lpt_assign`); with one or two windows per batch (``k <= 2``) the windows
    themselves are built step by step to a cost target (:func:`packkit.balance.pack_to_cost`; long
    documents queued, counted in ``epoch_stats().queued``).

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
        options: a :class:`SamplerOptions` (seed, ranks, steps, balance), or any of its fields as a keyword.
    """

    _unit_name = "windows"

    def __init__(self, lengths=None, *, window: int, windows_per_batch: int = 1, strategy: str = "bfd",
                 overflow: str = "error", dataset=None, key: str = "input_ids", groups=None, group_sizes=None,
                 options: SamplerOptions | None = None, **option_keywords):
        self.window = check_window(window)
        self.windows_per_batch = check_int(windows_per_batch, "windows_per_batch")
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
        super().__init__(lengths, dataset=dataset, key=key,
                         options=SamplerOptions.of(options, option_keywords, type(self).__name__))

    @property
    def _k(self) -> int:
        return self.windows_per_batch

    @property
    def _splittable(self) -> bool:
        return all(v is None for v in self._groups.values())

    @property
    def _plans_to_cost(self) -> bool:
        return self.balance == "compute" and self.windows_per_batch <= 2 and self._splittable

    def _config(self):
        groups = {k: hashlib.sha1(np.asarray(v).tobytes()).hexdigest() for k, v in self._groups.items()
                  if v is not None}
        return {"window": self.window, "windows_per_batch": self.windows_per_batch,
                "strategy": self.strategy, "overflow": self.overflow, **groups, **super()._config()}

    def _lengths_used(self) -> np.ndarray:
        """(n,) the tokens a window holds of each example, read-only and made once: the lengths themselves when none
        is past ``W`` (so the figures, ``packkit plan``'s and ``waste``'s read them through the schedule once)."""
        used = self.__dict__.get("_used")
        if used is None:
            used = self.lengths if int(self.lengths.max()) <= self.window else np.minimum(self.lengths, self.window)
            used.setflags(write=False)
            self._used = used
        return used

    def _cut_tokens(self) -> int:
        return int((self.lengths - self._lengths_used()).sum()) if self.overflow == "truncate" else 0

    def _padded(self, sched: Schedule, lens: np.ndarray) -> int:
        return int(sched.pieces.sum()) * self.window

    def _plan(self, rng) -> Plan:
        if self.overflow == "error" and self._splittable:  # the fixes a batch sampler offers (no "split")
            err = overflow_error(self.lengths, self.window, fixes=("truncate", "drop"),
                                 why=" (and the same overflow to the collator)")
            if err is not None:
                raise err
        if self.strategy == "shuffle_ff":  # a new random order each epoch
            return pack(self.lengths, window=self.window, strategy="shuffle_ff", overflow=self.overflow,
                        seed=int(rng.integers(1 << 62)), **self._groups)
        if self._plan_cache is None:  # best/first fit decreasing do not depend on the seed: plan once
            self._plan_cache = pack(self.lengths, window=self.window, strategy=self.strategy,
                                    overflow=self.overflow, **self._groups)
        return self._plan_cache

    def plan(self) -> Plan:
        """The windows of the current epoch in sequence order (steps of ``step_batches x k`` windows,
        then the last, partial step; the same for every world size with this ``step_batches``)."""
        return self._sequence(self._epoch_num, self.seed, self._point.seq_step or self._step_units).plan

    def _sequence_of(self, rng, step: int) -> _Sequence:
        k = self.windows_per_batch
        plan = self._plan(rng)
        if self._plans_to_cost:
            # windows built step by step to a cost target (groups keep their windows: they take the LPT deal)
            return _Sequence(step=step, **_balance().sequence_to_cost(self, plan, rng, step))
        nw = plan.num_windows
        # the windows in a seeded random order (Plan.shuffled's), arranged in steps: both in one selection
        shuffled = plan.shuffle_order(int(rng.integers(1 << 62))) if self.shuffle else np.arange(nw, dtype=np.int64)
        full = nw // step * step
        if full == 0 and self.drop_last:
            raise ValueError(
                f"the plan has {nw} windows, fewer than one step of step_batches x windows_per_batch = "
                f"{step}: pass drop_last=False or fewer windows_per_batch"
            )
        balance = self.balance in ("tokens", "sqlen")  # the windows' costs order the steps only then
        win_cost = (batch_sums(self._policy_cost(plan.seg_length, plan.seg_example), plan.window_ptr)[shuffled]
                    if balance else np.zeros(nw))
        bptr = np.arange(0, full + 1, k, dtype=np.int64)  # micro-batches of k windows, over windows
        arrangement = arrange_steps(batch_sums(win_cost, bptr), step // k, rng, shuffle=self.shuffle, balance=balance)
        wins, _ = select_batches(np.arange(nw, dtype=np.int64), bptr, arrangement)
        dropped = int(plan.dropped_examples.size)
        if full < nw and self.drop_last:
            dropped += int(plan.segments_per_window[shuffled[full:]].sum())
        else:
            wins = np.concatenate((wins, np.arange(full, nw, dtype=np.int64)))
        sel = plan.select(shuffled[wins])
        return _Sequence(flat=sel.seg_example, ptr=sel.window_ptr, step=step, full=full, plan=sel,
                         dropped=dropped)

class _GivenPlan(PackedBatchSampler):
    """A :class:`~packkit.sampler.PackedBatchSampler` dealing windows planned already (a plan given to
    :func:`plan_budget`, next fit in order, the streaming packer): every segment is an example of its own."""

    def __init__(self, plan: Plan, **kwargs):
        self._given = windows_plan(plan.seg_length, plan.window_ptr, window=plan.window, strategy=plan.strategy)
        super().__init__(plan.seg_length, window=plan.window, **kwargs)

    def _plan(self, rng) -> Plan:
        return self._given
