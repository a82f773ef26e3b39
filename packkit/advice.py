"""The advice a practitioner would give on an epoch's figures (a :class:`packkit.budget.BudgetReport`), each an
:class:`Advice` with a stable ``code``, under the thresholds of :class:`AdviceOptions`: ``low_tokens_per_step`` (raise
accumulation, not the learning rate), ``few_steps_per_epoch``, ``lora_large_batch`` (an adapter run),
``accumulation_for_target``, and on the data itself ``loss_free``, ``far_beyond_window`` and ``far_beyond_batch``.

A policy of its own: it reads a report's figures (:mod:`packkit.budget` makes them) and says what to change, naming
the arguments as the caller spells them (:meth:`Advice.render`); it imports no reader nor command.
"""

from __future__ import annotations

import dataclasses
import math

from .epoch import trains_on_nothing
from .errors import Message, arg, check_int
from .records import record

__all__ = ["Advice", "AdviceOptions", "BudgetWarning", "advise", "for_target"]


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
    """The warning :func:`packkit.budget.plan_budget` emits for each :class:`Advice` (``.advice``, ``.code``).
    Silence it with ``warnings.filterwarnings("ignore", category=packkit.budget.BudgetWarning)`` or
    ``plan_budget(..., advice=AdviceOptions(warn=False))``; the advice stays in ``report.advice``."""

    def __init__(self, advice: "Advice | str"):  # a str: rebuilt from its text (``cls(*args)``: pytest-xdist, pickle)
        super().__init__(advice if isinstance(advice, str) else f"[{advice.code}] {advice.message}")
        self.advice = None if isinstance(advice, str) else advice
        self.code = advice[1:advice.find("]")] if self.advice is None else advice.code


@record
class AdviceOptions:
    """The thresholds of :func:`advise` (module docstring); ``lora``: an adapter run (adds the large-batch advice);
    ``target_tokens_per_step``: report (and advise) the accumulation steps that reach it (:func:`for_target`);
    ``warn``: also emit each advice as a :class:`BudgetWarning` from :func:`packkit.budget.plan_budget`."""

    lora: bool = False
    target_tokens_per_step: int | None = None
    min_tokens_per_step: int = 4000
    min_steps_per_epoch: int = 50
    lora_max_batch: int = 32
    warn: bool = True


def _per_accumulation(r) -> float:
    """Tokens one accumulation step of the report ``r`` carries on average: those of ``per_device_batch x world_size``
    units."""
    return r.num_tokens / r.num_units * r.per_device_batch * r.world_size if r.num_units else 0.0


def for_target(r, target) -> tuple[int, int | None]:
    """``(target, accumulation steps)``: ``target_tokens_per_step`` checked, and the accumulation steps whose mean
    tokens per step reach it on the report ``r`` (None when its steps carry no token)."""
    target = check_int(target, "target_tokens_per_step", fix=": pass 1 or more")
    per_accum = _per_accumulation(r)
    return target, max(1, math.ceil(target / per_accum)) if per_accum > 0 else None


def advise(r, options: AdviceOptions | None = None) -> tuple:
    """The :class:`Advice` a practitioner would give on ``r`` (a :class:`packkit.budget.BudgetReport`; the module
    docstring), under ``options``' thresholds."""
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
        said = trains_on_nothing(rows=(r.loss_free_units, r.num_units), steps=(r.loss_free_steps, r.steps_per_epoch),
                                 what=unit, window=r.mode == "packed")[0]
        out.append(Advice("loss_free", str(said), {"loss_free_units": r.loss_free_units,
                                                   "loss_free_steps": r.loss_free_steps, "unit": unit}, said))
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
