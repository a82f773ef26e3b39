"""The effective batch: tokens per optimiser step, steps per epoch, and the advice that follows.

The number that governs gradient noise is tokens per optimiser step, not examples::

    effective batch = per-device batch x accumulation steps x world size (data-parallel devices)
                      (windows of W tokens when packed, examples when padded)

    >>> effective_batch_size(per_device_batch=4, accumulation_steps=8, world_size=2)
    64

:func:`plan_budget` reports an epoch of the user's lengths as packkit's sampler deals it (:func:`packkit.epoch.deal`,
under any ``balance``; ``packkit waste`` reads the same schedule) and the advice a practitioner would give
(:func:`advise`, its thresholds :class:`AdviceOptions`'), each an :class:`Advice` also emitted as a
:class:`BudgetWarning`: ``low_tokens_per_step`` (raise accumulation, not the learning rate), ``few_steps_per_epoch``,
``lora_large_batch`` (an adapter run), ``accumulation_for_target``, and on the data itself ``loss_free``,
``far_beyond_window`` and ``far_beyond_batch``. ``packkit plan`` prints the table on the command line;
:func:`find_max_micro_batch` bisects the largest micro-batch that fits in memory.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np

from .binpack import DEFAULT_OVERFLOW, Plan, check_window, overflow_note
from .cp_layouts import check_cp_window, cp_multiples
from .epoch import Dealt, Lengths, Units, deal, packed_units, padded_units, read_lengths_object
from .errors import Message, arg, check_int
from .records import record
from .sampler import batch_sums

__all__ = ["Advice", "BudgetWarning", "Spread", "BudgetReport", "AdviceOptions", "advise", "MicroBatchSearch",
           "effective_batch_size", "plan_budget", "find_max_micro_batch", "is_out_of_memory", "synthetic_sft_lengths"]


@record
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
    """An :class:`Advice` whose ``template`` names ``values`` and ``fields`` (the arguments and figures it adds)."""
    wording = Message(template, **values, **fields)
    return Advice(code, str(wording), values, wording)


class BudgetWarning(UserWarning):
    """The warning :func:`plan_budget` emits for each :class:`Advice` (``.advice``, ``.code``). Silence it with
    ``warnings.filterwarnings("ignore", category=packkit.budget.BudgetWarning)`` or
    ``plan_budget(..., advice=AdviceOptions(warn=False))``; the advice stays in ``report.advice``."""

    def __init__(self, advice: "Advice | str"):  # a str: rebuilt from its text (``cls(*args)``: pytest-xdist, pickle)
        super().__init__(advice if isinstance(advice, str) else f"[{advice.code}] {advice.message}")
        self.advice = None if isinstance(advice, str) else advice
        self.code = advice[1:advice.find("]")] if self.advice is None else advice.code


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
            ("examples per step", _spread(self.examples_per_step)),
            ("tokens per step", _spread(self.tokens_per_step)),
            ("loss tokens", f"{self.loss_tokens:,} in the epoch"
             + ("  (assumed: all but each example's first)" if self.loss_tokens_assumed else "")),
            ("loss tokens per step", _spread(self.loss_tokens_per_step)),
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
        if self.dropped_pieces:
            rows.append(("loss-free", f"left out {self.dropped_pieces:,} pieces with no loss token "
                                      f"({self.dropped_tokens:,} tokens)"))
        width = max(len(k) for k, _ in rows)
        head = (f"packed into windows of {self.window:,} tokens" if packed
                else "length-grouped micro-batches, each padded to its longest example")
        lines = [f"packkit plan: {self.num_examples:,} examples, {self.num_tokens:,} tokens, {head}"]
        lines += [f"  {k:<{width}}  {v}" for k, v in rows]
        lines.append("advice:" if self.advice else "advice: none")
        lines += [f"  [{a.code}] {a.render(options)}" for a in self.advice]
        return "\n".join(lines)


def _spread(s: Spread) -> str:
    return f"mean {s.mean:,.1f}  std {s.std:,.1f}  min {s.min:,.0f}  max {s.max:,.0f}"


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


def synthetic_sft_lengths(n: int, *, seed: int = 0, max_length: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, loss_lengths)`` of ``n`` SFT-like examples: a prompt, then a completion that carries the loss.
    Both log-normal (medians about 100 and 180 tokens, long right tails) as in chat instruction data, the total
    clipped to ``max_length``; deterministic for a seed."""
    n = _at_least_one(n, "n")
    rng = np.random.default_rng(seed)
    prompt = np.maximum(rng.lognormal(np.log(100), 0.9, n).astype(np.int64), 4)
    completion = np.maximum(rng.lognormal(np.log(180), 1.0, n).astype(np.int64), 1)
    completion = np.minimum(completion, max_length - 2)
    lengths = np.minimum(prompt + completion, max_length)
    return lengths, np.minimum(completion, lengths - 1)


@record
class AdviceOptions:
    """The thresholds of :func:`advise` (module docstring); ``lora``: an adapter run (adds the large-batch advice);
    ``target_tokens_per_step``: report (and advise) the accumulation steps that reach it; ``warn``: also emit each
    advice as a :class:`BudgetWarning` from :func:`plan_budget`."""

    lora: bool = False
    target_tokens_per_step: int | None = None
    min_tokens_per_step: int = 4000
    min_steps_per_epoch: int = 50
    lora_max_batch: int = 32
    warn: bool = True


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
        target = _at_least_one(options.target_tokens_per_step, "target_tokens_per_step")
        per_accum = _per_accumulation(report)
        report = dataclasses.replace(report, target_tokens_per_step=target,
                                     accumulation_for_target=max(1, math.ceil(target / per_accum)) if per_accum > 0
                                     else None)
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
        padding = 1.0 - total / float(plan.num_windows * window) if plan.num_windows else 0.0
        num_units = plan.num_windows
    else:  # padded: planned lengths are the tokens (CP rounds the rows)
        rows = sched.longest(lens) if lens.size else lens
        rows = -(-rows // units.row_round) * units.row_round  # a padded row is cut as one sequence
        padding = 1.0 - total / float((rows * sched.sizes).sum()) if rows.size else 0.0
        free, num_units = dealt.loss_free(units.free_left, sums=loss), units.tokens.size
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


def _per_accumulation(r: BudgetReport) -> float:
    """Tokens one accumulation step carries on average: the tokens of ``per_device_batch x world_size`` units."""
    return r.num_tokens / r.num_units * r.per_device_batch * r.world_size if r.num_units else 0.0


def advise(r: BudgetReport, options: AdviceOptions | None = None) -> tuple:
    """The :class:`Advice` a practitioner would give on ``r`` (module docstring), under ``options``' thresholds."""
    o = options or AdviceOptions()
    per_accum, tok, per_step = _per_accumulation(r), r.tokens_per_step.mean, r.examples_per_step.mean
    acc, w, out = arg("accumulation_steps"), arg("window"), []
    if 0 < tok < o.min_tokens_per_step:
        need = math.ceil(o.min_tokens_per_step / per_accum)
        out.append(_advice(
            "low_tokens_per_step", {"tokens_per_step": tok, "min_tokens_per_step": o.min_tokens_per_step,
                                    "accumulation_steps": r.accumulation_steps, "suggested_accumulation_steps": need},
            "about {tokens_per_step:,.0f} tokens per optimiser step (< {min_tokens_per_step:,}): gradients are noisy. "
            "Raise {acc} from {accumulation_steps} to {suggested_accumulation_steps} (about {tokens:,.0f} tokens per "
            "step) rather than raising the learning rate.", acc=acc, tokens=need * per_accum))
    if r.steps_per_epoch < o.min_steps_per_epoch:
        out.append(_advice(
            "few_steps_per_epoch",
            {"steps_per_epoch": r.steps_per_epoch, "full_steps_per_epoch": r.full_steps_per_epoch,
             "examples": r.num_examples, "examples_per_step": per_step, "min_steps_per_epoch": o.min_steps_per_epoch,
             "suggested_examples_per_step": max(1, r.num_examples // o.min_steps_per_epoch)},
            "only {full_steps_per_epoch:,} full optimiser steps per epoch ({examples:,} examples at about "
            "{examples_per_step:,.0f} examples per step): the optimiser and the learning-rate schedule get few "
            "updates. For {min_steps_per_epoch} steps use about {suggested_examples_per_step:,} examples per step, "
            "or train more epochs."))
    if o.lora and per_step > o.lora_max_batch:
        out.append(_advice(
            "lora_large_batch", {"examples_per_step": per_step, "lora_max_batch": o.lora_max_batch},
            "LoRA/adapter run at about {examples_per_step:,.0f} examples per step (> {lora_max_batch}): adapters tend "
            "to train better with small effective batches; lower {acc} or {batch}.", acc=acc,
            batch=arg("per_device_batch")))
    if r.loss_free_units:  # then the advice about the data itself
        unit = "windows" if r.mode == "packed" else "examples"
        out.append(_advice(
            "loss_free", {"loss_free_units": r.loss_free_units, "loss_free_steps": r.loss_free_steps, "unit": unit},
            "{loss_free_units:,} {unit} and {loss_free_steps:,} optimiser steps hold no loss token (they train on "
            "nothing; a step of them has loss 0): pass {drop} to leave the pieces without one out"
            + (", or raise {w}" if r.mode == "packed" else ""), drop=arg("drop_loss_free", True), w=w))
    if r.window is not None and r.longest_example > 4 * r.window:
        out.append(_advice(
            "far_beyond_window", {"longest_example": r.longest_example, "window": r.window},
            "the longest example has {longest_example:,} tokens, {times:,.0f} times the window of {window:,}: "
            + ("it is split into {pieces:,} pieces that see only their own window; " if r.overflow == "split" else "")
            + "check it (a concatenated or runaway example?), or raise {w}",
            times=r.longest_example / r.window, pieces=-(-r.longest_example // r.window), w=w))
    elif r.window is None and r.longest_example > 64 * max(1.0, tok / max(1, r.effective_batch)):
        out.append(_advice(
            "far_beyond_batch", {"longest_example": r.longest_example},
            "the longest example has {longest_example:,} tokens, far beyond the typical one: every padded "
            "micro-batch that holds it is padded to it; check it, or pack into windows ({w})",
            w=arg("window", metavar="W")))
    if r.accumulation_for_target is not None and r.accumulation_for_target != r.accumulation_steps:
        a = r.accumulation_for_target
        out.append(_advice(
            "accumulation_for_target", {"target_tokens_per_step": r.target_tokens_per_step,
                                        "accumulation_steps": r.accumulation_steps,
                                        "suggested_accumulation_steps": a, "tokens_per_step": tok},
            "to reach {target_tokens_per_step:,} tokens per step use {acc} (about {tokens:,.0f} tokens per step; "
            "now {accumulation_steps}, about {tokens_per_step:,.0f}).", acc=arg("accumulation_steps", a),
            tokens=a * per_accum))
    return tuple(out)
