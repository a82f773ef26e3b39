"""One epoch, one order: the pieces a sampler deals and its schedule, the one place ``packkit plan``
(:func:`packkit.budget.plan_budget`) and ``packkit waste`` (:func:`packkit.waste.measure_waste`) cut an epoch into
steps, so that their figures are those of the schedule a sampler deals, whatever its ``balance``.

:class:`Lengths` (example lengths and loss tokens, as the door in reads them; :func:`read_lengths_object`) ->
:func:`packed_units` / :func:`padded_units` (the overflow policy's pieces or whole examples, CP-padded, with their
loss tokens: :class:`Units`) -> :func:`deal` (the sampler, rank 0) -> :class:`Dealt` (its schedule summed per
optimiser step). Nothing here reads a file or prints a figure.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from .binpack import Plan, apply_overflow, as_lengths, check_overflow, pack
from .errors import DataError, Message, arg
from .records import record
from .length_rules import check_loss_lengths
from .segments import lengths_to_offsets, piece_loss_tokens

__all__ = ["Dealt", "Lengths", "Units", "deal", "loss_of", "none_left", "packed_units", "padded_units",
           "read_lengths_object", "trains_on_nothing"]


@record
class Lengths:
    """Example lengths and where they came from.

    Fields:
        lengths: (num_examples,) int64, every entry >= 1
        source:  a short description, e.g. ``"data.jsonl, column 'input_ids'"``
        unit:    ``"tokens"``, or ``"bytes"`` when the byte-level tokenizer counted them
        loss_lengths: (num_examples,) int64 loss-bearing tokens of each example, from ``labels`` or a loss mask
                 (a chat template writes one), or None when the data has neither
        targets: (sum(lengths),) bool, where the loss is taken, the examples end to end
                 (:func:`packkit.listcolumns.loss_targets`; what counts the loss tokens of the overflow policy's
                 pieces), or None with ``loss_lengths``
    """

    lengths: np.ndarray
    source: str
    unit: str = "tokens"
    loss_lengths: np.ndarray | None = None
    targets: np.ndarray | None = None


def read_lengths_object(data) -> Lengths:
    """``data``, at least one example, as a :class:`Lengths`: one as it is (its loss counts checked), the lengths of
    a :class:`~packkit.binpack.Plan`, or an array of lengths (no loss counts: every token but a piece's first).
    ``read_lengths_object([3, 4]).lengths -> [3, 4]``."""
    lengths = as_lengths(data.lengths if isinstance(data, (Lengths, Plan)) else data)
    if lengths.size == 0:
        raise ValueError("lengths is empty: a plan needs at least one example")
    if not isinstance(data, Lengths):
        return Lengths(lengths, "lengths")
    if data.targets is not None and np.shape(data.targets) != (int(lengths.sum()),):
        raise ValueError(f"targets must be one bool per token ({int(lengths.sum()):,}), got shape "
                         f"{np.shape(data.targets)}")
    loss = None if data.loss_lengths is None else check_loss_lengths(data.loss_lengths, lengths)
    return dataclasses.replace(data, lengths=lengths, loss_lengths=loss)


def loss_of(data: Lengths, example=None, start=None, length=None) -> np.ndarray:
    """(pieces,) int64 loss tokens of pieces of ``data``'s examples once packed
    (:func:`packkit.segments.piece_loss_tokens`); no pieces given: the examples whole."""
    length = data.lengths if length is None else length
    if example is None:
        example, start = np.arange(length.size), np.zeros(length.size, np.int64)
    return piece_loss_tokens(example, start, length, offsets=lengths_to_offsets(data.lengths), targets=data.targets,
                             loss_lengths=data.loss_lengths)


def deal(lengths, *, per_rank: int, accumulation_steps: int = 1, world_size: int = 1, window: int | None = None,
         strategy: str = "bfd", balance: str | None = None, seed: int = 0, drop_last: bool = False,
         cp_size: int = 1, shuffle: bool = True):
    """The sampler (rank 0 of ``world_size``) that deals an epoch of ``lengths``: a
    :class:`~packkit.sampler.PackedBatchSampler` with ``window`` (``per_rank`` windows a batch; every length at most
    ``window``; ``strategy="next_fit"``, which no sampler plans, planned here and dealt as given), a given
    :class:`~packkit.binpack.Plan`'s windows (each segment an example of its own), else a
    :class:`~packkit.sampler.LengthGroupedSampler` (``per_rank`` examples a batch). ``drop_last`` with no full step:
    the sampler without it (the caller counts no step). An array of lengths is lent, not copied: leave it unchanged
    while the sampler is in use. ``deal([5, 3, 4, 2], per_rank=1, window=8).plan().num_windows -> 2``.
    """
    from .sampler import LengthGroupedSampler, PackedBatchSampler, _GivenPlan, _Lent  # lazy: reading deals none

    kw = dict(world_size=world_size, rank=0, step_batches=world_size * accumulation_steps, balance=balance,
              cp_size=cp_size, seed=seed, shuffle=shuffle)
    if window is not None and strategy == "next_fit" and not isinstance(lengths, Plan):  # planned here, dealt as given
        lengths = pack(lengths, window=window, strategy=strategy)
    elif isinstance(lengths, np.ndarray):  # (the sampler lives for one figure: a view of them, not a copy)
        lengths = _Lent(lengths)
    for last in (True, False) if drop_last else (False,):
        try:
            if isinstance(lengths, Plan):
                return _GivenPlan(lengths, windows_per_batch=per_rank, drop_last=last, **kw)
            if window is not None:
                return PackedBatchSampler(lengths, window=window, windows_per_batch=per_rank, strategy=strategy,
                                          drop_last=last, **kw)
            return LengthGroupedSampler(lengths, batch_size=per_rank, drop_last=last, **kw)
        except ValueError:
            if not last:
                raise


@record
class Dealt:
    """An epoch as ``sampler`` deals it: its ``schedule``, ``full`` steps (``drop_last``: only those are steps) and
    ``stats`` (:meth:`~packkit.sampler.PackedBatchSampler.epoch_stats`)."""

    sampler: object
    schedule: object
    full: np.ndarray
    drop_last: bool

    @classmethod
    def of(cls, sampler, *, drop_last: bool = False) -> "Dealt":
        sched = sampler.schedule()
        if hasattr(sampler, "windows_per_batch"):  # a PackedBatchSampler: a full step is every window of it
            full = sched.units_per_step == sampler.step_batches * sampler.windows_per_batch
        else:  # every batch of it whole (the last batch of a dataset may be short)
            full = sched.step_entries == sampler.step_batches * sampler.batch_size
        return cls(sampler, sched, full, drop_last)

    @property
    def stats(self):
        if self.drop_last and not self.sampler.drop_last:  # no full step: none dealt
            return dataclasses.replace(self.sampler.epoch_stats(), steps=0, compute_imbalance=1.0,
                                       examples_per_step_cv=0.0)
        return self.sampler.epoch_stats()

    @property
    def steps(self) -> int:
        return int(self.full.sum()) if self.drop_last else int(self.full.size)

    def per_step(self, sums: np.ndarray, *, full_only: bool = False) -> np.ndarray:
        """:meth:`sums` over the steps dealt; ``full_only``: the full ones (the one partial step when there is none)."""
        if full_only:
            return sums[self.full] if self.full.any() else sums
        return sums[self.full] if self.drop_last else sums

    def sums(self, values, *, taken: bool = False) -> np.ndarray:
        """(steps held,) ``values`` summed over every rank of each step: one per example the sampler deals, or
        (``taken``) one per entry of the schedule, read through it already."""
        from .sampler import batch_sums  # lazy: what reads lengths deals none

        sched = self.schedule
        if taken:  # the batches' sums (remembered: the sampler's figures took them already), then each step's
            return sched.per_step(values).sum(axis=1)
        return batch_sums(np.asarray(values)[sched.flat], sched.step_ptr)

    def tokens(self, units: "Units") -> np.ndarray:
        """``units.tokens``, one per entry of the schedule (read-only); the lengths the sampler read itself where
        it was given them (no CP padding, no plan given), so that its figures and the report share one gather."""
        own = units.given is None and units.planned is units.tokens
        return self.schedule.take(self.sampler._lengths_used() if own else units.tokens)

    def loss_free(self, unit_loss, values=None, *, sums: np.ndarray | None = None) -> tuple[int, int]:
        """``(units, steps)`` with no loss token: ``unit_loss`` per unit (window or example; or their count, an
        int), ``values`` the loss per example dealt (``sums``: its :meth:`sums`, if taken)."""
        free = unit_loss if isinstance(unit_loss, int) else int(np.count_nonzero(np.asarray(unit_loss) == 0))
        return free, int((self.per_step(self.sums(values) if sums is None else sums) == 0).sum())

    def examples(self, first: np.ndarray | None) -> np.ndarray:
        """(steps held,) examples in each step: its entries less the pieces that do not start their example
        (``first`` False; None: none), found where they fall."""
        entries = self.schedule.step_entries
        if first is None or first.all():
            return entries
        at = np.flatnonzero(~np.asarray(first, bool)[self.schedule.flat])
        return entries - np.bincount(np.searchsorted(self.schedule.step_ptr, at, side="right") - 1,
                                     minlength=entries.size)


@record
class Units:
    """What a sampler deals for ``packkit plan`` and ``waste``, one entry per example it deals (a piece when packed):
    ``planned`` lengths (CP-padded), ``tokens``, ``first`` (True where a piece starts its example; None: every
    one), ``counted`` loss tokens (None: every token but a piece's first, :attr:`loss` made when read); ``free``
    units without a loss token, ``dropped`` / ``dropped_tokens`` those ``drop_loss_free`` left out; ``given``: the
    plan dealt as given; ``overflow`` and its counts; ``row_round``: padded rows' multiple."""

    planned: np.ndarray
    tokens: np.ndarray
    first: np.ndarray | None
    counted: np.ndarray | None
    free: int
    dropped: int = 0
    dropped_tokens: int = 0
    given: Plan | None = None
    overflow: str | None = None
    overflow_examples: int = 0
    cut_tokens: int = 0
    row_round: int = 1

    @functools.cached_property
    def loss(self) -> np.ndarray:
        """(units,) int64 loss tokens (made once: ``plan`` reads only their sum and count, :meth:`loss_sum`)."""
        return self.counted if self.counted is not None else np.maximum(np.subtract(self.tokens, 1), 0)

    @property
    def free_left(self) -> int:
        """Units dealt with no loss token."""
        return self.free - self.dropped

    @functools.cached_property
    def total(self) -> int:
        return int(self.tokens.sum())

    def loss_sum(self) -> int:
        """Loss tokens of every unit, without :attr:`loss`'s array where no loss counts were given."""
        return int(self.counted.sum()) if self.counted is not None else self.total - int(np.count_nonzero(self.tokens))

    def keep(self, keep: np.ndarray) -> "Units":
        """The units where ``keep`` (``drop_loss_free``): none left is the error naming it."""
        if not keep.any():
            raise none_left()
        tokens = self.tokens[keep]
        return dataclasses.replace(self, planned=tokens if self.planned is self.tokens else self.planned[keep],
                                   tokens=tokens, first=None if self.first is None else self.first[keep],
                                   counted=None if self.counted is None else self.counted[keep],
                                   dropped=int((~keep).sum()), dropped_tokens=int(self.tokens[~keep].sum()),
                                   given=None if self.given is None else self.given.keep_segments(keep))


def none_left(where: str = "") -> DataError:
    """The refusal when ``drop_loss_free`` leaves out every piece; ``where`` names the input (`` of 'a.jsonl'``)."""
    return DataError("no piece{where} holds a loss token, and {drop} left every one out", where=where,
                     drop=arg("drop_loss_free", True))


def trains_on_nothing(*, dropped=(0, 0), pieces=(0, 0), rows=(0, 0), steps=None, what: str = "windows",
                      unit: str = "tokens", label: str = "", window: bool = True) -> list:
    """What trains on nothing and its fix, one :class:`~packkit.errors.Message` a fact whose count is not 0, each
    caller saying it in its medium (a line of ``waste`` or ``pack``, ``pack_dataset``'s log, ``plan``'s row or advice).
    Each fact is a pair: ``dropped``, the pieces ``drop_loss_free`` left out and their ``unit``\\ s; else ``pieces``
    with no loss token, and all; ``rows`` (``what``, after ``label``) and ``steps`` (None: not known) with none, and
    all, where a larger window helps too (``window``). ``trains_on_nothing(dropped=(8, 156))`` -> ``[Message(
    'drop_loss_free=True left out 8 pieces with no loss token (156 tokens)')]``."""
    said, f = [], {"drop": arg("drop_loss_free", True), "w": arg("window"), "unit": unit, "what": what,
                   "steps": steps, "label": label and f"{label}: "}
    if dropped[0]:
        said.append(Message("{drop} left out {n[0]:,} pieces with no loss token ({n[1]:,} {unit})", n=dropped, **f))
    elif pieces[0]:
        said.append(Message("{n[0]:,} of {n[1]:,} pieces hold no loss token (they train on nothing); pass {drop} to "
                            "leave them out", n=pieces, **f))
    if rows[0]:
        of_steps = " and {steps[0]:,} of {steps[1]:,} steps" if steps else ""
        said.append(Message("{label}{n[0]:,} of {n[1]:,} {what}" + of_steps + " hold no loss token (they train on "
                            "nothing; a step of them has loss 0); pass {drop}" + (", or raise {w}" if window else ""),
                            n=rows, **f))
    return said


def packed_units(data: Lengths, given: Plan | None = None, *, window: int, overflow: str, doc_multiple: int = 1,
                 drop_loss_free: bool = False) -> Units:
    """The pieces a packed epoch deals: the overflow policy's (or a given plan's segments), CP-padded to
    ``doc_multiple`` (:func:`packkit.cp_plan.cp_multiples`), with the loss tokens that train once packed (one count
    for waste, plan and pack). ``packed_units(Lengths(np.array([5]), "x"), window=4, overflow="split").tokens
    -> [4, 1]``."""
    if given is not None:
        example, start, length = given.seg_example, given.seg_start, given.seg_length
        over, cut, overflow = given.overflow_examples.size, given.cut_tokens, given.overflow
    else:
        pieces = apply_overflow(data.lengths, window=window, overflow=check_overflow(overflow), in_order=True)
        example, start, length = pieces.example, pieces.start, pieces.length
        over, cut = pieces.overflow_examples.size, pieces.cut_tokens
    planned = length if doc_multiple == 1 else -(-length // doc_multiple) * doc_multiple  # (the same: Dealt.tokens)
    units = Units(planned, length, start == 0, *_counted(data, example, start, length), given=given,
                  overflow=overflow, overflow_examples=int(over), cut_tokens=int(cut))
    units = units.keep(units.loss > 0) if drop_loss_free and units.free else units
    if units.tokens.size == 0:
        raise DataError("every example is longer than {window} and {drop} dropped them all; raise {w} or pass {fix}",
                        window=arg("window", window), drop=arg("overflow", "drop"), w=arg("window"),
                        fix=arg("overflow", "split", "truncate"))
    return units


def padded_units(data: Lengths, *, row_round: int, drop_loss_free: bool) -> Units:
    """The examples a padded epoch deals, whole."""
    units = Units(data.lengths, data.lengths, None, *_counted(data, length=data.lengths), row_round=row_round)
    return units.keep(units.loss > 0) if drop_loss_free and units.free else units


def _counted(data: Lengths, example=None, start=None, length=None) -> tuple[np.ndarray | None, int]:
    """``(counted, free)``: :func:`loss_of` (None where no loss counts were given: every token but a piece's first,
    made when read) and the units with no loss token."""
    if data.targets is None and data.loss_lengths is None:
        return None, int(np.count_nonzero(length <= 1))
    loss = loss_of(data, example, start, length)
    return loss, int(np.count_nonzero(loss == 0))
