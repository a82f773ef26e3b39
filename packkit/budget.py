"""The effective batch: tokens per optimiser step, steps per epoch, and the advice that follows.

The number that governs gradient noise is tokens per optimiser step, not examples::

    effective batch = per-device batch x accumulation steps x devices
                      (windows of W tokens when packed, examples when padded)

    >>> effective_batch_size(per_device_batch=4, accumulation_steps=8, devices=2)
    64

:func:`plan_budget` walks one epoch of the user's lengths (packed with packkit's planner, or in random
padded batches) and reports examples, tokens and loss tokens per step (mean and spread), steps per
epoch and padding, plus advice a practitioner would give, each an :class:`Advice` (code, message and
the numbers) also emitted as a :class:`BudgetWarning`:

=========================  ==========================================================================
code                       when
=========================  ==========================================================================
``low_tokens_per_step``    mean tokens per step under ``min_tokens_per_step`` (4,000): raise
                           accumulation, not the learning rate
``few_steps_per_epoch``    fewer than ``min_steps_per_epoch`` (50) optimiser steps per epoch
                           (800 examples at an effective batch of 64 is 12 full steps)
``lora_large_batch``       a LoRA/adapter run with more than ``lora_max_batch`` (32) examples per step
``accumulation_for_target``  the accumulation steps that reach ``target_tokens_per_step``, when they
                           differ from the ones given
=========================  ==========================================================================

:func:`find_max_micro_batch` bisects the largest micro-batch that fits in memory, and
``packkit plan`` prints the table on the command line.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import warnings

import numpy as np

from .balance import CostModel, step_figures
from .binpack import DEFAULT_OVERFLOW, Plan, as_lengths, check_window, overflow_note
from .cp_plan import check_cp_window, cp_multiples, plan_for_cp
from .errors import Message, arg, check_int
from .segments import lengths_to_offsets, piece_loss_tokens

__all__ = [
    "Advice",
    "BudgetWarning",
    "Spread",
    "BudgetReport",
    "MicroBatchSearch",
    "effective_batch_size",
    "plan_budget",
    "find_max_micro_batch",
    "is_out_of_memory",
    "synthetic_sft_lengths",
]


# ----------------------------------------------------------------------------------------------
# results
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Advice:
    """One piece of advice: a stable ``code``, a message with the numbers, and the numbers themselves."""

    code: str
    message: str
    values: dict = dataclasses.field(hash=False)
    #: the message with the arguments it names kept apart, so the command line can name its options
    wording: Message | None = dataclasses.field(default=None, hash=False, compare=False, repr=False)

    def as_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "values": dict(self.values)}

    def render(self, options=None) -> str:
        """The message, naming arguments as ``options`` spell them (``packkit.errors.Arg.render``)."""
        return self.message if self.wording is None else self.wording.render(options)


def _advice(code: str, values: dict, template: str, **fields) -> Advice:
    wording = Message(template, **fields)
    return Advice(code, str(wording), values, wording)


class BudgetWarning(UserWarning):
    """The warning :func:`plan_budget` emits for each :class:`Advice` (``.advice``, ``.code``).

    Silence it with ``warnings.filterwarnings("ignore", category=packkit.budget.BudgetWarning)`` or
    ``plan_budget(..., warn=False)``; the advice stays in ``report.advice``.
    """

    def __init__(self, advice: Advice):
        super().__init__(f"[{advice.code}] {advice.message}")
        self.advice = advice
        self.code = advice.code


@dataclasses.dataclass(frozen=True)
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
        return cls(float(v.mean()), float(v.std()), float(v.min()), float(v.max()))


@dataclasses.dataclass(frozen=True)
class BudgetReport:
    """What one epoch looks like at a given effective batch.

    Fields
    ------
    mode:                 ``"packed"`` (windows of ``window`` tokens) or ``"padded"``
    per_device_batch, accumulation_steps, devices: as given
    effective_batch:      int, windows (packed) or examples (padded) per optimiser step
    window:               int or None
    num_examples, num_tokens: the dataset (tokens after the overflow policy)
    steps_per_epoch:      int, optimiser steps (the last one partial unless ``drop_last``)
    full_steps_per_epoch: int, steps with the whole effective batch
    examples_per_step, tokens_per_step, loss_tokens_per_step: :class:`Spread` over the epoch's full
                          steps (over the one partial step when there is no full step)
    padding_fraction:     float, slots (window or padded positions) that hold no real token
    loss_tokens_assumed:  bool, no loss lengths were given: every token but each example's first
    target_tokens_per_step: int or None
    accumulation_for_target: int or None, accumulation steps whose mean tokens per step reach the target
    advice:               tuple of :class:`Advice`
    overflow, overflow_examples, cut_tokens: the policy for examples longer than ``window``, how many
                          were, and the tokens it cut (``None``, 0, 0 when padded)
    compute_imbalance:    float, the slowest of ``devices`` ranks over the mean, summed over steps
                          (:func:`packkit.balance.step_figures`; a document costs ``24576 L + L^2 / cp``,
                          a padded micro-batch its size x ``24576 P + P^2``); 1.0 is balanced
    examples_per_step_cv: float, std / mean of the examples per step (full steps)
    """

    mode: str
    per_device_batch: int
    accumulation_steps: int
    devices: int
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
    target_tokens_per_step: int | None
    accumulation_for_target: int | None
    advice: tuple
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

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["advice"] = [a.as_dict() for a in self.advice]
        # the key packkit waste and pack use for the same count (loss_free_units is its name in either mode)
        d["loss_free_windows" if self.mode == "packed" else "loss_free_rows"] = self.loss_free_units
        return d

    def table(self, *, options=None) -> str:
        """The report as aligned text (what ``packkit plan`` prints; ``options`` names arguments as the
        command line does, see ``packkit.errors.Arg.render``)."""
        unit = "windows" if self.mode == "packed" else "examples"
        head = (f"packed into windows of {self.window:,} tokens" if self.mode == "packed"
                else "padded to the longest example of each micro-batch")
        rows = [
            ("effective batch", f"{self.effective_batch:,} {unit}/step = {self.per_device_batch} per device "
                                f"x {self.accumulation_steps} accumulation x {self.devices} device"
                                f"{'s' if self.devices != 1 else ''}"),
            ("examples per step", _spread(self.examples_per_step)),
            ("tokens per step", _spread(self.tokens_per_step)),
            ("loss tokens", f"{self.loss_tokens:,} in the epoch"
             + ("  (assumed: all but each example's first)" if self.loss_tokens_assumed else "")),
            ("loss tokens per step", _spread(self.loss_tokens_per_step)),
            ("longest example", f"{self.longest_example:,} tokens (as given, before the overflow policy)"),
            ("steps per epoch", f"{self.steps_per_epoch:,} ({self.full_steps_per_epoch:,} full)"),
            ("padding", f"{100 * self.padding_fraction:.1f}% of the "
                        + ("window slots" if self.mode == "packed" else "padded positions")),
            ("compute imbalance", f"{self.compute_imbalance:.3f} (slowest of {self.devices} device"
                                  f"{'s' if self.devices != 1 else ''} / mean, cost 24576 L + L^2; "
                                  f"examples per step cv {self.examples_per_step_cv:.2f})"),
        ]
        if self.target_tokens_per_step is not None:
            rows.append(("for the target", f"{self.target_tokens_per_step:,} tokens/step: " + arg(
                "accumulation_steps", self.accumulation_for_target).render(options)))
        note = None if self.overflow is None else overflow_note(
            self.overflow, over=self.overflow_examples, examples=self.num_examples, cut=self.cut_tokens,
            tokens=self.num_tokens + self.cut_tokens)
        if note is not None:
            rows.append(("overflow", note.render(options)))
        if self.dropped_pieces:
            rows.append(("loss-free", f"left out {self.dropped_pieces:,} pieces with no loss token "
                                      f"({self.dropped_tokens:,} tokens)"))
        width = max(len(k) for k, _ in rows)
        lines = [f"packkit plan: {self.num_examples:,} examples, {self.num_tokens:,} tokens, {head}"]
        lines += [f"  {k:<{width}}  {v}" for k, v in rows]
        lines.append("advice:" if self.advice else "advice: none")
        lines += [f"  [{a.code}] {a.render(options)}" for a in self.advice]
        return "\n".join(lines)


def _spread(s: Spread) -> str:
    return f"mean {s.mean:,.1f}  std {s.std:,.1f}  min {s.min:,.0f}  max {s.max:,.0f}"


# ----------------------------------------------------------------------------------------------
# small pure functions
# ----------------------------------------------------------------------------------------------


def _at_least_one(value, name: str) -> int:
    """``check_int`` with the fix each count of :func:`plan_budget` suggests: ``_at_least_one(8, "devices") -> 8``."""
    fix = {"devices": ": at least one device (1 for a single GPU or the CPU)",
           "accumulation_steps": ": {one} means no accumulation"}.get(name, ": pass 1 or more")
    return check_int(value, name, fix=fix, one=arg(name, 1))


def effective_batch_size(*, per_device_batch: int, accumulation_steps: int = 1, devices: int = 1) -> int:
    """``per_device_batch x accumulation_steps x devices``: ``(4, 8, 2) -> 64``."""
    return (_at_least_one(per_device_batch, "per_device_batch") * _at_least_one(accumulation_steps, "accumulation_steps")
            * _at_least_one(devices, "devices"))


def step_sums(values, group: int) -> np.ndarray:
    """Sums of consecutive groups of ``group`` values (the last may be shorter).

    ``step_sums([1, 2, 3, 4, 5], 2) -> [3, 7, 5]``.
    """
    values = np.asarray(values)
    if values.size == 0:
        return values[:0]
    return np.add.reduceat(values, np.arange(0, values.size, group))


def synthetic_sft_lengths(n: int, *, seed: int = 0, max_length: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, loss_lengths)`` of ``n`` SFT-like examples: a prompt, then a completion that carries the loss.

    Prompt and completion lengths are log-normal (medians about 100 and 180 tokens, long right tails),
    as in chat instruction data; the total is clipped to ``max_length``. Deterministic for a seed.
    """
    n = _at_least_one(n, "n")
    rng = np.random.default_rng(seed)
    prompt = np.maximum(rng.lognormal(np.log(100), 0.9, n).astype(np.int64), 4)
    completion = np.maximum(rng.lognormal(np.log(180), 1.0, n).astype(np.int64), 1)
    completion = np.minimum(completion, max_length - 2)
    lengths = np.minimum(prompt + completion, max_length)
    return lengths, np.minimum(completion, lengths - 1)


# ----------------------------------------------------------------------------------------------
# the plan
# ----------------------------------------------------------------------------------------------


def _check_loss_lengths(loss_lengths, lengths: np.ndarray) -> np.ndarray:
    loss = np.asarray(loss_lengths)
    if loss.ndim != 1 or loss.size != lengths.size:
        raise ValueError(f"loss_lengths must have one entry per example ({lengths.size:,}), got shape {loss.shape}")
    if loss.dtype.kind not in "iu":
        raise TypeError(f"loss_lengths must be integers, got dtype {loss.dtype}")
    loss = loss.astype(np.int64)
    bad = (loss < 0) | (loss > lengths - 1)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"example {i} has loss_lengths={int(loss[i])} with length {int(lengths[i])}: "
            "loss tokens must be between 0 and length - 1 (the first token is never a target)"
        )
    return loss


def plan_budget(lengths=None, *, per_device_batch: int, accumulation_steps: int = 1, devices: int = 1,
                window: int | None = None, plan: Plan | None = None, loss_lengths=None, targets=None,
                drop_loss_free: bool = False,
                strategy: str = "bfd", overflow: str = DEFAULT_OVERFLOW, lora: bool = False,
                target_tokens_per_step: int | None = None, min_tokens_per_step: int = 4000,
                min_steps_per_epoch: int = 50, lora_max_batch: int = 32, drop_last: bool = False,
                seed: int = 0, warn: bool = True, cp_size: int = 1, cp_layout: str = "hybrid") -> BudgetReport:
    """Examples, tokens and loss tokens per optimiser step, steps per epoch, and advice.

    Args:
        lengths: (num_examples,) tokens per example (list, numpy, torch). Not needed with ``plan``.
        per_device_batch: windows per device per micro-batch when packed (``window`` or ``plan``
            given), else examples per device per micro-batch (padded to the micro-batch's longest).
        accumulation_steps, devices: >= 1.
        window: pack into windows of this many tokens with ``strategy``/``overflow`` (see
            :func:`packkit.binpack.pack`), shuffled with ``seed`` as a sampler would.
        plan: an existing :class:`~packkit.binpack.Plan`, its windows taken in the order given (pass
            ``plan.shuffled()`` for a training order).
        loss_lengths: (num_examples,) loss-bearing tokens per example (the completion, at the end of
            the example). Default: every token but the first.
        targets: (sum(lengths),) bool, where the loss is taken token by token
            (``packkit.datafiles.Lengths.targets``): the exact loss tokens of every packed segment, as
            ``packkit waste`` and ``packkit pack`` count them.
        drop_loss_free: leave out the segments (packed) or examples (padded) that hold no loss token,
            counted in ``dropped_pieces`` / ``dropped_tokens`` (windows emptied by it are gone).
        lora: an adapter run (adds the large-batch advice).
        target_tokens_per_step: report (and advise) the accumulation steps that reach it.
        drop_last: leave out the last partial step.
        warn: also emit each advice as a :class:`BudgetWarning`.
        cp_size, cp_layout: context parallelism (:mod:`packkit.cp_plan`): with ``"zigzag"`` every example is
            planned padded to a multiple of ``2 * cp_size`` (the padding fills window slots and counts in
            ``padding_fraction``, not in the tokens); the other layouts need ``window`` (and padded
            micro-batches) to be multiples of ``cp_size``. ``devices`` stays the data-parallel count.

    Returns: a :class:`BudgetReport`.

    >>> r = plan_budget([300] * 800, per_device_batch=8, accumulation_steps=8, warn=False)
    >>> r.effective_batch, r.steps_per_epoch, r.full_steps_per_epoch, [a.code for a in r.advice]
    (64, 13, 12, ['few_steps_per_epoch'])
    """
    per_device_batch = _at_least_one(per_device_batch, "per_device_batch")
    accumulation_steps = _at_least_one(accumulation_steps, "accumulation_steps")
    devices = _at_least_one(devices, "devices")
    group = per_device_batch * accumulation_steps * devices
    if target_tokens_per_step is not None:
        target_tokens_per_step = _at_least_one(target_tokens_per_step, "target_tokens_per_step")
    if plan is not None:
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a packkit.binpack.Plan, got {type(plan).__name__}")
        if lengths is not None and not np.array_equal(as_lengths(lengths), plan.lengths):
            raise ValueError("lengths and plan disagree: pass one of them (the plan carries its lengths)")
        if window is not None and check_window(window) != plan.window:
            raise ValueError(f"window={window} but the plan was made for window={plan.window}")
        lengths = plan.lengths
    elif lengths is None:
        raise ValueError("pass the dataset's lengths (or a packed plan)")
    lengths = as_lengths(lengths)
    if lengths.size == 0:
        raise ValueError("lengths is empty: a plan needs at least one example")
    assumed = loss_lengths is None
    loss = lengths - 1 if assumed else _check_loss_lengths(loss_lengths, lengths)
    doc_multiple, row_multiple = cp_multiples(cp_size=cp_size, layout=cp_layout)
    row_round = doc_multiple * row_multiple
    if window is not None:
        check_cp_window(check_window(window), cp_size=cp_size, layout=cp_layout)
    if plan is not None and doc_multiple > 1:
        raise ValueError("plan= with a zigzag CP layout: pass lengths and window instead (the plan must be made "
                         "from the CP-padded lengths)")

    if plan is None and window is not None:
        # zigzag: each example planned at its CP-padded length; the plan holds the real ones
        plan = plan_for_cp(lengths, window=check_window(window), cp_size=cp_size, cp_layout=cp_layout,
                           strategy=strategy, overflow=overflow, seed=seed).shuffled(seed)
    if targets is not None and np.shape(targets) != (int(lengths.sum()),):
        raise ValueError(f"targets must be one bool per token ({int(lengths.sum()):,}), got shape {np.shape(targets)}")
    offsets = lengths_to_offsets(lengths)
    dropped_pieces = dropped_tokens = 0
    if plan is not None:
        mode, window = "packed", plan.window
        seg_loss = piece_loss_tokens(plan.seg_example, plan.seg_start, plan.seg_length, offsets=offsets,
                                     targets=targets, loss_lengths=loss)
        free_pieces = int((seg_loss == 0).sum())
        if drop_loss_free and free_pieces:
            keep = seg_loss > 0
            dropped_pieces, dropped_tokens = int((~keep).sum()), int(plan.seg_length[~keep].sum())
            plan, seg_loss = plan.keep_segments(keep), seg_loss[keep]
        win = plan.seg_window
        units_tokens = plan.window_loads
        units_examples = np.bincount(win, weights=plan.seg_start == 0, minlength=plan.num_windows)
        units_loss = np.bincount(win, weights=seg_loss, minlength=plan.num_windows)
        num_units, num_tokens = plan.num_windows, plan.total_tokens
        padding = 1.0 - plan.fill
        units_cost = np.bincount(win, weights=CostModel(cp_size=cp_size).costs(plan.seg_length),
                                 minlength=plan.num_windows)
        imbalance, cv = step_figures(units_cost, units_examples, ranks=devices,
                                     per_rank=per_device_batch * accumulation_steps)
    else:
        mode = "padded"
        order = np.random.default_rng(seed).permutation(lengths.size)
        ex_loss = piece_loss_tokens(np.arange(lengths.size), np.zeros(lengths.size, np.int64), lengths,
                                    offsets=offsets, targets=targets, loss_lengths=loss)
        free_pieces = int((ex_loss == 0).sum())
        if drop_loss_free and free_pieces:
            dropped_pieces, dropped_tokens = int((ex_loss == 0).sum()), int(lengths[ex_loss == 0].sum())
            order = order[ex_loss[order] > 0]
        units_tokens, units_examples, units_loss = lengths[order], np.ones(order.size), ex_loss[order]
        num_units, num_tokens = lengths.size, int(lengths.sum())
        # per-device micro-batches padded to their longest
        micro_max = np.maximum.reduceat(units_tokens, np.arange(0, num_units, per_device_batch))
        micro_max = -(-micro_max // row_round) * row_round  # a padded row is cut as one sequence
        micro_size = np.diff(np.append(np.arange(0, num_units, per_device_batch), num_units))
        padding = 1.0 - num_tokens / float((micro_max * micro_size).sum())
        imbalance, cv = step_figures(micro_size * CostModel(cp_size=cp_size).costs(micro_max), micro_size,
                                     ranks=devices, per_rank=accumulation_steps)

    full_steps = num_units // group
    steps = full_steps if drop_last else -(-num_units // group)
    # the spreads describe full steps (a partial last step would bias the mean); with no full step,
    # the one partial step
    keep = full_steps * group if full_steps else num_units
    tokens = step_sums(units_tokens[:keep], group)
    examples = step_sums(units_examples[:keep], group)
    loss_steps = step_sums(units_loss[:keep], group)
    all_steps = step_sums(units_loss[:full_steps * group if drop_last else num_units], group)
    tokens_spread = Spread.of(tokens)

    # accumulation for a target: one accumulation step carries, on average, the tokens of
    # per_device_batch x devices units
    per_accum = num_tokens / num_units * per_device_batch * devices
    accumulation_for_target = None
    if target_tokens_per_step is not None and per_accum > 0:
        accumulation_for_target = max(1, math.ceil(target_tokens_per_step / per_accum))

    report = BudgetReport(
        mode=mode, per_device_batch=per_device_batch, accumulation_steps=accumulation_steps, devices=devices,
        effective_batch=group, window=window, num_examples=int(lengths.size), num_tokens=int(num_tokens),
        steps_per_epoch=int(steps), full_steps_per_epoch=int(full_steps),
        examples_per_step=Spread.of(examples), tokens_per_step=tokens_spread,
        loss_tokens_per_step=Spread.of(loss_steps), padding_fraction=float(padding),
        loss_tokens_assumed=assumed and targets is None, target_tokens_per_step=target_tokens_per_step,
        loss_tokens=int(round(float(units_loss.sum()))), loss_free_units=int((units_loss == 0).sum()),
        loss_free_steps=int((all_steps == 0).sum()), loss_free_pieces=free_pieces, dropped_pieces=dropped_pieces,
        dropped_tokens=dropped_tokens,
        longest_example=int(lengths.max()),
        accumulation_for_target=accumulation_for_target, advice=(),
        overflow=None if mode == "padded" else plan.overflow,
        overflow_examples=0 if mode == "padded" else int(plan.overflow_examples.size),
        cut_tokens=0 if mode == "padded" else int(plan.cut_tokens),
        compute_imbalance=imbalance, examples_per_step_cv=cv,
    )
    advice = _advise(report, per_accum=per_accum, lora=lora, min_tokens_per_step=min_tokens_per_step,
                     min_steps_per_epoch=min_steps_per_epoch, lora_max_batch=lora_max_batch)
    report = dataclasses.replace(report, advice=tuple(advice))
    if warn:
        for a in advice:
            warnings.warn(BudgetWarning(a), stacklevel=2)
    return report


def _advise(r: BudgetReport, *, per_accum: float, lora: bool, min_tokens_per_step: int,
            min_steps_per_epoch: int, lora_max_batch: int) -> list[Advice]:
    out = []
    tok = r.tokens_per_step.mean
    if 0 < tok < min_tokens_per_step:
        need = math.ceil(min_tokens_per_step / per_accum)
        out.append(_advice(
            "low_tokens_per_step",
            {"tokens_per_step": tok, "min_tokens_per_step": min_tokens_per_step,
             "accumulation_steps": r.accumulation_steps, "suggested_accumulation_steps": need},
            "about {tok:,.0f} tokens per optimiser step (< {min:,}): gradients are noisy. Raise {acc} from {now} "
            "to {need} (about {tokens:,.0f} tokens per step) rather than raising the learning rate.",
            tok=tok, min=min_tokens_per_step, acc=arg("accumulation_steps"), now=r.accumulation_steps,
            need=need, tokens=need * per_accum,
        ))
    if r.steps_per_epoch < min_steps_per_epoch:
        per_step = r.examples_per_step.mean
        batch_for_min = max(1, r.num_examples // min_steps_per_epoch)
        out.append(_advice(
            "few_steps_per_epoch",
            {"steps_per_epoch": r.steps_per_epoch, "full_steps_per_epoch": r.full_steps_per_epoch,
             "examples": r.num_examples, "examples_per_step": per_step,
             "min_steps_per_epoch": min_steps_per_epoch, "suggested_examples_per_step": batch_for_min},
            "only {full:,} full optimiser steps per epoch ({n:,} examples at about {per_step:,.0f} examples per "
            "step): the optimiser and the learning-rate schedule get few updates. For {min} steps use about "
            "{batch:,} examples per step, or train more epochs.",
            full=r.full_steps_per_epoch, n=r.num_examples, per_step=per_step, min=min_steps_per_epoch,
            batch=batch_for_min,
        ))
    if lora and r.examples_per_step.mean > lora_max_batch:
        out.append(_advice(
            "lora_large_batch",
            {"examples_per_step": r.examples_per_step.mean, "lora_max_batch": lora_max_batch},
            "LoRA/adapter run at about {per_step:,.0f} examples per step (> {max}): adapters tend to train better "
            "with small effective batches; lower {acc} or {batch}.",
            per_step=r.examples_per_step.mean, max=lora_max_batch, acc=arg("accumulation_steps"),
            batch=arg("per_device_batch"),
        ))
    if r.loss_free_units:
        unit = "windows" if r.mode == "packed" else "examples"
        out.append(_advice(
            "loss_free",
            {"loss_free_units": r.loss_free_units, "loss_free_steps": r.loss_free_steps, "unit": unit},
            "{n:,} {unit} and {steps:,} optimiser steps hold no loss token (they train on nothing; a step of "
            "them has loss 0): pass {drop} to leave the pieces without one out" + (", or raise {w}" if r.mode ==
                                                                                     "packed" else ""),
            n=r.loss_free_units, unit=unit, steps=r.loss_free_steps, drop=arg("drop_loss_free", True), w=arg("window"),
        ))
    if r.window is not None and r.longest_example > 4 * r.window:
        out.append(_advice(
            "far_beyond_window",
            {"longest_example": r.longest_example, "window": r.window},
            "the longest example has {longest:,} tokens, {times:,.0f} times the window of {window:,}: "
            + ("it is split into {pieces:,} pieces that see only their own window; " if r.overflow == "split" else "")
            + "check it (a concatenated or runaway example?), or raise {w}",
            longest=r.longest_example, times=r.longest_example / r.window, window=r.window,
            pieces=-(-r.longest_example // r.window), w=arg("window"),
        ))
    elif r.window is None and r.longest_example > 64 * max(1.0, r.tokens_per_step.mean / max(1, r.effective_batch)):
        out.append(_advice(
            "far_beyond_batch",
            {"longest_example": r.longest_example},
            "the longest example has {longest:,} tokens, far beyond the typical one: every padded micro-batch "
            "that holds it is padded to it; check it, or pack into windows ({w})",
            longest=r.longest_example, w=arg("window", metavar="W"),
        ))
    if r.accumulation_for_target is not None and r.accumulation_for_target != r.accumulation_steps:
        a = r.accumulation_for_target
        out.append(_advice(
            "accumulation_for_target",
            {"target_tokens_per_step": r.target_tokens_per_step, "accumulation_steps": r.accumulation_steps,
             "suggested_accumulation_steps": a, "tokens_per_step": tok},
            "to reach {target:,} tokens per step use {acc} (about {tokens:,.0f} tokens per step; now {now}, "
            "about {tok:,.0f}).",
            target=r.target_tokens_per_step, acc=arg("accumulation_steps", a), tokens=a * per_accum,
            now=r.accumulation_steps, tok=tok,
        ))
    return out


# ----------------------------------------------------------------------------------------------
# the largest micro-batch that fits
# ----------------------------------------------------------------------------------------------


_OOM_MESSAGES = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed")


def is_out_of_memory(exc: BaseException) -> bool:
    """``torch.OutOfMemoryError``, or a RuntimeError whose message says the device ran out of memory.

    ``is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")) -> True``.
    """
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except (ImportError, AttributeError):  # pragma: no cover - torch without OutOfMemoryError
        pass
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _OOM_MESSAGES)


def _free_memory() -> None:
    """Collect garbage (tensors held by reference cycles) and return cached CUDA blocks to the driver."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


@dataclasses.dataclass(frozen=True)
class MicroBatchSearch:
    """``batch_size``: the largest that fit; ``attempts``: calls made; ``trials``: ``(size, fitted)`` in order."""

    batch_size: int
    attempts: int
    trials: tuple


def find_max_micro_batch(step, *, high: int, low: int = 1, multiple_of: int = 1) -> MicroBatchSearch:
    """The largest micro-batch in ``[low, high]`` for which ``step(batch_size)`` does not run out of memory.

    ``step(batch_size)`` runs one training step (forward, backward, optimiser step: the peak is at the
    backward) and returns nothing; it raises ``torch.OutOfMemoryError`` (or a CUDA out-of-memory
    RuntimeError) above the limit. Bisection assumes that a size fits whenever a larger one does, and
    makes ``ceil(log2(high - low + 2))`` attempts (sizes step by ``multiple_of``). Between attempts the
    exception (and the frames holding its tensors) is dropped, garbage is collected and the CUDA
    cache is emptied. Any other exception propagates. Leave headroom: memory use drifts with
    fragmentation and with the longest batch of the epoch.

    Raises ValueError when even ``low`` does not fit.

    >>> find_max_micro_batch(lambda b: None if b <= 37 else (_ for _ in ()).throw(MemoryError()), high=64)
    MicroBatchSearch(batch_size=37, attempts=6, trials=((32, True), (48, False), (40, False), (36, True), (38, False), (37, True)))
    """
    multiple_of = _at_least_one(multiple_of, "multiple_of")
    low, high = _at_least_one(low, "low"), _at_least_one(high, "high")
    lo_k, hi_k = -(-low // multiple_of), high // multiple_of  # candidate sizes k * multiple_of
    if lo_k > hi_k:
        raise ValueError(f"no multiple of {multiple_of} lies in [low={low}, high={high}]")
    fit, fail = lo_k - 1, hi_k + 1  # invariant: k <= fit fits (sentinel), k >= fail does not
    trials = []
    while fail - fit > 1:
        k = (fit + fail) // 2
        size = k * multiple_of
        try:
            step(size)
            ok = True
        except BaseException as exc:  # noqa: BLE001 - only out-of-memory is swallowed, the rest re-raised
            if not is_out_of_memory(exc):
                raise
            ok = False
            del exc  # the traceback holds the frames, and their tensors, of the failed step
        _free_memory()
        trials.append((size, ok))
        if ok:
            fit = k
        else:
            fail = k
    if fit < lo_k:
        raise ValueError(
            f"even micro-batch size {lo_k * multiple_of} runs out of memory: shorten the window or the "
            "longest example, enable gradient checkpointing, or use a smaller model/precision"
        )
    return MicroBatchSearch(batch_size=fit * multiple_of, attempts=len(trials), trials=tuple(trials))
