"""The effective batch: tokens per optimiser step, steps per epoch, and the advice that follows.

The number that governs gradient noise is tokens per optimiser step, not examples::

    effective batch = per-device batch x accumulation steps x world size (data-parallel devices)
                      (windows of W tokens when packed, examples when padded)

    >>> effective_batch_size(per_device_batch=4, accumulation_steps=8, world_size=2)
    64

:func:`plan_budget` reports an epoch of the user's lengths as packkit's sampler deals it (:mod:`packkit.epoch`) and the
advice of :mod:`packkit.advice`, each :class:`Advice` also emitted as a :class:`BudgetWarning`. ``packkit plan``
prints the table on the command line; :func:`find_max_micro_batch` bisects the largest micro-batch that fits in memory.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np

from .advice import Advice, AdviceOptions, BudgetWarning, advise, for_target
from .binpack import DEFAULT_OVERFLOW, Plan, check_window, overflow_note
from .cp_layouts import check_cp_window, cp_multiples
from .epoch import Dealt, Lengths, Units, deal, packed_units, padded_units, read_lengths_object, trains_on_nothing
from .errors import arg, check_int
from .records import record
from .sample import synthetic_sft_lengths
from .sampler import batch_sums

__all__ = ["Advice", "BudgetWarning", "Spread", "BudgetReport", "AdviceOptions", "advise", "MicroBatchSearch",
           "effective_batch_size", "plan_budget", "find_max_micro_batch", "is_out_of_memory", "synthetic_sft_lengths"]


@record
class Spread:
    """Mean, standard deviation, min and max of a per-step quantity: ``Spread.of([1, 3]).mean -> 2.0``."""

    mean: float
    std: float
    min: float
    max: float

    @classmethod
    def of(cls, values) -> "Spread":
        v = np.asarray(values, dtype=np.float64)
        if v.size == 0:
            return cls(0.0, 0.0, 0.0, 0.0)
        mean = float(v.sum()) / v.size  # numpy's mean and std (the same sums), without their dispatch: 3 per plan
        d = v - mean
        return cls(mean, math.sqrt(float((d * d).sum()) / v.size), float(v.min()), float(v.max()))

    def text(self) -> str:
        return f"mean {self.mean:,.1f}  std {self.std:,.1f}  min {self.min:,.0f}  max {self.max:,.0f}"


@record
class BudgetReport:
    """What one epoch looks like at a given effective batch. ``mode``: ``"packed"`` (windows of ``window`` tokens)
    or ``"padded"`` (``window`` None); ``per_device_batch``, ``accumulation_steps``, ``world_size``, ``balance``: as
    given; ``effective_batch`` and ``num_units``: windows (packed) or examples (padded) per optimiser step, and dealt;
    ``num_examples``, ``num_tokens``: the dataset (tokens after the overflow policy, ``longest_example`` before it);
    ``steps_per_epoch``: optimiser steps the sampler deals (the last one partial unless ``drop_last``), of them
    ``full_steps_per_epoch`` with the whole effective batch; ``examples_per_step``, ``tokens_per_step``,
    ``loss_tokens_per_step``: :class:`Spread` over the full steps (the one partial step when there is no full one);
    ``padding_fraction``: slots (window or padded positions) with no real token; ``loss_tokens`` of the epoch
    (``loss_tokens_assumed``: no loss lengths given, every token but each example's first);
    ``accumulation_for_target``: the accumulation steps whose mean tokens per step reach ``target_tokens_per_step``
    (None without one); ``advice``: tuple of :class:`Advice`; ``overflow``, ``overflow_examples``, ``cut_tokens``:
    the policy for examples longer than ``window``, how many were, the tokens it cut (None, 0, 0 when padded);
    ``compute_imbalance``, ``examples_per_step_cv``: the sampler's (:class:`~packkit.sampler.EpochStats`: 1.0 is
    balanced, and std / mean of the examples per step); ``loss_free_units``, ``loss_free_steps``,
    ``loss_free_pieces``: with no loss token; ``dropped_pieces``, ``dropped_tokens``: left out by ``drop_loss_free``.
    """

    mode: str
    per_device_batch: int
    accumulation_steps: int
    world_size: int
    effective_batch: int
    window: int | None
    num_examples: int
    num_tokens: int
    steps_per_epoch: int
    full_steps_per_epoch: int
    examples_per_step: Spread
    tokens_per_step: Spread
    loss_tokens_per_step: Spread
    padding_fraction: float
    loss_tokens_assumed: bool
    target_tokens_per_step: int | None = None
    accumulation_for_target: int | None = None
    advice: tuple = ()
    overflow: str | None = None
    overflow_examples: int = 0
    cut_tokens: int = 0
    compute_imbalance: float = 1.0
    examples_per_step_cv: float = 0.0
    loss_tokens: int = 0
    loss_free_units: int = 0
    loss_free_steps: int = 0
    loss_free_pieces: int = 0
    dropped_pieces: int = 0
    dropped_tokens: int = 0
    longest_example: int = 0
    num_units: int = 0
    balance: str | None = None

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["advice"] = [a.as_dict() for a in self.advice]
        # the key packkit waste and pack use for the same count (loss_free_units is its name in either mode)
        d["loss_free_windows" if self.mode == "packed" else "loss_free_rows"] = self.loss_free_units
        return d

    def table(self, *, options=None) -> str:
        """The report as aligned text (what ``packkit plan`` prints; ``options``: see ``packkit.errors.Arg.render``)."""
        packed, plural = self.mode == "packed", "s" if self.world_size != 1 else ""
        rows = [
            ("effective batch", f"{self.effective_batch:,} {'windows' if packed else 'examples'}/step = "
                                f"{self.per_device_batch} per device x {self.accumulation_steps} accumulation x "
                                f"{self.world_size} device{plural}"),
            ("examples per step", self.examples_per_step.text()),
            ("tokens per step", self.tokens_per_step.text()),
            ("loss tokens", f"{self.loss_tokens:,} in the epoch"
             + ("  (assumed: all but each example's first)" if self.loss_tokens_assumed else "")),
            ("loss tokens per step", self.loss_tokens_per_step.text()),
            ("longest example", f"{self.longest_example:,} tokens (as given, before the overflow policy)"),
            ("steps per epoch", f"{self.steps_per_epoch:,} ({self.full_steps_per_epoch:,} full)"),
            ("padding", f"{100 * self.padding_fraction:.1f}% of the "
                        + ("window slots" if packed else "padded positions")),
            ("compute imbalance", f"{self.compute_imbalance:.3f} (slowest of {self.world_size} device{plural} / "
                                  f"mean, cost 24576 L + L^2; examples per step cv {self.examples_per_step_cv:.2f}; "
                                  f"as the sampler deals them, balance {self.balance or 'none'})"),
        ]
        if self.target_tokens_per_step is not None:
            rows.append(("for the target", f"{self.target_tokens_per_step:,} tokens/step: " + arg(
                "accumulation_steps", self.accumulation_for_target).render(options)))
        note = overflow_note(self.overflow, over=self.overflow_examples, examples=self.num_examples,  # padded: None
                             cut=self.cut_tokens, tokens=self.num_tokens + self.cut_tokens)
        if note is not None:
            rows.append(("overflow", note.render(options)))
        rows += [("loss-free", m.render(options))
                 for m in trains_on_nothing(dropped=(self.dropped_pieces, self.dropped_tokens))]
        width = max(len(k) for k, _ in rows)
        head = (f"packed into windows of {self.window:,} tokens" if packed
                else "length-grouped micro-batches, each padded to its longest example")
        lines = [f"packkit plan: {self.num_examples:,} examples, {self.num_tokens:,} tokens, {head}"]
        lines += [f"  {k:<{width}}  {v}" for k, v in rows]
        lines.append("advice:" if self.advice else "advice: none")
        lines += [f"  [{a.code}] {a.render(options)}" for a in self.advice]
        return "\n".join(lines)


def __getattr__(name: str):
    """:mod:`packkit.microbatch`'s names, lent under their old address (``packkit.budget.find_max_micro_batch``)."""
    if name in ("find_max_micro_batch", "MicroBatchSearch", "is_out_of_memory"):
        from . import microbatch  # lazy: the micro-batch search, for a training step (not packkit plan)
        return getattr(microbatch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _at_least_one(value, name: str) -> int:
    """``check_int`` with the fix each count of :func:`plan_budget` suggests: ``_at_least_one(8, "devices") -> 8``."""
    fix = {"world_size": ": at least one device (1 for a single GPU or the CPU)",
           "accumulation_steps": ": {one} means no accumulation"}.get(name, ": pass 1 or more")
    return check_int(value, name, fix=fix, one=arg(name, 1))


def effective_batch_size(*, per_device_batch: int, accumulation_steps: int = 1, world_size: int = 1) -> int:
    """``per_device_batch x accumulation_steps x world_size``: ``(4, 8, 2) -> 64``."""
    return (_at_least_one(per_device_batch, "per_device_batch")
            * _at_least_one(accumulation_steps, "accumulation_steps") * _at_least_one(world_size, "world_size"))


def plan_budget(lengths=None, *, per_device_batch: int, accumulation_steps: int = 1, world_size: int = 1,
                window: int | None = None, strategy: str = "bfd", overflow: str = DEFAULT_OVERFLOW,
                balance: str | None = None, drop_loss_free: bool = False, drop_last: bool = False, seed: int = 0,
                cp_size: int = 1, cp_layout: str = "hybrid", advice: AdviceOptions | None = None) -> BudgetReport:
    """Examples, tokens and loss tokens per optimiser step, steps per epoch, and advice, of the epoch a
    sampler deals (:func:`packkit.epoch.deal`: the figures are those of its schedule, whatever ``balance``).

    Args:
        lengths: (num_examples,) tokens per example (list, numpy, torch), a lengths object
            (:class:`packkit.epoch.Lengths`: its ``loss_lengths`` or ``targets`` count the loss tokens, else every
            token but each piece's first), or a :class:`~packkit.binpack.Plan` (its windows dealt in the order
            given, its window, strategy and overflow taken as made).
        per_device_batch: windows per device per micro-batch when packed (``window`` or a plan given), else examples
            per device per micro-batch in length-grouped batches padded to their longest
            (:class:`~packkit.sampler.LengthGroupedSampler`).
        accumulation_steps, world_size: >= 1 (``world_size``: data-parallel ranks).
        window, strategy, overflow: pack into windows of this many tokens (:func:`packkit.binpack.pack`; the sampler
            plans the pieces the overflow policy leaves), dealt by a :class:`~packkit.sampler.PackedBatchSampler`
            seeded with ``seed``.
        balance: the samplers' ``balance`` (None, ``"tokens"``, ``"sqlen"``, ``"compute"``).
        drop_loss_free, drop_last: leave out the pieces (packed) or examples (padded) that hold no loss token
            (counted in ``dropped_pieces`` / ``dropped_tokens``), and the last partial step.
        cp_size, cp_layout: context parallelism (:mod:`packkit.cp_plan`): with ``"zigzag"`` every piece is planned
            padded to a multiple of ``2 * cp_size`` (the padding fills window slots and counts in
            ``padding_fraction``, not in the tokens); the other layouts need ``window`` (and padded micro-batches) to
            be multiples of ``cp_size``. ``world_size`` stays the data-parallel count.
        advice: :class:`AdviceOptions`, read by :func:`advise`. Returns a :class:`BudgetReport`.

    >>> r = plan_budget([300] * 800, per_device_batch=8, accumulation_steps=8, advice=AdviceOptions(warn=False))
    >>> r.effective_batch, r.steps_per_epoch, r.full_steps_per_epoch, [a.code for a in r.advice]
    (64, 13, 12, ['few_steps_per_epoch'])
    """
    per_device_batch = _at_least_one(per_device_batch, "per_device_batch")
    accumulation_steps = _at_least_one(accumulation_steps, "accumulation_steps")
    world_size = _at_least_one(world_size, "world_size")
    if lengths is None:
        raise ValueError("pass the dataset's lengths (or a packed plan)")
    data = read_lengths_object(lengths)
    doc_multiple, row_multiple = cp_multiples(cp_size=cp_size, cp_layout=cp_layout)
    given = lengths if isinstance(lengths, Plan) else None
    if given is not None and doc_multiple > 1:
        raise ValueError("a plan with a zigzag CP layout: pass lengths and window instead (the plan must be made "
                         "from the CP-padded lengths)")
    if given is not None or window is not None:
        window = check_cp_window(check_window(given.window if given else window), cp_size=cp_size, cp_layout=cp_layout)
        units = packed_units(data, given, window=window, overflow=overflow, doc_multiple=doc_multiple,
                             drop_loss_free=drop_loss_free)
    else:
        units = padded_units(data, row_round=doc_multiple * row_multiple, drop_loss_free=drop_loss_free)
    dealt = Dealt.of(deal(units.given if given is not None else units.planned, per_rank=per_device_batch,
                          accumulation_steps=accumulation_steps, world_size=world_size, window=window,
                          strategy=strategy, balance=balance, seed=seed, drop_last=drop_last, cp_size=cp_size,
                          shuffle=given is None), drop_last=drop_last)
    report = _report(data, units, dealt, per_device_batch=per_device_batch, accumulation_steps=accumulation_steps,
                     world_size=world_size, window=window, balance=balance)
    options = advice or AdviceOptions()
    if options.target_tokens_per_step is not None:
        target, steps = for_target(report, options.target_tokens_per_step)
        report = dataclasses.replace(report, target_tokens_per_step=target, accumulation_for_target=steps)
    report = dataclasses.replace(report, advice=advise(report, options))
    for a in report.advice if options.warn else ():
        warnings.warn(BudgetWarning(a), stacklevel=2)
    return report


def _report(data: Lengths, units: Units, dealt: Dealt, *, per_device_batch: int, accumulation_steps: int,
            world_size: int, window: int | None, balance: str | None) -> BudgetReport:
    """The figures of the epoch ``dealt`` deals (:func:`plan_budget`)."""
    sched, stats = dealt.schedule, dealt.stats
    total, lens = units.total, dealt.tokens(units)  # (as the sampler read them already)
    tokens, entries = dealt.sums(lens, taken=True), sched.step_entries
    # each sum taken once; with no loss counts a unit's loss is its tokens less one: a step's, tokens less entries
    assumed = data.loss_lengths is None and data.targets is None
    loss = tokens - entries if units.counted is None and units.tokens.min() >= 1 else dealt.sums(units.loss)
    if window is not None:
        plan = dealt.sampler.plan()
        free = dealt.loss_free(units.free_left and batch_sums(units.loss[plan.seg_example], plan.window_ptr), sums=loss)
        num_units, slots = plan.num_windows, plan.num_windows * window
    else:  # padded: planned lengths are the tokens; CP rounds each row up, a row cut as one sequence
        rows = sched.longest(lens) if lens.size else lens
        slots = int((-(-rows // units.row_round) * units.row_round * sched.sizes).sum())
        free, num_units = dealt.loss_free(units.free_left, sums=loss), units.tokens.size
    padding = 1.0 - total / float(slots) if slots else 0.0
    first = dealt.examples(units.first)  # an example counted where a piece starts it
    return BudgetReport(
        mode="packed" if window is not None else "padded", per_device_batch=per_device_batch,
        accumulation_steps=accumulation_steps, world_size=world_size,
        effective_batch=per_device_batch * accumulation_steps * world_size, window=window,
        num_examples=int(data.lengths.size), num_tokens=total, num_units=int(num_units),
        steps_per_epoch=dealt.steps, full_steps_per_epoch=int(dealt.full.sum()),
        examples_per_step=Spread.of(dealt.per_step(first, full_only=True)),
        tokens_per_step=Spread.of(dealt.per_step(tokens, full_only=True)),
        loss_tokens_per_step=Spread.of(dealt.per_step(loss, full_only=True)),
        padding_fraction=float(padding), loss_tokens_assumed=assumed, loss_tokens=units.loss_sum(),
        loss_free_units=free[0], loss_free_steps=free[1], loss_free_pieces=units.free, dropped_pieces=units.dropped,
        dropped_tokens=units.dropped_tokens, longest_example=int(data.lengths.max()), overflow=units.overflow,
        overflow_examples=units.overflow_examples, cut_tokens=units.cut_tokens, balance=balance,
        compute_imbalance=stats.compute_imbalance, examples_per_step_cv=stats.examples_per_step_cv)


